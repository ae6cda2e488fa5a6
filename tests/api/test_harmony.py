"""GPT-OSS's harmony channels split into reasoning and content, whole and streamed."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.api.harmony import HarmonySplitter
from splitserve.api.reasoning import split_reasoning
from splitserve.engine.output_constraint import HARMONY

NEXT = "<|end|><|start|>assistant"
OUTPUTS = [  # (output as generated after the prompt's `<|start|>assistant`, its stop token left out; reasoning, content)
    (f"<|channel|>analysis<|message|>User asks 2+3.{NEXT}<|channel|>final<|message|>It is 5.", "User asks 2+3.",
     "It is 5."),
    ("<|channel|>final<|message|>It is 5.", None, "It is 5."),  # reasoning effort low: no analysis
    ("<|channel|>analysis<|message|>cut short by max_tok", "cut short by max_tok", None),
    (f"<|channel|>analysis<|message|>a{NEXT}<|channel|>analysis<|message|>b{NEXT}<|channel|>final<|message|>c",
     "ab", "c"),
    (f"<|channel|>analysis<|message|>plan{NEXT}<|channel|>commentary<|message|>Checking.{NEXT}"
     "<|channel|>final<|message|>Done.", "plan", "Checking.Done."),  # a preamble is for the user
    # a call (its stop token, <|call|>, left out) is spelled as a hermes call, its header dropped
    (f"<|channel|>analysis<|message|>x{NEXT}<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
     '{"a": 2}', "x", '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'),
    (f"<|channel|>commentary<|message|>On it.{NEXT} to=functions.f<|channel|>commentary json<|message|>{{}}{NEXT}"
     "<|channel|>commentary to=functions.g<|message|>[1]", None,
     'On it.<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": [1]}</tool_call>'),
    (f"<|channel|>analysis<|message|>x{NEXT}<|channel|>fin", "x", None),  # a header cut short leaves nothing
    ('{"a": 2}', None, '{"a": 2}'),  # constrained from the first token: no header, all content
    ("<|chan and more", None, "<|chan and more"),
    ("", None, ""),
]


@pytest.mark.parametrize("output, reasoning, content", OUTPUTS)
def test_whole_output(output, reasoning, content):
    assert split_reasoning(output, HARMONY) == (reasoning, content)


@pytest.mark.parametrize("output, reasoning, content", OUTPUTS)
def test_streamed_in_any_pieces_gives_the_whole_split(output, reasoning, content):
    cuts = [[output[:i], output[i:]] for i in range(len(output) + 1)] + [list(output)]
    for pieces in cuts:
        splitter, thought, answer = HarmonySplitter(), "", ""
        for i, piece in enumerate(pieces):
            r, c = splitter.feed(piece, final=i == len(pieces) - 1)
            thought, answer = thought + r, answer + c
        assert thought == (reasoning or "") and answer == (content or ""), pieces
        assert "<|" not in thought


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(["<|channel|>", "analysis", "final", "<|message|>", "<|end|>", "<|start|>",
                                        "assistant", "<|", "end|>", " to=functions.f", "<|constrain|>", "a", "b c", "{}"]),
                       max_size=14),
       cut=st.integers(min_value=1, max_value=6))
def test_any_output_streamed_in_any_pieces_splits_as_the_whole(pieces, cut):
    text = "".join(pieces)
    splitter, thought, answer = HarmonySplitter(), "", ""
    chunks = [text[i:i + cut] for i in range(0, len(text), cut)] or [""]
    for i, chunk in enumerate(chunks):
        r, c = splitter.feed(chunk, final=i == len(chunks) - 1)
        thought, answer = thought + r, answer + c
    reasoning, content = split_reasoning(text, HARMONY)
    assert (thought, answer) == (reasoning or "", content or "")
