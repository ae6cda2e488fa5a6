"""Prompt and token workers in their own processes, driven over queues (the cluster's job later).

Commands a worker takes from its inbox, and what it puts in its outbox:
- token:  ("reserve", request_id, prompt, params, prompt_peer) -> ("ticket", ticket) or ("error", request_id, msg)
          ("cancel", request_id) gives a transfer up (a client that went away)
          outputs as ("done", request_id, token_ids), failures as ("failed", request_id, message)
- prompt: ("add", ticket, prompt, params) -> ("first", request_id, token_id) once prefilled,
          failures (a refused ticket too) as ("failed", request_id, message)
- both:   ("check",) -> ("check", integrity error or None, free blocks, total blocks, live requests)
          ("stop",) ends the loop; ("die",) exits at once, as a crash would
- prompt: ("stall",) stops pushing: later requests are prefilled but never sent (a hung peer)
- prompt: ("die_after_layers", n) crashes right after its n-th layer push has left (mid-transfer);
          ("freeze_after_layers", n) stops itself (SIGSTOP) there instead, until SIGCONT
- prompt: ("min_piece_tokens", n) sets its exporter's; ("peak",) -> ("peak", worker_id, {the most KV
          blocks held, the most prompt tokens a step, the layer messages pushed})
"""
from __future__ import annotations

import os
import queue

from splitserve.transfer.faults import crash_after_layer_pushes, freeze_after_layer_pushes, watch_layer_pushes

POLL_S = 0.002


def connect(backend: str, worker_id: str, store_port: int, engine, timeout: float, grpc_directory=None):
    from splitserve.transfer.direct_link import DirectFabric
    from splitserve.transfer.handoff import make_transport
    from splitserve.transfer.torch_link import TorchFabric

    if backend == "grpc":
        from splitserve.transfer.grpc_link import GrpcFabric

        fabric = GrpcFabric(worker_id, grpc_directory, timeout)
    else:
        fabric = TorchFabric.join("127.0.0.1", store_port, worker_id, engine.kv_cache.data.device, timeout)
        if backend in ("ipc", "cuda-ipc"):
            fabric = DirectFabric(fabric.store, worker_id, engine.kv_cache.data, fabric, timeout)
    return make_transport(engine, fabric, timeout)


def device_for(backend: str, role: str = "token") -> str:
    """CUDA backends: NCCL pairs two GPUs (it refuses two ranks on one: prompt workers take the
    second), CUDA IPC pairs two processes on one. gloo, gRPC and shared memory ("ipc") run on the
    CPU even where a GPU exists."""
    if backend == "nccl":
        return "cuda:1" if role == "prompt" else "cuda:0"
    return "cuda" if backend == "cuda-ipc" else "cpu"


def engine_args_for(backend: str) -> dict:
    """On a GPU, engines of several processes share one device: each gets a fixed KV budget (a
    memory profile would hand the first to start what the others need)."""
    return {} if device_for(backend) == "cpu" else {"kv_cache_memory_bytes": 64 << 20}


def _check(engine) -> tuple:
    try:
        engine.check_integrity()
        error = None
    except RuntimeError as e:
        error = str(e)
    blocks = engine.block_manager
    return ("check", error, blocks.num_free_blocks, blocks.num_blocks, engine.num_requests)


def _next(inbox):
    try:
        return inbox.get(timeout=POLL_S)
    except queue.Empty:
        return None


def _serve(engine, inbox, outbox, worker_id, handle, tick) -> None:
    """The worker loop: commands both roles share, the role's own via `handle`, then one `tick`."""
    outbox.put(("ready", worker_id))
    while True:
        cmd = _next(inbox)
        if cmd is not None:
            if cmd[0] == "stop":
                return
            if cmd[0] == "die":
                os._exit(1)
            if cmd[0] == "check":
                outbox.put(_check(engine))
            handle(cmd)
        tick()


def token_worker(worker_id, backend, store_port, timeout, inbox, outbox, engine_args, grpc_directory=None):
    import torch

    from splitserve import LLMEngine
    from splitserve.transfer.importer import KVImporter

    torch.set_num_threads(1)
    engine_args = dict(engine_args)
    engine = LLMEngine(engine_args.pop("model", "demo"), policy="token", device=device_for(backend, "token"),
                       **engine_args)
    importer = KVImporter(engine, connect(backend, worker_id, store_port, engine, timeout, grpc_directory), worker_id)

    def handle(cmd):
        if cmd[0] == "reserve":
            _, request_id, prompt, params, prompt_peer = cmd
            try:
                outbox.put(("ticket", importer.reserve(request_id, prompt, params, prompt_peer)))
            except (RuntimeError, ValueError) as error:
                outbox.put(("error", request_id, str(error)))
        if cmd[0] == "cancel":
            importer.cancel(cmd[1])

    def tick():
        landed, failures = importer.poll()
        for request_id, error in failures:
            outbox.put(("failed", request_id, str(error)))
        for out in landed + engine.step():
            if out.finished:
                outbox.put(("done", out.request_id, out.token_ids))

    _serve(engine, inbox, outbox, worker_id, handle, tick)


def prompt_worker(worker_id, backend, store_port, timeout, inbox, outbox, engine_args, grpc_directory=None):
    import torch

    from splitserve import LLMEngine
    from splitserve.transfer.exporter import KVExporter
    from splitserve.transfer.link import TransferError

    torch.set_num_threads(1)
    engine_args = dict(engine_args)
    engine = LLMEngine(engine_args.pop("model", "demo"), policy="prompt", device=device_for(backend, "prompt"),
                       **engine_args)
    exporter = KVExporter(engine, connect(backend, worker_id, store_port, engine, timeout, grpc_directory))
    # the most KV blocks held and prompt tokens a step; the layer messages (pieces) pushed
    stalled, peak = [], {"blocks": 0, "prefill_tokens": 0, "layer_messages": 0}
    watch_layer_pushes(exporter.transport, lambda: peak.update(layer_messages=peak["layer_messages"] + 1))

    def handle(cmd):
        if cmd[0] == "stall":
            stalled.append(True)
        if cmd[0] == "die_after_layers":
            crash_after_layer_pushes(exporter.transport, cmd[1])
        if cmd[0] == "freeze_after_layers":
            freeze_after_layer_pushes(exporter.transport, cmd[1])
        if cmd[0] == "pushed":
            outbox.put(("pushed", worker_id, exporter.bytes_pushed))
        if cmd[0] == "min_piece_tokens":
            exporter.min_piece_tokens = cmd[1]
        if cmd[0] == "peak":
            outbox.put(("peak", worker_id, dict(peak)))
        if cmd[0] == "add":
            _, ticket, prompt, params = cmd
            if stalled:  # prefill happens, the KV never leaves: the token side must time out
                engine.add_request(ticket.request_id, prompt, params)
                return
            try:
                exporter.add(ticket, prompt, params)
            except TransferError as error:  # refused: a different model, or a transfer given up already
                outbox.put(("failed", ticket.request_id, str(error)))

    def tick():
        outputs = exporter.step()
        peak["blocks"] = max(peak["blocks"], engine.block_manager.num_used_blocks)
        peak["prefill_tokens"] = max(peak["prefill_tokens"], engine.last_step.prefill_tokens)
        for out in outputs:
            if len(out.token_ids) == 1:
                outbox.put(("first", out.request_id, out.token_ids[0]))
        for request_id, error in exporter.failures():
            outbox.put(("failed", request_id, str(error)))
        if stalled:
            for out in outputs:
                engine.abort(out.request_id)

    _serve(engine, inbox, outbox, worker_id, handle, tick)
