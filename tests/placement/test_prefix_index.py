"""The CLS's prefix index (placement/prefix_index.py): deltas and snapshots, workers joining,
leaving and being replaced, the per-worker and global bounds, and the leading-blocks lookup."""
import random
import tracemalloc

import pytest

from splitserve.placement import ClusterState, PlacementRequest, Role, WorkerLoad
from splitserve.placement.prefix_index import PrefixIndex
from splitserve.placement.state import PrefixDelta, PrefixOptions

BS = 16
CHAIN = tuple(range(1000, 1010))  # a prompt's block hashes (any ints will do)


def delta(added=(), removed=(), snapshot=False, num_blocks=100) -> PrefixDelta:
    return PrefixDelta(BS, num_blocks, tuple(added), tuple(removed), snapshot)


def test_the_lookup_counts_each_workers_leading_blocks():
    index = PrefixIndex(1000)
    index.apply("a", delta(CHAIN[:3]))
    index.apply("b", delta(CHAIN[:7]))
    index.apply("c", delta(CHAIN[1:9]))  # not the first block: nothing leads
    index.apply("d", delta(CHAIN[:2] + CHAIN[3:]))  # a gap ends the run
    assert index.cached_tokens(CHAIN) == {"a": 3 * BS, "b": 7 * BS, "d": 2 * BS}
    assert index.cached_tokens(CHAIN[:5]) == {"a": 3 * BS, "b": 5 * BS, "d": 2 * BS}
    assert index.cached_tokens((5,) + CHAIN) == {} and index.cached_tokens(()) == {}
    index.check_integrity({"a", "b", "c", "d"})


def test_a_removed_hash_stops_matching_and_ends_the_run_there():
    index = PrefixIndex(1000)
    index.apply("a", delta(CHAIN[:6]))
    index.apply("a", delta(removed=CHAIN[2:3]))
    assert index.cached_tokens(CHAIN) == {"a": 2 * BS}
    index.apply("a", delta(removed=CHAIN[:1]))
    assert index.cached_tokens(CHAIN) == {} and index.num_entries("a") == 4
    index.apply("a", delta(removed=CHAIN[1:2] + CHAIN[3:6]))
    assert index.empty and index.num_entries() == 0


def test_a_snapshot_replaces_what_the_worker_held():
    index = PrefixIndex(1000)
    index.apply("a", delta(CHAIN[:6]))
    index.apply("b", delta(CHAIN[:2]))
    index.apply("a", delta((7, 8, 9), snapshot=True))
    assert index.cached_tokens(CHAIN) == {"b": 2 * BS} and index.num_entries("a") == 3
    index.check_integrity({"a", "b"})


def test_leave_and_replace():
    index = PrefixIndex(1000)
    index.apply("p-0.0", delta(CHAIN[:4]))
    index.apply("t-0.1", delta(CHAIN[:2]))
    index.remove("p-0.0")
    index.remove("nobody")
    assert index.cached_tokens(CHAIN) == {"t-0.1": 2 * BS}
    index.apply("p-0.2", delta(CHAIN[:1]))  # the replacement: a new id, a fresh cache (and the freed bit)
    assert index.cached_tokens(CHAIN) == {"t-0.1": 2 * BS, "p-0.2": BS}
    index.check_integrity({"t-0.1", "p-0.2"})
    with pytest.raises(RuntimeError, match="not in the cluster"):
        index.check_integrity({"t-0.1"})


def test_a_worker_keeps_at_most_its_kv_blocks_and_a_chain_loses_its_tail_first():
    index = PrefixIndex(1000)
    index.apply("a", delta(CHAIN[:3], num_blocks=4))
    index.apply("a", delta((50, 51), num_blocks=4))  # an eviction lost with a report: more than fits
    assert index.num_entries("a") == 4 and index.cached_tokens(CHAIN) == {"a": 2 * BS}
    assert index.cached_tokens((50, 51)) == {"a": 2 * BS}
    index.apply("a", delta(CHAIN[:2] + (60,), num_blocks=4))  # known entries keep their place
    assert index.cached_tokens(CHAIN) == {"a": BS} and index.cached_tokens((50, 51)) == {"a": 2 * BS}


def test_placing_a_request_renews_its_chain_and_adds_what_the_worker_will_hold():
    index = PrefixIndex(1000)
    index.apply("a", delta(CHAIN[:3], num_blocks=7))
    index.apply("a", delta((50, 51, 52), num_blocks=7))
    index.placed("a", CHAIN[:4])  # renews 0..2 and adds 3: now the most recent, root last
    index.placed("nobody", CHAIN)  # a worker that has not reported yet: nothing to renew
    assert index.cached_tokens(CHAIN) == {"a": 4 * BS} and index.num_entries() == 7
    index.apply("a", delta((60, 61), num_blocks=7))  # the chain 50..52 is the least recent: it goes
    assert index.cached_tokens(CHAIN) == {"a": 4 * BS} and index.cached_tokens((50, 51, 52)) == {"a": BS}
    index.check_integrity({"a"})


def test_the_global_cap_holds_through_joins_as_equal_shares():
    index = PrefixIndex(10)
    index.apply("a", delta(range(0, 8)))
    index.apply("b", delta(range(100, 108)))
    assert (index.num_entries("a"), index.num_entries("b")) == (5, 5)
    assert index.cached_tokens(range(0, 8)) == {"a": 5 * BS}  # the tails went
    index.apply("c", delta())  # the shares shrink to 3 each: a and b lose their least recent
    assert index.num_entries() == 6 and index.cached_tokens(range(0, 8)) == {"a": 3 * BS}
    index.remove("c")  # shares grow again; what was dropped stays dropped
    index.apply("a", delta(range(20, 30)))
    assert index.num_entries("a") == 5 and index.num_entries() <= 10
    index.check_integrity({"a", "b"})


def test_an_entry_takes_at_most_the_memory_the_setting_s_description_states():
    """scheduler.prefix_index_blocks says up to about 160 bytes an entry: 40 workers' distinct blocks
    (1 M of them measured 155)."""
    rng = random.Random(5)
    chains = [tuple(rng.getrandbits(63) for _ in range(2500)) for _ in range(40)]
    tracemalloc.start()
    try:
        index = PrefixIndex(1 << 20)
        for worker, chain in enumerate(chains):
            index.apply(f"w{worker}", PrefixDelta(16, 10_000, chain, snapshot=True))
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert index.num_entries() == 100_000 and used / 100_000 < 170


def test_random_churn_keeps_the_index_sound_bounded_and_exact_while_nothing_is_trimmed():
    rng = random.Random(5)
    for cap in (10_000, 40):
        index, mirror = PrefixIndex(cap), {}
        for _ in range(400):
            worker = rng.choice("abcdef")
            held = mirror.setdefault(worker, set())
            if rng.random() < 0.1:
                index.remove(worker)
                del mirror[worker]
                continue
            if rng.random() < 0.1:
                new = {rng.randrange(60) for _ in range(rng.randint(0, 20))}
                index.apply(worker, delta(sorted(new), snapshot=True, num_blocks=30))
                held.clear()
            else:
                gone = {h for h in held if rng.random() < 0.2}
                new = {rng.randrange(60) for _ in range(rng.randint(0, 8))} - held
                index.apply(worker, delta(sorted(new), sorted(gone), num_blocks=30))
                held -= gone
            held |= new
            index.check_integrity(set(mirror))
            assert index.num_entries() <= cap
            if cap == 10_000 and all(len(h) <= 30 for h in mirror.values()):
                chain = tuple(rng.sample(range(60), 10))
                leading = {w: next((i for i, c in enumerate(chain) if c not in h), 10) for w, h in mirror.items()}
                assert index.cached_tokens(chain) == {w: n * BS for w, n in leading.items() if n}
            else:  # trimmed: index entries are a subset
                mirror = {w: {h for h in mirror[w] if h in index._workers[w].hashes} for w in mirror}


def test_the_cluster_state_feeds_the_index_from_reports_and_placements_only_when_prefix_aware():
    state = ClusterState("jsq")
    state.add_worker("p0", Role.PROMPT, "h100")
    state.add_worker("t0", Role.TOKEN, "h100")
    state.report("p0", WorkerLoad(), 1.0, delta(CHAIN[:4]))
    state.report("ghost", WorkerLoad(), 1.0, delta(CHAIN[:4]))  # a worker already gone: ignored
    hashed = PlacementRequest("r", 100, 8, prefix_hashes=CHAIN)
    assert state.affinity(hashed).cached == {"p0": 4 * BS}
    assert state.affinity(PlacementRequest("r", 100, 8)) is None
    assert state.snapshot()["workers"]["p0"]["prefix_blocks"] == 4
    state.report("t0", WorkerLoad(), 1.0, delta())
    state.place(hashed, 1.5)  # both chosen workers now count the whole chain as theirs
    assert state.affinity(hashed).cached == {"p0": 10 * BS, "t0": 10 * BS}
    state.remove_worker("p0")
    state.remove_worker("t0")
    assert state.prefix_index.empty and state.affinity(hashed) is None
    state.check_integrity()
    blind = ClusterState("jsq", prefix=PrefixOptions(aware=False))
    blind.add_worker("p0", Role.PROMPT, "h100")
    blind.add_worker("t0", Role.TOKEN, "h100")
    blind.report("p0", WorkerLoad(), 1.0, delta(CHAIN[:4]))
    assert blind.place(hashed, 1.5)[0] is not None
    assert blind.prefix_index.empty and blind.affinity(hashed) is None


@pytest.mark.parametrize("make, field", [
    (lambda: PrefixDelta(0, 10), "block_size"),
    (lambda: PrefixDelta(16, -1), "num_blocks"),
    (lambda: PrefixDelta(16, 2, added=(1, 2, 3)), "added"),
    (lambda: PrefixDelta(16, 2, removed=[1]), "removed"),
    (lambda: PrefixDelta(16, 2, added=(1, "2")), "added"),
    (lambda: PlacementRequest("r", 10, 1, prefix_hashes=[1, 2]), "prefix_hashes"),
    (lambda: PlacementRequest("r", 10, 1, prefix_hashes=tuple(range(5000))), "prefix_hashes"),
    (lambda: PrefixOptions(prefill_saved_weight=-1), "prefill_saved_weight"),
    (lambda: PrefixOptions(transfer_saved_weight=float("nan")), "transfer_saved_weight"),
    (lambda: PrefixOptions(max_index_blocks=0), "max_index_blocks"),
    (lambda: PrefixOptions(aware="yes"), "aware"),
    (lambda: PrefixIndex(0), "max_blocks"),
    (lambda: ClusterState("jsq", prefix={"aware": True}), "prefix"),
])
def test_bad_input_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()
