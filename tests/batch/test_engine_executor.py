"""A batch on one in-process engine answers each line as its endpoint would: several choices with
their seeds (best_of keeping the likeliest), several prompts, logprobs and echo, structured output and tool calls,
Responses lines as the Response of the chat they ask for, in the shapes the official `openai` client
parses; a constraint that does not compile is the line's 400."""
from __future__ import annotations

import base64
import json

import jsonschema
import numpy as np
import pytest
from cohere import RerankResponse
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from splitserve import LLM, SamplingParams
from splitserve.api.chat_parsers import ChatParsers
from splitserve.batch.blend.feeder import BlendOptions
from splitserve.batch.engine_executor import run_lines
from splitserve.batch.lines import LineRules, parse_input, prepare
from splitserve.batch.results import ResultLog
from tests.batch.batch_helpers import ADD, FAILING, PREFIX, SCHEMA, as_jsonl, batch_lines, option_lines


@pytest.fixture(scope="module")
def llm():
    return LLM("demo")


@pytest.fixture(scope="module")
def results(llm, tmp_path_factory):
    """custom_id -> result line, for every option line (both endpoints in one run)."""
    lines = [line for group in option_lines().values() for line in group]
    directory = tmp_path_factory.mktemp("batch")
    with ResultLog(directory / "out.jsonl") as output, ResultLog(directory / "errors.jsonl") as errors:
        run_lines(llm.engine, parse_input(as_jsonl(lines)), "demo", output, errors, BlendOptions("dfs"))
        return {**output.done, **errors.done}


def body(results, custom_id: str) -> dict:
    return results[custom_id]["response"]["body"]


CLIENT_TYPES = {"/v1/completions": Completion, "/v1/chat/completions": ChatCompletion, "/v1/responses": Response,
                "/v1/embeddings": CreateEmbeddingResponse, "/v1/rerank": RerankResponse}  # vLLM's /v1/score: no client


def test_every_line_has_a_result_in_the_client_shapes(results):
    assert len(results) == sum(len(group) for group in option_lines().values())
    urls = {line["custom_id"]: url for url, group in option_lines().items() for line in group}
    for custom_id, line in results.items():
        if custom_id in FAILING:
            continue
        assert line["response"]["status_code"] == 200
        # echoed logprobs start with the first prompt token's null, as OpenAI's API gives it; the types deny it
        if custom_id not in ("echo-scored", "prompts") and urls[custom_id] in CLIENT_TYPES:
            CLIENT_TYPES[urls[custom_id]].model_validate(line["response"]["body"])


def test_n_choices_equal_independent_requests_with_their_seeds(llm, results):
    choices = body(results, "n")["choices"]
    prompt = "Several choices, please: "
    alone = [llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True))[0].text
             for i in range(2)]
    assert [c["index"] for c in choices] == [0, 1] and [c["text"] for c in choices] == alone
    assert body(results, "n")["usage"]["completion_tokens"] == 16
    for choice in choices:
        assert len(choice["logprobs"]["tokens"]) == 8 and all(len(t) == 1 for t in choice["logprobs"]["top_logprobs"])


def test_best_of_keeps_the_choices_whose_tokens_are_likeliest(llm, results):
    got = body(results, "best-of")
    runs = [llm.generate("Several choices, please: ", SamplingParams(max_tokens=6, temperature=1.0, seed=3 + i,
                                                                     logprobs=1, ignore_eos=True))[0]
            for i in range(3)]
    score = [sum(lps[t] for t, lps in zip(run.token_ids, run.outputs[0].logprobs)) for run in runs]
    best = sorted(range(3), key=lambda i: -score[i])[:2]
    assert [c["text"] for c in got["choices"]] == [runs[i].text for i in best]
    assert [c["index"] for c in got["choices"]] == [0, 1] and got["usage"]["completion_tokens"] == 18
    assert all(choice["logprobs"] is None for choice in got["choices"])


def test_several_prompts_are_answered_prompt_by_prompt(llm, results):
    """Prompt k's choices come at k x n, each the best of its prompt's seeded runs, echoed."""
    got = body(results, "prompts")
    texts = []
    for prompt, echo in (("Two prompts: ", "Two prompts: "), ([[256, 72, 105]], "<s>Hi")):
        runs = [llm.generate(prompt, SamplingParams(max_tokens=5, temperature=1.0, seed=7 + i, logprobs=1,
                                                    ignore_eos=True))[0] for i in range(2)]
        best = max(runs, key=lambda run: sum(lps[t] for t, lps in zip(run.token_ids, run.outputs[0].logprobs)))
        texts.append(echo + best.text)
    assert [c["index"] for c in got["choices"]] == [0, 1] and [c["text"] for c in got["choices"]] == texts
    assert got["usage"] == {"prompt_tokens": 14 + 3, "completion_tokens": 4 * 5, "total_tokens": 37,
                            "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},  # no full block
                            "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": 0,
                                                          "rejected_prediction_tokens": 0}}


def test_a_lines_usage_counts_its_prompts_cache_hit(llm, tmp_path):
    """Lines sharing a prefix: those prefilled after the first's blocks are cached say so in
    usage.prompt_tokens_details (whole blocks of the shared prefix: BOS and PREFIX, 85 tokens)."""
    shared = (len(PREFIX.encode()) + 1) // 16 * 16
    with ResultLog(tmp_path / "out.jsonl") as output, ResultLog(tmp_path / "errors.jsonl") as errors:
        stats = run_lines(llm.engine, parse_input(as_jsonl(batch_lines(12))), "demo", output, errors,
                          BlendOptions("dfs"))
    usages = [Completion.model_validate(line["response"]["body"]).usage for line in output.done.values()]
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert len(cached) == 12 and set(cached) <= {0, shared} and shared in cached
    assert sum(cached) == stats.cached_tokens and sum(u.prompt_tokens for u in usages) == stats.prompt_tokens


def test_echo_scores_the_prompt_and_puts_it_in_front(llm, results):
    scored = body(results, "echo-scored")
    [choice] = scored["choices"]
    prompt = llm.engine.tokenizer.encode("Score this text")
    reference = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    assert choice["text"] == "Score this text" and scored["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([lps[t] for t, lps in zip(prompt[1:], reference[1:])],
                                                                     abs=1e-4)
    echoed = body(results, "echo")["choices"][0]["text"]
    greedy = llm.generate([[256, 72, 105]], SamplingParams(max_tokens=4, temperature=0))[0].text
    assert echoed == llm.engine.tokenizer.decode([256, 72, 105], skip_special_tokens=False) + greedy


def test_chat_logprobs_are_those_of_the_tokens_sampled(llm, results):
    [choice] = body(results, "logprobs")["choices"]
    [line] = parse_input(as_jsonl(option_lines()["/v1/chat/completions"][:1]))
    prompt = prepare(line, LineRules(llm.engine.tokenizer, "demo", llm.engine.max_model_len, 64)).prompts[0]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=2))[0]
    content = choice["logprobs"]["content"]
    alone = [lps[t] for t, lps in zip(greedy.token_ids, greedy.outputs[0].logprobs)]
    assert [t["logprob"] for t in content] == pytest.approx(alone, abs=1e-4)  # batched with other lines
    for token in content:  # greedy: the sampled token is the likeliest
        assert len(token["top_logprobs"]) == 2 and token["logprob"] == token["top_logprobs"][0]["logprob"]


def test_structured_output_and_a_forced_tool_call_validate_against_their_schemas(results):
    [schema] = body(results, "schema")["choices"]
    assert schema["finish_reason"] == "stop"
    jsonschema.validate(json.loads(schema["message"]["content"]), SCHEMA)
    [tools] = body(results, "tools")["choices"]
    assert tools["finish_reason"] == "tool_calls" and tools["message"]["content"] is None
    [call] = tools["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD["parameters"])
    [regex] = body(results, "regex")["choices"]
    assert regex["finish_reason"] == "stop" and len(regex["text"]) == 6 and regex["text"][3] == "-"


def test_a_responses_line_is_the_response_of_the_chat_it_asks_for(llm, results, tmp_path):
    """Its text, status and usage are the chat completion's of the same messages (its instructions
    the system message), its usage in the Responses shape; a forced call is a `function_call` item
    and a schema holds the text; a refusal names the Responses field."""
    chat = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "demo", "messages": [{"role": "system", "content": "Be terse."},
                                                    {"role": "user", "content": "Is 2 + 3 five?"}],
                     "max_completion_tokens": 16, "temperature": 0}}
    with ResultLog(tmp_path / "out.jsonl") as output, ResultLog(tmp_path / "errors.jsonl") as errors:
        run_lines(llm.engine, parse_input(as_jsonl([chat])), "demo", output, errors, BlendOptions("dfs"))
    expected = ChatCompletion.model_validate(output.done["chat"]["response"]["body"])
    got = Response.model_validate(body(results, "resp-text"))
    assert got.output_text == expected.choices[0].message.content and got.output_text
    assert (got.status, got.incomplete_details.reason, expected.choices[0].finish_reason) == (
        "incomplete", "max_output_tokens", "length")
    assert (got.usage.input_tokens, got.usage.output_tokens) == (expected.usage.prompt_tokens, 16)
    assert results["resp-text"]["response"]["request_id"] == got.id and got.id.startswith("resp_")
    [call] = Response.model_validate(body(results, "resp-tools")).output
    assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    schema = Response.model_validate(body(results, "resp-schema"))
    assert schema.status == "completed"
    jsonschema.validate(json.loads(schema.output_text), SCHEMA)
    assert Response.model_validate(body(results, "resp-turns")).output[0].type == "message"
    error = results["bad-output-bound"]["response"]
    assert error["status_code"] == 400 and error["body"]["error"]["param"] == "max_output_tokens"


def test_a_constraint_that_does_not_compile_is_the_lines_400(results):
    error = results["bad-regex"]["response"]
    assert error["status_code"] == 400 and error["body"]["error"]["param"] == "guided_regex"


def test_a_batch_run_with_reasoning_and_hermes_parsers_reads_chat_lines_as_the_endpoint_does(llm, tmp_path):
    """`splitserve batch --reasoning-parser qwen3 --tool-call-parser hermes`: a line's thinking is the
    message's reasoning and its <tool_call> block its call (written here by a regex constraint, on a
    prompt that closed an empty thinking, so the constraint holds from the first token); a JSON
    constraint waits for the thinking a prompt opened (the noise model never closes it)."""
    regex = r'<think>[a-z]{3,6}</think>\n\n<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9]\}\}\n</tool_call>'

    def chat_line(custom_id: str, prefill: str, **fields) -> dict:
        messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": prefill}]
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "demo", "messages": messages, "continue_final_message": True,
                         "add_generation_prompt": False, **fields}}
    lines = [chat_line("think-call", "<think>\n\n</think>\n\n", max_tokens=120, structured_outputs={"regex": regex},
                       tools=[{"type": "function", "function": ADD}]),
             chat_line("think-json", "<think>\n", max_tokens=16, response_format={"type": "json_object"})]
    with ResultLog(tmp_path / "out.jsonl") as output, ResultLog(tmp_path / "errors.jsonl") as errors:
        run_lines(llm.engine, parse_input(as_jsonl(lines)), "demo", output, errors, BlendOptions("dfs"),
                  parsers=ChatParsers("qwen3", "hermes"))
    choice = output.done["think-call"]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning"].isalpha()
    usage = output.done["think-call"]["response"]["body"]["usage"]  # byte tokens: one per character
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len("<think>" + choice["message"]["reasoning"])
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    thinking = output.done["think-json"]["response"]["body"]["choices"][0]
    assert thinking["finish_reason"] == "length" and thinking["message"]["content"] is None
    assert thinking["message"]["reasoning"]


def test_embeddings_lines_answer_as_the_endpoint_with_the_engines_embeddings(llm, tmp_path):
    """Each input's embedding is `LLM.embed`'s (checked against transformers in test_model_vs_hf),
    in the shape the `openai` client parses, `dimensions` and base64 as the endpoint sends them;
    embeddings lines run beside completions (a file for `splitserve batch` may mix them)."""
    def line(custom_id: str, **body) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": "demo", **body}}

    inputs = ["The batch embeds this.", [5, 6, 7]]
    lines = [line("both", input=inputs), line("short", input=inputs[0], dimensions=4, encoding_format="base64"),
             *batch_lines(2)]
    with ResultLog(tmp_path / "out.jsonl") as output, ResultLog(tmp_path / "errors.jsonl") as errors:
        run_lines(llm.engine, parse_input(as_jsonl(lines)), "demo", output, errors, BlendOptions("blend"))
    expected = llm.embed(inputs)
    both = CreateEmbeddingResponse.model_validate(output.done["both"]["response"]["body"])
    assert [d.index for d in both.data] == [0, 1]
    for got, want in zip(both.data, expected):
        assert got.embedding == pytest.approx(want, abs=1e-6)
    prompt_tokens = len(llm.engine.tokenizer.encode(inputs[0])) + len(inputs[1])
    assert (both.usage.prompt_tokens, both.usage.total_tokens) == (prompt_tokens, prompt_tokens)
    short = output.done["short"]["response"]["body"]["data"][0]["embedding"]
    first = np.array(expected[0][:4])
    assert np.frombuffer(base64.b64decode(short), dtype="<f4") == pytest.approx(first / np.linalg.norm(first), abs=1e-6)
    assert {"req-0", "req-1"} <= output.done.keys() and not errors.done


def test_score_and_rerank_lines_are_the_cosines_of_the_engines_embeddings(llm, results):
    def cosine(a, b) -> float:
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))

    pairs = [("Is 2 + 3 five?", "Yes, it is."), ("Paris", "France")]
    scores = [d["score"] for d in body(results, "score-pairs")["data"]]
    assert scores == pytest.approx([cosine(*llm.embed(list(pair))) for pair in pairs], abs=1e-6)
    [query] = llm.embed(["Is 2 + 3 five?"])
    documents = llm.embed(["Yes, 2 + 3 = 5.", "Bananas are yellow.", "No idea."])
    expected = [cosine(query, d) for d in documents]
    ranked = body(results, "rerank-top")["results"]
    assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["relevance_score"] for r in ranked] == pytest.approx([expected[r["index"]] for r in ranked], abs=1e-6)


def test_with_score_labels_a_rerank_line_scores_each_pair_by_its_label_logits(llm, tmp_path):
    """`splitserve batch --score-label-tokens n y`: a pair is one prompt (the query, then the
    document without special tokens), its score the engine's verdict from the two labels' logits."""
    tokenizer = llm.engine.tokenizer
    labels = tuple(tokenizer.encode(t, add_special_tokens=False)[0] for t in ("n", "y"))
    documents = ["Yes, 2 + 3 = 5.", "Bananas are yellow."]
    line = {"custom_id": "r", "method": "POST", "url": "/v1/rerank",
            "body": {"model": "demo", "query": "Is 2 + 3 five?", "documents": documents}}
    with ResultLog(tmp_path / "out.jsonl") as output, ResultLog(tmp_path / "errors.jsonl") as errors:
        run_lines(llm.engine, parse_input(as_jsonl([line])), "demo", output, errors, BlendOptions("dfs"),
                  score_labels=labels)
    pairs = [tokenizer.encode("Is 2 + 3 five?") + tokenizer.encode(d, add_special_tokens=False) for d in documents]
    logits = [out.embedding for out in llm.generate([{"prompt_token_ids": p} for p in pairs],
                                                    SamplingParams.embedding(label_token_ids=labels))]
    expected = [1 / (1 + np.exp(n - y)) for n, y in logits]
    ranked = output.done["r"]["response"]["body"]["results"]
    assert [r["relevance_score"] for r in ranked] == pytest.approx(sorted(expected, reverse=True), abs=1e-6)
