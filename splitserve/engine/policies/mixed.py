"""Sarathi-Serve stall-free batching (Agrawal et al., OSDI '24, Algorithm 3).

Each iteration, under one token budget: every running decode first, then the next chunk of each
prompt already in progress, then new prompts (FCFS) in chunks. A chunk attends to the KV of the
earlier chunks. Admission is KV-aware: a prompt is admitted only when blocks for all of it are
free (above a watermark); when a decode cannot grow, the youngest running sequence is preempted
by recompute and no new prompt is admitted in that iteration.
"""
from splitserve.engine.policies.base import Policy
from splitserve.engine.policies.plan import Plan, ScheduledSeq, SchedulerLimits


class MixedPolicy(Policy):
    name = "mixed"

    def schedule(self) -> Plan:
        budget = self.limits.chunk_token_budget
        preempted = self._reserve_decode_slots()
        items, _ = self._running_items()
        used = len(items)
        for seq in self.running:
            if not seq.is_decoding and used < budget:
                items.append(ScheduledSeq(seq, min(seq.num_uncomputed_tokens, budget - used)))
                used += items[-1].num_new_tokens
        while not preempted and self.waiting and used < budget and self._can_admit(self.waiting[0]):
            seq = self.waiting[0]
            self._admit(seq)
            items.append(ScheduledSeq(seq, min(seq.num_uncomputed_tokens, budget - used)))
            used += items[-1].num_new_tokens
        return Plan(tuple(items), tuple(preempted))

    @staticmethod
    def max_step_tokens(limits: SchedulerLimits) -> int:
        """Chunks fill the budget; only running decodes alone may pass it."""
        return max(limits.chunk_token_budget, limits.max_num_seqs)
