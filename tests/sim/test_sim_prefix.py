"""Prefix replay in the simulator: shared prompt blocks hit the workers' own prefix caches, the CLS
places by them (the real `ClusterState` and index) and a token worker receives only what it lacks."""
import pytest

from splitserve.bench.workload import RequestSpec
from splitserve.placement import Role
from splitserve.placement.state import PrefixOptions
from splitserve.sim.cluster import simulate
from tests.sim.test_sim_cluster import scenario, split

BLOCK = 64  # tokens of one trace block


def turns() -> list[RequestSpec]:
    """Three conversations of two turns each, far apart: turn 2 resends turn 1's blocks and adds one."""
    requests = []
    for c in range(3):
        first, second = (10 * c + 1, 10 * c + 2), (10 * c + 1, 10 * c + 2, 10 * c + 3)
        requests.append(RequestSpec(2 * c, 10.0 * c, 2 * BLOCK, 4, prefix_blocks=first, block_tokens=BLOCK))
        requests.append(RequestSpec(2 * c + 1, 10.0 * c + 5, 3 * BLOCK, 4, prefix_blocks=second, block_tokens=BLOCK))
    return requests


def two_by_two(aware: bool):
    return split(2, 2, placement="splitwise", prefix=PrefixOptions(aware=aware))


def prefill_tokens(result) -> int:
    return sum(w.prefill_tokens for w in result.workers)


def test_aware_placement_reuses_each_earlier_turn_on_both_sides():
    requests = turns()
    aware, blind = simulate(two_by_two(True), requests), simulate(two_by_two(False), requests)
    total = sum(r.prompt_tokens for r in requests)
    # aware: each turn 2 lands where turn 1 ran; the prompt worker recomputes from its cached 2 blocks
    # on (the last token of a prompt is always computed), the token worker imports only the new block
    assert prefill_tokens(aware) == total - 3 * 2 * BLOCK
    assert aware.kv_tokens_reused == 3 * 2 * BLOCK and aware.kv_tokens_sent == total - 3 * 2 * BLOCK
    assert blind.kv_tokens_reused == 0 and blind.kv_tokens_sent == total
    assert all(r.status == 200 for r in aware.records)
    # what a client's usage would say: each turn 2's prompt found turn 1's two blocks cached
    assert [r.cached_tokens for r in aware.records] == [0, 2 * BLOCK] * 3
    assert aware.summary()["prompt_cached_share"] == 3 * 2 * BLOCK / total


def test_a_long_cached_prefix_beats_a_slightly_shorter_queue():
    """Turn 2 arrives while an unrelated 100-token prompt runs on turn 1's prompt worker: blind JSQ
    sends it to the idle one, which computes it all; aware keeps it where 128 tokens are cached."""
    first = RequestSpec(0, 0.0, 2 * BLOCK, 4, prefix_blocks=(1, 2), block_tokens=BLOCK)
    other = RequestSpec(1, 5.0, 100, 4, prefix_blocks=(7,), block_tokens=100)
    second = RequestSpec(2, 5.01, 3 * BLOCK, 4, prefix_blocks=(1, 2, 3), block_tokens=BLOCK)
    aware, blind = (simulate(two_by_two(a), [first, other, second]) for a in (True, False))
    assert prefill_tokens(blind) == 2 * BLOCK + 100 + 3 * BLOCK
    assert prefill_tokens(aware) == prefill_tokens(blind) - 2 * BLOCK


def test_requests_without_blocks_run_as_before():
    requests = [RequestSpec(i, 0.3 * i, 100 + 10 * i, 5) for i in range(8)]
    cached, plain = simulate(split(2, 2), requests), simulate(split(2, 2, prefix_caching=False), requests)
    assert [r.token_times_s for r in cached.records] == [r.token_times_s for r in plain.records]
    assert cached.kv_tokens_reused == 0 and prefill_tokens(cached) == sum(r.prompt_tokens for r in requests)


def test_a_whole_request_on_a_mixed_worker_reuses_its_cache():
    requests = turns()
    result = simulate(scenario((Role.MIXED, 2, "hw"), placement="jsq"), requests)
    assert prefill_tokens(result) == pytest.approx(sum(r.prompt_tokens for r in requests) - 3 * 2 * BLOCK)


def test_a_block_longer_than_its_prompt_is_cut_to_the_prompt():
    """A trace scaled past its prompts (`--length-scale`) has blocks of more tokens than a prompt:
    the prompt is built to its own length only (the blocks were built whole, then cut)."""
    from splitserve.sim.cluster import Simulation

    huge = RequestSpec(0, 0.0, 5, 1, prefix_blocks=(3, 4), block_tokens=10 ** 15)
    run = Simulation(split(), [huge])
    assert run.caching and run.inputs.prompt_of(huge) == [3] * 5
    assert run.inputs.prompt_of(RequestSpec(1, 0.0, 5, 1, prefix_blocks=(3, 4), block_tokens=3)) == [3, 3, 3, 4, 4]
    assert run.inputs.prompt_of(RequestSpec(2, 0.0, 9, 1, prefix_blocks=(3, 4), block_tokens=3)) == [3, 3, 3, 4, 4, 4]
