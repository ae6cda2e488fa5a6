"""Which LoRA adapter each device slot holds, and the sequences bound to each (a scheduler's view).

A sequence under an adapter is bound to a slot when admitted (`Policy._admit`, or as its import
completes) and let go when it stops computing: finished, preempted, or prefilled for a
hand-off. At admission its adapter's slot is used if one holds it; else a slot no sequence is
bound to takes the adapter from host memory (an empty one first, then the least recently
bound), written between two steps: with `max_cpu_loras` past `max_loras`, more adapters are
served than the device holds at once.

A sequence whose adapter finds no slot waits and is skipped, so others go on (vLLM's way, which
keeps the adapters running batched). So that it is not left waiting for ever while other adapters
keep every slot busy, once `patience` sequences of other adapters have been bound since it found
none, it claims one: the slot with the fewest sequences bound (the least recently bound of those)
takes no new sequence of its adapter until it drains, and then goes to the claiming adapter. One
claim at a time (each drains a slot: several at once would leave fewer to batch in); a claim
lapses once no waiting sequence names its adapter (they were aborted, say).
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable

from splitserve.engine.model.lora import NO_ADAPTER
from splitserve.engine.sequence import Sequence


class AdapterResidency:
    """Over `identity` (per slot: the adapter it holds, None: empty), with `write(slot, identity)`
    putting an adapter from host memory into a slot, which `identity` then names."""

    def __init__(self, identity: list[str | None], write: Callable[[int, str], None], patience: int):
        self.identity, self.write, self.patience = identity, write, patience
        self.bound = [0] * len(identity)  # sequences bound to each slot
        self._last = [0] * len(identity)  # when each slot was last bound (a tick), for least recently bound
        self._ticks = itertools.count(1)
        self.claim: tuple[int, str] | None = None  # (slot, adapter): the slot drains for that adapter
        self._overtaken: dict[str, int] = {}  # adapter finding no slot -> adapters' sequences bound since
        self.swaps = 0  # adapters written into a slot from host memory

    def ready(self, seq: Sequence) -> bool:
        """Whether admitting `seq` finds its adapter a slot; when not, it claims one (if none is claimed)."""
        identity = seq.adapter_identity
        if identity is None:
            return True
        if identity in self.identity:
            slot = self.identity.index(identity)
            return self.claim is None or self.claim[0] != slot or self.claim[1] == identity
        if self._free_slot(identity) is not None:
            return True
        if self._overtaken.setdefault(identity, 0) >= self.patience and self.claim is None:
            slot = min(range(len(self.bound)), key=lambda s: (self.bound[s], self._last[s]))
            self.claim = (slot, identity)
        return False

    def bind(self, seq: Sequence) -> None:
        """Bind a `ready` sequence to a slot holding its adapter, writing it into a free one if none does."""
        identity = seq.adapter_identity
        if identity is None:
            return
        if identity in self.identity:
            slot = self.identity.index(identity)
        else:
            slot = self._free_slot(identity)
            if slot is None:
                raise RuntimeError(f"no adapter slot is free for {seq.seq_id!r} (admitted without `ready`)")
            self.write(slot, identity)
            self.swaps += 1
        if self.claim is not None and self.claim[1] == identity:
            self.claim = None
        self._overtaken.pop(identity, None)
        for other in self._overtaken:
            self._overtaken[other] += 1
        self.bound[slot] += 1
        self._last[slot] = next(self._ticks)
        seq.adapter_slot = slot

    def release(self, seq: Sequence) -> None:
        """`seq` computes no more (for now): its slot no longer holds it."""
        if seq.adapter_slot != NO_ADAPTER:
            self.bound[seq.adapter_slot] -= 1
            seq.adapter_slot = NO_ADAPTER

    def resident(self) -> tuple[str, ...]:
        """The adapters the slots hold."""
        return tuple(identity for identity in self.identity if identity is not None)

    def idle_slots(self) -> int:
        """Slots no sequence is bound to, but a claimed one: each can take another adapter at once."""
        return sum(1 for slot, count in enumerate(self.bound)
                   if count == 0 and (self.claim is None or self.claim[0] != slot))

    def lapse_claim(self, waiting: Iterable[Sequence]) -> None:
        """Drop the claim if no waiting sequence names its adapter (one left the queue unadmitted)."""
        named = {seq.adapter_identity for seq in waiting}
        if self.claim is not None and self.claim[1] not in named:
            self.claim = None
        self._overtaken = {identity: count for identity, count in self._overtaken.items() if identity in named}

    def forget(self, identities: Iterable[str]) -> None:
        """Adapters gone from host memory: slots holding them (none bound) are empty again."""
        for identity in identities:
            if identity in self.identity:
                self.identity[self.identity.index(identity)] = None

    def check(self, holders: Iterable[Sequence]) -> None:
        """Each slot's count is the sequences bound to it, and each holds its sequences' adapter."""
        counts = Counter()
        for seq in holders:
            if seq.adapter_slot != NO_ADAPTER:
                counts[seq.adapter_slot] += 1
                if self.identity[seq.adapter_slot] != seq.adapter_identity:
                    raise RuntimeError(f"sequence {seq.seq_id!r} is bound to adapter slot {seq.adapter_slot}, "
                                       "which holds another adapter")
        if [counts[slot] for slot in range(len(self.bound))] != self.bound:
            raise RuntimeError(f"adapter slots count {self.bound} sequences bound, but hold {dict(counts)}")

    def _free_slot(self, identity: str) -> int | None:
        """A slot no sequence is bound to that `identity` may take: an empty one first, then the
        least recently bound; the claimed slot only for its claimant."""
        free = [slot for slot, count in enumerate(self.bound) if count == 0
                and (self.claim is None or self.claim[0] != slot or self.claim[1] == identity)]
        return min(free, key=lambda s: (self.identity[s] is not None, self._last[s]), default=None)
