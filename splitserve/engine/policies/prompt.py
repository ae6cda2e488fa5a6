"""Splitwise prompt machine (IV-B): FCFS, whole prompts batched up to a prompt-token budget; a
prompt longer than `prompt_chunk_tokens` is prefilled a chunk at a time (a layer-wise transfer
streams each chunk's KV as it lands)."""
from splitserve.engine.policies.token import TokenPolicy


class PromptPolicy(TokenPolicy):
    """Prefill only: each prompt yields its first token, then is held with its KV for export;
    prompt throughput degrades past ~2048 batched tokens (Splitwise Fig. 6a), hence the budget
    (and a long prompt gains nothing from one larger step, hence the chunks). A request left over
    from a spell in the mixed pool (not handed off) still decodes here, which is why this
    schedules like a token machine: its decodes first, then prompts."""

    name = "prompt"
    hands_off_by_default = True
