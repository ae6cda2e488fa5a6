"""Splitwise prompt machine (IV-B): FCFS, whole prompts batched up to a prompt-token budget."""
from splitserve.engine.policies.base import Policy
from splitserve.engine.policies.plan import Plan
from splitserve.engine.sequence import Sequence


class PromptPolicy(Policy):
    """Prefill only. Each prompt yields its first token, then is held with its KV for export;
    prompt throughput degrades past ~2048 batched tokens (Splitwise Fig. 6a), hence the budget."""

    name = "prompt"

    def schedule(self) -> Plan:
        items = []
        self._admit_whole_prompts(items, self.limits.prompt_token_budget)
        return Plan(tuple(items))

    def _after_sample(self, seq: Sequence) -> None:
        self.hold_prefilled(seq)
