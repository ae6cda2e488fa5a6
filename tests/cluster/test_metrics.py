"""The cluster's Prometheus metrics: what ingress observations, worker reports and pool changes
put in the registry, read back with prometheus_client's own text parser."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.bucket_counts import BucketCounts
from splitserve.cluster.metrics import (LATENCY_BUCKETS, REQUEST_KINDS, ClusterMetrics, RequestObservation,
                                        SLOBounds, kind_of)
from splitserve.cluster.worker_stats import WorkerStats
from splitserve.engine.outputs import StepStats
from splitserve.engine.sampling_params import SamplingParams
from splitserve.placement.state import Role, WorkerLoad
from splitserve.transfer.exporter import TransferStats


@pytest.fixture
def metrics():
    return ClusterMetrics("demo", SLOBounds(ttft=0.5, tbt=0.05, e2e=2.0))


def samples(metrics: ClusterMetrics) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, as Prometheus would scrape it."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def value(metrics, name, **labels) -> float:
    return samples(metrics)[name, tuple(sorted({"model": "demo", **labels}.items()))]


def request_value(metrics, name, lora: str = "", kind: str = "generate", **labels) -> float:
    """A request series' value: the base model's (lora ""), or an adapter's; generation's, or pooling's."""
    return value(metrics, name, lora=lora, kind=kind, **labels)


def test_every_family_is_prefixed_and_rare_events_start_at_zero(metrics):
    names = {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    assert names and all(n.startswith("splitserve_") for n in names)
    assert request_value(metrics, "splitserve_requests_total", outcome="failed") == 0
    assert request_value(metrics, "splitserve_requests_restarted_total") == 0
    assert request_value(metrics, "splitserve_placements_refused_total") == 0
    assert value(metrics, "splitserve_pool_transitions_total", from_pool="token", to_pool="mixed") == 0
    assert value(metrics, "splitserve_worker_failures_total") == 0


def gaps(*seconds: float) -> BucketCounts:
    counted = BucketCounts.over(LATENCY_BUCKETS)
    for gap in seconds:
        counted.add(gap)
    return counted


def test_request_observations_fill_latencies_tokens_and_slo_attainment(metrics):
    fast = RequestObservation("completed", 10, 3, 8, ttft=0.2, tbt=gaps(0.01, 0.03), e2e=0.3)
    slow = RequestObservation("completed", 20, 2, ttft=0.9, tbt=gaps(0.2), e2e=1.2, restarts=1)
    metrics.record_requests([fast, slow, RequestObservation("rejected", 5, refused_placements=3),
                             RequestObservation("aborted", 7, 1)])
    assert request_value(metrics, "splitserve_requests_total", outcome="completed") == 2
    assert request_value(metrics, "splitserve_requests_total", outcome="rejected") == 1
    assert request_value(metrics, "splitserve_prompt_tokens_total") == 42 and request_value(metrics, "splitserve_generation_tokens_total") == 6
    assert request_value(metrics, "splitserve_prompt_cached_tokens_total") == 8
    assert request_value(metrics, "splitserve_request_ttft_seconds_count") == 2
    assert request_value(metrics, "splitserve_request_ttft_seconds_sum") == pytest.approx(1.1)
    assert request_value(metrics, "splitserve_request_tbt_seconds_count") == 3
    assert request_value(metrics, "splitserve_request_tbt_seconds_bucket", le="0.01") == 1
    # ttft: 0.2 met, 0.9 not; tbt means 0.02 met, 0.2 not; e2e both within 2.0
    assert [request_value(metrics, "splitserve_slo_met_total", slo=s) for s in ("ttft", "tbt", "e2e")] == [1, 1, 2]
    assert request_value(metrics, "splitserve_slo_requests_total", slo="tbt") == 2
    assert request_value(metrics, "splitserve_requests_restarted_total") == 1
    assert request_value(metrics, "splitserve_placements_refused_total") == 3


def worker_stats(**overrides) -> WorkerStats:
    base = dict(steps=(StepStats(300, 0, 0.05), StepStats(0, 4, 0.01), StepStats(100, 2, 0.03)),
                queue_seconds=(0.002,), transfers=(TransferStats(0.01, 0.04),), preemptions=2,
                kv_bytes_sent=1000, kv_failures=0, kv_blocks_used=10, kv_blocks_free=90)
    return WorkerStats(**{**base, **overrides})


def test_a_request_under_an_adapter_counts_in_that_adapters_series():
    metrics = ClusterMetrics("demo", SLOBounds(ttft=0.5, tbt=0.05, e2e=2.0), adapters=("sql",))
    assert request_value(metrics, "splitserve_requests_total", lora="sql", outcome="failed") == 0
    assert request_value(metrics, "splitserve_request_tbt_seconds_count", lora="sql") == 0
    metrics.record_requests([RequestObservation("completed", 10, 3, ttft=0.2, tbt=gaps(0.01), e2e=0.3, lora="sql"),
                             RequestObservation("completed", 4, 1, ttft=0.1, e2e=0.1)])
    assert [request_value(metrics, "splitserve_prompt_tokens_total", lora=lora) for lora in ("", "sql")] == [4, 10]
    assert request_value(metrics, "splitserve_request_tbt_seconds_count", lora="sql") == 1
    assert request_value(metrics, "splitserve_request_tbt_seconds_count") == 0
    assert request_value(metrics, "splitserve_slo_met_total", lora="sql", slo="ttft") == 1


def test_pooling_requests_count_apart_from_generation(metrics):
    """Embeddings, scores and reranks: no token, so no TTFT or TBT; their end to end kept apart."""
    assert request_value(metrics, "splitserve_requests_total", kind="pooling", outcome="completed") == 0
    metrics.record_requests([RequestObservation("completed", 30, 0, e2e=0.4, kind="pooling"),
                             RequestObservation("completed", 5, 2, ttft=0.1, tbt=gaps(0.01), e2e=0.2)])
    assert [request_value(metrics, "splitserve_request_e2e_seconds_sum", kind=kind)
            for kind in REQUEST_KINDS] == [pytest.approx(0.2), pytest.approx(0.4)]
    assert [request_value(metrics, "splitserve_prompt_tokens_total", kind=kind) for kind in REQUEST_KINDS] == [5, 30]
    assert request_value(metrics, "splitserve_request_ttft_seconds_count", kind="pooling") == 0
    assert kind_of(SamplingParams.embedding()) == "pooling" and kind_of(SamplingParams()) == "generate"


def test_placements_under_adapters_count_by_what_the_slots_held(metrics):
    assert [value(metrics, "splitserve_lora_placements_total", slot=s) for s in ("held", "idle", "busy")] == [0, 0, 0]
    metrics.record_adapter_placements([3, 1, 0])
    metrics.record_adapter_placements([5, 1, 2])  # the CLS's totals: counted by their increase
    assert [value(metrics, "splitserve_lora_placements_total", slot=s) for s in ("held", "idle", "busy")] == [5, 1, 2]


def test_worker_reports_set_gauges_histograms_and_counter_deltas(metrics):
    load = WorkerLoad(pending_prompt_tokens=128, decode_tokens=900, num_decoding=3, num_waiting=1)
    metrics.record_worker("p0", Role.PROMPT, "h100", load, worker_stats())
    labels = {"worker": "p0", "pool": "prompt", "hardware": "h100"}
    assert value(metrics, "splitserve_worker_pending_prompt_tokens", **labels) == 128
    assert value(metrics, "splitserve_worker_kv_blocks_free", **labels) == 90
    assert value(metrics, "splitserve_worker_step_seconds_count", phase="prefill", **labels) == 1
    assert value(metrics, "splitserve_worker_step_seconds_count", phase="mixed", **labels) == 1
    assert value(metrics, "splitserve_worker_batch_tokens_sum", **labels) == 406
    assert value(metrics, "splitserve_kv_transfer_overlap_ratio_sum", worker="p0") == pytest.approx(0.75)
    # totals become counter increments: a second report adds only the difference
    metrics.record_worker("p0", Role.PROMPT, "h100", load, worker_stats(steps=(), transfers=(), queue_seconds=(),
                                                                       preemptions=5, kv_bytes_sent=2500, lora_swaps=3,
                                                                       kv_host_saved_tokens=64,
                                                                       kv_host_restored_tokens=32))
    assert value(metrics, "splitserve_worker_preemptions_total", **labels) == 5
    assert value(metrics, "splitserve_worker_lora_swaps_total", worker="p0") == 3
    assert value(metrics, "splitserve_kv_host_saved_tokens_total", worker="p0") == 64
    assert value(metrics, "splitserve_kv_host_restored_tokens_total", worker="p0") == 32
    assert value(metrics, "splitserve_kv_transfer_bytes_total", worker="p0") == 2500
    assert value(metrics, "splitserve_worker_prefill_tokens_total", worker="p0") == 400  # 300 + 100 prefilled
    assert value(metrics, "splitserve_request_queue_seconds_count") == 1
    metrics.record_worker("t0", Role.TOKEN, "h100", load, worker_stats(kv_tokens_reused=64))
    metrics.record_worker("t0", Role.TOKEN, "h100", load, worker_stats(steps=(), kv_tokens_reused=96))
    assert value(metrics, "splitserve_kv_import_reused_tokens_total", worker="t0") == 96


def test_drafts_checked_and_kept_add_up_over_steps(metrics):
    steps = (StepStats(decode_tokens=12, draft_tokens=8, accepted_tokens=5), StepStats(decode_tokens=4),
             StepStats(decode_tokens=9, draft_tokens=6, accepted_tokens=0))
    for _ in range(2):
        metrics.record_worker("t0", Role.TOKEN, "h100", WorkerLoad(), worker_stats(steps=steps))
    assert value(metrics, "splitserve_spec_decode_draft_tokens_total", worker="t0") == 28
    assert value(metrics, "splitserve_spec_decode_accepted_tokens_total", worker="t0") == 10
    metrics.remove_worker("t0")
    assert not [k for k in samples(metrics) if ("worker", "t0") in k[1]]


def test_a_worker_that_changes_pool_or_dies_drops_its_old_series(metrics):
    metrics.record_worker("t0", Role.TOKEN, "a100", WorkerLoad(), worker_stats())
    metrics.record_worker("t0", Role.MIXED, "a100", WorkerLoad(), worker_stats())
    names = samples(metrics)
    pools = {dict(k[1]).get("pool") for k in names if k[0] == "splitserve_worker_running_requests"}
    assert pools == {"mixed"}
    metrics.record_worker("t1", Role.TOKEN, "a100", WorkerLoad(), worker_stats())
    metrics.remove_worker("t0")  # replaced under a new id: none of its series stays
    assert not [k for k in samples(metrics) if ("worker", "t0") in k[1]]
    assert value(metrics, "splitserve_kv_transfer_bytes_total", worker="t1") == 1000


def test_pools_and_transitions(metrics):
    metrics.record_pools({"p0": (Role.PROMPT, "h100"), "t0": (Role.MIXED, "a100"), "t1": (Role.TOKEN, "a100")})
    assert value(metrics, "splitserve_pool_workers", pool="mixed", hardware="a100") == 1
    assert value(metrics, "splitserve_mixed_pool_occupancy") == pytest.approx(1 / 3)
    metrics.record_transition(Role.TOKEN, Role.MIXED)
    assert value(metrics, "splitserve_pool_transitions_total", from_pool="token", to_pool="mixed") == 1
    assert value(metrics, "splitserve_pool_workers", pool="mixed", hardware="h100") == 0  # empty pools show 0
    metrics.record_pools({"p0": (Role.PROMPT, "h100")})
    assert ("splitserve_pool_workers", (("hardware", "a100"), ("model", "demo"), ("pool", "mixed"))) not in samples(metrics)
