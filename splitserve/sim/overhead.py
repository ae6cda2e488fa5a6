"""What the serving stack adds to the engine's own iteration times, measured on a running cluster,
so that a simulator driven by an engine profile (`splitserve profile`) predicts what clients of that
cluster see.

The terms, fitted on groups of concurrent requests (one group at a time, so nothing queues, each
after a pause of GROUP_PAUSE_S: a request then meets an idle serving stack, as one arriving at a
lightly loaded cluster does; one sent the instant the previous one ended meets its threads still
awake, and comes back sooner):
- `iteration_s` + `token_s` x (tokens sampled): added to every iteration of a worker. The worker
  loop and its token streams (the actor's asyncio thread, Ray's streaming generator) share the
  engine's process; on CPU that costs each decode step milliseconds, more with more streams.
  First estimate (`fit_overhead`): from each request's median token gap less the profile's decode
  time at its batch (1 alone, 2 in pairs) and mean context, the medians e1 (alone) and e2 (pairs):
  token_s = e2 - e1, iteration_s = e1 - token_s (each at least 0). The terms the simulator gets are
  refitted on groups of up to 16 by replaying them in the simulator (`splitserve.sim.calibrate`).
- `request_s` and `prefill_scale`: the first is added once to every request's latency (the HTTP
  proxy, the ingress, the CLS placement and the worker calls around the iterations); the second
  multiplies every prefill's profiled time (in the worker process the engine's thread shares the
  cores with the actor's own threads, so a prefill takes longer than in `splitserve profile`).
  Fitted on lone requests of several prompt sizes: TTFT less the iteration's other terms, against
  the profiled prefill time, as a Theil-Sen line (the median slope over pairs of different sizes,
  then the median intercept). A split request's first token leaves from the prompt worker as it is
  sampled, so no part of its KV transfer is in its TTFT (the transfer is in its second token's gap).
- `host_cores`, `request_cpu_s` and `stream_cpu_s`: on a host whose cores the workers share with
  the serving stack (Serve's proxy, the ingress, the CLS, the clients), its cores, the CPU seconds
  of each request's path through the stack (part of `request_s`: the rest is waiting, on RPC hops
  and wake-ups) and the CPU seconds the stack spends per token streamed
  (`splitserve.sim.contention`). Measured while the requests above run, from the host's CPU time
  outside the worker processes sampled every 20 ms (`splitserve.sim.host_cpu`), less its idle rate
  read in the pauses between groups: a lone request's window from send to first token is its
  path's CPU; what every group's window spent beyond its requests' paths, over their tokens, is
  the per-token term (none left is an error: the host was busy with other work). On such a host
  the path's CPU is work on its cores (on arrival), so under load it stretches as the workers'
  iterations do.
The simulator applies exactly these terms (`Scenario.overhead`), so its unloaded latency equals
the measured one; what it predicts under load (queueing, batching, pool moves) is its own.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import secrets
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from splitserve.bench.client import send, server_info
from splitserve.bench.report import RequestRecord
from splitserve.bench.workload import RequestSpec

DEFAULT_PROMPT_SIZES = (32, 128, 256, 512)
DEFAULT_OUTPUT_TOKENS = 32
GROUP_PAUSE_S = 0.5  # idle time before each group
TERMS = ("request_s", "iteration_s", "token_s", "host_cores", "request_cpu_s", "stream_cpu_s", "prefill_scale")


@dataclass(frozen=True)
class ServingOverhead:
    request_s: float = 0.0    # once per request, on its first token and so on every later one
    iteration_s: float = 0.0  # on every worker iteration
    token_s: float = 0.0      # on a worker iteration, per token it samples (each goes out on a stream)
    host_cores: float = 0.0   # > 0: the workers share a host of this many cores with the serving stack
    request_cpu_s: float = 0.0  # on that host, the stack's CPU of request_s (at most it)
    stream_cpu_s: float = 0.0  # on that host, the stack's CPU per token streamed
    prefill_scale: float = 1.0  # a prefill takes this many times its profiled time

    def __post_init__(self) -> None:
        for name in TERMS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and value >= 0):
                unit = " of seconds" if name.endswith("_s") else ""
                raise ValueError(f"{name} must be a finite number{unit} >= 0, got {value!r}")
        if self.prefill_scale <= 0:
            raise ValueError(f"prefill_scale must be > 0, got {self.prefill_scale!r}")
        if self.request_cpu_s > self.request_s:
            raise ValueError(f"request_cpu_s ({self.request_cpu_s!r}) must be at most request_s ({self.request_s!r}): "
                             "it is the CPU of the request's path, part of its time")

    @classmethod
    def load(cls, path: str | Path) -> ServingOverhead:
        return cls.from_dict(json.loads(Path(path).read_text()), str(path))

    @classmethod
    def from_dict(cls, data: object, where: str) -> ServingOverhead:
        """The terms saved in `data` (a `splitserve profile --url` file's object); `where` names it in errors."""
        if not isinstance(data, dict) or set(data) - {*TERMS, "requests"}:
            raise ValueError(f"{where}: expected an object with {', '.join(TERMS)} (splitserve profile --url)")
        overhead = cls(**{name: data[name] for name in TERMS if name in data})
        if overhead.host_cores and "request_cpu_s" not in data:
            raise ValueError(f"{where}: a shared host's terms without request_cpu_s (measured before it was): "
                             "measure again with splitserve profile --url --shared-host")
        return overhead

    def save(self, path: str | Path, num_requests: int) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**asdict(self), "requests": num_requests}, indent=2) + "\n")
        return path


def fit_overhead(lone: list[RequestRecord], pairs: list[RequestRecord], prompt_perf, token_perf) -> ServingOverhead:
    """The terms but the host's (see the module docstring) from completed requests of >= 2 tokens sent one
    at a time (`lone`) and two at a time (`pairs`), with the performance models of the prompt
    worker (prefill) and of the token worker (decode)."""
    lone_extra = _decode_excess(lone, 1, token_perf)
    token = max(0.0, _decode_excess(pairs, 2, token_perf) - lone_extra)
    iteration = max(0.0, lone_extra - token)
    return fit_prefill(lone, ServingOverhead(iteration_s=iteration, token_s=token), prompt_perf)


def fit_prefill(lone: list[RequestRecord], decode: ServingOverhead, prompt_perf) -> ServingOverhead:
    """`decode` (its iteration_s and token_s) with request_s and prefill_scale fitted on the TTFTs of
    requests sent one at a time (`lone`)."""
    iteration, token = decode.iteration_s, decode.token_s
    points = []  # (profiled prefill, TTFT less the iteration's other terms)
    for r in _usable(lone):
        prefill = prompt_perf.prefill_time(r.prompt_tokens)
        points.append((prefill, r.ttft_s - iteration - token))
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(points, 2) if x1 != x2]
    scale = statistics.median(slopes) if slopes else 1.0
    scale = scale if scale > 0 else 1.0  # a flat or falling line says nothing about the prefill's speed
    request = max(0.0, statistics.median(y - scale * x for x, y in points))
    return replace(decode, request_s=request, request_cpu_s=min(decode.request_cpu_s, request), prefill_scale=scale)


def _usable(records: list[RequestRecord]) -> list[RequestRecord]:
    usable = [r for r in records if r.ok and len(r.tbt_s) >= 1]
    if not usable:
        raise ValueError("no completed request with two or more tokens to fit the overhead on")
    return usable


def _decode_excess(records: list[RequestRecord], batch: int, token_perf) -> float:
    """Median over requests of (median token gap - profiled decode time of `batch` sequences at
    the request's mean context)."""
    return statistics.median(statistics.median(r.tbt_s) - token_perf.decode_time(batch, r.prompt_tokens
                                                                                  + r.output_tokens / 2)
                             for r in _usable(records))


def measure_requests(url: str, prompt_sizes=DEFAULT_PROMPT_SIZES, output_tokens: int = DEFAULT_OUTPUT_TOKENS,
                     repeats: int = 3, concurrency: int = 1, model: str | None = None, api_key: str | None = None,
                     seed: int | None = None) -> list[RequestRecord]:
    """Groups of `concurrency` identical-length streamed requests sent together, one group at a
    time after a pause of GROUP_PAUSE_S: every prompt size `repeats` times, interleaved, after one
    warm-up group that is not returned. Prompts are random token ids from `seed` (default: a fresh
    one, so no prompt hits a prefix cache that an earlier run filled). The records' start_s are
    time.perf_counter() readings, as `host_cpu.trace_while`'s samples are."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency!r}")
    seed = secrets.randbits(32) if seed is None else seed
    return asyncio.run(_measure(url, prompt_sizes, output_tokens, repeats, concurrency, model, api_key, seed))


async def send_group(http: httpx.AsyncClient, url: str, model: str, specs: list[RequestSpec], seed: int,
                     t0: float) -> list[RequestRecord]:
    """`specs` sent together after a pause of GROUP_PAUSE_S (the stack idle, as the calibration
    meets it); their records, times from `t0`."""
    await asyncio.sleep(GROUP_PAUSE_S)
    return await asyncio.gather(*(send(http, url, model, spec, seed, t0) for spec in specs))


def _client(api_key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(timeout=600, headers=headers)


async def _measure(url, prompt_sizes, output_tokens, repeats, concurrency, model, api_key, seed) -> list:
    async with _client(api_key) as http:
        info = await server_info(http, url, model)
        sizes = [size for _ in range(repeats) for size in prompt_sizes]
        records = []
        for group, size in enumerate([min(prompt_sizes)] + sizes):
            specs = [RequestSpec(index=group * concurrency + i, arrival_s=0.0, prompt_tokens=size,
                                 output_tokens=output_tokens) for i in range(concurrency)]
            sent = await send_group(http, url, info.model, specs, seed, 0.0)
            for record in sent:
                if record.error is not None:
                    raise RuntimeError(f"request of {size} prompt tokens to {url} failed: {record.error}")
            records.extend(sent if group else ())
    return records
