"""The host-tier benchmark end to end on a few conversations: its four setups replay the same
requests, and the host tier (either write policy), as the cache as large as both, computes fewer
prompt tokens than the small cache alone, restoring what it evicted."""
import json

from tests.scripts.script_runner import load_script, run_script

bench_host_kv = load_script("bench_host_kv")


def test_the_setups_share_the_cache_and_differ_in_what_keeps_evictions():
    args = bench_host_kv.parse_args(["--kv-mib", "4", "--host-mib", "12"])
    device, back, through, bound = bench_host_kv.setups(args).items()
    assert device == ("device", {"kv_cache_memory_bytes": 4 << 20})
    tier = {"kv_cache_memory_bytes": 4 << 20, "kv_host_cache_bytes": 12 << 20}
    assert back == ("host tier, write-back", {**tier, "kv_host_write_policy": "write_back"})
    assert through == ("host tier, write-through", {**tier, "kv_host_write_policy": "write_through"})
    assert bound == ("device x4", {"kv_cache_memory_bytes": 16 << 20})


def test_a_small_replay_restores_from_host_memory(tmp_path):
    out = tmp_path / "host.json"
    done = run_script("bench_host_kv", "--num-requests", "24", "--rate", "20", "--max-prompt-tokens", "512",
                      "--max-output-tokens", "4", "--kv-mib", "3", "--host-mib", "12", "--json", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["setup"]: row for row in json.loads(out.read_text())["rows"]}
    device, bound = rows["device"], rows["device x5"]
    for tier in (rows["host tier, write-back"], rows["host tier, write-through"]):
        assert device["tokens_restored"] == 0 and tier["tokens_restored"] > 0
        assert tier["prompt_tokens_computed"] < device["prompt_tokens_computed"]
    assert bound["prompt_tokens_computed"] < device["prompt_tokens_computed"] and bound["tokens_restored"] == 0
    assert "| host tier, write-through |" in done.stdout
