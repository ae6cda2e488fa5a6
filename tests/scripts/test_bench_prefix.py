"""The prefix benchmark's clusters and report, without a cluster: each placement's config is a valid
cluster config that turns prefix-aware placement (and partial imports) on or off."""
from splitserve.config import ClusterConfig
from tests.scripts.script_runner import load_script

bench_prefix = load_script("bench_prefix")


def test_each_placement_is_a_split_cluster_with_prefix_caching():
    args = bench_prefix.parse_args([])
    for placement, aware in (("aware", True), ("blind", False)):
        config = ClusterConfig.model_validate(bench_prefix.cluster_config(args, placement))
        assert config.engine.enable_prefix_caching and config.prefix_options().aware is aware
        assert [(p.role, p.num_workers) for p in config.pools] == [("prompt", 2), ("token", 2)]


def test_the_report_compares_aware_with_blind(capsys):
    row = {"ttft_s": {"p50": 0.4, "p99": 1.0}, "tbt_s": {"p50": 0.008, "p99": 0.1}, "kv_tokens_reused": 0}
    rows = [{**row, "placement": "aware", "prefill_tokens_computed": 70.0, "kv_bytes_transferred": 50 * 2**20},
            {**row, "placement": "blind", "prefill_tokens_computed": 100.0, "kv_bytes_transferred": 100 * 2**20}]
    bench_prefix.print_rows(rows, "cpu", 60)
    out = capsys.readouterr().out
    assert "prefill_tokens_ideal: 60 (one unbounded cache shared by every worker), 40% fewer than blind" in out
    assert "prefill_tokens_computed: aware 30% fewer than blind" in out
    assert "kv_bytes_transferred: aware 50% fewer than blind" in out and "| aware | 0.400 |" in out


def test_the_default_workload_replays_whole_conversations():
    from splitserve.bench.traces import repeated_block_fraction
    from splitserve.bench.workload import make_workload
    requests = make_workload(bench_prefix.workload(bench_prefix.parse_args([])))
    assert len(requests) == 300 and repeated_block_fraction(r.prefix_blocks for r in requests) > 0.3


def test_the_ideal_prefill_counts_each_prompts_longest_cached_run_in_engine_blocks(monkeypatch):
    from splitserve.bench.workload import RequestSpec
    def request(index: int, prompt: int, blocks: tuple[int, ...]) -> RequestSpec:
        return RequestSpec(index, index / 10, prompt, 1, prefix_blocks=blocks, block_tokens=32)

    requests = [request(0, 64, (1, 2)),     # nothing before it: 64
                request(1, 96, (1, 2, 3)),  # (1, 2) cached: 96 - 64 = 32
                request(2, 64, (1, 2)),     # all cached, but never its last token: 63 -> 48 hit, 16
                request(3, 40, (2, 1))]     # 2 never led a prompt: 40
    monkeypatch.setattr(bench_prefix, "make_workload", lambda spec: requests)
    assert bench_prefix.ideal_prefill_tokens(bench_prefix.parse_args([])) == 64 + 32 + 16 + 40
