"""The `<think>` split of a reasoning model's chat output, whole and streamed."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.api.reasoning import ReasoningSplitter, constraint_thinking, prompt_opens_thinking, split_reasoning
from splitserve.engine.demo import demo_tokenizer

TOKENIZER = demo_tokenizer()

OUTPUTS = [  # (prompt opened the thinking, output, reasoning, content)
    (False, "<think>\nLet me add.\n</think>\n\nIt is 5.", "\nLet me add.\n", "It is 5."),  # Qwen3: the model opens it
    (True, "Let me add.\n</think>\n\nIt is 5.", "Let me add.\n", "It is 5."),  # DeepSeek-R1: the template opened it
    (False, "  <think>x</think>y", "x", "y"),
    (False, "It is 5.", None, "It is 5."),  # never opened: all content, as without a parser
    (False, " <thinking> is a tag", None, " <thinking> is a tag"),
    (True, "cut short by max_tok", "cut short by max_tok", None),  # never closed: all reasoning
    (False, "<think></think>\n\nIt is 5.", None, "It is 5."),  # nothing thought: no reasoning, as streamed
    (False, "<think>a</think>  \n ", "a", None),  # no answer after the thinking
    (True, "a </think> b </think> c", "a ", "b </think> c"),  # the first close ends it
    (False, "", None, ""),
]


@pytest.mark.parametrize("thinking, output, reasoning, content", OUTPUTS)
def test_whole_output(thinking, output, reasoning, content):
    assert split_reasoning(output, thinking) == (reasoning, content)


@pytest.mark.parametrize("thinking, output, reasoning, content", OUTPUTS)
def test_streamed_in_any_pieces_gives_the_whole_split(thinking, output, reasoning, content):
    """Every way of cutting the output in two or in single characters: tags split across pieces
    are held, never sent as text."""
    cuts = [[output[:i], output[i:]] for i in range(len(output) + 1)] + [list(output)]
    for pieces in cuts:
        splitter, thought, answer = ReasoningSplitter(thinking), "", ""
        for i, piece in enumerate(pieces):
            r, c = splitter.feed(piece, final=i == len(pieces) - 1)
            thought, answer = thought + r, answer + c
        assert thought == (reasoning or "") and answer == (content or ""), pieces
        assert "</think>" not in thought


def test_a_partial_tag_waits_for_the_next_piece():
    splitter = ReasoningSplitter(thinking=True)
    assert splitter.feed("step one</thi") == ("step one", "")
    assert splitter.feed("nk>\n\nDone") == ("", "Done")
    opening = ReasoningSplitter(thinking=False)
    assert opening.feed("\n<thi") == ("", "") and opening.feed("nk>hm") == ("hm", "")
    plain = ReasoningSplitter(thinking=False)
    assert plain.feed("<thx") == ("", "<thx")


@pytest.mark.parametrize("tail, opened, constrained", [("<|im_start|>assistant\n<think>\n", True, "open"),
                                                       ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False, ""),
                                                       ("<|im_start|>assistant\n", False, "optional")])
def test_the_prompt_says_whether_the_thinking_is_open(tail, opened, constrained):
    """`constrained`: the free thinking a constraint lets the model write before the answer."""
    prompt = TOKENIZER.encode(tail)
    assert prompt_opens_thinking(prompt, TOKENIZER) is opened
    assert constraint_thinking(prompt, TOKENIZER) == constrained


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "\n", " ", "a", "b c", "<", ">"]),
                       max_size=12),
       cut=st.integers(min_value=1, max_value=6), thinking=st.booleans())
def test_any_output_streamed_in_any_pieces_splits_as_the_whole(pieces, cut, thinking):
    text = "".join(pieces)
    chunks = [text[i:i + cut] for i in range(0, len(text), cut)] or [""]
    splitter, thought, answer = ReasoningSplitter(thinking), "", ""
    for i, chunk in enumerate(chunks):
        r, c = splitter.feed(chunk, final=i == len(chunks) - 1)
        thought, answer = thought + r, answer + c
    reasoning, content = split_reasoning(text, thinking)
    assert (thought, answer) == (reasoning or "", content or "")
