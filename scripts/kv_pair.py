"""A prompt worker and a token worker in two processes, timed: the measuring half of
bench_kv_transfer.py (CPU) and bench_gpu.py (the same-node transfer on one GPU).

Each worker runs one torch thread; the prompt worker also holds a colocated engine, the reference.
Backends: `gloo` (a gloo pair over loopback; NCCL between CUDA engines) and `ipc` (the KV written
straight into the token worker's cache: shared memory on CPU, CUDA IPC on a GPU). Times come from
time.monotonic(), which is system-wide on Linux and so comparable across the processes; on CUDA
the token worker synchronizes its device before it calls a transfer landed.

- sent_bytes: the KV bytes the prompt worker sent for the prompt (a model with windowed layers
  sends those layers only from the first block their window reaches; kv_bytes: the prompt's whole);
- prefill_ms: the colocated prefill step (TTFT of the colocated engine);
- serialized_transfer_ms: one-shot push after the prefill, until the last byte has landed and the
  token worker holds the request (first token sampled -> KV landed);
- visible_transfer_ms: with layer-wise streaming, what the transfer adds to the critical path: the
  tail from the first token to the last layer landing (tail_ms), plus what streaming delays the
  first token by. On CPU that is the compute thread's time packing and pushing layers during the
  prefill (streaming_host_ms); on a GPU the host packs and enqueues layers while the device is still
  computing earlier ones, so it is the device's delay: the layered run's TTFT over the one-shot
  run's (one_shot_ttft_ms), the same engine's, not below 0;
- ttft_ms: disaggregated time to first token (prompt worker), against colocated ttft;
- second_token_overhead: (second-token latency disaggregated / colocated) - 1, where the second
  token's latency is the time from the first token to the second one.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
import sys
import time

import torch
import torch.distributed as dist

NEVER = 10**9  # a layer-wise threshold no prompt reaches: one-shot transfer


def kv_bytes_per_token(model: str, element_size: int) -> int:
    from splitserve.engine.demo import demo_model_config
    from splitserve.engine.loader import load_model_config

    c = demo_model_config() if model == "demo" else load_model_config(model)
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * element_size


# ---- the two worker processes --------------------------------------------------------------
def _transport(engine, worker_id: str, port: int, backend: str):
    from splitserve.transfer.direct_link import DirectFabric
    from splitserve.transfer.handoff import make_transport
    from splitserve.transfer.torch_link import TorchFabric

    fabric = TorchFabric.join("127.0.0.1", port, worker_id, engine.kv_cache.data.device, 120.0)
    if backend == "ipc":
        fabric = DirectFabric(fabric.store, worker_id, engine.kv_cache.data, fabric, 120.0)
        if fabric.ipc_refused:  # its links would be NCCL's or gloo's: not what this backend's rows claim
            raise RuntimeError(f"{worker_id}: CUDA IPC refused: {fabric.ipc_refused}")
    return make_transport(engine, fabric, 120.0)


def prompt_process(model: str, port: int, backend: str, engine_args: dict, conn) -> None:
    from splitserve import LLMEngine, SamplingParams
    from splitserve.transfer.exporter import KVExporter

    torch.set_num_threads(1)
    engine = LLMEngine(model, policy="prompt", **engine_args)
    colocated = LLMEngine(model, policy="prefill_first", **engine_args)
    exporter = KVExporter(engine, _transport(engine, "prompt", port, backend))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    conn.send("ready")
    while (cmd := conn.recv()) != "stop":
        if cmd[0] == "colocated":
            start = time.monotonic()
            colocated.add_request(cmd[1], cmd[2], params, start)
            first = colocated.step()[0].token_timestamps[0]
            second = colocated.step()[0].token_timestamps[1]
            conn.send((first - start, second - first))
        else:  # ("push", ticket, prompt)
            start, pushed, streaming = time.monotonic(), exporter.bytes_pushed, 0.0
            exporter.add(cmd[1], cmd[2], params, start)
            while not (outputs := exporter.step()):  # a prompt longer than prompt_chunk_tokens: its chunks
                streaming += exporter.stream_seconds  # (each chunk's layers stream as they land)
            first = outputs[0].token_timestamps[0]
            conn.send((start, first, streaming + exporter.stream_seconds, exporter.bytes_pushed - pushed))
    exporter.transport.close()  # its links end, and with them the token side's receive loops


def token_process(model: str, port: int, backend: str, engine_args: dict, conn) -> None:
    from splitserve import LLMEngine, SamplingParams
    from splitserve.transfer.importer import KVImporter

    torch.set_num_threads(1)
    engine = LLMEngine(model, policy="token", **engine_args)
    importer = KVImporter(engine, _transport(engine, "token", port, backend), "token")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    cuda = engine.kv_cache.data.is_cuda
    conn.send("ready")
    while (cmd := conn.recv()) != "stop":
        _, request_id, prompt, threshold = cmd
        importer.layerwise_threshold = threshold
        conn.send(importer.reserve(request_id, prompt, params, "prompt"))
        landed = []
        while not landed:
            landed, failures = importer.poll(timeout=1.0)
            if failures:
                raise RuntimeError(failures)
        if cuda:
            torch.cuda.synchronize()  # the writes themselves, not only their announcement
        landed_at = time.monotonic()
        second = engine.step()[0].token_timestamps[1]
        conn.send((landed_at, second))
    importer.transport.close()  # joins its receive loops: none is inside a gloo call when the process exits


# ---- measuring -------------------------------------------------------------------------------
class Pair:
    def __init__(self, model: str, backend: str, engine_args: dict, label: str | None = None):
        ctx = mp.get_context("spawn")
        self.backend, self.label = backend, label or backend  # a row's name: pairs of one backend differ by label
        self.on_gpu = str(engine_args.get("device", "cpu")).startswith("cuda")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.prompt, prompt_end = ctx.Pipe()
        self.token, token_end = ctx.Pipe()
        args = (model, self.store.port, backend, engine_args)
        self.procs = [ctx.Process(target=prompt_process, args=(*args, prompt_end), daemon=True),
                      ctx.Process(target=token_process, args=(*args, token_end), daemon=True)]
        for proc in self.procs:
            proc.start()
        prompt_end.close(), token_end.close()  # the children's ends live in the children alone: their exit is EOF here
        self._recv(self.prompt), self._recv(self.token)
        self.count = 0

    def _recv(self, conn):
        try:
            return conn.recv()
        except EOFError:
            codes = [proc.exitcode for proc in self.procs]
            raise RuntimeError(f"a worker process ended (exit codes prompt, token: {codes}); "
                               "its traceback is above") from None

    def disaggregated(self, prompt: list[int], threshold: int) -> dict:
        self.count += 1
        request_id = f"r{self.count}"
        self.token.send(("reserve", request_id, prompt, threshold))
        self.prompt.send(("push", self._recv(self.token), prompt))
        start, first, streaming, sent = self._recv(self.prompt)
        landed, second = self._recv(self.token)
        return {"start": start, "first": first, "streaming": streaming, "landed": landed, "second": second,
                "sent_bytes": sent}

    def colocated(self, prompt: list[int]) -> tuple[float, float]:
        self.count += 1
        self.prompt.send(("colocated", f"c{self.count}", prompt))
        return self._recv(self.prompt)

    def close(self) -> None:
        """The prompt worker first: its links' end ends the token worker's receive loops, which that
        one joins before it exits (a thread left in a gloo call at exit aborts the process)."""
        for name, conn, proc in zip(("prompt", "token"), (self.prompt, self.token), self.procs):
            with contextlib.suppress(OSError):  # that worker is gone already
                conn.send("stop")
            _wait_exit(proc, 30)
            if proc.exitcode is None:
                proc.kill()
                _wait_exit(proc, 5)
            if proc.exitcode != 0:  # the rows stand (they were sent before); the exit is a bug
                print(f"kv_pair: the {name} worker exited with code {proc.exitcode} when stopped", file=sys.stderr)


def _wait_exit(proc: mp.Process, timeout: float) -> None:
    """Polls for the exit itself: `join` waits on a pipe that a CPU worker's torch_shm_manager
    inherits, so it would return only once that helper has exited too (seconds later)."""
    deadline = time.monotonic() + timeout
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)


def measure(pairs: list[Pair], model: str, n: int, repeats: int, kv_bytes_per_token: int) -> list[dict]:
    """One row per pair (its label: the backend unless given); the pairs' runs interleaved."""
    prompt = [1] + [(7 * i) % 250 + 3 for i in range(n - 1)]
    rows = {pair.label: {k: [] for k in ("prefill", "coloc_second", "serialized", "visible", "tail", "streaming_host",
                                           "ttft", "one_shot_ttft", "second", "sent_bytes")}
            for pair in pairs}
    for pair in pairs:
        pair.colocated(prompt)  # warm-up: both engines' first steps, and the link's set-up, are not measured
        pair.disaggregated(prompt, NEVER)
        pair.disaggregated(prompt, 0)
    for _ in range(repeats):
        for pair in pairs:
            ttft, second = pair.colocated(prompt)
            one_shot = pair.disaggregated(prompt, NEVER)
            layered = pair.disaggregated(prompt, 0)
            got = rows[pair.label]
            got["prefill"].append(ttft)
            got["coloc_second"].append(second)
            got["serialized"].append(one_shot["landed"] - one_shot["first"])
            got["tail"].append(layered["landed"] - layered["first"])
            got["streaming_host"].append(layered["streaming"])
            got["ttft"].append(layered["first"] - layered["start"])
            got["one_shot_ttft"].append(one_shot["first"] - one_shot["start"])
            delay = max(0.0, got["ttft"][-1] - got["one_shot_ttft"][-1]) if pair.on_gpu else layered["streaming"]
            got["visible"].append(got["tail"][-1] + delay)
            got["second"].append(layered["second"] - layered["first"])
            got["sent_bytes"] += [one_shot["sent_bytes"], layered["sent_bytes"]]
    return [_row(backend, got, model, n, repeats, kv_bytes_per_token) for backend, got in rows.items()]


def _row(backend: str, rows: dict, model: str, n: int, repeats: int, kv_bytes_per_token: int) -> dict:
    sent = set(rows.pop("sent_bytes"))
    if len(sent) != 1:
        raise RuntimeError(f"{backend}: the runs of one prompt sent different KV bytes: {sorted(sent)}")
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    return {"backend": backend, "model": model, "prompt_tokens": n, "kv_bytes": n * kv_bytes_per_token,
            "sent_bytes": sent.pop(),
            "prefill_ms": med["prefill"], "serialized_transfer_ms": med["serialized"],
            "visible_transfer_ms": med["visible"], "visible_fraction": med["visible"] / med["serialized"],
            "tail_ms": med["tail"], "streaming_host_ms": med["streaming_host"],
            "one_shot_ttft_ms": med["one_shot_ttft"],
            "ttft_ms": med["ttft"], "colocated_ttft_ms": med["prefill"],
            "second_token_ms": med["second"], "colocated_second_token_ms": med["coloc_second"],
            "second_token_overhead": med["second"] / med["coloc_second"] - 1, "repeats": repeats}
