"""Splitwise token machine: continuous batching of decodes, FCFS, as large as KV memory allows."""
from splitserve.engine.policies.base import Policy
from splitserve.engine.policies.plan import Plan, SchedulerLimits


class TokenPolicy(Policy):
    """Decodes every running sequence each iteration. Sequences normally arrive with imported
    KV; a preempted one (or one sent without KV) is prefilled again beside the decodes: whole
    prompts up to `prompt_token_budget`, and one longer than `prompt_chunk_tokens` a chunk of
    that many tokens a step. Chunks bound a step, so a long recompute never stalls the decodes
    for a whole prompt's prefill, and the activation memory the KV cache leaves room for stays
    bounded whatever max_model_len."""

    name = "token"

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.limits.prompt_chunk_tokens

    def schedule(self) -> Plan:
        budget, chunk = self.limits.prompt_token_budget, self.limits.prompt_chunk_tokens
        outranked = self._preempt_for_priority()
        preempted = self._reserve_decode_slots()
        items, prefills = self._running_items()
        used = 0
        for item in prefills:  # prompts mid-prefill: their next chunk
            used += self._chunk(item.seq, min(item.num_new_tokens, chunk), items, preempted)
        self._admit_prompts(items, budget, used, chunk, preempted)
        return Plan(tuple(items), tuple(outranked + preempted))

    @staticmethod
    def max_step_tokens(limits: SchedulerLimits) -> int:
        """Every other running sequence's decode, and whole prompts up to the budget (decodes are
        not counted against it) or one prompt's chunk alone."""
        return limits.max_num_seqs - 1 + max(limits.prompt_token_budget,
                                             min(limits.longest_sequence, limits.prompt_chunk_tokens))
