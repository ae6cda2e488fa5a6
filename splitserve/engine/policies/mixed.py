"""Sarathi-Serve stall-free batching (Agrawal et al., OSDI '24, Algorithm 3).

Each iteration, under one token budget: every running decode first, then the next chunk of each
prompt already in progress, then new prompts (FCFS) in chunks. A chunk attends to the KV of the
earlier chunks. Admission is KV-aware: a prompt is admitted only when blocks for all of it are
free (above a watermark; for a model with sliding windows, the blocks it holds at once as its
chunks go, `BlockManager.allocate`); when a decode cannot grow, the youngest running sequence is
preempted by recompute and no new prompt is admitted in that iteration.
"""
from splitserve.engine.policies.base import Policy
from splitserve.engine.policies.plan import Plan, SchedulerLimits


class MixedPolicy(Policy):
    name = "mixed"

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.limits.chunk_token_budget

    def schedule(self) -> Plan:
        budget = self.limits.chunk_token_budget
        outranked = self._preempt_for_priority()
        preempted = self._reserve_decode_slots()
        items, _ = self._running_items()
        used = len(items)
        for seq in [s for s in self.running if not s.is_decoding]:
            if used < budget:
                used += self._chunk(seq, min(seq.num_uncomputed_tokens, budget - used), items, preempted)
        while not preempted and used < budget and (seq := self._next_waiting()) is not None and \
                self._can_admit(seq):
            self._admit(seq)
            used += self._chunk(seq, min(seq.num_uncomputed_tokens, budget - used), items, preempted)
        return Plan(tuple(items), tuple(outranked + preempted))

    @staticmethod
    def max_step_tokens(limits: SchedulerLimits) -> int:
        """Chunks fill the budget; only running decodes alone may pass it."""
        return max(limits.chunk_token_budget, limits.max_num_seqs)
