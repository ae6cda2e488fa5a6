"""How long one response with many tokens' logprobs holds the ingress's event loop, where every
other stream of the replica waits its turn: built and encoded as shipped (past
`large_bodies.LOGPROB_TOKENS_ON_LOOP` tokens, in a thread) against all of it on the loop.

A scripted run plays --tokens output tokens in deltas of 16 (as a worker sends them), each with
--top alternatives, through the ingress's own `ChoicesResponse` over a byte tokenizer, for a
whole completions body and a whole chat body (`whole()`: built and encoded to the bytes sent), a
`/v1/responses` stream (its last four events each repeat every logprob of the text), and a
completions echo of a --tokens prompt, whole and streamed (its prompt's logprobs come in one delta
and leave in one chunk). A 1 ms ticker on the same loop records every gap between its
turns; a row has the response's time, the longest gap and the 99th percentile. Each case runs
--repeats times per way, the two ways interleaved; medians over the repeats.

Then the CLS's loop: what recording one finished request of --tokens tokens (in deltas of 16)
holds it for, its times between tokens counted into the TBT buckets at the ingress
(`BucketCounts`, as shipped) against each gap observed into prometheus_client's Histogram there.

    python scripts/bench_loop_stalls.py                    # ~1 minute on 2 shared cores
    python scripts/bench_loop_stalls.py --tokens 20000 --top 5 --json loop_stalls.json
    python scripts/bench_loop_stalls.py --no-gc           # what is left without the collector's passes
    python scripts/bench_loop_stalls.py --no-freeze       # a replica with RAY_SERVE_FREEZE_GC_ON_STARTUP=0

The start-up heap (the imports: Ray, torch, FastAPI, ...) is frozen out of the collector's passes
first, as Ray Serve does once a replica has started; unfrozen, each full pass also walks its
~240k objects.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram

from splitserve.api.responses_events import ResponseEvents
from splitserve.api.responses_request import ResponsesRequest
from splitserve.api.visible_text import TextStream
from splitserve.cluster import large_bodies
from splitserve.cluster.bucket_counts import BucketCounts
from splitserve.cluster.choices_response import ChoicesResponse
from splitserve.cluster.metrics import LATENCY_BUCKETS, ClusterMetrics, RequestObservation, SLOBounds
from splitserve.cluster.run_response import RunResponse
from splitserve.cluster.worker_loop import TokenDelta
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import ByteTokenizer
from splitserve.machine import cpu_name

DELTA_TOKENS = 16
CASES = ("completion whole", "chat whole", "responses stream", "echo whole", "echo stream")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20_000, help="output (or echoed prompt) tokens (20000)")
    p.add_argument("--top", type=int, default=5, choices=range(1, 21), metavar="1..20",
                   help="alternatives per token (5)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each case each way (3)")
    p.add_argument("--no-gc", action="store_true", help="the cyclic collector off: which stalls are its passes")
    p.add_argument("--no-freeze", action="store_true",
                   help="leave the start-up heap in the collector's passes (a replica that does not freeze it)")
    p.add_argument("--json", type=Path, help="write the rows here")
    return p.parse_args(argv)


class ScriptedRun:
    """What the ingress reads of a dispatch Run: the deltas a worker would send, nothing placed."""

    def __init__(self, prompt: list[int], deltas: list[TokenDelta], params: SamplingParams):
        self.request_id, self.prompt, self.params, self.tokens = "cmpl-bench", prompt, params, []
        self.prompt_logprobs = self.cached_tokens = self.cache_write_tokens = None
        self.failures = self.refusals = 0
        self.prediction_tokens = (0, 0)
        self._deltas, self.aborted = deltas, False

    async def deltas(self):
        for delta in self._deltas:
            if self.aborted:  # as a worker stops streaming a run the ingress aborted
                return
            self.tokens += delta.token_ids
            self.prompt_logprobs = delta.prompt_logprobs
            yield delta
            await asyncio.sleep(0)  # a worker's deltas arrive one event at a time

    async def abort(self) -> None:
        self.aborted = True


def alternatives(token: int, top: int) -> dict[int, float]:
    """The sampled token and `top` others, each its own printable byte (distinct texts)."""
    return {token: -0.1, **{48 + j: -1.0 - j for j in range(top)}}


def response(case: str, tokens: int, top: int) -> ChoicesResponse:
    kind, echo = ("completion", case.startswith("echo")) if case.startswith(("completion", "echo")) else ("chat", False)
    params = SamplingParams(max_tokens=1 if echo else tokens, logprobs=top)
    text = [97 + i % 26 for i in range(tokens)]
    if echo:
        prompt = text
        deltas = [TokenDelta((98,), "length", logprobs=(alternatives(98, top),),
                             prompt_logprobs=(None, *(alternatives(t, top) for t in prompt[1:])))]
    else:
        prompt = [72, 105]
        deltas = [TokenDelta(tuple(text[i:i + DELTA_TOKENS]), "length" if i + DELTA_TOKENS >= tokens else None,
                             logprobs=tuple(alternatives(t, top) for t in text[i:i + DELTA_TOKENS]))
                  for i in range(0, tokens, DELTA_TOKENS)]
    run = ScriptedRun(prompt, deltas, params)
    reply = RunResponse(kind, run, "demo", TextStream(ByteTokenizer(), params, prompt),
                        echo=bytes(prompt).decode() if echo else None, num_top=top)
    return ChoicesResponse([[reply]], 1)


async def answer(case: str, reply: ChoicesResponse, top: int) -> int:
    """Bytes the client would get."""
    if case.startswith("responses"):
        request = ResponsesRequest(model="demo", input="x", include=["message.output_text.logprobs"], top_logprobs=top)
        return sum([len(event) async for event in reply.response_events(ResponseEvents(request, "resp_bench", 0))])
    if case.endswith("stream"):
        return sum([len(event) async for event in reply.sse(include_usage=True)])
    return len((await reply.whole()).body)


def measure(case: str, tokens: int, top: int) -> dict:
    async def timed():
        reply = response(case, tokens, top)
        gaps, stop = [], False

        async def tick():
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.01)
        gaps.clear()
        start = time.perf_counter()
        size = await answer(case, reply, top)
        took = time.perf_counter() - start
        stop = True
        await ticker
        gaps.sort()
        return {"response_s": took, "longest_gap_s": gaps[-1], "p99_gap_s": gaps[int(0.99 * (len(gaps) - 1))],
                "bytes": size}

    return asyncio.run(timed())


def run(args: argparse.Namespace) -> list[dict]:
    threshold = large_bodies.LOGPROB_TOKENS_ON_LOOP
    rows = []
    for case in CASES:
        samples = {"thread": [], "loop": []}
        for _ in range(args.repeats):
            for way, bound in (("thread", threshold), ("loop", 10**12)):
                large_bodies.LOGPROB_TOKENS_ON_LOOP = bound
                try:
                    samples[way].append(measure(case, args.tokens, args.top))
                finally:
                    large_bodies.LOGPROB_TOKENS_ON_LOOP = threshold
        for way, runs in samples.items():
            row = {"case": case, "way": way, "tokens": args.tokens, "top": args.top, "bytes": runs[0]["bytes"]}
            row.update({key: statistics.median(r[key] for r in runs)
                        for key in ("response_s", "longest_gap_s", "p99_gap_s")})
            rows.append(row)
    return rows


def cls_record(tokens: int, repeats: int) -> dict:
    """Median ms the CLS spends recording one request of `tokens` tokens, each way."""
    gaps = [0.0 if i % DELTA_TOKENS else 0.02 for i in range(1, tokens)]
    counted, each = [], []
    for _ in range(repeats):
        metrics = ClusterMetrics("demo", SLOBounds(ttft=1.0, tbt=0.05, e2e=60.0))
        buckets = BucketCounts.over(LATENCY_BUCKETS)
        for gap in gaps[DELTA_TOKENS - 1::DELTA_TOKENS]:  # the ingress: one count a delta, its own tokens at once
            buckets.add(gap)
        buckets.add(0.0, len(gaps) - buckets.count)
        observation = RequestObservation("completed", 100, tokens, ttft=0.1, tbt=buckets, e2e=10.0)
        start = time.perf_counter()
        metrics.record_requests([observation])
        counted.append(time.perf_counter() - start)
        histogram = Histogram("tbt_seconds", "TBT", ("model",), buckets=LATENCY_BUCKETS,
                              registry=CollectorRegistry()).labels("demo")
        start = time.perf_counter()
        for gap in gaps:
            histogram.observe(gap)
        each.append(time.perf_counter() - start)
    return {"tokens": tokens, "counted_ms": statistics.median(counted) * 1e3,
            "each_gap_ms": statistics.median(each) * 1e3}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gc.collect()
    if not args.no_freeze:
        gc.freeze()  # as a Serve replica at the end of its start-up (RAY_SERVE_FREEZE_GC_ON_STARTUP, on by default)
    if args.no_gc:
        gc.disable()
    try:
        rows = run(args)
    finally:
        gc.enable()
        gc.unfreeze()
    cls = cls_record(args.tokens, args.repeats)
    print(f"{'case':<18}{'way':<8}{'response s':>11}{'longest gap s':>15}{'p99 gap s':>11}{'MB':>7}")
    for r in rows:
        print(f"{r['case']:<18}{r['way']:<8}{r['response_s']:>11.3f}{r['longest_gap_s']:>15.3f}"
              f"{r['p99_gap_s']:>11.4f}{r['bytes'] / 1e6:>7.1f}")
    print(f"CLS recording a {cls['tokens']}-token request: {cls['counted_ms']:.3f} ms with its gaps counted at "
          f"the ingress, {cls['each_gap_ms']:.2f} ms observing each gap")
    if args.json:
        meta = {"cpu": cpu_name(), "python": platform.python_version(), "repeats": args.repeats, "gc": not args.no_gc,
                "start_up_heap_frozen": not args.no_freeze}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "cls_record": cls}, indent=1))


if __name__ == "__main__":
    main()
