"""A worker: one engine in a Ray actor, in the prompt, token or mixed role (switchable live).
With tensor parallelism this actor is rank 0 of its worker; the other ranks are `ShardWorker`s
the controller places beside it (one placement group), meeting it under `tp_prefix(worker_id)`.

The engine runs on its own thread (`WorkerLoop`); the actor's asyncio loop serves calls from the
ingress (requests, token feeds) and the controller (role changes, load reports). Tokens go back
through one feed per subscriber (an ingress replica, the batch manager): a queue the engine thread
fills with every request's deltas, streamed in batches by a long-lived call (`feed`; `FeedOutbox`),
so a step's tokens for many requests cost one message, not one per request.

`report` goes through the engine loop (so a poll that returns proves the loop turns); `health`
does not (it reads the loop's heartbeat), so the controller can tell a busy worker from a stuck
or unhealthy one when a poll does not return. Fault-injection hooks refuse unless the cluster
config enables them.

The actor is detached: it outlives a CLS that dies, whose successor adopts it (`info` says
whether it can: same config, same rendezvous store). Every call from a CLS renews its orphan
lease; one no CLS calls for `scheduler.orphan_timeout_s` stops itself with its other ranks.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import math
import os
import socket

import ray
import torch.distributed as dist

from splitserve.cluster.feed_outbox import FeedOutbox
from splitserve.cluster.orphan_lease import OrphanLease
from splitserve.cluster.rendezvous import Rendezvous
from splitserve.cluster.worker_group import WorkerActors
from splitserve.cluster.worker_loop import TokenDelta, WorkerLoop
from splitserve.cluster.worker_stats import WorkerStats
from splitserve.config import ClusterConfig
from splitserve.engine import faults as engine_faults
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_builder import resolve_device
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tensor_parallel import TPGroup
from splitserve.placement.state import PrefixDelta, WorkerLoad
from splitserve.transfer.codec import wire_shape
from splitserve.transfer.faults import crash_after_layer_pushes, freeze_after_layer_pushes
from splitserve.transfer.handoff import make_transport
from splitserve.transfer.transport import KVTransport, TransferTicket

MAX_CONCURRENT_CALLS = 4096  # calls in flight: feeds (one per subscriber), prefills, reservations, control


class FaultInjectionDisabled(PermissionError):
    """A fault-injection hook called on a worker whose cluster config does not enable them."""


def engine_policy(role: str, config: ClusterConfig) -> str:
    return config.engine.policy_for(role)


def tp_prefix(worker_id: str) -> str:
    return f"splitserve/tp/{worker_id}"


def join_store(rendezvous: Rendezvous, timeout: float) -> dist.TCPStore:
    host, port, _ = rendezvous
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


class Worker:
    def __init__(self, worker_id: str, role: str, hardware: str, config: dict, rendezvous: Rendezvous | None,
                 tensor_parallel_size: int = 1):
        cfg = ClusterConfig.model_validate(config)
        self.worker_id, self.hardware, self._config = worker_id, hardware, cfg
        self._rendezvous, self._tp_size = rendezvous, tensor_parallel_size
        self._reports_prefix = cfg.prefix_options().aware
        self._reports_adapters = cfg.engine.max_loras > 0
        engine_config = cfg.engine_config(role)
        self._store = join_store(rendezvous, cfg.transfer.timeout_s) if rendezvous else None
        group = None
        if tensor_parallel_size > 1:
            group = TPGroup(dist.PrefixStore(tp_prefix(worker_id), self._store), 0, tensor_parallel_size,
                            resolve_device(engine_config.device), cfg.transfer.timeout_s)
        engine = LLMEngine(cfg.model, engine_config, tp=group)
        transport = None
        if cfg.disaggregated:
            self._store.set(_tp_key(worker_id), str(tensor_parallel_size))
            transport = connect_transport(cfg, worker_id, engine, rendezvous)
        self._peer_tp: dict[str, int] = {}
        self._lora_paths: dict[str, str] = {}  # the adapters loaded at run time, by name
        self.loop = WorkerLoop(engine, transport, worker_id, cfg.transfer.layerwise_threshold, cfg.transfer.lease_s,
                               reuse_prefix=self._reports_prefix)
        self.loop.start()
        self._outbox = FeedOutbox(lambda request_id: self._call(self.loop.abort, request_id))
        self._lease = OrphanLease(cfg.scheduler.orphan_timeout_s, self._orphaned, worker_id).start()

    async def info(self) -> dict:
        """What it is; `config_digest` and `rendezvous` (the store's host and port) tell a new CLS
        whether it can adopt this worker."""
        self._lease.renew()
        engine = self.loop.engine
        return {"worker_id": self.worker_id, "hardware": self.hardware, "pid": os.getpid(),
                "device": str(engine.kv_cache.data.device), "max_model_len": engine.max_model_len,
                "node_ip": ray.util.get_node_ip_address(), "config_digest": self._config.digest(),
                "rendezvous": list(self._rendezvous[:2]) if self._rendezvous else None}

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, subscriber: str) -> None:
        """Run a whole request here; its token deltas go to `subscriber`'s feed."""
        await self._open(request_id, subscriber, self.loop.generate, request_id, prompt, params)

    async def reserve(self, request_id: str, prompt: list[int], params: SamplingParams,
                      prompt_peer: str, subscriber: str) -> TransferTicket:
        """Reserve KV blocks for a prompt another worker prefills; its tokens go to `subscriber`'s feed."""
        reserve = functools.partial(self.loop.reserve, prompt_tp=self._tensor_parallel_size(prompt_peer))
        return await self._open(request_id, subscriber, reserve, request_id, prompt, params, prompt_peer)

    async def prefill(self, ticket: TransferTicket, prompt: list[int], params: SamplingParams) -> TokenDelta:
        """Prefill and push the KV to `ticket.token_peer`; returns the first token (or the error)."""
        deltas: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        await self._call(self.loop.prefill, ticket, prompt, params,
                         lambda delta: loop.call_soon_threadsafe(deltas.put_nowait, delta))
        return await deltas.get()

    async def feed(self, subscriber: str):
        """Every delta of `subscriber`'s requests, as (request id, delta) pairs in batches of what
        has come, until the subscriber's next feed call takes over, or the subscriber goes away:
        then its requests still open are aborted."""
        async with contextlib.aclosing(self._outbox.stream(subscriber)) as batches:
            async for batch in batches:
                yield batch

    async def abort(self, request_id: str) -> None:
        self._outbox.drop(request_id)
        await self._call(self.loop.abort, request_id)

    # ---- control ---------------------------------------------------------------------------
    async def set_role(self, role: str) -> None:
        self._lease.renew()
        await self._call(self.loop.set_role, engine_policy(role, self._config))

    async def load(self) -> WorkerLoad:
        self._lease.renew()
        return await self._call(self.loop.load)

    async def report(self, prefix_snapshot: bool = False, gone: tuple[str, ...] = (),
                     live: tuple[str, ...] | None = None
                     ) -> tuple[WorkerLoad, WorkerStats, PrefixDelta | None, dict[str, str] | None]:
        """Load for placement, what happened since the last report for the metrics, with
        prefix-aware placement the prefix cache's change since the last report (`prefix_snapshot`:
        all it holds instead, after a report that was lost), and with adapters loaded while serving
        the adapters it holds (name -> identity; the controller mends any that differ from its
        table). `gone`: workers removed from the cluster since the last report (this worker's links
        to them close); `live`, from a CLS that adopted this worker: every worker of the cluster
        (its links to any other close)."""
        self._lease.renew()

        def report():
            self.loop.require_healthy()  # an unhealthy worker fails its poll, so the controller replaces it
            self.loop.forget_peers(gone)
            if live is not None:
                self.loop.keep_peers(live)
            prefix = self.loop.prefix_delta(prefix_snapshot) if self._reports_prefix else None
            adapters = self.loop.engine.lora_identities if self._reports_adapters else None
            return self.loop.load(), self.loop.drain_stats(), prefix, adapters
        return await self._call(report)

    async def health(self) -> dict:
        """The engine loop's own account of itself (heartbeat, step in progress), read without
        waiting for the loop: the controller asks when a poll does not come back."""
        self._lease.renew()
        return dataclasses.asdict(self.loop.health())

    async def in_flight(self) -> int:
        """Requests this worker still streams to (through the loop): a CLS retiring it asks."""
        self._lease.renew()
        return await self._call(lambda: len(self.loop.tracked))

    # ---- LoRA adapters loaded at run time (the controller's `lora_updates`) ----------------------
    async def load_lora(self, name: str, path: str) -> str:
        """Load the adapter between two steps (every rank its slice); its identity."""
        self._lease.renew()
        identity = await self._call(self.loop.engine.load_lora, name, path)
        self._lora_paths[name] = path
        return identity

    async def unload_lora(self, name: str) -> None:
        self._lease.renew()
        await self._call(self.loop.engine.unload_lora, name)
        self._lora_paths.pop(name, None)

    async def lora_adapters(self) -> dict[str, tuple[str | None, str]]:
        """Every adapter loaded, name -> (its path if loaded at run time, else None; its identity)."""
        self._lease.renew()
        identities = await self._call(lambda: self.loop.engine.lora_identities)
        return {name: (self._lora_paths.get(name), identity) for name, identity in identities.items()}

    async def check_integrity(self) -> dict:
        """The engine's invariants (raises if one is broken), and its KV blocks in use."""
        def check():
            self.loop.check_integrity()
            blocks = self.loop.engine.block_manager
            return {"blocks_used": blocks.num_used_blocks, "requests": self.loop.engine.num_requests}
        return await self._call(check)

    # ---- fault injection (only where the config enables it) ---------------------------------
    async def inject_fault(self, kind: str, **args) -> None:
        """kind: "crash_after_layer_pushes" (n), "freeze_after_layer_pushes" (n), "fail_steps" (times,
        leak_block), "stall_step" (seconds)."""
        if not self._config.fault_injection:
            raise FaultInjectionDisabled(f"worker {self.worker_id}: fault injection is disabled (fault_injection "
                                         "is false in the cluster config)")
        hooks = {"crash_after_layer_pushes": lambda: crash_after_layer_pushes(self.loop.exporter.transport, **args),
                 "freeze_after_layer_pushes": lambda: freeze_after_layer_pushes(self.loop.exporter.transport, **args),
                 "fail_steps": lambda: engine_faults.fail_next_steps(self.loop.engine, **args),
                 "stall_step": lambda: engine_faults.stall_next_step(self.loop.engine, **args)}
        if kind not in hooks:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(hooks)}")
        await self._call(hooks[kind])

    # ---- internals -------------------------------------------------------------------------
    def _orphaned(self) -> None:
        """No CLS for the orphan timeout: this worker's actors and placement group go (this one last)."""
        WorkerActors.find(ray.get_runtime_context().get_actor_name(), self._tp_size).kill()

    def _tensor_parallel_size(self, worker_id: str) -> int:
        """A peer's TP size, as it published it when it started (worker ids are never reused)."""
        if worker_id not in self._peer_tp:
            key = _tp_key(worker_id)
            self._peer_tp[worker_id] = int(self._store.get(key)) if self._store.check([key]) else 1
        return self._peer_tp[worker_id]

    async def _open(self, request_id: str, subscriber: str, fn, *args):
        sink = self._outbox.sink(subscriber, request_id)
        try:
            return await self._call(fn, *args, sink)
        except BaseException:
            self._outbox.drop(request_id)
            raise

    async def _call(self, fn, *args):
        return await asyncio.wrap_future(self.loop.call(fn, *args))


def _tp_key(worker_id: str) -> str:
    return f"splitserve/tp-size/{worker_id}"


def connect_transport(cfg: ClusterConfig, worker_id: str, engine, rendezvous: Rendezvous) -> KVTransport:
    """A rank's transport (`engine`: an LLMEngine, or a TPFollower under its rank's id). Joins the
    cluster's rendezvous store; gRPC workers publish their address there and take only calls that
    carry the cluster's secret, of at most one whole prompt's KV. Direct fabrics publish a handle
    to the rank's KV cache there (`direct_link`)."""
    from splitserve.transfer.direct_link import DirectFabric
    from splitserve.transfer.torch_link import TorchFabric

    (host, port, secret), timeout = rendezvous, cfg.transfer.timeout_s
    device = engine.kv_cache.data.device
    backend = cfg.transfer.backend
    if backend != "grpc":
        fabric = TorchFabric.join(host, port, worker_id, device, timeout)  # NCCL on CUDA, gloo on CPU
        if backend == "ipc" or (backend == "auto" and device.type == "cuda"):  # same-node peers: no wire
            fabric = DirectFabric(fabric.store, worker_id, engine.kv_cache.data, fabric, timeout)
        return make_transport(engine, fabric, timeout)
    from splitserve.transfer.grpc_link import GrpcFabric

    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    store.set(f"splitserve/grpc/{worker_id}", f"{ray.util.get_node_ip_address()}:{_free_port()}")
    cache = engine.kv_cache
    largest = cache.data.element_size() * cache.num_layers * math.prod(wire_shape(cache, engine.max_model_len))
    fabric = GrpcFabric(worker_id, lambda peer: _grpc_address(store, peer), timeout, secret=secret,
                        max_message_bytes=largest + 4096)  # + the message's own header
    return make_transport(engine, fabric, timeout)


def _grpc_address(store: dist.Store, worker_id: str) -> str:
    key = f"splitserve/grpc/{worker_id}"
    if not store.check([key]):
        raise KeyError(worker_id)
    return store.get(key).decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
