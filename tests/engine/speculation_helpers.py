"""What the speculative decoding tests share: the proposer's rule as a plain scan, a proposer,
generation to the end with the drafts counted, and the texts the demo engine drafts on."""
from __future__ import annotations

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.speculation import NgramProposer, SpeculativeConfig
from tests.engine.engine_helpers import assert_all_free

DRAFTS = dict(num_speculative_tokens=4)
TEXTS = ["the cat sat on the mat and the cat sat on the", "one two three one two three one", "abcabcabcabcab",
         "0123456789" * 3, "to be or not to be, that is", "la la la la la la"]


def scan(tokens: list[int], lo: int, hi: int, limit: int) -> tuple[int, ...]:
    """The rule as a plain scan: the longest ending of hi down to lo tokens that occurred before
    (with a token after it), its latest occurrence; the tokens that followed it, going on as a copy
    of themselves past the end."""
    total = len(tokens)
    for n in range(min(hi, total - 1), lo - 1, -1):
        for i in range(total - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[total - n:]:
                copied = list(tokens)
                while len(copied) < total + limit:
                    copied.append(copied[len(copied) - (total - i - n)])
                return tuple(copied[i + n:i + n + limit])
    return ()


def proposer(lo: int = 2, hi: int = 4, k: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(k, lo, hi))


def generate(engine: LLMEngine, prompts: list, params: SamplingParams | list[SamplingParams]) -> tuple[list, int, int]:
    """The final outputs in prompt order, and the drafts the steps checked and kept."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    finished, drafted, kept = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_integrity()
        drafted, kept = drafted + engine.last_step.draft_tokens, kept + engine.last_step.accepted_tokens
    assert_all_free(engine)
    return [finished[str(i)] for i in range(len(prompts))], drafted, kept


def assert_same_text(outputs, reference) -> None:
    for got, want in zip(outputs, reference):
        assert (got.outputs[0].token_ids, got.outputs[0].text, got.finish_reason) == \
            (want.outputs[0].token_ids, want.outputs[0].text, want.finish_reason)
