"""Chat messages to prompt tokens through the model's jinja chat template, rendered as
transformers' `apply_chat_template` renders it (same sandbox, globals and whitespace handling)."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from splitserve.api import client_json
from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.errors import RequestError
from splitserve.engine.tokenizer import Tokenizer

# For models without a template of their own (the demo model): the tools and the calls made, as JSON.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['tool_calls'] %}{{ message['tool_calls'] | map(attribute='function') | list | tojson }}{% endif %}"
    "{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CONTINUE_MARK = "SPLITSERVE_CONTINUES_HERE "


def render_chat(messages: list[dict], template: str | None, *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, continue_final_message: bool = False, **kwargs) -> str:
    """`messages` rendered by `template` (None: `DEFAULT_CHAT_TEMPLATE`); `kwargs` are extra template
    variables. A template that refuses the conversation (`raise_exception`) is a 400 `RequestError`.
    `continue_final_message`: the text ends where the last message's content does, as transformers
    cuts it, so the model goes on with that message."""
    compiled = _compile(DEFAULT_CHAT_TEMPLATE if template is None else template)
    if continue_final_message:  # the mark shows where the content ends once rendered
        messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_MARK}]
    # tools and documents are defined (as None) because templates test them with `is not none`.
    context = {"tools": None, "documents": None, **kwargs}
    try:
        text = compiled.render(context, messages=messages, bos_token=bos_token, eos_token=eos_token,
                               add_generation_prompt=add_generation_prompt)
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise RequestError(f"messages: the model's chat template refused them: {exc}", param="messages") from None
    return _cut_at_mark(text) if continue_final_message else text


def _cut_at_mark(text: str) -> str:
    """`text` up to the mark. The mark ends in a space: a template that kept it writes content as
    sent (its trailing whitespace stays); one that trimmed it trims content, so the cut does too."""
    at = text.rfind(CONTINUE_MARK.strip())
    if at < 0:
        raise RequestError("continue_final_message: the model's chat template does not write the last message's "
                           "content, so there is no place to continue it from", param="continue_final_message")
    return text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise RequestError(f"the model's chat template does not compile: {exc}", status=500,
                           type="server_error") from None


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson`: plain `json.dumps`, without jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def messages_for_template(request: ChatCompletionRequest) -> list[dict]:
    """The messages as templates expect them: string content (text parts joined by newlines, as
    vLLM joins them; null as ""), `name`, `tool_call_id` and an assistant's thinking (as
    `reasoning_content`, which Qwen3's template reads, and as `thinking`, GPT-OSS's) only where
    given, and tool calls as transformers passes them (`arguments` a dict, not JSON text)."""
    messages = []
    for i, message in enumerate(request.messages):
        content = message.content or ""
        if not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        extra = {key: value for key, value in (("name", message.name), ("tool_call_id", message.tool_call_id),
                                               ("reasoning_content", message.thinking),
                                               ("thinking", message.thinking)) if value is not None}
        if message.tool_calls:
            extra["tool_calls"] = [_template_call(call, f"messages.{i}.tool_calls.{j}")
                                   for j, call in enumerate(message.tool_calls)]
        messages.append({"role": message.role, "content": content, **extra})
    return messages


def _template_call(call, where: str) -> dict:
    try:
        arguments = client_json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments: must be a JSON object's text", param=f"{where}.function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def chat_prompt_token_ids(request: ChatCompletionRequest, tokenizer: Tokenizer,
                          add_special_tokens: bool | None = None) -> list[int]:
    """The prompt tokens of a chat request. The tokenizer's own special tokens (BOS) are added only
    when the rendered text does not already start with BOS, so a template that writes BOS gets
    exactly one, and the plain default template still gets the BOS the model expects. A tokenizer
    without BOS adds nothing, as in transformers' `apply_chat_template`. `add_special_tokens`
    given: added, or not, whatever the text starts with."""
    bos = _token_text(tokenizer, tokenizer.bos_token_id)
    eos = _token_text(tokenizer, next(iter(tokenizer.eos_token_ids), None))
    # Like transformers, chat_template_kwargs may override the special tokens' strings.
    variables = {"bos_token": bos, "eos_token": eos, **(request.chat_template_kwargs or {})}
    if request.reasoning_effort is not None:  # as vLLM passes it: GPT-OSS's template writes it in its system message
        variables["reasoning_effort"] = request.reasoning_effort
    tools = [{"type": "function", "function": f} for f in request.tool_functions()] or None
    text = render_chat(messages_for_template(request), tokenizer.chat_template,
                       add_generation_prompt=request.add_generation_prompt,
                       continue_final_message=request.continue_final_message, tools=tools, **variables)
    add = not text.startswith(bos) if add_special_tokens is None else add_special_tokens
    return tokenizer.encode(text, add_special_tokens=add)


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)
