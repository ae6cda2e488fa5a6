"""Binding sequences to LoRA adapter slots at admission (`lora_residency`), alone and through every
scheduling policy: which slot an adapter takes, the claim that keeps an adapter from waiting for
ever while others keep the slots busy, and what an import is refused."""
from __future__ import annotations

import pytest

from splitserve.engine.lora_residency import AdapterResidency
from splitserve.engine.policies.base import EngineFullError
from splitserve.engine.sequence import SequenceStatus
from tests.engine.policy_helpers import make, make_seq, shape, step

DECODING_POLICIES = ["mixed", "token", "orca", "prefill_first", "accelgen"]  # the prompt policy hands off: its own test


class Slots:
    """A residency over `n` slots, recording its writes; an adapter finding no slot claims one at
    once (`patience` 0) unless told otherwise."""

    def __init__(self, n: int, held: tuple[str | None, ...] = (), patience: int = 0):
        self.identity = list(held) + [None] * (n - len(held))
        self.writes: list[tuple[int, str]] = []
        self.residency = AdapterResidency(self.identity, self.write, patience)

    def write(self, slot: int, identity: str) -> None:
        self.writes.append((slot, identity))
        self.identity[slot] = identity


def under(seq_id: str, adapter: str | None, at: int = 0, length: int = 5, **params):
    seq = make_seq(seq_id, length, start=100 * at, **params)
    seq.adapter_identity = adapter
    return seq


def long_under(seq_id: str, adapter: str, at: int):
    """Its import (and first token) takes 4 blocks."""
    return under(seq_id, adapter, at, length=12, max_tokens=3)


def test_a_held_adapter_binds_where_it_is_and_a_new_one_takes_an_empty_slot_then_the_least_recently_bound():
    slots = Slots(3, ("a",))
    r = slots.residency
    a, b, c, d = under("a1", "a"), under("b1", "b"), under("c1", "c"), under("d1", "d")
    for seq in (a, b, c):
        assert r.ready(seq)
        r.bind(seq)
    assert (a.adapter_slot, b.adapter_slot, c.adapter_slot) == (0, 1, 2)
    assert slots.writes == [(1, "b"), (2, "c")] and r.bound == [1, 1, 1]
    for seq in (c, a):  # c let go first: a is the least recently bound of the two free slots
        r.release(seq)
    r.bind(d)
    assert d.adapter_slot == 0 and slots.identity == ["d", "b", "c"] and slots.writes[-1] == (0, "d")
    base = under("base", None)
    assert r.ready(base)
    r.bind(base)
    assert base.adapter_slot == -1 and r.swaps == 3
    r.check([b, d, base])
    with pytest.raises(RuntimeError, match=r"count \[1, 1, 0\] sequences bound, but hold \{0: 1\}"):
        r.check([d])


def test_an_adapter_finding_no_slot_claims_the_one_that_drains_first_and_gets_it_before_its_own_adapter():
    slots = Slots(2)
    r = slots.residency
    a1, a2, b1, c1, a3 = under("a1", "a"), under("a2", "a"), under("b1", "b"), under("c1", "c"), under("a3", "a")
    for seq in (a1, a2, b1):
        r.bind(seq)
    assert not r.ready(c1) and r.claim == (1, "c")  # b's slot holds one sequence, a's two
    assert not r.ready(under("b2", "b"))  # b's slot drains for c
    assert r.ready(a3) and not r.ready(under("d1", "d"))  # another adapter waits behind the claim
    r.release(b1)
    assert r.ready(c1)
    r.bind(c1)
    assert c1.adapter_slot == 1 and r.claim is None and slots.writes[-1] == (1, "c")


def test_an_adapter_claims_a_slot_only_once_patience_sequences_of_others_took_slots_meanwhile():
    """Until then it is skipped and others batch into their slots (vLLM's way); after, it claims."""
    slots = Slots(1, patience=2)
    r = slots.residency
    r.bind(under("a1", "a"))
    b1 = under("b1", "b")
    for later in ("a2", "a3"):
        assert not r.ready(b1) and r.claim is None
        r.bind(under(later, "a"))
        r.bind(under("base", None))  # the base model takes no slot: it does not count
    assert not r.ready(b1) and r.claim == (0, "b") and not r.ready(under("a4", "a"))


def test_a_claim_lapses_once_no_waiting_sequence_names_its_adapter():
    slots = Slots(1)
    r = slots.residency
    r.bind(under("a1", "a"))
    b1 = under("b1", "b")
    assert not r.ready(b1) and r.claim == (0, "b")
    r.lapse_claim([under("a2", "a"), b1])
    assert r.claim == (0, "b")
    r.lapse_claim([under("a2", "a")])
    assert r.claim is None and r.ready(under("a2", "a"))


def test_forgotten_adapters_leave_their_slots_empty():
    slots = Slots(2, ("a", "b"))
    slots.residency.forget(["b", "z"])
    assert slots.identity == ["a", None]


@pytest.mark.parametrize("name", DECODING_POLICIES)
def test_a_policy_skips_a_sequence_whose_adapter_finds_no_slot_and_runs_it_once_one_drains(name):
    """One slot, held by adapter a's running sequence: b's request waits (claiming the slot), the
    base model's request behind it runs at once, a later request of a does not overtake b."""
    p = make(name, max_num_seqs=8, prompt_chunk_tokens=64)
    slots = Slots(1)
    p.adapters = slots.residency
    a1 = under("a1", "a", 0, max_tokens=3)
    p.add(a1)
    step(p)
    b1, base, a2 = under("b1", "b", 1, max_tokens=2), under("base", None, 2, max_tokens=2), under("a2", "a", 3)
    for seq in (b1, base, a2):
        p.add(seq)
    plan, _ = step(p)
    ran = {item.seq.seq_id for item in plan.scheduled}
    assert "base" in ran and not ran & {"b1", "a2"} and slots.residency.claim == (0, "b")
    p.check_integrity()
    while a1.status is not SequenceStatus.FINISHED:
        step(p)
    while b1.status is SequenceStatus.WAITING:
        plan, _ = step(p)
        assert "a2" not in {item.seq.seq_id for item in plan.scheduled}
    assert b1.adapter_slot in (0, -1) and slots.writes == [(0, "a"), (0, "b")]
    p.check_integrity()
    while p.has_work() and a2.status is SequenceStatus.WAITING:
        step(p)
    assert slots.writes[-1] == (0, "a") and a2.status is not SequenceStatus.WAITING
    p.check_integrity()


def test_a_prompt_worker_lets_go_of_the_slot_once_the_prompt_is_prefilled():
    p = make("prompt", max_num_seqs=8)
    p.adapters = Slots(1).residency
    a1, b1 = under("a1", "a"), under("b1", "b", 1)
    p.add(a1)
    p.add(b1)
    step(p)
    assert a1.status is SequenceStatus.PREFILLED and a1.adapter_slot == -1 and b1.status is SequenceStatus.WAITING
    step(p)
    assert b1.status is SequenceStatus.PREFILLED and p.adapters.swaps == 2
    p.check_integrity()


def test_an_import_whose_adapter_finds_no_slot_waits_and_finds_its_kv_in_the_prefix_cache_when_it_runs():
    """A token worker reserves blocks for any import; one completing while every slot runs another
    adapter is preempted (it claims the slot), and admitted once the slot drains, its imported KV
    a prefix-cache hit. Meanwhile the worker takes imports: it awaits a slot, not blocks."""
    p = make("token", max_num_seqs=8, prompt_chunk_tokens=64)
    p.adapters = Slots(1).residency
    a1, b1 = under("a1", "a", max_tokens=3), under("b1", "b", 1, max_tokens=3)
    for seq in (a1, b1):
        p.reserve_import(seq)
    assert p.adapters.bound == [0]  # blocks only: no slot is needed to receive KV
    p.complete_import("a1", 7)
    p.complete_import("b1", 7)
    assert a1.adapter_slot == 0 and b1.status is SequenceStatus.WAITING and p.adapters.claim == (0, "b")
    assert b1.awaits_adapter_slot and p.num_preempted_waiting == 0 and p.num_preemptions == 1
    p.reserve_import(under("a2", "a", 2))
    p.check_integrity()
    while b1.status is SequenceStatus.WAITING:
        plan, _ = step(p)
    assert ("b1", 2) in shape(plan)  # its 6 tokens but the first block's 4, which its import left cached
    assert b1.adapter_slot == 0 and p.adapters.identity == ["b"] and not b1.awaits_adapter_slot
    p.check_integrity()


def test_an_import_awaiting_its_slot_then_waits_for_blocks_as_a_preempted_one():
    """Once its adapter finds a slot, an import that awaited one and still finds no blocks holds
    imports back as any preempted sequence does."""
    p = make("token", max_num_seqs=8, num_blocks=6, prompt_chunk_tokens=64)
    p.adapters = Slots(1).residency
    a1, b1, a2 = under("a1", "a", max_tokens=3), long_under("b1", "b", 1), long_under("a2", "a", 2)
    for seq in (a1, b1):
        p.reserve_import(seq)  # 2 + 4 blocks
    p.complete_import("a1", 7)
    p.complete_import("b1", 7)
    assert p.num_preempted_waiting == 0
    p.reserve_import(a2)  # 4 blocks: b1's cached ones are evicted for them
    a1.status = SequenceStatus.FINISHED
    p.finish(a1, "length")
    step(p)  # the slot drained: b1's adapter is ready, but a2 holds the blocks it needs
    assert not b1.awaits_adapter_slot and b1.status is SequenceStatus.WAITING and p.num_preempted_waiting == 1
    with pytest.raises(EngineFullError, match="a preempted sequence waits"):
        p.reserve_import(under("a3", "a", 3))
    p.check_integrity()
