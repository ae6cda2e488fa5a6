"""Batch input files for the batch tests: completions sharing a prefix, greedy and fixed-length."""
from __future__ import annotations

import json

from splitserve.api.usage import Usage

PREFIX = "You grade answers. Reply with one letter. " * 2


def batch_lines(n: int, max_tokens: int = 4) -> list[dict]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "demo", "prompt": PREFIX + f"Question {i}: {i * 7919 % 1000}?",
                      "max_tokens": max_tokens if i % 5 else 4 * max_tokens, "temperature": 0, "ignore_eos": True}}
            for i in range(n)]


LINE_USAGE = Usage(prompt_tokens=90, completion_tokens=4, cached_tokens=64, reasoning_tokens=1, cache_write_tokens=16)


def answered(custom_id: str) -> dict:
    """A result line as an executor logs it, its body reduced to LINE_USAGE (for the service
    tests' executors, which stand in for an engine)."""
    return {"custom_id": custom_id, "response": {"status_code": 200, "body": {"usage": LINE_USAGE.body()}},
            "error": None}


def as_jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def expected_texts(lines: list[dict]) -> dict[str, str]:
    """What the offline engine answers for each line (the batch must give the same)."""
    from splitserve import LLM, SamplingParams

    llm = LLM("demo")
    outs = llm.generate([line["body"]["prompt"] for line in lines],
                        [SamplingParams(max_tokens=line["body"]["max_tokens"], temperature=0, ignore_eos=True)
                         for line in lines])
    return {line["custom_id"]: out.text for line, out in zip(lines, outs)}


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}}
ADD = {"name": "add", "description": "Add two numbers",
       "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                      "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}
ASK = [{"role": "user", "content": "Is 2 + 3 five?"}]
CALL = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'}


def option_lines() -> dict[str, list[dict]]:
    """Per endpoint, lines that use every option a batch line takes (all reproducible: greedy or
    seeded), custom_ids unique across them; one whose constraint does not compile (`bad-regex`),
    one a Responses line's bound refuses (`bad-output-bound`) and one asking more dimensions
    than the model's (`bad-dimensions`) are 400s."""
    def line(custom_id: str, url: str, **body) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "demo", **body}}

    prompt = "Several choices, please: "
    completions = [
        line("n", "/v1/completions", prompt=prompt, n=2, seed=11, temperature=1.0, max_tokens=8, logprobs=1,
             ignore_eos=True),
        line("best-of", "/v1/completions", prompt=prompt, n=2, best_of=3, seed=3, temperature=1.0, max_tokens=6,
             ignore_eos=True),  # ranked by logprobs the client did not ask for
        line("echo-scored", "/v1/completions", prompt="Score this text", echo=True, logprobs=2, max_tokens=0),
        line("echo", "/v1/completions", prompt=[256, 72, 105], echo=True, max_tokens=4, temperature=0,
             stop=["zz"]),
        line("regex", "/v1/completions", prompt="Code:", max_tokens=10, seed=2, guided_regex="[A-Z]{3}-[0-9]{2}"),
        line("bad-regex", "/v1/completions", prompt="x", guided_regex="[a-"),
        line("prompts", "/v1/completions", prompt=["Two prompts: ", [256, 72, 105]], best_of=2, seed=7,
             temperature=1.0, max_tokens=5, ignore_eos=True, echo=True, logprobs=1),
    ]
    chat = [
        line("logprobs", "/v1/chat/completions", messages=ASK, logprobs=True, top_logprobs=2, max_tokens=6,
             temperature=0),
        line("schema", "/v1/chat/completions", messages=ASK, seed=1, max_tokens=60,
             response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}),
        line("tools", "/v1/chat/completions", messages=ASK, seed=4, max_tokens=60, tool_choice="required",
             tools=[{"type": "function", "function": ADD}]),
        line("chat-n", "/v1/chat/completions", messages=ASK, n=2, seed=5, max_tokens=6, ignore_eos=True),
    ]
    responses = [
        line("resp-text", "/v1/responses", instructions="Be terse.", input="Is 2 + 3 five?", max_output_tokens=16,
             temperature=0),
        line("resp-turns", "/v1/responses", input=[*ASK, CALL, {"type": "function_call_output", "call_id": "call_1",
                                                                "output": "5"}],
             tools=[{"type": "function", **ADD}], max_output_tokens=8, temperature=0),
        line("resp-schema", "/v1/responses", input=ASK, max_output_tokens=60, temperature=0,
             text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}),
        line("resp-tools", "/v1/responses", input=ASK, max_output_tokens=60, tool_choice="required", temperature=0,
             tools=[{"type": "function", **ADD}]),
        line("resp-logprobs", "/v1/responses", instructions="Be terse.", input="Is 2 + 3 five?", max_output_tokens=6,
             temperature=0, include=["message.output_text.logprobs"], top_logprobs=2),
        line("bad-output-bound", "/v1/responses", input="x", max_output_tokens=0),
    ]
    embeddings = [
        line("embed-inputs", "/v1/embeddings", input=["Embed this text.", [256, 72, 105]]),
        line("embed-short", "/v1/embeddings", input="Embed this text.", dimensions=8),
        line("bad-dimensions", "/v1/embeddings", input="x", dimensions=10 ** 6),
    ]
    scores = [line("score-pairs", "/v1/score", text_1=["Is 2 + 3 five?", "Paris"], text_2=["Yes, it is.", "France"])]
    rerank = [line("rerank-top", "/v1/rerank", query="Is 2 + 3 five?", top_n=2,
                   documents=["Yes, 2 + 3 = 5.", {"text": "Bananas are yellow."}, "No idea."])]
    return {"/v1/completions": completions, "/v1/chat/completions": chat, "/v1/responses": responses,
            "/v1/embeddings": embeddings, "/v1/score": scores, "/v1/rerank": rerank}


FAILING = ("bad-regex", "bad-output-bound", "bad-dimensions")  # the option lines that are 400s


UNCOMPARABLE = ("id", "created", "created_at", "call_id", "prompt_tokens_details", "input_tokens_details", "store")


def comparable(body: dict) -> dict:
    """A response body without what differs between two answers to one request: its id, creation
    time and tool call ids (a Response's and its items' too), the prefix cache's part in its
    usage (what ran before decides it), and whether a Response is kept (a batch's are not)."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in UNCOMPARABLE}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(body)
