"""AccelGen's SLO-aware iteration scheduling (Shen and Sen, "AccelGen"; docs/slo-scheduling.md), for
the mixed and prompt pools.

Every request carries a TTFT and a TBT target (`SamplingParams.ttft_slo_s` / `tbt_slo_s`, else the
defaults in `SLOOptions`). Each iteration:

1. Slack (A2): T_r = SLO - T_w - N_ck x T_max. A prompt's SLO is its TTFT target and T_w the time
   since it arrived; a decode's (or a preempted decode's recompute) is its TBT target and T_w the
   time since its last token. N_ck = remaining prompt tokens / budget, rounded up (1 for a decode);
   T_max = the time of a full-budget iteration.
2. Urgent first (A4, Algorithm 1): every candidate with T_r <= T_max joins, least slack first.
   Over the compute budget the member with the most slack waits for a later iteration; short of KV
   for a decode's next block, the running sequence with the most slack is preempted (recompute).
3. Token budget (Eq. 6): S_b = S_pf x SLO_min / T_pf, floored to a tile, within [tile, max budget];
   SLO_min is the tightest iteration SLO in the batch, so a member with a tighter SLO shrinks it.
4. SelectRequests (Algorithm 2): among the rest, those within `window_s` (gamma) of the least slack,
   repeatedly the one whose (compute, KV) demand is nearest (Euclidean) the free (compute, KV),
   both in tokens (KV rounded to blocks), until the budget is full.
5. Dynamic chunking: the last prompt taken is cut where the budget ends, so an iteration computes
   exactly S_b tokens when there is work. ERA: one long prompt (>= long_prompt_tokens) in prefill
   at a time, the one already started or else the least slack.

A prompt's KV blocks are allocated at admission (the engine's block manager: all of them, or for
a model with sliding windows the most it holds at once as its chunks go, promised), so its KV
demand is counted once, then. Latency model: T(S_f) = T_pf x S_f / S_pf, with T_pf
given or learned (an average over observed iterations of at least half the pivot size).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies.base import Policy
from splitserve.engine.policies.plan import Plan, ScheduledSeq, SchedulerLimits, SLOOptions
from splitserve.engine.sequence import Sequence, SequenceStatus

LEARNING_RATE = 0.2  # weight of the newest iteration in the learned time per token


@dataclass
class Candidate:
    seq: Sequence
    slack_s: float
    slo_s: float          # its iteration SLO: TTFT target while in its first prefill, TBT after
    compute: int          # tokens it wants this iteration (1 for a decode)
    kv_tokens: int        # KV it needs before it can run, in block-rounded tokens (0 if it holds it)

    @property
    def waiting(self) -> bool:
        return self.seq.status is SequenceStatus.WAITING


class AccelGenPolicy(Policy):
    name = "accelgen"
    takes_priorities = False  # ordered by slack

    def __init__(self, blocks: BlockManager, limits: SchedulerLimits, clock: Callable[[], float] = time.monotonic):
        super().__init__(blocks, limits, clock)
        options = limits.slo
        # seconds per token of the linear model; before any observation, the pivot at the default TBT
        self.time_per_token = (options.pivot_time_s or options.default_tbt_s) / options.pivot_tokens
        self.budget = options.pivot_tokens  # S_b of the last iteration (T_max derives from it)
        self.last_token_at: dict[str, float] = {}

    @property
    def options(self) -> SLOOptions:
        return self.limits.slo

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.options.max_budget_tokens

    @staticmethod
    def max_step_tokens(limits: SchedulerLimits) -> int:
        """Decodes are cut to the token budget, and the last prompt where it ends."""
        return limits.slo.max_budget_tokens

    # ---- the latency model -----------------------------------------------------------------
    def token_budget(self, slo_min_s: float) -> int:
        """Eq. 6: S_pf x SLO_min / T_pf tokens, floored to a tile, within [tile, max_budget_tokens]."""
        tile = self.options.tile_tokens
        tokens = math.floor(slo_min_s / self.time_per_token / tile) * tile
        return max(tile, min(tokens, self.options.max_budget_tokens))

    def observe(self, plan: Plan, seconds: float) -> None:
        if self.options.pivot_time_s is None and plan.num_tokens >= self.options.pivot_tokens / 2 and seconds > 0:
            self.time_per_token += LEARNING_RATE * (seconds / plan.num_tokens - self.time_per_token)

    # ---- bookkeeping of last tokens ----------------------------------------------------------
    def complete_step(self, plan: Plan, sampled: Mapping[str, Sequence_[int]]) -> list[Sequence]:
        updated = super().complete_step(plan, sampled)
        now = self.clock()
        for seq in updated:
            self.last_token_at[seq.seq_id] = now
        return updated

    def complete_import(self, seq_id: str, first_token_id: int) -> Sequence:
        seq = super().complete_import(seq_id, first_token_id)
        self.last_token_at[seq_id] = self.clock()
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        super().finish(seq, reason)
        self.last_token_at.pop(seq.seq_id, None)

    def adopt(self, previous: Policy) -> None:
        super().adopt(previous)
        self.last_token_at = dict(getattr(previous, "last_token_at", {}))

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> Plan:
        now, t_max = self.clock(), self.time_per_token * self.budget
        candidates = sorted(self._candidates(now, t_max), key=lambda c: c.slack_s)
        batch: list[Candidate] = []
        preempted: dict[str, Sequence] = {}  # by id, in preemption order
        for cand in [c for c in candidates if c.slack_s <= t_max]:
            if cand.seq.seq_id not in preempted and self._fits_kv(cand, batch, candidates, preempted):
                batch.append(cand)
        slo_min = min((c.slo_s for c in batch), default=None)
        budget = self.token_budget(slo_min) if slo_min is not None else self.options.max_budget_tokens
        while sum(c.seq.is_decoding for c in batch) > budget:  # decodes alone overflow: the most slack waits
            batch.remove(max((c for c in batch if c.seq.is_decoding), key=lambda c: c.slack_s))
        chosen = {id(c) for c in batch}
        rest = [c for c in candidates if id(c) not in chosen and c.seq.seq_id not in preempted]
        self.budget = self._select(batch, rest, budget)
        return self._plan(batch, tuple(preempted.values()))

    def _candidates(self, now: float, t_max: float) -> list[Candidate]:
        """Every running and waiting sequence with its slack, after ERA: of the long prompts not yet
        started, none while one is in prefill, else only the one with the least slack."""
        out = self._all_candidates(now, t_max)
        fresh_long = [c for c in out if c.waiting and self._is_long(c.seq)]
        if any(not s.is_decoding and self._is_long(s) for s in self.running):
            keep = None
        else:
            keep = min(fresh_long, key=lambda c: c.slack_s, default=None)
        return [c for c in out if not (c.waiting and self._is_long(c.seq)) or c is keep]

    def _all_candidates(self, now: float, t_max: float) -> list[Candidate]:
        opts, out = self.options, []
        for seq in [*self.running, *self.waiting]:
            params = seq.params
            ttft, tbt = params.ttft_slo_s or opts.default_ttft_s, params.tbt_slo_s or opts.default_tbt_s
            if seq.is_decoding:
                since = self.last_token_at.get(seq.seq_id, now)
                new_block = self.blocks.blocks_for(seq.num_tokens) > len(self.blocks.block_table(seq.seq_id))
                out.append(Candidate(seq, tbt - (now - since) - t_max, tbt, 1, self.blocks.block_size * new_block))
                continue
            first = seq.num_output_tokens == 0
            slo = ttft if first else tbt
            since = seq.arrival_time if first else self.last_token_at.get(seq.seq_id, now)
            remaining = seq.num_uncomputed_tokens
            chunks = math.ceil(remaining / self.budget)
            kv = 0 if seq.status is SequenceStatus.RUNNING else self._admission_kv_tokens(seq)
            out.append(Candidate(seq, slo - (now - since) - chunks * t_max, slo, remaining, kv))
        return out

    def _admission_kv_tokens(self, seq: Sequence) -> int:
        """The KV a waiting prompt's admission takes (prefix hits aside), in block-rounded tokens."""
        blocks = self.blocks.blocks_to_admit(seq, self.prefill_chunk_tokens, use_prefix_cache=False)
        return self.blocks.tokens_of(blocks + self.blocks.num_groups - 1)

    def _is_long(self, seq: Sequence) -> bool:
        return len(seq.prompt_token_ids) >= self.options.long_prompt_tokens

    def _free_kv_tokens(self) -> int:
        watermark = self._watermark if self.running else 0
        return self.blocks.tokens_of(max(0, self.blocks.num_free_blocks - watermark))

    def _fits_kv(self, cand: Candidate, batch: list[Candidate], candidates: list[Candidate],
                 preempted: dict[str, Sequence]) -> bool:
        """Make room for an urgent candidate's KV (and batch slot): preempt running sequences with
        more slack (most first) until it fits. False when it does not; the blocks they hold are
        counted first, so none is preempted when even all of them would not be enough."""
        seq = cand.seq
        if cand.waiting:
            if not self._adapter_ready(seq):
                return False  # no preemption gives its LoRA adapter a slot
            fits = lambda: self._can_admit(seq)  # noqa: E731
        elif seq.is_decoding:
            fits = lambda: self.blocks.can_grow(seq, seq.num_tokens)  # noqa: E731
        else:
            return True  # a running prompt already holds (or is promised) its blocks
        if fits():
            victims = []
        else:  # only now: the common case, where it fits, sorts nothing
            victims = self._victims(cand, candidates, preempted)
            if self._reclaimable(victims) + self.blocks.num_free_blocks < self._blocks_needed(cand):
                return False
        while not fits() and victims:
            victim = victims.pop(0)
            self.preempt(victim.seq)
            preempted[victim.seq.seq_id] = victim.seq
            if victim in batch:
                batch.remove(victim)
        if not fits():
            return False
        if cand.waiting:
            self._admit(seq)
        else:
            self.blocks.grow(seq, seq.num_tokens)
        return True

    @staticmethod
    def _victims(cand: Candidate, candidates: list[Candidate], preempted: dict[str, Sequence]) -> list[Candidate]:
        """Running sequences with more slack than `cand`, most slack first."""
        return sorted((c for c in candidates if c.seq.status is SequenceStatus.RUNNING and c.seq is not cand.seq
                       and c.seq.seq_id not in preempted and c.slack_s > cand.slack_s), key=lambda c: -c.slack_s)

    def _reclaimable(self, victims: list[Candidate]) -> int:
        return sum(self.blocks.num_held_blocks(v.seq.seq_id) for v in victims)

    def _blocks_needed(self, cand: Candidate) -> int:
        if cand.waiting:
            return self.blocks.blocks_to_admit(cand.seq, self.prefill_chunk_tokens)
        return self.blocks.num_groups

    def _select(self, batch: list[Candidate], rest: list[Candidate], budget: int) -> int:
        """Algorithm 2, filling the budget the urgent batch left, window by window: the candidates
        within gamma of the least slack left, best fit first; when a window is used up and budget
        remains, the next one (so the budget never idles while work fits). Returns the budget (a
        pick with a tighter SLO shrinks it)."""
        used = self._used(batch, budget)
        window: list[Candidate] = []
        while used < budget and (window or rest):
            if not window:
                window = [c for c in rest if c.slack_s <= rest[0].slack_s + self.options.window_s]
                rest = rest[len(window):]
            free_c, free_m = budget - used, self._free_kv_tokens()
            fitting = [c for c in window if c.kv_tokens <= free_m and
                       (not c.waiting or len(self.running) < self.limits.max_num_seqs)]
            if not fitting:
                window = []
                continue
            pick = min(fitting, key=lambda c: math.hypot(free_c - min(c.compute, free_c), free_m - c.kv_tokens))
            window.remove(pick)
            tighter = self.token_budget(pick.slo_s)
            if tighter < budget:
                if self._used(batch, tighter) + min(pick.compute, 1) > tighter:
                    continue  # its SLO would shrink the budget below what is already taken
                budget = tighter
            if pick.waiting:
                if not self._can_admit(pick.seq):
                    continue
                self._admit(pick.seq)
            elif pick.seq.is_decoding:
                if not self.blocks.can_grow(pick.seq, pick.seq.num_tokens):
                    continue
                self.blocks.grow(pick.seq, pick.seq.num_tokens)
            batch.append(pick)
            used = self._used(batch, budget)
        return budget

    @staticmethod
    def _used(batch: list[Candidate], budget: int) -> int:
        """Tokens the batch computes under `budget`: decodes first, then prompts in order, the last cut."""
        decodes = sum(1 for c in batch if c.seq.is_decoding)
        prompts = sum(c.seq.num_uncomputed_tokens for c in batch if not c.seq.is_decoding)  # after prefix hits
        return min(budget, decodes + prompts) if prompts else decodes

    def _plan(self, batch: list[Candidate], preempted: tuple[Sequence, ...]) -> Plan:
        decodes = [c for c in batch if c.seq.is_decoding]
        items = [ScheduledSeq(c.seq, 1) for c in decodes]
        left, preempted = self.budget - len(items), list(preempted)
        for c in batch:
            if not c.seq.is_decoding and left > 0:
                left -= self._chunk(c.seq, min(c.seq.num_uncomputed_tokens, left), items, preempted)
        return Plan(tuple(items), tuple(preempted))


class AccelGenPromptPolicy(AccelGenPolicy):
    """The prompt pool's AccelGen: the same scheduling, prompts handed off after their first token."""

    name = "accelgen_prompt"
    hands_off_by_default = True
