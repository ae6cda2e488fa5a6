"""The load generator: replays a workload against an OpenAI-compatible server, streaming, and
times every token as the client sees it.

Each request is sent at its arrival time (open loop: a slow server does not slow the arrivals),
as a completion whose prompt is a list of token ids of exactly the workload's length (requests
that share prefix blocks share those tokens, so a server's prefix cache sees the trace's reuse), with
`max_tokens` = the output length and `ignore_eos` (forced output lengths, as Splitwise does).
`stream_options.continuous_usage_stats` makes every chunk carry the running token count, so
tokens that arrive together in one chunk share an arrival time.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import numpy as np

from splitserve.bench.report import RequestRecord
from splitserve.bench.workload import RequestSpec

TOKEN_ID_RANGE = (10, 250)  # ids every tokenizer has (bytes / byte fallbacks); the demo model's vocab is 259
# A block's tokens come from entropy [seed, hash id, BLOCK_STREAM], a request's own from [seed, index]:
# the nonzero last word keeps the two apart (numpy's SeedSequence pads short entropy with zeros).
BLOCK_STREAM = 0xB10C
FRESH_PROMPTS = 1_000_003  # the prompt seeds of successive replays of one workload lie this far apart


class ServerInfo:
    def __init__(self, model: str, max_model_len: int | None):
        self.model, self.max_model_len = model, max_model_len


def prompt_ids(spec: RequestSpec, seed: int) -> list[int]:
    """`spec.prompt_tokens` ids: its prefix blocks' tokens, a function of (seed, hash id) alone, then
    tokens of the request's own."""
    blocks = spec.prefix_blocks[:-(-spec.prompt_tokens // spec.block_tokens)] if spec.prefix_blocks else ()
    shared = [t for h in blocks for t in _random_ids([seed, h, BLOCK_STREAM], spec.block_tokens)][:spec.prompt_tokens]
    return shared + _random_ids([seed, spec.index], spec.prompt_tokens - len(shared))


def fresh_prompt_seed(seed: int, run: int) -> int:
    """The prompt seed of the `run`-th replay of a workload of `seed` (run 0: `seed` itself). Replays
    on one cluster then share no prompt: none is served from a prefix cache an earlier one filled."""
    return seed + FRESH_PROMPTS * run


def _random_ids(entropy: list[int], size: int) -> list[int]:
    return np.random.default_rng(entropy).integers(*TOKEN_ID_RANGE, size=size).tolist()


async def server_info(http: httpx.AsyncClient, url: str, model: str | None) -> ServerInfo:
    """The served model (the first one unless named) and its context length, from /v1/models."""
    response = await http.get(f"{url}/v1/models")
    response.raise_for_status()
    models = response.json()["data"]
    chosen = next((m for m in models if m["id"] == model), None) if model else models[0]
    if chosen is None:
        raise ValueError(f"model {model!r} is not served at {url} (it serves {[m['id'] for m in models]})")
    return ServerInfo(chosen["id"], chosen.get("max_model_len"))


async def send(http: httpx.AsyncClient, url: str, model: str, spec: RequestSpec, seed: int, t0: float,
               temperature: float = 0.0) -> RequestRecord:
    """One streamed request; its record (times relative to the run start `t0` and to its own send)."""
    body = {"model": spec.adapter or model, "prompt": prompt_ids(spec, seed), "max_tokens": spec.output_tokens,
            "stream": True, "ignore_eos": True, "temperature": temperature,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if spec.priority:
        body["priority"] = spec.priority
    start = time.perf_counter()
    times: list[float] = []
    status, error, cached = None, None, None
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            status = response.status_code
            if status != 200:
                error = (await response.aread()).decode(errors="replace")[:500]
            else:
                error, cached = await _read_stream(response, start, times)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    return RequestRecord(index=spec.index, prompt_tokens=spec.prompt_tokens, output_tokens=len(times),
                         requested_output_tokens=spec.output_tokens, start_s=start - t0,
                         ttft_s=times[0] if times else None, token_times_s=tuple(times),
                         e2e_s=end - start if error is None else None, error=error, status=status,
                         cached_tokens=cached, priority=spec.priority)


async def _read_stream(response: httpx.Response, start: float, times: list[float]) -> tuple[str | None, int | None]:
    """Append each token's arrival time; returns an error message (None when the stream ended
    well) and the prompt tokens the server's usage said its prefix cache held (None: it did not say)."""
    cached = None
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return None, cached
        now = time.perf_counter() - start
        event = json.loads(line[6:])
        if "error" in event:
            return event["error"].get("message", "stream error"), cached
        usage = event.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
        if event.get("choices") and "completion_tokens" in usage:
            times.extend([now] * (usage["completion_tokens"] - len(times)))
    return "the stream ended without [DONE]", cached


async def replay(url: str, requests: list[RequestSpec], model: str, seed: int = 0, api_key: str | None = None,
                 on_done: Callable[[RequestRecord], None] | None = None,
                 timeout: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time; returns the records (in request order) and the
    run's duration (first send to last completion)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as http:
        t0 = time.perf_counter()

        async def at_arrival(spec: RequestSpec) -> RequestRecord:
            await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - t0)))
            record = await send(http, url, model, spec, seed, t0)
            if on_done is not None:
                on_done(record)
            return record

        records = await asyncio.gather(*(at_arrival(spec) for spec in requests))
        return list(records), time.perf_counter() - t0


async def fetch_server_info(url: str, model: str | None, api_key: str | None = None) -> ServerInfo:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=60, headers=headers) as http:
        return await server_info(http, url, model)
