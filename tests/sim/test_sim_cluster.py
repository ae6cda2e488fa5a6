"""The event loop: hand-computed timelines, conservation, determinism, pool moves, rejections."""
import dataclasses
import gc
import random

import pytest

from splitserve.bench.workload import RequestSpec
from splitserve.placement import PlacementThresholds, Role
from splitserve.sim.cluster import Simulation, _first_tick_at, simulate
from splitserve.sim.scenario import PoolSpec, Scenario
from splitserve.sim.transfer import TransferModel
from tests.sim.test_sim_worker import LinearPerf
from tests.sim.test_transfer_model import pipeline_visible

# 100 tokens take 0.1 s on the wire (+ 10 ms); 10 layers
TRANSFER = TransferModel(bandwidth_bytes_per_s=1e6, latency_s=0.01, kv_bytes_per_token=1000, num_layers=10)


def scenario(*pools, placement="jsq", perf=None, **overrides):
    options = {"kv_budget_tokens": 4096, "max_model_len": 2048, "transfer": TRANSFER, **overrides}
    return Scenario(tuple(PoolSpec(*pool) for pool in pools), {"hw": perf or LinearPerf()}, placement=placement,
                    **options)


def split(prompt=1, token=1, **kwargs):
    return scenario((Role.PROMPT, prompt, "hw"), (Role.TOKEN, token, "hw"), **kwargs)


def mixed(count=1, policy="mixed", **kwargs):
    return scenario((Role.MIXED, count, "hw"), role_policies={"mixed": policy}, **kwargs)


def spec(index, arrival, prompt, output):
    return RequestSpec(index, arrival, prompt, output)


def test_one_local_request():
    [record] = simulate(mixed(), [spec(0, 0.5, 100, 3)]).records
    # TTFT = the 100-token prefill (0.1 s), then one decode iteration (0.02 s) per token
    assert record.ttft_s == pytest.approx(0.1)
    assert record.token_times_s == pytest.approx((0.1, 0.12, 0.14))
    assert record.e2e_s == pytest.approx(0.14) and record.start_s == 0.5 and record.status == 200


def test_one_split_request_pays_the_visible_transfer_on_its_second_token():
    [record] = simulate(split(), [spec(0, 0.0, 100, 3)]).records
    # the first token leaves the prompt worker after the 0.1 s prefill (as Splitwise's paper says:
    # the transfer shows only in the second token); the KV lands after a serialized transfer of
    # 0.01 + 0.1 s; then 0.02 s a token on the token worker
    assert record.token_times_s == pytest.approx((0.1, 0.23, 0.25))


def test_one_layerwise_split_request():
    [record] = simulate(split(), [spec(0, 0.0, 600, 2)]).records
    # prefill 0.6 s; transfer T = 0.6 s overlaps 9/10 of it: visible 0.01 + max(0.06, 0.6 - 0.54)
    assert record.token_times_s == pytest.approx((0.6, 0.69))


def test_a_layerwise_split_request_prefilled_in_chunks_streams_each_chunk():
    """2000 tokens in chunks of 500 (0.5 s each), a layer-wise threshold of 500: each chunk's 500
    tokens take 0.5 s on the wire, 0.05 s a layer, so the link keeps pace with the compute and only
    the last layer's piece is left at the hand-off: 0.01 + 0.05 (the whole KV behind the last chunk
    would leave 0.01 + 2.0 - 0.45). With the threshold at 512 the pieces go every other chunk: the
    first 1000 tokens' by 1.55 s, the last 1000 tokens' 1.0 s after their last chunk began. The
    first token leaves at the prefill's end (2.0 s); the second a decode (0.02 s) after the KV lands."""
    streamed = dataclasses.replace(TRANSFER, layerwise_threshold=500)
    for transfer, landed in ((streamed, 2.06), (TRANSFER, 2.56)):
        chunked = split(prompt_chunk_tokens=500, prompt_token_budget=500, transfer=transfer)
        [record] = simulate(chunked, [spec(0, 0.0, 2000, 2)]).records
        assert record.token_times_s == pytest.approx((2.0, landed + 0.02))
    [whole] = simulate(split(), [spec(0, 0.0, 2000, 2)]).records
    assert whole.token_times_s[1] - 0.02 == pytest.approx(2.0 + pipeline_visible(TRANSFER, 2000, 2.0)) \
        == pytest.approx(2.21)


def test_two_requests_batched_on_a_mixed_worker():
    result = simulate(mixed(), [spec(0, 0.0, 100, 2), spec(1, 0.0, 200, 3)])
    # one prefill of 300 tokens (0.3 s), then decodes of both together
    assert [r.token_times_s for r in result.records] == [pytest.approx((0.3, 0.32)),
                                                         pytest.approx((0.3, 0.32, 0.34))]
    assert result.duration_s == pytest.approx(0.34)


@pytest.mark.parametrize("policy, second", [("orca", (0.23, 0.25)), ("prefill_first", (0.21, 0.23))])
def test_a_prompt_arriving_mid_decode(policy, second):
    result = simulate(mixed(1, policy), [spec(0, 0.0, 100, 3), spec(1, 0.11, 200, 2)])
    # at 0.12 r1's prompt runs; orca batches r0's decode with it (0.2 + 0.02 s, both sample at 0.34),
    # prefill_first runs the prompt alone (0.2 s) and decodes both after it (0.34)
    first, late = result.records
    assert first.token_times_s == pytest.approx((0.1, 0.12, 0.34))
    assert late.token_times_s == pytest.approx(second)


def test_priority_scheduling_serves_a_late_urgent_request_first_as_the_engines_do():
    """One mixed worker, one sequence at a time (max_num_seqs 1): a backlog of two requests, then an
    urgent one (priority -1). First come, first served it waits for both. By priority it preempts
    the first once that step ends (0.1 s) and runs at once; the preempted one goes back ahead of the
    second (it came first) and is prefilled again with its first token (101 tokens). The simulator
    runs the engines' own policies, so this is the engine's behaviour."""
    requests = [spec(0, 0.0, 100, 3), spec(1, 0.01, 100, 3), dataclasses.replace(spec(2, 0.02, 100, 3), priority=-1)]

    def token_times(**options):
        return [[r.start_s + t for t in r.token_times_s] for r in simulate(mixed(max_num_seqs=1, **options),
                                                                           requests).records]

    assert token_times() == [pytest.approx(t) for t in ([0.1, 0.12, 0.14], [0.24, 0.26, 0.28], [0.38, 0.4, 0.42])]
    assert token_times(scheduling_policy="priority") == [
        pytest.approx(t) for t in ([0.1, 0.341, 0.361], [0.461, 0.481, 0.501], [0.2, 0.22, 0.24])]
    with pytest.raises(ValueError, match="the accelgen policy orders requests by their latency targets' slack"):
        mixed(policy="accelgen", scheduling_policy="priority")


def test_two_split_requests_batched_on_the_prompt_worker():
    result = simulate(split(), [spec(0, 0.0, 100, 3), spec(1, 0.0, 200, 2)])
    # one 0.3 s prefill gives both first tokens; KV lands after 0.11 s and 0.21 s; each then decodes
    # every 0.02 s
    assert [r.token_times_s for r in result.records] == [pytest.approx((0.3, 0.43, 0.45)),
                                                         pytest.approx((0.3, 0.53))]
    prompt, token = result.workers
    assert (prompt.worker_id, prompt.iterations, prompt.num_prefills) == ("prompt-000", 1, 2)
    assert (token.worker_id, token.iterations, token.busy_s) == ("token-000", 3, pytest.approx(0.06))


def test_a_single_token_split_request_ends_on_the_prompt_worker():
    sim = Simulation(split(), [spec(0, 0.0, 100, 1)])
    [record] = sim.run().records
    assert record.token_times_s == pytest.approx((0.1,))
    assert sim.workers["token-000"].blocks.num_free_blocks == 4096 // 16  # reservation dropped


def random_requests(count, seed=1, rate=2.5):
    rng, now, requests = random.Random(seed), 0.0, []
    for index in range(count):
        now += rng.expovariate(rate)
        requests.append(spec(index, now, rng.randint(1, 900), rng.randint(1, 120)))
    return requests


NO_BACKPRESSURE = {"max_queue_tokens": 1e9, "max_decode_queue_tokens": 1e9}
CLUSTERS = {
    "round-robin": split(2, 2, placement="round-robin", thresholds=PlacementThresholds(**NO_BACKPRESSURE)),
    "jsq": split(2, 2, placement="jsq", thresholds=PlacementThresholds(**NO_BACKPRESSURE)),
    "splitwise": split(2, 2, placement="splitwise",
                       thresholds=PlacementThresholds(mixed_prompt_tokens=600, **NO_BACKPRESSURE)),
    "mixed-only": mixed(3, placement="splitwise", thresholds=PlacementThresholds(**NO_BACKPRESSURE)),
    "prefill-first-only": mixed(3, "prefill_first", thresholds=PlacementThresholds(**NO_BACKPRESSURE)),
    "orca-only": mixed(3, "orca", thresholds=PlacementThresholds(**NO_BACKPRESSURE)),
}


@pytest.mark.parametrize("name", list(CLUSTERS))
def test_conservation(name):
    """Loaded (workers busy most of the run, KV tight: some preemptions, a rare 429 when the CLS sees
    no KV room): every admitted request gets exactly its tokens, and every worker ends empty."""
    requests = random_requests(300)
    sim = Simulation(CLUSTERS[name], requests)
    records = sim.run().records
    assert [r.index for r in records] == list(range(300))
    assert sum(r.ok for r in records) >= 295
    for r, request in zip(records, requests):
        if not r.ok:
            assert (r.status, r.output_tokens) == (429, 0), r
            continue
        assert r.output_tokens == len(r.token_times_s) == r.requested_output_tokens == request.output_tokens
        assert list(r.token_times_s) == sorted(r.token_times_s) and r.ttft_s > 0
    assert not sim.token_times  # no request left in flight
    for worker in sim.workers.values():
        worker.check_integrity()
        assert worker.blocks.num_free_blocks == worker.blocks.num_blocks
    sim.cls.check_integrity()


def test_same_inputs_same_run():
    requests = random_requests(200, seed=7)
    first, second = (simulate(CLUSTERS["splitwise"], requests, seed=3) for _ in range(2))
    assert first == second and first.records[0].ok
    assert gc.isenabled()  # simulate pauses the collector only while it runs
    assert first != simulate(CLUSTERS["splitwise"], random_requests(200, seed=8), seed=3)


def test_prompt_backlog_moves_a_token_worker_into_the_mixed_pool_and_back():
    thresholds = PlacementThresholds(mixed_prompt_tokens=500)
    result = simulate(split(1, 2, placement="splitwise", thresholds=thresholds),
                      [spec(i, 0.0, 400, 4) for i in range(6)])
    # prompt queue 0, 400, then 800 > 500: the third request overflows into a guest token worker
    assert all(r.ok and r.output_tokens == 4 for r in result.records)
    guest = result.workers[1]
    assert guest.worker_id == "token-000" and guest.num_prefills > 0
    assert (guest.pool_moves, guest.pool, guest.home) == (2, "token", "token")  # in, and home once drained


def test_a_pool_move_switches_the_worker_to_its_new_pool_s_policy():
    # as the cluster's engine.policy_for: the guest runs the mixed pool's policy, then its home's again
    overflow = split(1, 2, placement="splitwise", thresholds=PlacementThresholds(mixed_prompt_tokens=500),
                     role_policies={"mixed": "orca"})
    sim = Simulation(overflow, [spec(i, 0.0, 400, 4) for i in range(6)])
    guest, seen = sim.workers["token-000"], []
    switch = guest.set_policy
    guest.set_policy = lambda name: (seen.append(name), switch(name))
    sim.run()
    assert seen == ["orca", "token"] and guest.policy.name == "token"
    with pytest.raises(ValueError, match="role_policies"):
        split(role_policies={"mixed": "nope"})


def test_everything_full_rejects_with_429():
    thresholds = PlacementThresholds(max_queue_tokens=1000)
    result = simulate(split(placement="jsq", thresholds=thresholds), [spec(i, 0.0, 600, 2) for i in range(5)])
    # prompt queue 0, then 600, then 1200 >= 1000: no prompt worker for the rest
    assert [r.status for r in result.records] == [200, 200, 429, 429, 429]
    assert result.summary()["num_rejected"] == 3


def test_token_worker_without_a_free_slot_rejects_at_reservation():
    """The CLS's view is a report old: the reservation is refused, and the request placed again
    without that worker (as the ingress does), on another token worker if one has room."""
    result = simulate(split(max_num_seqs=1), [spec(0, 0.0, 100, 2), spec(1, 0.0, 100, 2)])
    assert [r.status for r in result.records] == [200, 429] and result.placements_refused == 1
    assert "no worker can take the request now; token-000 cannot take it" in result.records[1].error
    # the last one goes to token-000 by its queue (two 10-token sequences against one of 1000) and
    # is refused there (max_num_seqs), then placed on token-001
    result = simulate(split(token=2, max_num_seqs=2), [spec(i, 0.0, n, 2) for i, n in enumerate((10, 1000, 10, 10))])
    assert [r.status for r in result.records] == [200] * 4 and result.placements_refused == 1


def test_prompt_of_max_model_len_is_refused():
    [record] = simulate(mixed(), [spec(0, 0.0, 2048, 2)]).records
    assert record.status == 400 and "max_model_len" in record.error


def test_idle_time_costs_no_report_ticks():
    """Idle between sparse arrivals, the loop jumps to the tick at or after the next event instead of
    ticking through the gap: the second request runs as the first did, in a few dozen events."""
    result = simulate(split(), [spec(0, 0.0, 100, 3), spec(1, 1e5, 100, 3)])
    first, second = result.records
    assert first.ok and second.ok and second.ttft_s == pytest.approx(first.ttft_s)
    assert result.num_events < 100


@pytest.mark.parametrize("time, interval", [(0.3, 0.1), (0.30000000000000004, 0.1), (0.7, 0.1), (1e5 + 0.05, 0.1),
                                            (0.0, 0.1), (2.0, 0.5)])
def test_first_tick_at_is_the_least_tick_not_before_the_time(time, interval):
    tick = _first_tick_at(time, interval)
    assert tick * interval >= time and (tick == 0 or (tick - 1) * interval < time)


def test_progress_reports_the_end():
    calls = []
    simulate(mixed(), random_requests(50), progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (50, 50) and all(done <= total == 50 for done, total in calls)


def test_hardware_speeds_follow_the_models():
    fast, slow = LinearPerf(0.001, 0.02), LinearPerf(0.002, 0.03)
    both = Scenario((PoolSpec(Role.PROMPT, 1, "fast"), PoolSpec(Role.TOKEN, 1, "slow")),
                    {"fast": fast, "slow": slow}, kv_budget_tokens=4096, max_model_len=2048)
    profiles = both.hardware_profiles()
    assert (profiles["fast"].prompt_speed, profiles["fast"].token_speed) == (1.0, 1.0)
    assert (profiles["slow"].prompt_speed, profiles["slow"].token_speed) == (0.5, pytest.approx(2 / 3))


@pytest.mark.parametrize("overrides, message", [({"kv_budget_tokens": 1000}, "max_model_len"),
                                                ({"placement": "random"}, "placement"),
                                                ({"report_interval_s": 0}, "report_interval_s"),
                                                ({"kv_windows": ()}, "kv_windows"),
                                                ({"kv_windows": (None, 0)}, "kv_windows"),
                                                ({"kv_group_share": 0}, "kv_group_share"),
                                                ({"kv_group_share": 1.5}, "kv_group_share"),
                                                # two groups: the 4096 tokens' blocks hold 2048 tokens
                                                ({"kv_windows": (None, 64), "max_model_len": 2048 + 1},
                                                 "max_model_len"),
                                                ({"kv_windows": (None, 64), "transfer": dataclasses.replace(
                                                    TRANSFER, layer_groups=(0,) * 10)}, "layer_groups")])
def test_scenario_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        mixed(**overrides)


def test_scenario_needs_a_model_for_every_hardware():
    with pytest.raises(ValueError, match="no model for hardware other"):
        Scenario((PoolSpec(Role.MIXED, 1, "other"),), {"hw": LinearPerf()}, kv_budget_tokens=4096)


def test_a_sliding_window_model_keeps_a_window_of_blocks_per_request():
    """The workers' block managers release what a window model's layers can no longer read, as the
    engine's do: eight long decodes that outgrow a 2048-token cache (refused or preempted) fit in it."""
    requests = [spec(i, 0.3 * i, 200, 800) for i in range(8)]
    served, preemptions = {}, {}
    for window in (None, 128):
        sim = Simulation(mixed(kv_budget_tokens=2048, max_model_len=1024, kv_windows=(window,)), requests)
        records = sim.run().records
        served[window] = sum(r.status == 200 and len(r.token_times_s) == 800 for r in records)
        preemptions[window] = sum(w.policy.num_preemptions for w in sim.workers.values())
    assert (served[128], preemptions[128]) == (8, 0)
    assert served[None] < 8 or preemptions[None] > 0


@pytest.mark.parametrize("windows, layer_groups", [((256,), (0,) * 10), ((None, 256), (0, 1) * 5)])
def test_a_windowed_models_kv_travels_only_within_the_window(windows, layer_groups):
    """A split request's second token comes a decode (0.02 s) after its KV has landed: a windowed
    group's layers send only the positions the token worker's window reaches (from the first block
    it reads, at 16 tokens a block)."""
    transfer, landed = dataclasses.replace(TRANSFER, layer_groups=layer_groups), {}
    for windowed in (False, True):
        options = dict(kv_windows=windows, transfer=transfer, kv_group_share=1 / len(windows)) if windowed else {}
        [record] = simulate(split(**options), [spec(0, 0.0, 2000, 2)]).records
        landed[windowed] = record.token_times_s[1] - 0.02
    # a 2 s prefill (LinearPerf: 1 ms a token); 10 layers, 1000 B a token over 1 MB/s
    assert landed[False] == pytest.approx(2.0 + pipeline_visible(TRANSFER, 2000, 2.0))
    reach = 2000 - (2000 - 256 + 1) // 16 * 16  # 256 tokens a windowed layer
    if len(windows) == 1:  # 256 tokens a layer: one message after the prefill, as a 256-token prompt's
        assert landed[True] == pytest.approx(2.0 + 0.01 + 256 * 1000 / 1e6)
    else:  # (2000 + 256) / 2 a layer: layer by layer, the windowed ones short
        layers = [2000 if group == 0 else reach for group in layer_groups]
        assert landed[True] == pytest.approx(2.0 + pipeline_visible(transfer, layers, 2.0))
        assert landed[True] < landed[False]
        # a transfer model that does not say which layers each group holds sends every position
        [record] = simulate(split(kv_windows=windows, kv_group_share=0.5), [spec(0, 0.0, 2000, 2)]).records
        assert record.token_times_s[1] - 0.02 == pytest.approx(landed[False])


def test_a_model_where_some_layers_slide_keeps_a_window_of_blocks_in_their_groups():
    """Two layer groups, each block half a token's KV: the windowed group's tables stay at a
    window's blocks, so the same bytes run the long decodes with fewer preemptions than keeping
    every block; with no window at all the cache is the one-group model's."""
    requests = [spec(i, 0.3 * i, 200, 800) for i in range(8)]
    preemptions, blocks = {}, {}
    for windows in ((None,), (None, None), (None, 128)):
        share = 1 / len(windows)
        sim = Simulation(mixed(kv_budget_tokens=4096, max_model_len=1024, kv_windows=windows, kv_group_share=share),
                         requests)
        records = sim.run().records
        assert all(r.status == 200 and len(r.token_times_s) == 800 for r in records)
        worker = next(iter(sim.workers.values()))
        preemptions[windows], blocks[windows] = worker.policy.num_preemptions, worker.blocks.num_blocks
    assert blocks[(None,)] * 2 == blocks[(None, None)] == blocks[(None, 128)] + 1  # + NULL_BLOCK
    assert preemptions[(None,)] == preemptions[(None, None)] > preemptions[(None, 128)]
