"""Tools through a real local cluster, with the official `openai` client and LangChain: a forced
call (tool_choice "required" or named) comes back as OpenAI's `tool_calls`, whole and streamed in
OpenAI's delta shapes, with arguments that validate against the function's schema; on a cluster
configured for Qwen3 (reasoning and hermes parsers), its thinking comes back as `reasoning`, its
`<tool_call>` blocks as `tool_calls`, and structured output waits for the thinking. `allowed_tools`
calls only the tools it names."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.ray_cluster import POOLS_KEY

WEATHER = {"name": "weather", "description": "The weather in a city now",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 12}}}}
ADD = {"name": "add", "description": "Add two numbers",
       "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                      "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, ADD)]
SCHEMAS = {"weather": WEATHER["parameters"], "add": ADD["parameters"]}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


def test_required_call_whole_and_streamed(client):
    args = dict(model="demo", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, seed=4)
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = whole.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **args) if c.choices]
    pieces = [t for c in chunks if c.delta.tool_calls for t in c.delta.tool_calls]
    assert [p.index for p in pieces] == [0, 0] and pieces[0].id.startswith("call_")
    assert (pieces[0].function.name, pieces[1].function.name) == (call.function.name, None)
    assert pieces[0].function.arguments + pieces[1].function.arguments == call.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"


def test_a_named_call_and_the_conversation_after_it(client):
    named = {"type": "function", "function": {"name": "weather"}}
    reply = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=120,
                                           seed=1).choices[0].message
    [call] = reply.tool_calls
    assert call.function.name == "weather"
    history = ASK + [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    after = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8).choices[0]
    assert after.finish_reason == "length" and after.message.tool_calls is None


def test_allowed_tools_keep_every_tool_offered_and_call_only_those_allowed(client):
    """The prompt holds every tool (its prefix the same whichever are allowed); the call is one of
    the allowed ones, and the prompt the same size as without the choice."""
    for name in ("weather", "add"):
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": name}}]}}
        reply = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=choice,
                                               max_tokens=120, seed=2)
        [call] = reply.choices[0].message.tool_calls
        assert call.function.name == name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])
        plain = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=1)
        assert reply.usage.prompt_tokens == plain.usage.prompt_tokens


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class Forecast(BaseModel):
    """A forecast."""
    city: str = Field(max_length=10)
    degrees: int = Field(ge=-40, le=50)


def test_langchain_bind_tools_and_function_calling_structured_output(server):
    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model="demo", max_tokens=120, seed=2)
    message = llm.bind_tools([multiply], tool_choice="any").invoke("3 times 4?")
    [call] = message.tool_calls
    assert call["name"] == "multiply" and set(call["args"]) == {"a", "b"}
    assert isinstance(multiply.invoke(call["args"]), int)
    streamed = None
    for chunk in llm.bind_tools([multiply], tool_choice="any").stream("3 times 4?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["multiply"]
    forecast = llm.with_structured_output(Forecast, method="function_calling").invoke("Forecast for Oslo")
    assert isinstance(forecast, Forecast)


# what a Qwen3 writes when it thinks, then calls a tool (forced here by a regex: the demo model is noise)
THINK_THEN_CALL = (r'<think>[a-z]{3,8}</think>\n\n<tool_call>\n\{"name": "add", "arguments": '
                   r'\{"a": [0-9], "b": [0-9]\}\}\n</tool_call>')


def prefilled(assistant: str) -> dict:
    """The chat continued from an assistant message's start (as a template that opens, or closes,
    the thinking ends the prompt)."""
    return dict(messages=[*ASK, {"role": "assistant", "content": assistant}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False})


@pytest.fixture(scope="module")
def pools_client(pools_server):
    """The official client on the app configured like a Qwen3 (reasoning and hermes parsers)."""
    return openai.OpenAI(base_url=f"{pools_server}/v1", api_key=POOLS_KEY["Authorization"].split()[1],
                         max_retries=0, timeout=120)


def test_reasoning_and_hermes_calls_on_a_cluster_configured_for_them(pools_client):
    # the prompt closed an empty thinking (Qwen3's enable_thinking false): the constraint holds from the first token
    closed = prefilled("<think>\n\n</think>\n\n")
    args = dict(model="demo", tools=TOOLS, max_tokens=120, temperature=0, messages=closed["messages"],
                extra_body={**closed["extra_body"], "structured_outputs": {"regex": THINK_THEN_CALL}})
    whole = pools_client.chat.completions.create(**args).choices[0]
    thought = whole.message.model_extra["reasoning"]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert thought.isalpha() and whole.message.model_extra["reasoning_content"] == thought
    [call] = whole.message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])
    deltas = [c.choices[0].delta for c in pools_client.chat.completions.create(stream=True, **args) if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == thought
    assert not "".join(d.content or "" for d in deltas).strip()
    pieces = [t for d in deltas if d.tool_calls for t in d.tool_calls]
    assert pieces[0].function.name == "add" and pieces[1].function.arguments == call.function.arguments
    plain = pools_client.chat.completions.create(model="demo", messages=ASK, max_tokens=8, temperature=0).choices[0]
    assert plain.message.content and "reasoning" not in plain.message.model_extra  # no <think>: all content


def test_structured_output_waits_for_the_thinking_the_prompt_opened(pools_client):
    """vLLM's rule with a reasoning parser: the schema holds the answer, after a free thinking
    (which the noise model never closes, so the whole output is reasoning)."""
    choice = pools_client.chat.completions.create(model="demo", max_tokens=24, temperature=0, **prefilled("<think>\n"),
                                                  response_format={"type": "json_object"}).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert len(choice.message.model_extra["reasoning"]) > 0
