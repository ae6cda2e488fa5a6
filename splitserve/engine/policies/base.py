"""The machinery every scheduling policy shares: queues, admission, preemption and step bookkeeping.

Pure Python: a policy takes sequences and returns a `Plan`; the engine (or the simulator) runs
the plan and reports the sampled tokens back through `complete_step`.

Queues: `waiting` (FIFO, no KV blocks) and `running` (admission order, oldest first, hold blocks).
`held` keeps sequences that hold blocks but are not scheduled: PREFILLED (prompt role, waiting
for export) and IMPORTING (blocks reserved for a KV transfer in).

By priority (`SchedulerLimits.by_priority`, vLLM's priority scheduling): `waiting` is ordered by
`rank` (a lower priority value first, then arrival), a preempted sequence going back to its
place in it; when KV runs out the lowest-ranked running sequence is preempted first; and a
waiting sequence that cannot be admitted preempts running ones of a strictly lower priority
(`_preempt_for_priority`), so equal priorities never preempt each other.

LoRA adapters (`adapters`, set by an engine whose model holds adapter slots): a sequence under an
adapter is bound to a slot holding it at admission and lets go when it stops computing
(`lora_residency`); a waiting sequence whose adapter finds no slot is skipped, and the next one
goes first (`_next_waiting`).
"""
from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as Sequence_
from typing import TYPE_CHECKING

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies.plan import Plan, ScheduledSeq, SchedulerLimits
from splitserve.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from splitserve.engine.lora_residency import AdapterResidency

WATERMARK_FRACTION = 0.01  # blocks kept free at admission so running decodes rarely preempt


class EngineFullError(RuntimeError):
    """The engine cannot take another sequence now (batch full); retry later or elsewhere."""


class Policy(ABC):
    """Every policy can finish every sequence it holds (decode, prefill, hand-off), so a worker
    can switch policy at run time (`adopt`) without dropping or stranding work."""

    name: str
    hands_off_by_default = False
    takes_priorities = True  # orders by SamplingParams.priority when limits.by_priority
    prefill_chunk_tokens: int | None = None  # the most prompt tokens of one sequence a step computes (None: all)

    def __init__(self, blocks: BlockManager, limits: SchedulerLimits, clock: Callable[[], float] = time.monotonic):
        self.blocks = blocks
        self.limits = limits
        self.clock = clock  # the time arrival_time is on (the simulator's own clock in a simulation)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.adapters: AdapterResidency | None = None  # the LoRA adapter slots (None: the model holds none)
        self._watermark = int(WATERMARK_FRACTION * blocks.num_blocks)

    @abstractmethod
    def schedule(self) -> Plan:
        """Choose the next iteration's work."""

    @staticmethod
    @abstractmethod
    def max_step_tokens(limits: SchedulerLimits) -> int:
        """The most tokens one iteration computes, from this policy's own queues with at most
        max_num_seqs sequences running (what the KV cache's memory profile runs)."""

    def observe(self, plan: Plan, seconds: float) -> None:
        """The iteration `plan` took `seconds`: a policy with a latency model may learn from it."""

    # ---- requests in and out -------------------------------------------------------------
    def add(self, seq: Sequence, hand_off: bool | None = None) -> None:
        """Queue a sequence; `hand_off`: prefill only and hold its KV for export (default: the role's)."""
        seq.hand_off = self.hands_off_by_default if hand_off is None else hand_off
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    @staticmethod
    def rank(seq: Sequence) -> tuple[int, float]:
        """By priority, who goes first: the lower priority value, then the earlier arrival."""
        return seq.params.priority, seq.arrival_time

    def _enqueue(self, seq: Sequence, preempted: bool = False) -> None:
        """Into `waiting`: by rank, after those of an equal one; else at the back, or with
        `preempted` at the front."""
        if not self.limits.by_priority:
            (self.waiting.appendleft if preempted else self.waiting.append)(seq)
            return
        self.waiting.insert(bisect.bisect_right(self.waiting, self.rank(seq), key=self.rank), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def decodes(self) -> Iterator[Sequence]:
        """The sequences that decode here, running or importing (not prompts held for a hand-off):
        a windowed import leaves room for their growth (`reserve_import`)."""
        return (seq for seq in (*self.running, *self.held.values()) if not seq.hand_off)

    def find(self, seq_id: str) -> Sequence | None:
        if seq_id in self.held:
            return self.held[seq_id]
        return next((s for s in [*self.running, *self.waiting] if s.seq_id == seq_id), None)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            if self.adapters is not None:
                self.adapters.lapse_claim(self.waiting)
        self.held.pop(seq.seq_id, None)
        self.blocks.free(seq.seq_id)
        self._release_slot(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def complete_step(self, plan: Plan, sampled: Mapping[str, Sequence_[int]]) -> list[Sequence]:
        """Record a finished iteration: advance computed tokens, append the tokens each sequence got
        (`sampled[seq_id]`: its drafts kept, then one: `speculation.accepted`), stop sequences that
        hit a limit. Returns the sequences that received a token."""
        updated, commit, max_model_len = [], self.blocks.commit, self.limits.max_model_len
        running = SequenceStatus.RUNNING
        for item in plan.scheduled:
            seq = item.seq
            if seq.status is not running:  # aborted while the step ran
                continue
            if not item.samples:
                seq.num_computed_tokens = item.start + item.num_new_tokens
                commit(seq)
                continue
            tokens = sampled[seq.seq_id]
            # the KV of the drafts kept is right; that of the rest lies past it, to be overwritten
            seq.num_computed_tokens = item.start + item.num_new_tokens - len(item.drafts) + len(tokens) - 1
            commit(seq)
            updated.append(seq)
            for token in tokens:
                seq.token_ids.append(token)
                reason = seq.stop_reason_after_append(max_model_len)
                if reason:
                    self.finish(seq, reason)
                    break
            if seq.hand_off and not seq.is_finished:
                self.hold_prefilled(seq)
        return updated

    def adopt(self, previous: "Policy") -> None:
        """Take over another policy's sequences and counters (a role switch on a live engine). A
        prompt the previous policy prefilled chunk by chunk goes on in this one's chunks; one whose
        blocks this policy's chunks need are not free is preempted."""
        self.waiting, self.running, self.held = previous.waiting, previous.running, previous.held
        self.num_preemptions, self.adapters = previous.num_preemptions, previous.adapters
        for seq in list(self.running):
            if not seq.is_decoding and not self.blocks.rechunk(seq, self.prefill_chunk_tokens):
                self.preempt(seq)

    # ---- KV handoff between a prompt engine and a token engine ---------------------------
    def hold_prefilled(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_slot(seq)  # its KV is computed: nothing more runs under its adapter here
        seq.status = SequenceStatus.PREFILLED
        self.held[seq.seq_id] = seq

    @property
    def adapter_swaps(self) -> int:
        """LoRA adapters written into a device slot from host memory so far."""
        return 0 if self.adapters is None else self.adapters.swaps

    @property
    def num_preempted_waiting(self) -> int:
        """Waiting sequences that were preempted: they go before any new import. One that awaits
        a slot for its adapter, not blocks, does not (imports take none it waits for)."""
        return sum(1 for seq in self.waiting if seq.num_preemptions and not seq.awaits_adapter_slot)

    def reserve_import(self, seq: Sequence, reuse_prefix: bool = False) -> list[list[int]]:
        """Reserve blocks for `seq.token_ids` before its KV arrives; returns the block tables. With
        `reuse_prefix` the KV of the first `seq.num_computed_tokens` is already here (prefix cache),
        and only the rest must arrive (`BlockManager.reserve_for_import`, which for a windowed model
        also asks for room for the running and importing sequences' growth). Raises OutOfBlocksError, or
        EngineFullError when max_num_seqs sequences are already running or importing, or while a
        preempted sequence waits for blocks here (an import would take them first)."""
        if len(self.running) + len(self.held) >= self.limits.max_num_seqs:
            raise EngineFullError(f"cannot import {seq.seq_id!r}: max_num_seqs={self.limits.max_num_seqs} "
                                  "sequences are already running or importing")
        if self.num_preempted_waiting:
            raise EngineFullError(f"cannot import {seq.seq_id!r}: a preempted sequence waits for KV blocks here")
        tables = self.blocks.reserve_for_import(seq, reuse_prefix, self.decodes())
        seq.status = SequenceStatus.IMPORTING
        self.held[seq.seq_id] = seq
        return tables

    def complete_import(self, seq_id: str, first_token_id: int) -> Sequence:
        """The prompt's KV has landed: the sequence decodes from its first token on; or, when its
        LoRA adapter finds no slot, it is preempted, to run when one does (its KV stays in the
        prefix cache, where its admission finds it again)."""
        seq = self.held.pop(seq_id)
        seq.num_computed_tokens = seq.num_tokens
        self.blocks.commit(seq)
        seq.append_token(first_token_id)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        reason = seq.stop_reason_after_append(self.limits.max_model_len)
        if reason:
            self.finish(seq, reason)
        elif self._adapter_ready(seq):
            self._bind_slot(seq)
        else:
            self.preempt(seq)
            seq.awaits_adapter_slot = True
        return seq

    # ---- building blocks for schedule() --------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)  # the first waiting one but for AccelGen's picks and adapters' skips
        self.blocks.allocate(seq, chunk_tokens=self.prefill_chunk_tokens)
        self._bind_slot(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _can_admit(self, seq: Sequence) -> bool:
        """Room in the batch, a slot for its LoRA adapter, and room in KV memory. The watermark
        only guards running sequences' growth, so with nothing running a prompt may take the whole cache."""
        watermark = self._watermark if self.running else 0
        return len(self.running) < self.limits.max_num_seqs and self._adapter_ready(seq) and \
            self.blocks.can_allocate(seq, watermark, self.prefill_chunk_tokens)

    def _next_waiting(self) -> Sequence | None:
        """The first waiting sequence, skipping those whose LoRA adapter finds no slot (the first
        of them claims one); None when none is left."""
        if self.adapters is None:
            return self.waiting[0] if self.waiting else None
        return next((seq for seq in self.waiting if self._adapter_ready(seq)), None)

    def _adapter_ready(self, seq: Sequence) -> bool:
        """Whether its adapter finds a slot (`AdapterResidency.ready`); once it does, a sequence
        that awaited one waits for blocks like any preempted one."""
        if self.adapters is None:
            return True
        if not self.adapters.ready(seq):
            return False
        seq.awaits_adapter_slot = False
        return True

    def _bind_slot(self, seq: Sequence) -> None:
        if self.adapters is not None:
            self.adapters.bind(seq)

    def _release_slot(self, seq: Sequence) -> None:
        if self.adapters is not None:
            self.adapters.release(seq)

    def _chunk(self, seq: Sequence, num_new_tokens: int, items: list[ScheduledSeq],
               preempted: list[Sequence]) -> int:
        """Schedule a prefill chunk into `items`, its blocks taken (a prompt prefilled chunk by chunk
        has them promised); returns the tokens scheduled. 0, the sequence preempted into
        `preempted`, in the rare case they are not free: the prompt released windowed blocks that
        other sequences' prefix hits still hold, so its promise fell short."""
        if self.blocks.try_grow(seq, seq.num_computed_tokens + num_new_tokens):
            items.append(ScheduledSeq(seq, num_new_tokens))
            return num_new_tokens
        self.preempt(seq)
        preempted.append(seq)
        return 0

    def preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV, requeue at the front; prompt + output is prefilled again."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        self._release_slot(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, preempted=True)
        self.num_preemptions += 1

    def _preempt_for_priority(self) -> list[Sequence]:
        """By priority: while the next waiting sequence (`_next_waiting`) cannot be admitted, preempt
        the lowest-ranked running sequence of a strictly lower priority. Returns those preempted
        (none by FCFS)."""
        preempted = []
        while self.limits.by_priority and (head := self._next_waiting()) is not None and not self._can_admit(head):
            victim = max(self.running, key=self.rank, default=None)
            if victim is None or victim.params.priority <= head.params.priority:
                break
            self.preempt(victim)
            preempted.append(victim)
        return preempted

    def _reserve_decode_slots(self) -> list[Sequence]:
        """Give every decoding sequence a slot for its next token, oldest first (by priority: by
        rank). When blocks run out, preempt the youngest (lowest-ranked) running sequence not yet
        served (possibly the one asking). Returns the preempted sequences; `self.running` keeps the
        rest in order."""
        pending = sorted(self.running, key=self.rank) if self.limits.by_priority else list(self.running)
        preempted, try_grow = [], self.blocks.try_grow
        served, end = 0, len(pending)  # pending[served:end]: not served yet, nor preempted
        while served < end:
            seq = pending[served]
            served += 1
            if not seq.is_decoding:
                continue
            while not try_grow(seq, len(seq.token_ids)):
                if served < end:
                    end -= 1
                    victim = pending[end]
                else:
                    victim = seq
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
        return preempted

    def _admit_prompts(self, items: list[ScheduledSeq], budget: int, used: int = 0, chunk: int | None = None,
                       preempted: list[Sequence] | None = None) -> int:
        """FCFS: admit waiting sequences while KV allows and the batch's tokens (`used` of them
        already taken) fit the budget, each computing its whole prompt or, with `chunk`, at most
        that many tokens of it (`_chunk`; one whose promise fell short goes to `preempted`, and
        admission stops). A prompt alone in a batch may exceed the budget, so no prompt starves.
        Returns the batch's tokens after admission."""
        preempted = [] if preempted is None else preempted
        while not preempted and (seq := self._next_waiting()) is not None and self._can_admit(seq):
            if used and used + seq.num_tokens > budget:
                break
            self._admit(seq)
            rest = seq.num_uncomputed_tokens
            used += self._chunk(seq, rest if chunk is None else min(rest, chunk), items, preempted)
        return used

    def check_integrity(self) -> None:
        """Blocks are held exactly by running and held sequences; then the block manager's own checks."""
        holders = {s.seq_id for s in self.running} | set(self.held)
        for seq in self.waiting:
            if self.blocks.has_blocks(seq.seq_id):
                raise RuntimeError(f"waiting sequence {seq.seq_id!r} holds KV blocks")
        for seq_id in holders:
            if not self.blocks.has_blocks(seq_id):
                raise RuntimeError(f"sequence {seq_id!r} is running or held but has no KV blocks")
        extra = set(self.blocks.owners()) - holders
        if extra:
            raise RuntimeError(f"KV blocks held by sequences the policy does not track: {sorted(extra)}")
        if self.adapters is not None:
            self.adapters.check([*self.running, *self.held.values()])
        self.blocks.check_integrity()

    def _running_items(self) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
        """In one pass over `running`: a token each for the decoding sequences, and the rest of the
        prompts another policy left half-prefilled (chunked, before a role switch)."""
        decodes, prefills = [], []
        for seq in self.running:
            if seq.is_decoding:
                decodes.append(ScheduledSeq(seq, 1))
            else:
                prefills.append(ScheduledSeq(seq, len(seq.token_ids) - seq.num_computed_tokens))
        return decodes, prefills
