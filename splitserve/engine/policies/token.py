"""Splitwise token machine: continuous batching of decodes, FCFS, as large as KV memory allows."""
from splitserve.engine.policies.base import Policy
from splitserve.engine.policies.plan import Plan, SchedulerLimits


class TokenPolicy(Policy):
    """Decodes every running sequence each iteration. Sequences normally arrive with imported
    KV; a preempted one (or one sent without KV) is prefilled whole again in a later iteration."""

    name = "token"

    def schedule(self) -> Plan:
        preempted = self._reserve_decode_slots()
        decodes, prefills = self._running_items()
        items = decodes + prefills
        if not preempted:
            self._admit_whole_prompts(items, self.limits.prompt_token_budget)
        return Plan(tuple(items), tuple(preempted))

    @staticmethod
    def max_step_tokens(limits: SchedulerLimits) -> int:
        """Every other running sequence's decode, and whole prompts up to the budget (decodes are
        not counted against it) or one longer prompt alone."""
        return limits.max_num_seqs - 1 + max(limits.prompt_token_budget, limits.longest_sequence)
