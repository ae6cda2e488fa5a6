"""What a choice's text starts with (echo) and ends with (no stop token), how a chat choice is read
(reasoning, tool calls in each format) and which choices best_of keeps, per prompt."""
from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from splitserve.api.chat_parsers import ChatParsers
from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.choice_text import ChoiceText, best_choices, choice_options
from splitserve.api.request_models import CompletionRequest, parse_request
from splitserve.api.visible_text import TextStream
from splitserve.engine.demo import demo_tokenizer
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import HFTokenizer
from tests.engine.hf_checkpoints import save_harmony_tokenizer, train_tokenizer

TOKENIZER = demo_tokenizer()


def request(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"model": "demo", **fields}).encode())


def test_echo_is_the_prompt_as_sent_or_the_tokens_the_model_saw():
    sent = request(prompt=["first", [256, 104, 105]], echo=True, max_tokens=1)
    assert choice_options(sent, 0, TOKENIZER.encode("first"), TOKENIZER)["echo"] == "first"
    assert choice_options(sent, 1, [256, 104, 105], TOKENIZER)["echo"] == "<s>hi"
    truncated = request(prompt="a long prompt", echo=True, max_tokens=1, truncate_prompt_tokens=6)
    assert choice_options(truncated, 0, list(b"prompt"), TOKENIZER)["echo"] == "prompt"
    assert choice_options(request(prompt="x"), 0, [1], TOKENIZER)["echo"] is None


def test_best_of_keeps_the_likeliest_numbered_from_the_prompts_first_index():
    choices = [{"index": i, "text": t} for i, t in enumerate("abc")]
    kept = best_choices(choices, [-3.0, -1.0, -2.0], 2, first_index=4)
    assert kept == [{"index": 4, "text": "b"}, {"index": 5, "text": "c"}]
    assert best_choices(choices, [0.0] * 3, 3) is choices  # all returned: as they are


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "demo", "messages": [{"role": "user", "content": "2+3?"}], **fields}
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
QWEN3 = ChatParsers("qwen3", "hermes")


@pytest.mark.parametrize("prompt_end, fields, parsers, thinking, tool_parser", [
    ("assistant\n<think>\n", {}, QWEN3, True, "hermes"),  # the template opened the thinking
    ("assistant\n", {}, QWEN3, False, "hermes"),
    ("assistant\n<think>\n", {}, ChatParsers(), None, "llama3_json"),  # no reasoning parser: all content
    # constrained: thought all the same (the constraint holds the answer after it)
    ("assistant\n<think>\n", {"response_format": {"type": "json_object"}}, QWEN3, True, "hermes"),
    ("assistant\n", {"response_format": {"type": "json_object"}}, QWEN3, False, "hermes"),
    ("assistant\n<think>\n", {"tools": [ADD], "tool_choice": "required"}, QWEN3, True, "llama3_json"),  # forced: JSON
])
def test_chat_options_say_how_the_output_is_read(prompt_end, fields, parsers, thinking, tool_parser):
    options = choice_options(chat(**fields), 0, TOKENIZER.encode(prompt_end), TOKENIZER, parsers)
    assert (options["thinking"], options["tool_parser"]) == (thinking, tool_parser)


def test_a_chat_choice_with_reasoning_and_hermes_calls():
    options = choice_options(chat(tools=[ADD]), 0, TOKENIZER.encode("<think>\n"), TOKENIZER, QWEN3)
    text = ChoiceText("chat", TextStream(TOKENIZER, SamplingParams(), []), [], **options)
    output = 'Sum.</think>\n\nOn it.<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    message = text.choice(output, "stop")["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("Sum.", "Sum.", "On it.")
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    plain = ChoiceText("chat", TextStream(TOKENIZER, SamplingParams(), []), [])
    assert "reasoning" not in plain.choice(output, "stop")["message"]  # no parser: the text as it is


def test_chat_logprobs_give_each_tokens_own_bytes_where_it_holds_part_of_a_character():
    """The demo's tokens are bytes: alone, each of these decodes to U+FFFD; joined, the bytes are the text."""
    text = ChoiceText("chat", TextStream(TOKENIZER, SamplingParams(), []), [], num_top=1)
    ids = TOKENIZER.encode("日🙂", add_special_tokens=False)
    delta, _ = text.add(ids, [{t: -0.5} for t in ids], "length")
    content = text.take_logprobs()["content"]
    assert delta == "日🙂" and {c["token"] for c in content} == {"\ufffd"}
    assert [c["bytes"] for c in content] == [[b] for b in "日🙂".encode()]
    assert bytes(b for c in content for b in c["bytes"]).decode() == "日🙂"


def test_the_stop_token_that_ends_a_choice_adds_no_text_even_spelled_out():
    """vLLM's rule: EOS (or a stop_token_id) ends the text without its own, unless
    include_stop_str_in_output; a stop string ending in the last token is still cut there."""
    def run(params: SamplingParams, tokens: list[int], reason: str) -> str:
        text = ChoiceText("completion", TextStream(TOKENIZER, params, []), [])
        return text.add(tokens[:-1], None, None)[0] + text.add(tokens[-1:], None, reason)[0]

    spelled = SamplingParams(skip_special_tokens=False)
    assert run(spelled, [104, 105, 257], "stop") == "hi"
    assert run(SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True), [104, 105, 257],
               "stop") == "hi</s>"
    assert run(SamplingParams(stop_token_ids=[33]), [104, 105, 33], "stop") == "hi"
    assert run(spelled, [104, 105, 257], "length") == "hi</s>"  # EOS under ignore_eos: text like any token
    assert run(SamplingParams(stop=["i!"]), [104, 105, 33], "stop") == "h"


def test_a_mistral_call_written_with_its_special_tokens_comes_back_as_tool_calls(tmp_path):
    """`[TOOL_CALLS]` and `[ARGS]` are special tokens of Mistral's tokenizers: kept in the text of a
    chat offering tools (prepare_request sets skip_special_tokens false), they mark the call."""
    raw = train_tokenizer()
    raw.add_special_tokens(["[TOOL_CALLS]", "[ARGS]"])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    output = tokenizer.encode('[TOOL_CALLS]add[ARGS]{"a": 2}', add_special_tokens=False) + list(tokenizer.eos_token_ids)
    assert tokenizer.decode(output) == 'add{"a": 2}'  # what the text would be with special tokens skipped
    options = choice_options(chat(tools=[ADD]), 0, [], tokenizer, ChatParsers(tool_calls="mistral"))
    text = ChoiceText("chat", TextStream(tokenizer, SamplingParams(skip_special_tokens=False), []), [], **options)
    whole = text.add(output, None, "stop")[0]
    message = text.choice(whole, "stop")["message"]
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 2}'} and message["content"] is None
    assert len(call["id"]) == 9 and call["id"].isalnum()


def test_a_granite_call_after_its_special_token_comes_back_as_tool_calls_beside_content(tmp_path):
    """Granite 3's `<|tool_call|>` is a special token of its tokenizer, kept likewise."""
    raw = train_tokenizer()
    raw.add_special_tokens(["<|tool_call|>"])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    output = tokenizer.encode('Adding.<|tool_call|>[{"name": "add", "arguments": {"a": 2}}]',
                              add_special_tokens=False) + list(tokenizer.eos_token_ids)
    options = choice_options(chat(tools=[ADD]), 0, [], tokenizer, ChatParsers(tool_calls="granite"))
    text = ChoiceText("chat", TextStream(tokenizer, SamplingParams(skip_special_tokens=False), []), [], **options)
    message = text.choice(text.add(output, None, "stop")[0], "stop")["message"]
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 2}'} and message["content"] == "Adding."
    assert call["id"].startswith("call_")


def test_a_glm45_call_written_with_its_special_tokens_comes_back_typed_by_the_schema(tmp_path):
    """GLM-4.5's tags are special tokens of its tokenizer, kept likewise; a value is text where the
    offered function's schema types it a string, else its JSON."""
    raw = train_tokenizer()
    raw.add_special_tokens(["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}}
    output = tokenizer.encode("<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n<arg_key>b</arg_key>\n"
                              "<arg_value>3</arg_value>\n</tool_call>", add_special_tokens=False)
    options = choice_options(chat(tools=[tool]), 0, [], tokenizer, ChatParsers(tool_calls="glm45"))
    text = ChoiceText("chat", TextStream(tokenizer, SamplingParams(skip_special_tokens=False), []), [], **options)
    message = text.choice(text.add(output + list(tokenizer.eos_token_ids), None, "stop")[0], "stop")["message"]
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": "3"}'} and message["content"] is None


def test_minimax_calls_after_a_thinking_the_prompt_opened(tmp_path):
    """MiniMax-M2's template opens the thinking in the prompt (`<think>` then a newline): under
    `minimax_m2` for both parsers its thinking is the reasoning and its `<minimax:tool_call>` block
    (the tags special tokens of its tokenizer, kept) the calls, typed by the schema."""
    raw = train_tokenizer()
    raw.add_special_tokens(["<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>"])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}}
    prompt = tokenizer.encode("user: add\nai:<think>\n", add_special_tokens=False)
    output = tokenizer.encode('adding two\n</think>\n\n<minimax:tool_call>\n<invoke name="add">\n'
                              '<parameter name="a">2</parameter>\n<parameter name="b">3</parameter>\n</invoke>\n'
                              "</minimax:tool_call>", add_special_tokens=False)
    options = choice_options(chat(tools=[tool]), 0, prompt, tokenizer, ChatParsers("minimax_m2", "minimax_m2"))
    text = ChoiceText("chat", TextStream(tokenizer, SamplingParams(skip_special_tokens=False), []), prompt,
                      **options)
    message = text.choice(text.add(output + list(tokenizer.eos_token_ids), None, "stop")[0], "stop")["message"]
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": "3"}'}
    assert (message["reasoning"], message["content"]) == ("adding two\n", None)


def test_gpt_oss_channels_written_with_their_special_tokens_split_into_reasoning_and_content(tmp_path):
    """Harmony's markers are special tokens of GPT-OSS's tokenizer: a chat under `openai_gptoss`
    keeps them in its text (prepare_request), and its analysis is the reasoning; the stop token
    (`<|return|>`) is left out."""
    tokenizer = save_harmony_tokenizer(tmp_path)
    call_stop = tokenizer.encode("<|call|>", add_special_tokens=False)
    params = SamplingParams(skip_special_tokens=False, stop_token_ids=call_stop)

    def message(output: str, stop: list[int], **fields) -> dict:
        ids = tokenizer.encode(output, add_special_tokens=False) + stop
        options = choice_options(chat(**fields), 0, [], tokenizer, ChatParsers("openai_gptoss"))
        text = ChoiceText("chat", TextStream(tokenizer, params, []), [], **options)
        return text.choice(text.add(ids, None, "stop")[0], "stop")

    answer = "<|channel|>analysis<|message|>the sum<|end|><|start|>assistant<|channel|>final<|message|>It is 5."
    assert tokenizer.decode(tokenizer.encode(answer, add_special_tokens=False)) == \
        "analysisthe sumassistantfinalIt is 5."  # what the text would be with special tokens skipped
    answered = message(answer, list(tokenizer.eos_token_ids))["message"]
    assert (answered["reasoning"], answered["content"]) == ("the sum", "It is 5.")
    call = ("<|channel|>analysis<|message|>use add<|end|><|start|>assistant<|channel|>commentary to=functions.add "
            '<|constrain|>json<|message|>{"a": 2}')
    called = message(call, call_stop, tools=[ADD])
    assert called["finish_reason"] == "tool_calls" and called["message"]["reasoning"] == "use add"
    assert [c["function"] for c in called["message"]["tool_calls"]] == [{"name": "add", "arguments": '{"a": 2}'}]
