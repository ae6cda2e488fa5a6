"""Structured output through a real local cluster: the prompt worker masks the first token and the
token worker the rest (its matcher catches up on the first), so the JSON that comes back parses
and validates whole and streamed, with the official `openai` client and LangChain's `ChatOpenAI`."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 50}}}
MESSAGES = [{"role": "user", "content": "Name a city as JSON"}]


def test_chat_json_schema_whole_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        whole = client.chat.completions.create(model="demo", messages=MESSAGES, response_format=fmt, seed=seed,
                                               max_tokens=120).choices[0]
        streamed = client.chat.completions.create(model="demo", messages=MESSAGES, response_format=fmt, seed=seed,
                                                  max_tokens=120, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert whole.finish_reason == "stop" and text == whole.message.content
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completion_choice_regex_and_json_object(client):
    picked = client.completions.create(model="demo", prompt="Answer:", max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert picked.choices[0].text in ("yes", "no", "maybe")
    pattern = r"[A-Z]{2}-[0-9]{3}"
    coded = client.completions.create(model="demo", prompt="Code:", max_tokens=10, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, coded.choices[0].text)
    obj = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=200, seed=1,
                                         response_format={"type": "json_object"}).choices[0]
    if obj.finish_reason == "stop":  # any object may outrun max_tokens under random weights
        assert isinstance(json.loads(obj.message.content), dict)


def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="demo", prompt="x", extra_body={"guided_regex": "[a-"})
    assert refused.value.body["param"] == "guided_regex"


class City(BaseModel):
    """A city and its rank."""
    city: str = Field(max_length=10)
    rank: int = Field(ge=1, le=50)


def test_langchain_with_structured_output(server):
    """LangChain's default method (json_schema, strict) and json_mode, through the openai SDK's parser."""
    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model="demo", max_tokens=120, seed=3)
    city = llm.with_structured_output(City).invoke("Name a city")
    assert isinstance(city, City) and 1 <= city.rank <= 50
    streamed = list(llm.with_structured_output(City).stream("Name a city"))
    assert isinstance(streamed[-1], City)
