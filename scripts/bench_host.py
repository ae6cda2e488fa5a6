"""The engine's host time per decode step: what the CPU spends on a step outside the model
(scheduling, the step's inputs, sampling, outputs and their detokenization).

On a GPU a decode step is a graph replay the host launches and then waits on for the sampled
ids; the engine does not overlap its own Python with the device, so this time adds to every
step's device time. An H100 runs a Llama-3-8B decode step at batch 64 and 1k tokens of context in
about 7 ms, so each millisecond here costs over a tenth of that step's MBU.

Measured here on the CPU with a model too small to matter (one layer, hidden 16; a 1024-token
vocabulary whose tokenizer decodes every id to a word): the model's forward and its logits are
timed apart and subtracted from each `LLMEngine.step()`. What is left is host work; only the
sampler's tensor ops on [batch, 1024] logits, which a GPU runs on the device, are counted in it.
B sequences with C tokens of context enter the token-policy engine through its import path (as
from a prompt worker), then decode greedily; steps are timed at the start of their outputs and
again once each has --output-len tokens (the work that grows with the output shows there). Each
is measured twice: as a cluster's token worker runs requests without stop strings ("ids": the
ingress decodes the ids, `SamplingParams.ids_only`), and with the engine decoding the text
("text": `LLM.generate`, or a request with stop strings).

Each is also run both ways of scheduling (`EngineConfig.async_scheduling`, --scheduling): "sync",
where a step is built after the last one's outputs, and "async", where it is queued before them.
What a GPU would wait on is the host's work between reading one iteration's sampled ids and
starting the next one's forward: `device_idle_ms`, the median of that gap (on a GPU the forward,
logits and sampling are queued in microseconds, and the rest of the step's host work overlaps
the device's). `host_ms` is all of the step's host work, wherever it falls.

    python scripts/bench_host.py --json host.json          # about 2 minutes on 2 cores
    python scripts/bench_host.py --batches 1,16 --output-len 64   # a quick look
    python scripts/bench_host.py --modes text --scheduling sync,async   # what async scheduling hides
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from call_timer import timed  # this script's folder

from splitserve.engine.dummy_weights import write_shape_checkpoint
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampler import Drawn
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.shapes import LLAMA3_8B

SHAPE = {**LLAMA3_8B, "vocab_size": 1024, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "torch_dtype": "float32",
         "bos_token_id": 1, "eos_token_id": 2}


class ModelClock:
    """Seconds spent in the model's forward and its logits since the last `take`."""

    def __init__(self, model: torch.nn.Module):
        self.seconds = 0.0
        for name in ("forward", "compute_logits"):
            setattr(model, name, timed(getattr(model, name), self._add))

    def _add(self, seconds: float) -> None:
        self.seconds += seconds

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class IdleClock:
    """The gaps between an iteration's sampled ids read on the host and the next forward's start."""

    def __init__(self, model: torch.nn.Module):
        self.gaps: list[float] = []
        self._read_at: float | None = None
        forward, read = model.forward, Drawn.read

        def forward_started(*args, **kwargs):
            if self._read_at is not None:
                self.gaps.append(time.perf_counter() - self._read_at)
                self._read_at = None
            return forward(*args, **kwargs)

        def read_ended(drawn: Drawn):
            try:
                return read(drawn)
            finally:
                self._read_at = time.perf_counter()

        model.forward, Drawn.read = forward_started, read_ended
        self.restore = lambda: setattr(Drawn, "read", read)

    def take(self) -> list[float]:
        gaps, self.gaps = self.gaps, []
        return gaps


def timed_steps(engine: LLMEngine, clock: ModelClock, count: int) -> tuple[list[float], list[float]]:
    """(host seconds, model seconds) of `count` steps."""
    host, model = [], []
    for _ in range(count):
        clock.take()
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        model.append(clock.take())
        host.append(wall - model[-1])
    return host, model


def row(mode: str, scheduling: str, batch: int, context: int, output_position: int, host: list[float],
        model: list[float], idle: list[float]) -> dict:
    ordered = sorted(host)
    return {"mode": mode, "scheduling": scheduling, "batch": batch, "context": context,
            "output_position": output_position, "host_ms": statistics.median(host) * 1e3,
            "host_ms_p90": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
            "host_us_per_seq": statistics.median(host) * 1e6 / batch, "model_ms": statistics.median(model) * 1e3,
            "device_idle_ms": statistics.median(idle) * 1e3}


def measure(model_dir: str, mode: str, scheduling: str, batch: int, context: int, args) -> list[dict]:
    max_len = context + args.output_len + args.steps + 8
    engine = LLMEngine(model_dir, policy="token", load_format="dummy", enable_prefix_caching=False, device="cpu",
                       dtype="float32", max_num_seqs=batch, max_model_len=max_len,
                       num_kv_blocks=batch * -(-max_len // 16), async_scheduling=scheduling == "async")
    clock, idle = ModelClock(engine.runner.model), IdleClock(engine.runner.model)
    try:
        return _measure(engine, clock, idle, mode, scheduling, batch, context, args)
    finally:
        idle.restore()


def _measure(engine: LLMEngine, clock: ModelClock, idle: IdleClock, mode: str, scheduling: str, batch: int,
             context: int, args) -> list[dict]:
    max_len = engine.max_model_len
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=max_len - context, ignore_eos=True)
    params = params.ids_only() if mode == "ids" else params
    for i in range(batch):
        engine.reserve_import(f"r{i}", [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(context)], params)
        engine.complete_import(f"r{i}", rng.randrange(3, SHAPE["vocab_size"]))
    timed_steps(engine, clock, 3)
    idle.take()
    rows = [row(mode, scheduling, batch, context, 4, *timed_steps(engine, clock, args.steps), idle.take())]
    for _ in range(args.output_len - 4 - args.steps):
        engine.step()
    idle.take()
    rows.append(row(mode, scheduling, batch, context, args.output_len, *timed_steps(engine, clock, args.steps),
                    idle.take()))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="ids,text", help="ids (a cluster worker), text (the engine decodes it)")
    p.add_argument("--scheduling", default="sync,async", help="sync, async (EngineConfig.async_scheduling)")
    p.add_argument("--batches", default="1,64,256", help="running sequences per step (1,64,256)")
    p.add_argument("--context", type=int, default=1024, help="tokens of context each sequence enters with (1024)")
    p.add_argument("--output-len", type=int, default=1024, help="output tokens at the second measurement (1024)")
    p.add_argument("--steps", type=int, default=20, help="steps timed per measurement (20)")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    if args.output_len < args.steps + 4:
        p.error("--output-len must be at least --steps + 4")
    if not set(args.modes.split(",")) <= {"ids", "text"}:
        p.error(f"--modes takes ids and text, got {args.modes!r}")
    if not set(args.scheduling.split(",")) <= {"sync", "async"}:
        p.error(f"--scheduling takes sync and async, got {args.scheduling!r}")
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_checkpoint(Path(tmp) / "model", SHAPE)
        for mode in args.modes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                for scheduling in args.scheduling.split(","):
                    for got in measure(model_dir, mode, scheduling, batch, args.context, args):
                        rows.append(got)
                        print(json.dumps(got), flush=True)
    result = {"hardware": platform.processor() or platform.machine(), "python": sys.version.split()[0],
              "torch": torch.__version__, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
