"""The OpenAI Batch API's JSONL formats: input lines (`custom_id`, `method`, `url`, `body`) checked
up front, each body prepared like an HTTP request of its endpoint, and the result lines."""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from splitserve.api import client_json
from splitserve.api.chat_parsers import ChatParsers
from splitserve.api.embedding_request import PreparedEmbeddings
from splitserve.api.errors import RequestError, error_body
from splitserve.api.limits import RequestLimits
from splitserve.api.prepared_request import ConstraintCheck, PreparedRequest, prepare_request
from splitserve.api.request_models import ModelNames
from splitserve.api.responses_bodies import response_from_chat
from splitserve.api.pooled_requests import POOLED_KINDS, prepare_pooled
from splitserve.api.score_request import PreparedScores
from splitserve.api.usage import Usage
from splitserve.batch.results import ResultLog
from splitserve.engine.tokenizer import Tokenizer

ENDPOINTS = {"/v1/completions": "completion", "/v1/chat/completions": "chat", "/v1/responses": "responses",
             "/v1/embeddings": "embedding", "/v1/score": "score", "/v1/rerank": "rerank"}
MAX_REPORTED_ERRORS = 100

# a generation line's, or one answered from its texts' embeddings (each text a prompt-only request)
Prepared = PreparedRequest | PreparedEmbeddings | PreparedScores


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based line number in the input file
    custom_id: str
    kind: str  # ENDPOINTS' values
    body: dict

    @property
    def runs_as(self) -> str:
        """The kind of request its prompts run as: a Responses line's, the chat completion it asks
        for; a score or rerank line's texts, embeddings."""
        return {"responses": "chat", "score": "embedding", "rerank": "embedding"}.get(self.kind, self.kind)


class InputFileError(ValueError):
    """The input file is not a valid batch; `errors` are OpenAI batch error objects."""

    def __init__(self, errors: list[dict]):
        super().__init__("; ".join(f"line {e['line']}: {e['message']}" if e.get("line") else e["message"]
                                   for e in errors[:5]))
        self.errors = errors


def parse_input(data: bytes, endpoint: str | None = None, max_lines: int = RequestLimits.max_batch_lines
                ) -> list[BatchLine]:
    """Every line of a batch input file, or InputFileError listing what is wrong (all lines must
    be JSON objects with a unique `custom_id`, `method` POST and the batch's `url`; at most
    `max_lines` of them)."""
    lines, errors, seen = [], [], set()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not part of line 1
    except UnicodeDecodeError:
        raise InputFileError([_error("invalid_file", "the input file is not UTF-8 text")]) from None
    # lines end at \n alone (JSON Lines): \u2028 and the like are text inside a JSON string
    for number, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        if len(lines) + len(errors) >= max_lines:
            raise InputFileError([_error("too_many_requests", f"the input file has more than {max_lines} requests, "
                                         "this server's limit per batch")])
        try:
            line = _parse_line(raw, number, endpoint, seen)
        except ValueError as problem:
            errors.append(_error("invalid_request", str(problem), number, getattr(problem, "param", None)))
            if len(errors) >= MAX_REPORTED_ERRORS:
                break
            continue
        lines.append(line)
        seen.add(line.custom_id)
    if not lines and not errors:
        errors.append(_error("empty_file", "the input file has no requests"))
    if errors:
        raise InputFileError(errors)
    return lines


class _LineError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _parse_line(raw: str, number: int, endpoint: str | None, seen: set[str]) -> BatchLine:
    try:
        item = client_json.loads(raw)
    except ValueError as exc:
        raise _LineError(f"not valid JSON: {exc}") from None
    if not isinstance(item, dict):
        raise _LineError(f"a line must be a JSON object, got {type(item).__name__}")
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineError("custom_id must be a non-empty string", "custom_id")
    if custom_id in seen:
        raise _LineError(f"custom_id {custom_id!r} is used by an earlier line; custom_ids must be unique", "custom_id")
    if method != "POST":
        raise _LineError(f"method must be POST, got {method!r}", "method")
    if url not in ENDPOINTS:
        raise _LineError(f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}", "url")
    if endpoint is not None and url != endpoint:
        raise _LineError(f"url {url!r} differs from the batch's endpoint {endpoint!r}", "url")
    if not isinstance(body, dict):
        raise _LineError("body must be a JSON object", "body")
    if body.get("stream"):
        raise _LineError("body.stream: a batch request cannot stream", "body.stream")
    return BatchLine(number, custom_id, ENDPOINTS[url], body)


def _error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass(frozen=True)
class LineRules:
    """What a batch's lines are checked against, as the HTTP endpoints check requests: the model
    served and the server's bounds. A line whose body names no `priority` runs at `priority`
    (`batch.priority`)."""
    tokenizer: Tokenizer
    model: ModelNames
    max_model_len: int
    hidden_size: int  # the most `dimensions` an embeddings line may ask
    limits: RequestLimits = RequestLimits()
    check_constraint: ConstraintCheck | None = None
    parsers: ChatParsers = ChatParsers()
    priority: int = 0
    score_labels: tuple[int, ...] = ()  # a token-answering reranker's label ids (score_label_tokens)


def prepare(line: BatchLine, rules: LineRules) -> Prepared:
    """Tokenize and check one request as its endpoint would (RequestError on a bad body)."""
    raw = json.dumps(line.body).encode()
    if line.kind in POOLED_KINDS:
        prepared = prepare_pooled(line.kind, raw, rules.tokenizer, rules.model, rules.max_model_len, rules.limits,
                                  rules.hidden_size, rules.score_labels)
    else:
        prepared = prepare_request(line.kind, raw, rules.tokenizer, rules.model, rules.max_model_len, rules.limits,
                                   rules.check_constraint, rules.parsers)
    if not rules.priority or "priority" in line.body:
        return prepared
    return replace(prepared, params=[replace(p, priority=rules.priority) for p in prepared.params])


def prepare_pending(lines: list[BatchLine], rules: LineRules, output: ResultLog, errors: ResultLog,
                    on_result: Callable[[bool], None]) -> tuple[list[tuple[BatchLine, Prepared]], dict[int, int]]:
    """The lines that tokenize and check (a bad one's error is logged now, unless it already
    was), keyed by position, and the output lengths of those already done (to skip, and to serve
    as samples)."""
    jobs, finished = [], {}
    for line in lines:
        done = output.done.get(line.custom_id) or errors.done.get(line.custom_id)
        try:
            prepared = prepare(line, rules)
        except RequestError as error:
            if done is None:
                errors.append(error_line(line.custom_id, error))
                on_result(False)
            continue
        if done is not None:
            finished[len(jobs)] = completion_tokens(done)
        jobs.append((line, prepared))
    return jobs, finished


def result_line(custom_id: str, status_code: int, body: dict) -> dict:
    """One output (or error) file line; `body` is the endpoint's response or error body."""
    return _line(custom_id, {"status_code": status_code, "request_id": body.get("id", f"req_{uuid.uuid4().hex}"),
                             "body": body})


def answer_line(line: BatchLine, prepared: Prepared, body: dict) -> dict:
    """A line's output line, from the response body computed for it (a Responses line's: the
    Response made of the chat completion it asked for)."""
    return result_line(line.custom_id, 200, body if line.kind != "responses"
                       else response_from_chat(prepared.responses, body))


def error_line(custom_id: str, error: RequestError) -> dict:
    return result_line(custom_id, error.status, error_body(error))


def expired_line(custom_id: str) -> dict:
    """The error file's line for a request its batch's window ended before (OpenAI's shape: no
    response, the error `batch_expired`)."""
    return _line(custom_id, None, {"code": "batch_expired",
                                   "message": "the batch's completion window ended before this request ran"})


def _line(custom_id: str, response: dict | None, error: dict | None = None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def completion_tokens(line: dict) -> int:
    """A result line's output length (0 for an error)."""
    usage = (line.get("response") or {}).get("body", {}).get("usage")
    return Usage.from_body(usage).completion_tokens if usage else 0
