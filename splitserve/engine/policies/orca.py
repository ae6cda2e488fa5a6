"""Splitwise's mixed continuous batching (IV-A "Mixed machines", after ORCA): what the paper's
baseline machines run, and splitwise-sim's baseline instances (max_batch_tokens 2048, 4 preemptions).

Each iteration, whole prompts and decodes share one token budget (`prompt_token_budget`):
1. decodes left out of the last MAX_SKIPS iterations, so prompts cannot starve a request's tokens;
2. waiting prompts, FCFS and whole (a prompt alone in the batch may exceed the budget);
3. the other decodes, oldest first, one token each, while the budget lasts.
A decode left out keeps its KV and runs in a later iteration (the paper's token preemption).
When KV runs out, the youngest sequence is preempted by recompute and no prompt is admitted.
"""
from splitserve.engine.policies.base import Policy
from splitserve.engine.policies.plan import Plan, SchedulerLimits

# splitwise-sim's max_preemptions, counted in a row rather than over a request's life: with a lifetime
# count, long decodes go first for good and keep whole prompts out of the budget (TTFT collapses)
MAX_SKIPS = 4


class OrcaPolicy(Policy):
    name = "orca"

    def schedule(self) -> Plan:
        budget = self.limits.prompt_token_budget
        outranked = self._preempt_for_priority()
        preempted = self._reserve_decode_slots()
        decodes, prompts = self._running_items()  # prompts: left half-prefilled by a chunking policy
        starved = [item for item in decodes if item.seq.num_skips >= MAX_SKIPS]
        used = len(starved) + sum(item.num_new_tokens for item in prompts)
        if not preempted:
            used = self._admit_prompts(prompts, budget, used)
        room = max(budget - used, 0)
        rest = [item for item in decodes if item.seq.num_skips < MAX_SKIPS]
        chosen = starved + rest[:room]
        for item in chosen:
            item.seq.num_skips = 0
        for item in rest[room:]:
            item.seq.num_skips += 1
        return Plan(tuple(chosen + prompts), tuple(outranked + preempted))

    @staticmethod
    def max_step_tokens(limits: SchedulerLimits) -> int:
        """The budget, or one longer prompt alone, or starved decodes alone."""
        return max(limits.prompt_token_budget, limits.longest_sequence, limits.max_num_seqs)
