"""The prefix cache's host tier in the simulator (`sim.host_kv`): the engine's own tier keeps what
a worker's small cache evicts, a later turn restores it instead of prefilling it, and each block
copied costs the iteration that copies it."""
from dataclasses import replace

import pytest

from splitserve.bench.workload import RequestSpec
from splitserve.sim.cluster import simulate
from splitserve.sim.host_kv import HostKVModel, SimHostKV
from tests.sim.test_sim_cluster import TRANSFER, mixed

BLOCK = 64  # tokens of one trace block


def conversations() -> list[RequestSpec]:
    """Three first turns of 512 tokens, each evicting the one before from a 1024-token cache; then
    the first conversation's second turn, its first turn's blocks and one more."""
    requests = [RequestSpec(c, 10.0 * c, 8 * BLOCK, 4, prefix_blocks=tuple(range(10 * c, 10 * c + 8)),
                            block_tokens=BLOCK) for c in range(3)]
    return requests + [RequestSpec(3, 30.0, 9 * BLOCK, 4, prefix_blocks=tuple(range(9)), block_tokens=BLOCK)]


def small(host_tokens: int = 0, bytes_per_s: float = 1e12, write_through: bool = False):
    host = HostKVModel(host_tokens, bytes_per_s, write_through) if host_tokens else None
    return mixed(kv_budget_tokens=1024, max_model_len=1024, host_kv=host)


@pytest.mark.parametrize("write_through", [False, True], ids=["write_back", "write_through"])
def test_a_later_turn_restores_its_evicted_prefix(write_through):
    plain, tier = simulate(small(), conversations()), simulate(small(4096, write_through=write_through),
                                                               conversations())
    prefill = [sum(w.prefill_tokens for w in r.workers) for r in (plain, tier)]
    assert prefill[0] - prefill[1] == 8 * BLOCK  # the second turn computes its new block only
    assert [w.host_restored_tokens for w in tier.workers] == [8 * BLOCK]
    assert tier.records[3].cached_tokens == 8 * BLOCK and plain.records[3].cached_tokens == 0
    assert tier.records[3].ttft_s < plain.records[3].ttft_s


def test_blocks_written_through_cost_only_what_outlasts_the_iteration():
    """Saves and restores cost in full; writes run beside the iteration and cost what is left."""
    mover = SimHostKV(0.25)
    mover.write([1, 2, 3], [0, 1, 2])
    assert mover.take_cost(0.5) == pytest.approx(0.25) and mover.take_cost(0.5) == 0
    mover.write([1, 2], [0, 1])
    mover.load([3], [4])
    mover.save([5], [6])
    assert mover.take_cost(1.0) == pytest.approx(0.5)


def test_each_block_copied_costs_its_iteration():
    """Copies at one block (16 tokens) a second against free ones: the workers were busy longer by
    a whole second per block saved or restored (A's 32 blocks saved, then restored, at the least),
    and the second turn's first token waited for its 32 restores."""
    block_bytes = 16 * TRANSFER.kv_bytes_per_token
    requests = [replace(r, arrival_s=100.0) if r.index == 3 else r for r in conversations()]
    fast, slow = (simulate(small(4096, rate), requests) for rate in (1e15, block_bytes))
    assert all(r.status == 200 for r in slow.records)
    busy = sum(w.busy_s for w in slow.workers) - sum(w.busy_s for w in fast.workers)
    assert busy == pytest.approx(round(busy), abs=1e-6) and busy >= 64
    assert slow.records[3].ttft_s - fast.records[3].ttft_s >= 32


def test_a_host_tier_needs_prefix_caching_and_room():
    with pytest.raises(ValueError, match="needs prefix_caching"):
        replace(small(4096), prefix_caching=False)
    with pytest.raises(ValueError, match="less than a KV block"):
        small(8)
    with pytest.raises(ValueError, match="at least one token"):
        HostKVModel(0)
    with pytest.raises(ValueError, match="finite number > 0"):
        HostKVModel(64, float("inf"))
