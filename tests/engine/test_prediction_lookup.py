"""Drafts from a request's prediction (engine/prediction_lookup.py, OpenAI's Predicted Outputs):
the lookup against a plain scan of its rule as the output grows, its alignment after an edit, its
counts, and generation with predictions against the same engine without them."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import MAX_TOKEN_ID, SamplingParams
from splitserve.engine.sequence import Sequence
from tests.engine.engine_helpers import ENGINE
from tests.engine.engine_helpers import one_thread  # noqa: F401  (pytest fixture)
from tests.engine.speculation_helpers import DRAFTS, TEXTS, assert_same_text, generate, proposer, scan


class PredictionScan:
    """The prediction rule as a plain scan: with the output and the prediction each led by a start
    mark, the longest ending of the marked output (of hi down to lo tokens, or the whole of it) that
    ends in the marked prediction where the prediction followed since the last match puts the
    output's end; else the longest one's earliest occurrence starting at or after (its length
    before) where the last match ended; else anywhere; the tokens after it."""

    def __init__(self, prediction: list[int]):
        self.marked, self.matched, self.outputs_then = [-1, *prediction], None, 0

    def propose(self, outputs: list[int], lo: int, hi: int, limit: int) -> tuple[int, ...]:
        ours = [-1, *outputs]
        endings = [ours[-n:] for n in range(min(hi, len(ours)), 0, -1) if n >= lo or n == len(ours)]
        if self.matched is not None:
            aligned = self.matched + len(outputs) - self.outputs_then
            if any(aligned >= len(e) and self.marked[aligned - len(e):aligned] == e for e in endings):
                return self._from(aligned, outputs, limit)
        for end in [0] if self.matched is None else [self.matched, 0]:
            for e in endings:
                starts = [i for i in range(len(self.marked) - len(e) + 1) if self.marked[i:i + len(e)] == e]
                if after := [i for i in starts if i >= end - len(e)]:
                    return self._from(after[0] + len(e), outputs, limit)
        return ()

    def _from(self, at: int, outputs: list[int], limit: int) -> tuple[int, ...]:
        self.matched, self.outputs_then = at, len(outputs)
        return tuple(self.marked[at:at + limit])


ENGINE_IDS = st.sampled_from([0, 1, 2, 3, 256, 65536, 2**24, MAX_TOKEN_ID])  # the mark past the largest


@settings(max_examples=300, deadline=None)
@given(st.lists(ENGINE_IDS, min_size=1, max_size=8), st.lists(ENGINE_IDS, max_size=30),
       st.lists(st.lists(ENGINE_IDS, max_size=6), min_size=1, max_size=6), st.integers(1, 3), st.integers(0, 3),
       st.integers(1, 5))
def test_prediction_drafts_follow_the_rule_as_the_output_grows(prompt, prediction, appended, lo, extra, limit):
    """Drafts from the prediction where it matches, else from the context."""
    hi = lo + extra
    seq, growing = Sequence("s", prompt, SamplingParams(prediction=prediction)), proposer(lo, hi)
    reference = PredictionScan(prediction)
    for tokens in appended:
        seq.token_ids += tokens
        want = (reference.propose(seq.output_token_ids, lo, hi, limit) if seq.output_token_ids else ()) \
            or scan(seq.token_ids, lo, hi, limit)
        if seq.output_token_ids:
            assert growing.propose(seq, limit) == want


def test_a_prediction_is_followed_from_the_output_start_and_found_again_after_an_edit():
    seq = Sequence("s", [9, 9], SamplingParams(prediction=[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 9]))
    drafting = proposer(lo=2, hi=3)
    seq.token_ids += [1]
    assert drafting.propose(seq, 3) == (2, 3, 4)  # one token in: the whole output, from the start
    seq.token_ids += [2, 3, 4, 0]
    assert drafting.propose(seq, 3) == ()  # an edit: [4, 0] and [3, 4, 0] occur nowhere
    seq.token_ids += [6, 7]
    assert drafting.propose(seq, 3) == (8, 1, 2)  # found again after it
    seq.token_ids += [8, 1, 2, 3]
    assert drafting.propose(seq, 3) == (9,)  # [1, 2, 3] after where the last match ended, not at 0


def test_drafts_from_a_prediction_are_counted_and_never_back_off():
    seq = Sequence("s", [5, 6, 7, 8], SamplingParams(prediction=[1, 2, 3, 4, 5]))
    drafting = proposer(lo=2, hi=2)
    seq.token_ids += [1]
    assert drafting.propose(seq, 3) == (2, 3, 4)
    drafting.checked(seq, 3, 2)
    seq.token_ids += [2, 3]
    assert drafting.propose(seq, 3) == (4, 5)
    drafting.checked(seq, 2, 0)
    assert (seq.accepted_prediction_tokens, seq.rejected_prediction_tokens) == (2, 3)
    seq.token_ids += [5, 6]
    assert drafting.propose(seq, 3) == (7, 8, 1)  # no match in the prediction: the context's, at once


def test_a_prediction_drafts_where_the_output_repeats_it_and_changes_no_token():
    """Predicted Outputs: the output itself as the prediction (every draft kept), with its second
    token changed (found again after it), unrelated tokens (no draft from it), greedy and seeded; the
    same tokens as without one, and without drafts where the engine does not speculate."""
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    alone = generate(LLMEngine("demo", **ENGINE), TEXTS[:3], greedy)[0]
    exact = alone[0].outputs[0].token_ids
    edited = alone[1].outputs[0].token_ids[:1] + [7] + alone[1].outputs[0].token_ids[2:]  # the first draft fails
    predictions = [exact, edited, [200 + i % 50 for i in range(60)]]
    predicted = [replace(greedy, prediction=p) for p in predictions]
    outputs, _, _ = generate(LLMEngine("demo", **ENGINE, **DRAFTS, prompt_lookup_min=3), TEXTS[:3], predicted)
    assert_same_text(outputs, alone)
    counts = [(o.accepted_prediction_tokens, o.rejected_prediction_tokens) for o in outputs]
    assert counts[0][0] >= 35 and counts[0][1] == 0  # 47 tokens after the first: 4 drafts, 1 more, a step
    assert counts[1][0] > 20 and counts[1][1] >= 4  # kept after the edit too
    assert counts[2] == (0, 0)
    seeded = [replace(p, temperature=1.0, seed=i) for i, p in enumerate(predicted)]
    sampled = generate(LLMEngine("demo", **ENGINE), TEXTS[:3], [replace(p, prediction=()) for p in seeded])[0]
    assert_same_text(generate(LLMEngine("demo", **ENGINE, **DRAFTS), TEXTS[:3], seeded)[0], sampled)
    plain = generate(LLMEngine("demo", **ENGINE), TEXTS[:3], predicted)[0]
    assert_same_text(plain, alone)
    assert all(o.accepted_prediction_tokens == o.rejected_prediction_tokens == 0 for o in plain)
