"""bench_gpu.py's sections that time engine steps (its docstring defines their rows): decode
(and decode-fp8, decode-sync, its variants) and prefill (and prefill-triton); each runs in a
process of its own."""
from __future__ import annotations

import os
import random
import statistics
import time

import torch

from call_timer import timed  # this script's folder, as the one below
from gpu_roofline import decode_kv_bytes, decode_weight_bytes, prefill_flops


def random_prompt(rng: random.Random, c: dict, n: int) -> list[int]:
    return [rng.randrange(3, c["vocab_size"]) for _ in range(n)]


def started(build):
    """(what build() returns, its seconds): an engine's start-up is its weights drawn, its memory
    profiled, its kernels compiled and its CUDA graphs captured."""
    start = time.perf_counter()
    built = build()
    return built, time.perf_counter() - start


def timed_steps(engine, count: int, clock: ForwardClock | None = None) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        engine.step()  # returns after the sampled ids reach the host: the step has run
        times.append(time.perf_counter() - start)
        if clock is not None:
            clock.close_step()
    return times


class ForwardClock:
    """Seconds of the forwards each step ran (with async scheduling, the next iteration's, queued
    before the step returned): on CUDA between events recorded on the stream around them, read
    once `steps` is asked for (it waits for the device), else wall time."""

    def __init__(self, runner):
        self._steps: list[list] = []
        self._pending: list = []
        forward = runner.forward

        def timed_on_device(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = forward(*args, **kwargs)
            end.record()
            self._pending.append((start, end))
            return out

        runner.forward = timed_on_device if runner.device.type == "cuda" else timed(forward, self._pending.append)

    def close_step(self) -> None:
        self._steps.append(list(self._pending))
        self._pending.clear()  # in place: the wrapper appends to this list

    @property
    def steps(self) -> list[float]:
        return [sum(p if isinstance(p, float) else _elapsed(*p) for p in step) for step in self._steps]

    def reset(self) -> None:
        """Forget every forward so far, the untimed steps' too (they were never closed)."""
        self._steps.clear()
        self._pending.clear()


def _elapsed(start, end) -> float:
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def decode_section(model: str, s: dict, args, kv_cache_dtype: str = "auto", async_scheduling: bool = True,
                   section: str = "decode") -> list[dict]:
    from splitserve import LLMEngine, SamplingParams

    c, warm = s["config"], 3
    engine, startup = started(lambda: LLMEngine(
        model, policy="token", load_format="dummy", enable_prefix_caching=False, max_num_seqs=max(s["batches"]),
        max_model_len=max(s["contexts"]) + warm + args.steps + 16, kv_cache_dtype=kv_cache_dtype,
        async_scheduling=async_scheduling, **s["engine"]))
    cache = engine.kv_cache
    if cache.data.dtype == torch.uint8:
        cache.data.random_(0, 256)  # FP8 codes, any
    else:
        cache.data.normal_()
    clock = ForwardClock(engine.runner)
    capacity = engine.block_manager.num_free_blocks * engine.kv_cache.block_size
    element, kv_element = cache.dtype.itemsize, cache.data.element_size()
    # as a cluster's token worker runs a request without stop strings: the ingress decodes the ids
    params = SamplingParams(temperature=0, max_tokens=warm + args.steps + 2, ignore_eos=True).ids_only()
    rng, rows = random.Random(0), []
    for context in s["contexts"]:
        for batch in s["batches"]:
            row = {"section": section, "batch": batch, "context": context, "kv_cache": cache.encoding,
                   "async_scheduling": async_scheduling, "startup_s": startup}
            block = engine.kv_cache.block_size
            needed = batch * -(-(context + warm + args.steps + 1) // block) * block
            if needed > capacity:
                rows.append({**row, "skipped": f"needs {needed} KV tokens; the cache holds {capacity}"})
                continue
            ids = [f"d{batch}-{context}-{i}" for i in range(batch)]
            for request_id in ids:
                engine.reserve_import(request_id, random_prompt(rng, c, context), params)
                engine.complete_import(request_id, rng.randrange(3, c["vocab_size"]))
            timed_steps(engine, warm)
            clock.reset()
            times = timed_steps(engine, args.steps, clock)
            forwards = clock.steps  # each read waits for the device: once
            forward = statistics.median(forwards)
            for request_id in ids:
                engine.abort(request_id)
            step = statistics.median(times)
            read = decode_weight_bytes(c, batch, element) + decode_kv_bytes(c, batch, context + warm + args.steps / 2,
                                                                            kv_element)
            rows.append({**row, "step_ms": step * 1e3, "step_ms_min": min(times) * 1e3,
                         "step_ms_max": max(times) * 1e3, "forward_ms": forward * 1e3,
                         "outside_forward_ms": statistics.median(t - f for t, f in zip(times, forwards)) * 1e3,
                         "tokens_per_s": batch / step, "bytes_per_step": read, "bytes_per_s": read / step})
    return rows


def fp8_decode_section(model: str, s: dict, args) -> list[dict]:
    return decode_section(model, s, args, "fp8", section="decode-fp8")


def sync_decode_section(model: str, s: dict, args) -> list[dict]:
    return decode_section(model, s, args, async_scheduling=False, section="decode-sync")


def prefill_section(model: str, s: dict, args, attention_backend: str = "auto",
                    section: str = "prefill") -> list[dict]:
    from splitserve import LLMEngine, SamplingParams

    c = s["config"]
    engine, startup = started(lambda: LLMEngine(
        model, policy="prefill_first", load_format="dummy", enable_prefix_caching=False, max_num_seqs=1,
        prompt_token_budget=max(s["prefill"]), max_model_len=max(s["prefill"]) + 16,
        **{**s["engine"], "attention_backend": attention_backend}))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng, rows, count = random.Random(1), [], 0
    for n in s["prefill"]:
        times = []
        for _ in range(1 + args.repeats):  # the first one warms this length up
            count += 1
            engine.add_request(f"p{count}", random_prompt(rng, c, n), params)
            times += timed_steps(engine, 1)
            if engine.has_unfinished_requests():
                raise RuntimeError(f"a {n}-token prompt did not prefill in one step")
        times = times[1:]
        step = statistics.median(times)
        rows.append({"section": section, "attention": engine.runner.backend.name, "batch": 1, "context": n,
                     "startup_s": startup, "step_ms": step * 1e3,
                     "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3, "tokens_per_s": n / step,
                     "flops": prefill_flops(c, n), "flops_per_s": prefill_flops(c, n) / step})
    return rows


def triton_prefill_section(model: str, s: dict, args) -> list[dict]:
    if s["engine"]["device"] == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return [{"section": "prefill-triton",
                 "skipped": "the Triton kernels run on a CPU only under TRITON_INTERPRET=1"}]
    return prefill_section(model, s, args, "triton", "prefill-triton")
