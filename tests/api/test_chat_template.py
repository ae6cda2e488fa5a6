"""Chat templates rendered and tokenized as transformers' `apply_chat_template` does, on small
checkpoints with Llama-3 and ChatML templates written here."""
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    chat_prompt_token_ids,
    messages_for_template,
    render_chat,
)
from splitserve.api.chat_parsers import ChatParsers
from splitserve.api.choice_text import choice_options
from splitserve.api.errors import RequestError
from splitserve.engine.tokenizer import ByteTokenizer, HFTokenizer

LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's, verbatim
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML_TEMPLATE = (  # Qwen2's
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")
# Exercises what Hub templates use: trim/lstrip of blocks, raise_exception, strftime_now, tojson,
# loop controls, `tools is not none`, message names and template kwargs.
FEATURES_TEMPLATE = """\
{%- if tools is not none %}TOOLS{% endif %}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{{ raise_exception('tool messages need tools, got ' + message['content']) }}{% endif %}
    {{ message['role'] }}{% if message.name is defined %}({{ message.name }}){% endif %}: {{ message['content'] | tojson }}
{% endfor %}
{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}first={{ m.role }}{% endfor %}
{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}
{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{% endif %}
year={{ strftime_now('%Y') }} eos={{ eos_token }}
{% if add_generation_prompt %}assistant:{% endif %}"""
# Llama 3.1's way with tools (condensed): the tools as JSON in the first user turn, calls as
# {"name", "parameters"} JSON with their arguments as an object, tool results as `ipython` turns.
TOOLS_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' and loop.first and tools is not none %}
        {{- '<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with a JSON call.\n\n' }}
        {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}
        {{- message['content'] + '<|eot_id|>' }}
    {%- elif message.tool_calls is defined %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.name + '", "parameters": ' }}
        {{- call.arguments | tojson }}{{- '}<|eot_id|>' }}
    {%- elif message['role'] == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""
# Qwen3's way with thinking (condensed): an assistant turn's reasoning_content inside <think>, and the
# prompt left inside an open <think> unless enable_thinking is false (then an empty one is closed).
THINKING_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.role == 'assistant' and message.reasoning_content is defined %}
        {{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}
    {%- endif %}
    {{- message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}
    {%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}"""
# GPT-OSS's way (condensed): an assistant turn's thinking as its analysis message, its answer as final
HARMONY_TEMPLATE = """\
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {%- if message.thinking %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
        {%- endif %}
        {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
    {%- else %}
        {{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"""
CHECKPOINTS = {  # template, special tokens, bos, eos, whether tokenizer.json's post-processor adds BOS
    "llama3": (LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", True),
    "chatml": (CHATML_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", False),
    "features": (FEATURES_TEMPLATE, ["<|endoftext|>", "<no_think>"], None, "<|endoftext|>", False),
    "tools": (TOOLS_TEMPLATE, ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
              "<|begin_of_text|>", "<|eot_id|>", False),
    "thinking": (THINKING_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None,
                 "<|im_end|>", False),
    "harmony": (HARMONY_TEMPLATE, ["<|return|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>"], None,
                "<|return|>", False),
}
CONVERSATION = [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "héllo <tag> \"wörld\" 🦊"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "and you?"}]


def save_checkpoint(path, name):
    template, specials, bos, eos, adds_bos = CHECKPOINTS[name]
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for m in CONVERSATION] * 10 + [template], trainer)
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                            chat_template=template).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(tmp_path_factory, request):
    path = save_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return HFTokenizer(path), AutoTokenizer.from_pretrained(path)


def chat_request(messages, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})


def hf_ids(hf_tok, messages, **kwargs) -> list[int]:
    out = hf_tok.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_matches_transformers(checkpoint, generation_prompt):
    ours, hf_tok = checkpoint
    request = chat_request(CONVERSATION, add_generation_prompt=generation_prompt)
    bos = hf_tok.bos_token or ""
    text = render_chat(messages_for_template(request), ours.chat_template, bos_token=bos, eos_token=hf_tok.eos_token,
                       add_generation_prompt=generation_prompt)
    assert text == hf_tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=generation_prompt)
    expected = hf_ids(hf_tok, CONVERSATION, add_generation_prompt=generation_prompt)
    assert chat_prompt_token_ids(request, ours) == expected
    if bos:  # the template writes BOS; the tokenizer's post-processor must not add a second one
        assert expected.count(ours.bos_token_id) == 1


def test_names_and_template_kwargs_match_transformers(tmp_path):
    path = save_checkpoint(tmp_path, "features")
    ours, hf_tok = HFTokenizer(path), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "developer", "content": "x"}]
    request = chat_request(messages, chat_template_kwargs={"enable_thinking": False})
    expected = hf_ids(hf_tok, messages, add_generation_prompt=True, enable_thinking=False)
    assert chat_prompt_token_ids(request, ours) == expected
    assert hf_tok.convert_tokens_to_ids("<no_think>") in expected


def test_reasoning_effort_reaches_the_template_as_transformers_passes_it(tmp_path):
    path = save_checkpoint(tmp_path, "features")
    ours, hf_tok = HFTokenizer(path), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "hi"}]
    expected = hf_ids(hf_tok, messages, add_generation_prompt=True, reasoning_effort="high")
    assert chat_prompt_token_ids(chat_request(messages, reasoning_effort="high"), ours) == expected
    assert "Reasoning: high" in ours.decode(expected)
    assert "Reasoning" not in ours.decode(chat_prompt_token_ids(chat_request(messages), ours))


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    request = chat_request([{"role": "user", "content": parts}, {"role": "assistant", "content": None, "name": "bot"}])
    assert messages_for_template(request) == [{"role": "user", "content": "one\ntwo"},
                                              {"role": "assistant", "content": "", "name": "bot"}]


def test_default_template_on_the_demo_tokenizer():
    tok = ByteTokenizer()
    request = chat_request([{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}])
    text = "system: be nice\nuser: hi\nassistant:"
    assert render_chat(messages_for_template(request), None) == text
    assert chat_prompt_token_ids(request, tok) == [tok.BOS, *text.encode()]
    no_prompt = chat_request(request.model_dump()["messages"], add_generation_prompt=False)
    assert render_chat(messages_for_template(no_prompt), DEFAULT_CHAT_TEMPLATE, add_generation_prompt=False) == \
        "system: be nice\nuser: hi\n"


def test_bos_is_added_when_the_template_does_not_write_it(tmp_path):
    """A tokenizer with BOS under a template without it: the prompt still starts with BOS (where
    transformers' apply_chat_template would leave it out)."""
    class ChatmlLlama(HFTokenizer):
        chat_template = CHATML_TEMPLATE

    path = save_checkpoint(tmp_path, "llama3")
    ours, hf_tok = ChatmlLlama(path), AutoTokenizer.from_pretrained(path)
    hf_tok.chat_template = CHATML_TEMPLATE
    expected = hf_ids(hf_tok, CONVERSATION, add_generation_prompt=True)
    assert chat_prompt_token_ids(chat_request(CONVERSATION), ours) == [ours.bos_token_id, *expected]


def test_template_kwargs_override_special_tokens(tmp_path):
    ours = HFTokenizer(save_checkpoint(tmp_path, "features"))
    request = chat_request([{"role": "user", "content": "hi"}], chat_template_kwargs={"eos_token": "END"})
    assert "eos=END" in ours.decode(chat_prompt_token_ids(request, ours))


def test_raise_exception_is_a_400():
    with pytest.raises(RequestError) as info:
        render_chat([{"role": "tool", "content": "x"}], FEATURES_TEMPLATE)
    error = info.value
    assert (error.status, error.param) == (400, "messages")
    assert error.message == "messages: the model's chat template refused them: tool messages need tools, got x"


def test_broken_template_is_a_server_error():
    with pytest.raises(RequestError) as info:
        render_chat([{"role": "user", "content": "x"}], "{% for m in messages %}")
    assert (info.value.status, info.value.type) == (500, "server_error")
    assert info.value.message.startswith("the model's chat template does not compile: ")


def test_sandbox_refuses_unsafe_access():
    with pytest.raises(RequestError, match="refused them"):
        render_chat([], "{{ messages.__class__.__mro__ }}{{ messages.append(1) }}")


WEATHER = {"name": "weather", "description": "The weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_tools_and_earlier_calls_render_as_transformers_renders_them(tmp_path):
    """The tools reach the template as transformers passes them, and an earlier call's JSON-text
    arguments reach it as an object, so the prompt's tokens equal `apply_chat_template`'s."""
    path = save_checkpoint(tmp_path, "tools")
    ours, hf_tok = HFTokenizer(path), AutoTokenizer.from_pretrained(path)
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    request = chat_request(messages, tools=[{"type": "function", "function": WEATHER}])
    hf_messages = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}, messages[2]]
    expected = hf_ids(hf_tok, hf_messages, tools=[{"type": "function", "function": WEATHER}],
                      add_generation_prompt=True)
    assert chat_prompt_token_ids(request, ours) == expected
    assert '"name": "weather", "parameters": {"city": "Oslo"}}' in hf_tok.decode(expected)


def test_the_default_template_shows_the_tools_and_calls():
    call = {"id": "c", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    request = chat_request([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}],
                           tools=[{"type": "function", "function": WEATHER}])
    text = bytes(chat_prompt_token_ids(request, ByteTokenizer())[1:]).decode()
    assert text.startswith('tools: [{"type": "function", "function": {"name": "weather"')
    assert 'assistant: [{"name": "weather", "arguments": {"city": "Oslo"}}]\nassistant:' in text


def test_an_earlier_call_whose_arguments_are_not_an_object_is_a_400():
    call = {"id": "c", "type": "function", "function": {"name": "weather", "arguments": "[1]"}}
    with pytest.raises(RequestError) as refused:
        messages_for_template(chat_request([{"role": "assistant", "tool_calls": [call]}]))
    assert refused.value.param == "messages.0.tool_calls.0.function.arguments"


@pytest.mark.parametrize("answer", ["Sure, the answer is", "  Sure, with spaces around  "])
def test_continue_final_message_matches_transformers(checkpoint, answer):
    """The prompt ends inside the last (assistant) message, as transformers cuts it, whether the
    template keeps the content's spaces (ChatML) or trims them (Llama 3)."""
    ours, hf_tok = checkpoint
    messages = [*CONVERSATION, {"role": "assistant", "content": answer}]
    request = chat_request(messages, add_generation_prompt=False, continue_final_message=True)
    expected = hf_ids(hf_tok, messages, add_generation_prompt=False, continue_final_message=True)
    assert chat_prompt_token_ids(request, ours) == expected
    assert ours.decode(expected, skip_special_tokens=False).rstrip().endswith(answer.strip())


def test_continue_final_message_on_the_default_template():
    request = chat_request([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, "}],
                           add_generation_prompt=False, continue_final_message=True)
    assert chat_prompt_token_ids(request, ByteTokenizer()) == [ByteTokenizer.BOS, *b"user: hi\nassistant: Hello, "]


def test_continue_final_message_refusals():
    with pytest.raises(RequestError) as both:
        chat_request([{"role": "assistant", "content": "x"}], continue_final_message=True)
    assert both.value.param == "continue_final_message"  # add_generation_prompt is true unless sent false
    with pytest.raises(RequestError) as unwritten:  # a template that leaves the content out
        render_chat([{"role": "assistant", "content": "secret"}], "{% for m in messages %}{{ m.role }}{% endfor %}",
                    add_generation_prompt=False, continue_final_message=True)
    assert unwritten.value.param == "continue_final_message"


@pytest.mark.parametrize("enable_thinking, opened", [(None, True), (False, False)])
def test_an_earlier_turns_reasoning_reaches_the_template_and_the_prompt_says_if_thinking_is_open(
        tmp_path, enable_thinking, opened):
    """An assistant message as a reasoning parser returned it (`reasoning`, or vLLM's older
    `reasoning_content`) renders as transformers renders `reasoning_content`; whether the prompt
    leaves the model thinking is read off the prompt's tokens."""
    path = save_checkpoint(tmp_path, "thinking")
    ours, hf_tok = HFTokenizer(path), AutoTokenizer.from_pretrained(path)
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "and you?"}]
    expected = hf_ids(hf_tok, [turns[0], {**turns[1], "reasoning_content": "greet"}, turns[2]],
                      add_generation_prompt=True, **kwargs)
    for field in ("reasoning", "reasoning_content"):
        request = chat_request([turns[0], {**turns[1], field: "greet"}, turns[2]], chat_template_kwargs=kwargs)
        prompt = chat_prompt_token_ids(request, ours)
        assert prompt == expected
        options = choice_options(request, 0, prompt, ours, ChatParsers("qwen3"))
        assert options["thinking"] is opened


def test_an_earlier_turns_reasoning_reaches_gpt_oss_template_as_its_thinking(tmp_path):
    """GPT-OSS's template reads an assistant turn's `thinking` (as transformers users pass it)."""
    path = save_checkpoint(tmp_path, "harmony")
    ours, hf_tok = HFTokenizer(path), AutoTokenizer.from_pretrained(path)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "and you?"}]
    expected = hf_ids(hf_tok, [turns[0], {**turns[1], "thinking": "greet"}, turns[2]], add_generation_prompt=True)
    request = chat_request([turns[0], {**turns[1], "reasoning": "greet"}, turns[2]])
    assert chat_prompt_token_ids(request, ours) == expected
    assert "<|channel|>analysis<|message|>greet<|end|>" in ours.decode(expected, skip_special_tokens=False)
