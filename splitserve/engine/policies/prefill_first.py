"""The baseline: vLLM's original scheduler. An iteration is all-prefill or all-decode, and
waiting prompts go first, so every new prompt stalls the running decodes (generation stalls)."""
from splitserve.engine.policies.base import Policy
from splitserve.engine.policies.plan import Plan, SchedulerLimits


class PrefillFirstPolicy(Policy):
    name = "prefill_first"

    def schedule(self) -> Plan:
        outranked = self._preempt_for_priority()
        _, items = self._running_items()
        self._admit_prompts(items, self.limits.prompt_token_budget)
        if items:
            return Plan(tuple(items), tuple(outranked))
        preempted = self._reserve_decode_slots()
        decodes, _ = self._running_items()
        return Plan(tuple(decodes), tuple(outranked + preempted))

    @staticmethod
    def max_step_tokens(limits: SchedulerLimits) -> int:
        """Whole prompts up to the budget, or one longer prompt alone; or every running decode."""
        return max(limits.prompt_token_budget, limits.longest_sequence, limits.max_num_seqs)
