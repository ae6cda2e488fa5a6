"""One simulated worker: the engine's own policy and block manager, with a performance model in
place of the model runner.

An iteration is `policy.schedule()` at its start and `policy.complete_step()` at its end, exactly as
`LLMEngine.step` does; in between, simulated time passes (the performance model's estimate). Every
request has a forced output length (max_tokens with ignore_eos), so every sampled token is the same
non-EOS id. Token times go into a dict shared with the cluster, one list per request, since a
request's tokens come from two workers when it is split: its first when the prompt worker samples
it (the real prompt worker hands it to the client then, while the KV may still be on its way),
the rest from the token worker once the KV has landed. With LoRA adapter slots, the engine's own
residency binds sequences to them (`lora_residency`); each adapter it writes into a slot adds
`lora_swap_s` to the iteration that admits it (the adapters' own compute is not modelled). With a
`DraftModel`, decodes draft as the engine's speculative decoding does (`sim.drafts`): a step gives
a drafting decode its kept drafts' tokens and one more. With a host tier (`sim.host_kv`), the block
manager keeps what it evicts in host memory, as the engine's does, and the copies cost time.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.host_kv_tier import HostKVTier
from splitserve.engine.lora_residency import AdapterResidency
from splitserve.engine.policies import Plan, SchedulerLimits, make_policy
from splitserve.engine.prefix_hash import sequence_root
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.engine.speculation import speculate
from splitserve.placement.load import load_of
from splitserve.placement.state import WorkerLoad
from splitserve.sim.drafts import DraftModel, SimDrafts
from splitserve.sim.host_kv import SimHostKV, WorkerHostTier
from splitserve.sim.overhead import ServingOverhead

NO_OVERHEAD = ServingOverhead()

FILLER_TOKEN = 7  # the token every sampling sequence gets: not an EOS (requests also ignore EOS)


class PerfModel(Protocol):
    """Seconds an iteration takes (splitserve.sim.perf_model.PerfModel is one). Called positionally:
    `decode_time(batch, mean context tokens per sequence)`."""

    def iteration_time(self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int,
                       chunk_context: int, /) -> float: ...

    def prefill_time(self, num_tokens: int, /) -> float: ...

    def decode_time(self, batch: int, context: float, /) -> float: ...


class _SameToken(dict):
    """`sampled[seq_id]` for `complete_step`: the filler token for every sequence, nothing built."""

    def __missing__(self, key: str) -> tuple[int]:
        return _FILLER


_FILLER = (FILLER_TOKEN,)
SAMPLED = _SameToken()


@dataclass(frozen=True)
class StepResult:
    """What one finished iteration did (each tuple in the plan's order)."""

    first_tokens: tuple[Sequence, ...] = ()  # got their first token here (handed-off ones included)
    finished: tuple[Sequence, ...] = ()      # reached their length (their token time is recorded)
    handed_off: tuple[Sequence, ...] = ()    # prefilled for another worker: KV sent, blocks freed here


NOTHING_HAPPENED = StepResult()


class SimWorker:
    """`start_iteration` / `finish_iteration` alternate while the worker has work; requests come in
    through `add` (local or prefill for hand-off), `reserve_import` + `complete_import` (the token
    side of a split request) and leave through `abort` or by finishing. `changed` turns True with
    anything that can change `load()`; the cluster clears it when it reports the load."""

    def __init__(self, worker_id: str, policy: str, perf: PerfModel, num_blocks: int, block_size: int,
                 limits: SchedulerLimits, token_times: dict[str, list[float]],
                 overhead: ServingOverhead = NO_OVERHEAD, clock: Callable[[], float] = lambda: 0.0,
                 prefix_caching: bool = False, windows: tuple[int | None, ...] = (None,), lora_slots: int = 0,
                 lora_swap_s: float = 0.0, drafts: DraftModel | None = None,
                 host_tier: WorkerHostTier | None = None):
        """`host_tier`: `Scenario.host_tier_of` its pool."""
        self.worker_id, self.perf, self.token_times, self.clock = worker_id, perf, token_times, clock
        self.iteration_overhead_s, self.token_overhead_s = overhead.iteration_s, overhead.token_s
        self.prefill_extra = overhead.prefill_scale - 1.0  # of a prefill's profiled time, added to it
        self.host_kv = None if host_tier is None else SimHostKV(host_tier.block_s)
        self.host_tier = None if host_tier is None else \
            HostKVTier(host_tier.blocks, len(windows), self.host_kv, host_tier.write_through)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                                   root_of=sequence_root(None), windows=windows, host_tier=self.host_tier)
        if limits.slo.pivot_time_s is None:  # SLO-aware policies: the pivot's time from this worker's model
            pivot = limits.slo.pivot_tokens
            limits = replace(limits, slo=replace(limits.slo, pivot_time_s=perf.prefill_time(pivot)))
        self.policy = make_policy(policy, self.blocks, limits, clock)
        if lora_slots:  # as the engine's (lora_loading.EngineAdapters): patience of a batch's worth
            self.policy.adapters = AdapterResidency([None] * lora_slots, self._write_slot, limits.max_num_seqs)
        self.lora_swap_s, self._swaps_unpaid = lora_swap_s, 0  # written into slots since an iteration paid for them
        self.plan: Plan | None = None  # the iteration in flight
        self.iterations = self.num_prefills = 0
        self.prefill_tokens = 0  # prompt tokens computed here (not taken from the prefix cache)
        self.busy_s = 0.0
        self.iteration_s = 0.0  # duration of the iteration in flight (or of the last one)
        self.sampling = 0  # tokens the iteration in flight samples (each goes out on a stream)
        self.drafts = None if drafts is None else SimDrafts(drafts, FILLER_TOKEN, worker_id)
        self.draft_tokens = self.accepted_tokens = 0  # drafts checked, and kept, so far
        self._sampling_prefills: list[Sequence] = []  # the plan in flight's prefills that end in a token
        self.changed = True

    @property
    def host_restored_tokens(self) -> int:
        """Tokens restored from the host tier (a token's block of every layer group)."""
        return 0 if self.host_tier is None else self.blocks.tokens_of(self.host_tier.restored_blocks)

    @property
    def busy(self) -> bool:
        return self.plan is not None

    def _write_slot(self, slot: int, identity: str) -> None:
        self.policy.adapters.identity[slot] = identity
        self._swaps_unpaid += 1

    # ---- requests in and out -------------------------------------------------------------
    def add(self, seq: Sequence, hand_off: bool) -> None:
        self.policy.add(seq, hand_off)
        self.changed = True

    def reserve_import(self, seq: Sequence, reuse_prefix: bool = False) -> None:
        """Blocks for a prompt prefilled elsewhere (EngineFullError / OutOfBlocksError: no room); with
        `reuse_prefix`, cached blocks of its prefix are shared and `seq.num_computed_tokens` of its
        KV need not travel."""
        self.policy.reserve_import(seq, reuse_prefix)
        self.changed = True

    def import_starts(self, seq: Sequence) -> tuple[int, ...]:
        """Per KV layer group: the first prompt position whose KV a reserved import receives (a
        windowed group's only within its window: `BlockManager.held_from`)."""
        return self.blocks.held_from(seq)

    def complete_import(self, seq_id: str, first_token: int) -> Sequence:
        """The KV and the first token have landed: the sequence decodes from here on (the first
        token's time is the prompt worker's, recorded as it was sampled)."""
        self.changed = True
        return self.policy.complete_import(seq_id, first_token)

    def abort(self, seq_id: str) -> None:
        seq = self.policy.find(seq_id)
        if seq is not None:
            self.policy.finish(seq, "abort")
            self.changed = True

    def set_policy(self, name: str) -> None:
        """Switch scheduling policy on the live worker (a pool move), as `LLMEngine.set_policy` does."""
        policy = make_policy(name, self.blocks, self.policy.limits, self.clock)
        policy.adopt(self.policy)
        self.policy, self.changed = policy, True

    # ---- iterations ----------------------------------------------------------------------
    def start_iteration(self, now: float) -> float | None:
        """Schedule the next iteration; returns when it ends, or None when there is nothing to run."""
        plan = self.policy.schedule()
        self.changed = True  # admission moves sequences (and blocks) even when nothing runs
        if not plan.scheduled:
            return None
        if self.drafts is not None:
            limits = self.policy.limits
            plan = speculate(plan, self.drafts, self.blocks, self.policy.max_step_tokens(limits), limits.max_num_seqs,
                             limits.max_model_len)
        prefill = decodes = context = chunk_context = 0
        prefills = self._sampling_prefills = []
        for item in plan.scheduled:
            seq = item.seq
            num_tokens = len(seq.token_ids)
            # Sequence.is_decoding, inlined (the hot path): one uncomputed token, after the prompt
            if num_tokens - item.start == 1 and num_tokens > len(seq.prompt_token_ids):
                decodes += 1
                context += num_tokens
                if item.drafts:  # costed as a mixed batch's chunk tokens, over the decode's context
                    prefill += len(item.drafts)
                    chunk_context += len(item.drafts) * num_tokens
            else:
                prefill += item.num_new_tokens
                chunk_context += item.num_new_tokens * item.start  # attends over the tokens before the chunk
                if item.samples:
                    prefills.append(seq)
        self.sampling = decodes + len(prefills)
        duration = (self.perf.iteration_time(prefill, decodes, context, chunk_context) + self.iteration_overhead_s
                    + self.token_overhead_s * self.sampling + self.lora_swap_s * self._swaps_unpaid)
        self._swaps_unpaid = 0
        if self.host_kv is not None:
            duration += self.host_kv.take_cost(duration)  # blocks copied since the last iteration
        if prefill and self.prefill_extra:
            duration += self.prefill_extra * self.perf.prefill_time(prefill)
        self.plan, self.iteration_s = plan, duration
        self.iterations += 1
        self.prefill_tokens += prefill
        self.busy_s += duration
        return now + duration

    def stretch(self, elapsed: float) -> None:
        """The iteration in flight took `elapsed` seconds (a shared host slowed it), not its time alone."""
        self.busy_s += elapsed - self.iteration_s
        self.iteration_s = elapsed

    def finish_iteration(self, now: float) -> StepResult:
        """Record the iteration in flight as finished at `now`."""
        plan, self.plan = self.plan, None
        if plan is None:
            raise RuntimeError(f"worker {self.worker_id}: no iteration in flight to finish")
        self.changed = True
        self.policy.observe(plan, self.iteration_s)
        sampled, before = (SAMPLED, {}) if self.drafts is None else self._sampled(plan)
        updated = self.policy.complete_step(plan, sampled)
        if self.host_tier is not None:
            self.host_tier.flush()  # write-through: the blocks this iteration cached
        finished, handed_off, times = [], [], self.token_times
        prefilled, finished_status = SequenceStatus.PREFILLED, SequenceStatus.FINISHED
        for seq in updated:
            status = seq.status
            if status is prefilled:  # its first token goes to the client now, whenever its KV lands
                times[seq.seq_id].append(now)
                handed_off.append(seq)
                self.policy.finish(seq, "abort")  # LLMEngine.release_request: the KV went as a copy
                continue
            if seq.seq_id in before:  # a decode with drafts: the tokens it got
                times[seq.seq_id] += [now] * (seq.num_tokens - before[seq.seq_id])
            else:
                times[seq.seq_id].append(now)
            if status is finished_status:
                finished.append(seq)
        first = [seq for seq in self._sampling_prefills if seq.num_output_tokens == 1]
        self.num_prefills += len(first)
        if not (first or finished or handed_off):
            return NOTHING_HAPPENED
        return StepResult(tuple(first), tuple(finished), tuple(handed_off))

    def _sampled(self, plan: Plan) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
        """`complete_step`'s tokens: the filler for each sampling sequence, and for a decode with
        drafts one more per draft kept; each drafting sequence's tokens before the step."""
        drafting = [item for item in plan.scheduled if item.drafts]
        if not drafting:
            return SAMPLED, {}
        sampled, before = _SameToken(), {}
        for item in drafting:
            kept = self.drafts.kept(len(item.drafts))
            self.draft_tokens += len(item.drafts)
            self.accepted_tokens += kept
            sampled[item.seq.seq_id] = (FILLER_TOKEN,) * (1 + kept)
            before[item.seq.seq_id] = item.seq.num_tokens
        return sampled, before

    # ---- reports -------------------------------------------------------------------------
    def load(self) -> WorkerLoad:
        """What the worker reports to the CLS: the real worker's own definition."""
        return load_of(self.policy, self.blocks)

    def check_integrity(self) -> None:
        self.policy.check_integrity()
