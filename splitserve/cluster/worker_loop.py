"""The loop a worker runs: one engine on one thread, with KV export and import beside it.

Everything that touches the engine runs on this thread (the engine is not thread-safe): other
threads hand in commands with `call`, and get tokens back through per-request sinks. A request
is one of three kinds here:
- local: the whole request (prefill and decode) runs on this engine;
- prefill: prefill only, the KV goes to a token worker, the sink gets the first token;
- import: the KV comes from a prompt worker into reserved blocks, then the request decodes here.
No Ray here: the Ray actor (`worker.py`) wraps it.

The loop never dies of one unit of work. A step that raises fails the requests it ran (their sinks
get an error, so the dispatcher places them again elsewhere) and the loop goes on; any other error
fails every request here. Either way the engine's integrity is checked next: if it does not hold,
the loop marks itself unhealthy, fails all work and takes no more (the controller replaces it).
`health()` reads, from any thread, what the loop itself last wrote: its heartbeat (every
iteration) and how long the step in progress has run, so a stuck step shows from outside.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from splitserve.cluster.worker_stats import StatsRecorder, WorkerStats
from splitserve.engine.llm_engine import LLMEngine, StepFailed
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.placement.load import load_of, prefix_delta_of
from splitserve.placement.state import PrefixDelta, WorkerLoad
from splitserve.transfer.exporter import KVExporter
from splitserve.transfer.importer import KVImporter
from splitserve.transfer.kv_routes import rank_peers, worker_of
from splitserve.transfer.transport import KVTransport, TransferTicket

IDLE_WAIT_S = 0.05    # nothing to run: block on the command queue this long
IMPORT_WAIT_S = 0.002  # only transfers in flight: wait on them this long, then look at commands
log = logging.getLogger("splitserve.worker")


class WorkerUnhealthy(RuntimeError):
    """The worker's engine is not sound any more (or its loop ended): it takes no work."""


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request since its last delta; a final delta has `finish_reason` or `error`."""

    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None  # failed here (a KV transfer broke): place it again elsewhere
    logprobs: tuple[dict[int, float], ...] | None = None  # per token: {id: logprob}, the sampled one and the top
    # with a request's first token, when asked for: per prompt position (None at 0), the same shape
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None
    cached_tokens: int | None = None  # with a request's first delta: prompt tokens the prefix cache held
    cache_write_tokens: int | None = None  # ... and those its prefill added to the prefix cache
    embedding: tuple[float, ...] | None = None  # with the first delta of a request asking one (SamplingParams.embed)
    # with a final delta of a request with a prediction: its drafts from it kept, and thrown away
    prediction_tokens: tuple[int, int] | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


Sink = Callable[[TokenDelta], None]


@dataclass(frozen=True)
class LoopHealth:
    """What the engine loop last reported about itself (read without going through its queue)."""

    alive: bool                  # the loop thread runs
    healthy: bool                # the engine's state held after every failure so far
    reason: str | None           # why not healthy
    heartbeat_age_s: float       # since the loop last began an iteration
    step_running_s: float        # the step in progress so far; 0 when none runs


class WorkerLoop:
    def __init__(self, engine: LLMEngine, transport: KVTransport | None, worker_id: str, layerwise_threshold: int,
                 lease_s: float = float("inf"), reuse_prefix: bool = True):
        """`reuse_prefix`: imports take the prompt blocks this engine's prefix cache holds, and only
        the rest of the KV travels."""
        self.engine, self.worker_id = engine, worker_id
        self.exporter = KVExporter(engine, transport, lease_s, layerwise_threshold) if transport else None
        self.importer = (KVImporter(engine, transport, worker_id, layerwise_threshold, lease_s, reuse_prefix)
                         if transport else None)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._delivered: dict[str, int] = {}  # tokens already sent to each request's sink
        self._prefills: set[str] = set()
        self._importing: set[str] = set()
        self.stats = StatsRecorder()
        self._unhealthy: str | None = None
        self._heartbeat = time.monotonic()
        self._step_started: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"engine-{worker_id}")

    # ---- any thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the engine loop, then the links this worker sends KV on: its token peers fail what
        was in flight from it at once, and free what it was writing into (not at the timeout)."""
        self._stopped.set()
        self._thread.join(timeout=10)
        if self.exporter is not None:
            self.exporter.transport.close(timeout=0)

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the engine thread between two steps; its result or error in the future."""
        future: Future = Future()
        if not self._thread.is_alive() and self._thread.ident is not None:
            future.set_exception(WorkerUnhealthy(f"worker {self.worker_id}: the engine loop has ended"))
            return future
        self._commands.put((future, fn, args))
        return future

    @property
    def tracked(self) -> frozenset[str]:
        """Requests this loop streams tokens to."""
        return frozenset(self._sinks)

    def health(self) -> LoopHealth:
        now, started = time.monotonic(), self._step_started
        return LoopHealth(self._thread.is_alive(), self._unhealthy is None, self._unhealthy, now - self._heartbeat,
                          0.0 if started is None else now - started)

    # ---- engine thread (through `call`) -----------------------------------------------------
    def generate(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink) -> None:
        self.require_healthy()
        self.engine.add_request(request_id, prompt, params.ids_only(), hand_off=False)
        self._track(request_id, sink)

    def prefill(self, ticket: TransferTicket, prompt: list[int], params: SamplingParams, sink: Sink) -> None:
        self.require_healthy()
        self._require_transport()
        self.exporter.add(ticket, prompt, params.ids_only())  # the ingress decodes the ids
        self._track(ticket.request_id, sink)
        self._prefills.add(ticket.request_id)

    def reserve(self, request_id: str, prompt: list[int], params: SamplingParams, prompt_peer: str,
                sink: Sink, prompt_tp: int = 1) -> TransferTicket:
        """`prompt_tp`: the prompt worker's tensor-parallel size."""
        self.require_healthy()
        self._require_transport()
        ticket = self.importer.reserve(request_id, prompt, params.ids_only(), prompt_peer, prompt_tp=prompt_tp)
        self._track(request_id, sink)
        self._importing.add(request_id)
        return ticket

    def abort(self, request_id: str) -> None:
        """Stops the request (its client's call): its sink gets a final delta, "abort" (a prefill's
        caller waits for one)."""
        sink = self._sinks.get(request_id)
        self._drop(request_id)
        if sink is not None:
            sink(TokenDelta(finish_reason="abort"))

    def _drop(self, request_id: str) -> None:
        """Frees what the request holds here (and cancels its transfer); its sink hears nothing."""
        if request_id in self._sinks:
            self.stats.aborted_requests += 1
        if request_id in self._importing:
            self.importer.cancel(request_id)
        elif request_id in self._prefills:
            self.exporter.abort(request_id)
        else:
            self.engine.abort(request_id)
        self._forget(request_id)

    def forget_peers(self, worker_ids: tuple[str, ...]) -> None:
        """Workers that left the cluster for good: this worker's links to them close."""
        if worker_ids and self.exporter is not None:
            self.exporter.forget_peers(rank_peers(worker_ids))

    def keep_peers(self, live: tuple[str, ...]) -> None:
        """`live`: every worker of the cluster. This worker's links to any other (one that left
        while no controller ran to say so) close. Rank 0 links to every worker its ranks send to
        (the route 0 -> 0 carries each transfer's first token)."""
        if self.exporter is not None:
            linked = {worker_of(peer) for peer in self.exporter.transport.peers()}
            self.forget_peers(tuple(linked - set(live)))

    def set_role(self, policy: str) -> None:
        self.engine.set_policy(policy)

    def load(self) -> WorkerLoad:
        return load_of(self.engine.policy, self.engine.block_manager)

    def prefix_delta(self, snapshot: bool) -> PrefixDelta:
        return prefix_delta_of(self.engine.block_manager, snapshot)

    def check_integrity(self) -> None:
        """The engine's own checks, and that every request this loop tracks is one the engine holds."""
        self.engine.check_integrity()
        stray = set(self._sinks) - self.engine.request_ids
        if stray:
            raise RuntimeError(f"worker {self.worker_id} streams to requests the engine does not hold: {sorted(stray)}")

    def drain_stats(self) -> WorkerStats:
        if self.exporter:
            self.exporter.reap()  # transfers that finished since the last step count now
            self._record_transfers()
        blocks = self.engine.block_manager
        sent = self.exporter.bytes_pushed if self.exporter else 0
        reused = self.importer.kv_tokens_reused if self.importer else 0
        self.stats.leases_expired = (self.exporter.leases_expired + self.importer.leases_expired) if self.exporter else 0
        used = blocks.num_blocks - blocks.num_free_blocks
        return self.stats.drain(self.engine.policy.num_preemptions, sent, reused, used, blocks.num_free_blocks,
                                self.engine.policy.adapter_swaps, self.engine.host_tier_tokens)

    # ---- internals -----------------------------------------------------------------------
    def require_healthy(self) -> None:
        """Raises WorkerUnhealthy once the engine's state did not hold after a failure."""
        if self._unhealthy is not None:
            raise WorkerUnhealthy(f"worker {self.worker_id} is unhealthy: {self._unhealthy}")

    def _require_transport(self) -> None:
        if self.exporter is None:
            raise RuntimeError(f"worker {self.worker_id} has no KV transport (a mixed-only cluster)")

    def _track(self, request_id: str, sink: Sink) -> None:
        self._sinks[request_id] = sink
        self._delivered[request_id] = 0

    def _forget(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._delivered.pop(request_id, None)
        self._prefills.discard(request_id)
        self._importing.discard(request_id)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._heartbeat = time.monotonic()
            try:
                self._iterate()
            except StepFailed as failure:
                self._step_failed(failure)
            except Exception as error:  # a bug outside the step: no request is known to be at fault
                log.exception("worker %s: engine loop error", self.worker_id)
                self._fail_all(f"engine loop error: {type(error).__name__}: {error}")
                self._check_sound()

    def _iterate(self) -> None:
        self._run_commands()
        if self._unhealthy is not None:
            return
        outputs, failures = self._poll_imports()
        outputs += self._step()
        if self.exporter:
            failures += self.exporter.failures()
        for out in outputs:
            self._deliver(out)
        self.stats.kv_failures += len(failures)
        for request_id, error in failures:
            self._fail(request_id, str(error))

    def _step_failed(self, failure: StepFailed) -> None:
        self.stats.step_failures += 1
        log.error("worker %s: %s (requests %s)", self.worker_id, failure, failure.request_ids)
        if failure.request_ids is None:
            self._fail_all(str(failure))
        for request_id in failure.request_ids or ():
            self._abort_and_fail(request_id, str(failure))
        self._check_sound()

    def _check_sound(self) -> None:
        """After a failure: go on if the engine's state holds, else stop taking work for good."""
        try:
            self.check_integrity()
        except Exception as error:
            self._unhealthy = f"engine state unsound after a failure: {error}"
            log.error("worker %s: %s", self.worker_id, self._unhealthy)
            self._fail_all(self._unhealthy)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._sinks):
            self._abort_and_fail(request_id, message)

    def _abort_and_fail(self, request_id: str, message: str) -> None:
        """Free what the request holds here (and cancel its transfer), then send its sink the error."""
        sink = self._sinks.get(request_id)
        try:
            self._drop(request_id)
        except Exception:  # the state is checked right after; one bad request must not stop the others
            log.exception("worker %s: aborting %s failed", self.worker_id, request_id)
            self._forget(request_id)
        if sink is not None:
            sink(TokenDelta(error=f"worker {self.worker_id}: {message}"))

    def _step(self) -> list[RequestOutput]:
        """One engine step (with KV export when there is a transport), recorded for the metrics."""
        step = self.engine.last_step
        self._step_started = time.monotonic()
        try:
            outputs = self.exporter.step() if self.exporter else self.engine.step()
        finally:
            self._step_started = None
        if self.engine.last_step is not step:
            self.stats.step(self.engine.last_step)
        self._record_transfers()
        return outputs

    def _record_transfers(self) -> None:
        for transfer in self.exporter.take_transfers() if self.exporter else ():
            self.stats.transfer(transfer)

    def _run_commands(self) -> None:
        idle = not self.engine.has_unfinished_requests() and not self._importing
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if idle else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            future, fn, args = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as error:  # the caller gets it; the loop goes on
                    future.set_exception(error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _poll_imports(self) -> tuple[list[RequestOutput], list]:
        if not self._importing and not (self.importer and self.importer.num_held):  # held: given up, not yet freed
            return [], []
        wait = 0.0 if self.engine.has_unfinished_requests() else IMPORT_WAIT_S
        outputs, failures = self.importer.poll(wait)
        for out in outputs:
            self._importing.discard(out.request_id)
        for request_id, _ in failures:
            self._importing.discard(request_id)
        return outputs, failures

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        sent = self._delivered[out.request_id]
        if sent == 0 and out.first_scheduled_time is not None:  # imports were never queued here
            self.stats.queued(out.first_scheduled_time - out.arrival_time)
        new = tuple(out.token_ids[sent:])
        self._delivered[out.request_id] = len(out.token_ids)
        handed_off = out.request_id in self._prefills
        if out.finished or handed_off:
            self._forget(out.request_id)
        logprobs = out.outputs[0].logprobs
        # the engine's lists are live: a step after this output was made may have appended to them
        logprobs = None if logprobs is None else tuple(logprobs[sent:len(out.token_ids)])
        first = sent == 0  # the prompt's facts travel with a request's first delta
        prompt_logprobs = tuple(out.prompt_logprobs) if first and out.prompt_logprobs is not None else None
        sink(TokenDelta(new, out.finish_reason if out.finished else None, logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs, cached_tokens=out.num_cached_tokens if first else None,
                        cache_write_tokens=out.num_cache_write_tokens if first else None,
                        embedding=tuple(out.embedding) if first and out.embedding is not None else None,
                        prediction_tokens=_prediction_tokens(out)))

    def _fail(self, request_id: str, message: str) -> None:
        sink = self._sinks.get(request_id)
        self._forget(request_id)
        if sink is not None:
            sink(TokenDelta(error=f"worker {self.worker_id}: {message}"))


def _prediction_tokens(out: RequestOutput) -> tuple[int, int] | None:
    """A finished request's drafts from its prediction, kept and thrown away (None: none drafted)."""
    counts = out.accepted_prediction_tokens, out.rejected_prediction_tokens
    return counts if out.finished and any(counts) else None
