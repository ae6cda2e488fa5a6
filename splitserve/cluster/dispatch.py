"""Drives one request across the cluster, from the ingress: place it, start it, stream its
tokens, and fail over when a worker dies.

An attempt is one placement. Split placement: reserve KV on the token worker, then prefill on the
prompt worker (the KV streams across while it runs); the first token comes from the prompt
worker, the rest from the token worker. Local placement: one worker runs the whole request.
When a worker dies, or a transfer breaks, the next attempt prefills the prompt plus the tokens
already streamed, on other workers, so the client sees one unbroken stream (greedy output is
identical). Invariant: `tokens` holds exactly what the client has been sent.

The calls that start a request on its workers are sent outside the Serve request's Ray context
(`detached`): a client that goes away cancels the request here, whose abort stops it on the
workers; were they its children, Ray would cancel them too, and a cancelled prefill would look
like a failed attempt and place a request nobody waits for again.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from ray.exceptions import RayActorError, RayError, RayTaskError

from splitserve.api.errors import RequestError
from splitserve.cluster.background import background
from splitserve.cluster.delta_feeds import DeltaFeeds, FeedBroken, detached
from splitserve.cluster.owned_actor import through_restart
from splitserve.cluster.worker_loop import TokenDelta
from splitserve.engine.prefix_hash import PrefixNaming
from splitserve.engine.sampling_params import SamplingParams
from splitserve.placement import Placement, PlacementRequest
from splitserve.placement.state import MAX_PREFIX_BLOCKS, REFUSED_TRIES

log = logging.getLogger("splitserve.dispatch")
REPLACE_WAIT_S = 0.5    # a failover that finds no room waits this long before asking again
REPLACE_TRIES = 20


class Overloaded(Exception):
    """The cluster cannot admit the request now (the client should retry later: 429)."""


class _Refused(Overloaded):
    """The token worker had no room for the reservation after all (the CLS placed by its last
    load report, which the decodes since may have outgrown)."""

    def __init__(self, message: str, worker: str):
        super().__init__(message)
        self.worker = worker


class ClusterUnavailable(Overloaded):
    """The CLS places nothing now: no worker is ready (the cluster is starting) or it is shutting
    down. Raised by the CLS. Waited on as a full cluster is (a batch line, a failover), but a new
    request is told 503, not 429: nothing is full."""


class RequestFailed(Exception):
    """The request could not be completed (its attempts ran out)."""

    def as_error(self) -> RequestError:
        """What the client is told: a 503, as the API answers a request no worker could finish."""
        return RequestError(str(self), status=503, type="service_unavailable")


class _AttemptFailed(Exception):
    def __init__(self, message: str, worker: str | None = None, dead: bool = False):
        super().__init__(message)
        self.worker, self.dead = worker, dead


class WorkerDirectory:
    """Worker actor handles by id, asked of the CLS once per worker (per ingress replica), and the
    token feeds this replica's requests stream through (one per worker). `dead` once a call found
    the CLS gone for good: the ingress asks the controller deployment for the new one, and replaces
    the directory."""

    def __init__(self, cls):
        self.cls = cls
        self.dead = False
        self.feeds = DeltaFeeds()
        self._handles: dict[str, object] = {}
        self._calls: set[asyncio.Task] = set()  # best-effort calls in flight, held until they end

    async def place(self, request: PlacementRequest, exclude: frozenset[str], lora: str | None = None
                    ) -> Placement | None:
        return await self._ask_cls("place", request, exclude, lora)

    async def get(self, worker_id: str):
        if worker_id not in self._handles:
            handle = await self._ask_cls("worker_handle", worker_id)
            if handle is None:
                raise _AttemptFailed("worker is gone", worker_id, dead=True)
            self._handles[worker_id] = handle
        return self._handles[worker_id]

    def forget(self, worker_id: str) -> None:
        self._handles.pop(worker_id, None)
        self.feeds.forget(worker_id)

    async def _ask_cls(self, method: str, *args):
        """Through a restart of the CLS (it crashed); one gone for good makes this directory dead."""
        try:
            return await through_restart(getattr(self.cls, method), *args)
        except RayTaskError as error:
            if isinstance(error.cause, (ClusterUnavailable, RequestFailed)):  # RequestFailed: an adapter unloaded
                raise error.cause from None
            raise
        except RayActorError:
            self.dead = True
            raise RequestFailed("the cluster controller (CLS) died; Serve is replacing it (its workers serve on): "
                                "retry shortly") from None

    def call_quietly(self, method, *args) -> None:
        """`_quietly(method, *args)` in the background: nobody waits for its answer."""
        task = background(_quietly(method, *args))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)


@dataclass
class Run:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    workers: WorkerDirectory
    max_attempts: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    placement: Placement | None = None
    prompt_handle: object = None
    token_handle: object = None
    _attempts: itertools.count = field(default_factory=itertools.count)
    failures: int = 0  # attempts that failed (each one placed the request again, if attempts were left)
    refusals: int = 0  # reservations token workers refused (the CLS placed by a stale load report)
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None  # from the first attempt that computed them
    cached_tokens: int | None = None  # of the prompt, in the prefix cache of the first attempt that answered
    cache_write_tokens: int | None = None  # of the prompt, added to that prefix cache by its prefill
    embedding: tuple[float, ...] | None = None  # with params.embed, once its prefill ran
    prediction_tokens: tuple[int, int] = (0, 0)  # drafts from params.prediction kept, thrown away: every attempt's
    follow: Placement | None = None  # the first attempt goes where this placement went, if it still qualifies
    prefix: PrefixNaming = PrefixNaming()  # how to name the prompt's blocks to the CLS (by default: not at all)
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set at the first token, or when it ends without
    _deltas: asyncio.Queue | None = None  # this attempt's token deltas from its token worker's feed
    _first: asyncio.Task | None = None
    _admission: asyncio.Task | None = None

    async def admit(self) -> None:
        """First placement and start; raises Overloaded when nothing can take it."""
        try:
            await self._start_attempt(failover=False)
        except _AttemptFailed as failure:
            await self._recover(failure)

    def admit_after(self, leader: Run, retry_s: float | None = None) -> None:
        """Admit once `leader` (another choice of the same prompt) has its first token, on its
        workers: their prefix caches then hold the prompt, so this one's prefill is a cache hit.
        `deltas` waits for it; no room then is a RequestFailed, or with `retry_s` another try that
        much later (a batch's choice waits for room, as its lines do)."""
        async def admission():
            await leader.started.wait()
            self.follow = leader.placement
            while True:
                try:
                    return await self.admit()
                except Overloaded as error:
                    if retry_s is None:
                        raise RequestFailed(str(error)) from None
                await asyncio.sleep(retry_s)
        self._admission = asyncio.ensure_future(admission())

    async def deltas(self) -> AsyncIterator[TokenDelta]:
        """New tokens as they come (failovers included) until the request finishes."""
        try:
            if self._admission is not None:
                await self._admission
            while self.finish_reason is None:
                try:
                    async for delta in self._attempt_deltas():
                        yield delta
                except _AttemptFailed as failure:
                    await self._recover(failure)
        finally:
            self.started.set()  # a follower must not wait on a run that ended without a token

    async def abort(self) -> None:
        """Stop the request wherever it runs (client gone, stop string seen at the ingress)."""
        if self._admission is not None and not self._admission.done():
            self._admission.cancel()
        if self.placement is not None and self.finish_reason is None:
            self.finish_reason = "abort"
            await self._abort_on_workers()

    # ---- one attempt ------------------------------------------------------------------------
    async def _start_attempt(self, failover: bool, exclude: frozenset[str] = frozenset()) -> None:
        """Places and starts the request; a token worker that refuses the reservation is left out
        of the next placement, up to REFUSED_TRIES placements (then Overloaded)."""
        prompt, params, refusals = self.prompt + self.tokens, self._remaining_params(), ""
        for tries in range(1, REFUSED_TRIES + 1):
            self._worker_request_id = f"{self.request_id}.{next(self._attempts)}"
            request = PlacementRequest(self._worker_request_id, len(prompt), params.max_tokens,
                                       None if failover else self.follow, self._prefix_hashes(prompt, params),
                                       params.priority)
            self.placement = self.prompt_handle = self.token_handle = None
            for _ in range(REPLACE_TRIES if failover else 1):
                try:
                    self.placement = await self.workers.place(request, exclude, params.lora)
                except ClusterUnavailable:
                    if not failover:
                        raise
                    # a failover waits for replacements as it waits for room
                if self.placement is not None:
                    break
                await asyncio.sleep(REPLACE_WAIT_S)
            if self.placement is None:
                raise Overloaded("no worker can take the request now" + refusals) if not failover else \
                    RequestFailed("no worker could take the request over after a failure" + refusals)
            self.prompt_handle = await self.workers.get(self.placement.prompt_worker)
            self.token_handle = await self.workers.get(self.placement.token_worker)
            try:
                return await self._launch(prompt, replace(params, lora_identity=self.placement.lora_identity))
            except _Refused as refused:
                self.refusals += 1
                if tries == REFUSED_TRIES:
                    raise
                log.info("request %s: %s; placing it again without that worker", self.request_id, refused)
                exclude, refusals = exclude | {refused.worker}, f"{refusals}; {refused}"

    async def _launch(self, prompt: list[int], params: SamplingParams) -> None:
        rid, placement, feeds = self._worker_request_id, self.placement, self.workers.feeds
        self._deltas = feeds.open(placement.token_worker, self.token_handle, rid)  # before the worker can send
        if placement.local:
            try:
                await detached(self.token_handle.generate, rid, prompt, params, feeds.subscriber)
            except RayTaskError as error:
                raise _AttemptFailed(f"worker failed to start it: {error.cause}", placement.token_worker) from None
            except RayActorError:
                raise _AttemptFailed("worker died at admission", placement.token_worker, dead=True) from None
            return
        try:
            ticket = await detached(self.token_handle.reserve, rid, prompt, params, placement.prompt_worker,
                                    feeds.subscriber)
        except RayTaskError as error:  # the token worker has no room after all (blocks, batch)
            feeds.close(placement.token_worker, rid)
            raise _Refused(f"worker {placement.token_worker} cannot take the request: {error.cause}",
                           placement.token_worker) from None
        except RayActorError:
            raise _AttemptFailed("worker died at admission", placement.token_worker, dead=True) from None
        self._first = asyncio.ensure_future(detached(self.prompt_handle.prefill, ticket, prompt, params))

    async def _attempt_deltas(self) -> AsyncIterator[TokenDelta]:
        emitted = position = 0  # this attempt's tokens passed on / seen in the token stream
        if self._first is not None:  # the prompt worker's first token: sooner than the stream's
            first = await self._await_first()
            emitted = len(first.token_ids)
            if first.final:  # the caller reads no further: free what the token worker holds first
                self.workers.feeds.close(self.placement.token_worker, self._worker_request_id)
                self.workers.call_quietly(self.token_handle.abort, self._worker_request_id)
            yield self._record(first)
            if first.final:
                return
        async for batch in self._token_batches():
            for delta in batch:
                if delta.error:
                    raise _AttemptFailed(delta.error, self.placement.token_worker)
                seen = max(0, emitted - position)  # the first token came from the prompt worker
                new = delta.token_ids[seen:]
                position += len(delta.token_ids)
                emitted = max(emitted, position)
                if new or delta.finish_reason:
                    logprobs = None if delta.logprobs is None else delta.logprobs[seen:]
                    yield self._record(replace(delta, token_ids=tuple(new), logprobs=logprobs))

    async def _await_first(self) -> TokenDelta:
        task, self._first = self._first, None
        try:
            first = await task
        except RayActorError:
            raise _AttemptFailed("prompt worker died", self.placement.prompt_worker, dead=True) from None
        except RayTaskError as error:  # it refused the ticket: given up by the token worker, or another layout
            raise _AttemptFailed(f"prompt worker refused the transfer: {error.cause}",
                                 self.placement.prompt_worker) from None
        if first.error:
            raise _AttemptFailed(first.error, self.placement.token_worker)
        return first

    async def _token_batches(self):
        """The attempt's deltas from its token worker's feed, in batches of what has come, through
        the final one."""
        final = False
        while not final:
            batch = [await self._deltas.get()]
            while not self._deltas.empty():
                batch.append(self._deltas.get_nowait())
            if isinstance(batch[-1], FeedBroken):
                broken = batch[-1]
                raise _AttemptFailed(broken.reason, self.placement.token_worker, dead=broken.dead)
            final = batch[-1].final
            if final:  # closed before the caller sees it: a caller stops reading at the final delta
                self.workers.feeds.close(self.placement.token_worker, self._worker_request_id)
            yield batch

    def _record(self, delta: TokenDelta) -> TokenDelta:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self.embedding is None:
            self.embedding = delta.embedding
        if self.cached_tokens is None:
            self.cached_tokens, self.cache_write_tokens = delta.cached_tokens, delta.cache_write_tokens
        if delta.prediction_tokens is not None:
            self.prediction_tokens = tuple(a + b for a, b in zip(self.prediction_tokens, delta.prediction_tokens))
        self.started.set()
        self.tokens += delta.token_ids
        self.finish_reason = delta.finish_reason
        return delta

    def _prefix_hashes(self, prompt: list[int], params: SamplingParams) -> tuple[int, ...]:
        """The prompt's blocks as the engines' prefix caches name them, for prefix-aware placement;
        none when it is off or no cache would be used (prompt logprobs still to compute)."""
        if params.prompt_logprobs is not None:
            return ()
        return self.prefix.hashes(prompt, MAX_PREFIX_BLOCKS, params.lora, params.cache_salt)

    def _remaining_params(self) -> SamplingParams:
        done, have_prompt_logprobs = len(self.tokens), self.prompt_logprobs is not None
        return replace(self.params, max_tokens=self.params.max_tokens - done,
                       min_tokens=max(0, self.params.min_tokens - done),
                       prompt_logprobs=None if have_prompt_logprobs else self.params.prompt_logprobs,
                       resumed_tokens=done)

    # ---- failover ---------------------------------------------------------------------------
    async def _recover(self, failure: _AttemptFailed) -> None:
        self.failures += 1
        log.warning("request %s: attempt failed on %s (%s); %d generated tokens kept",
                    self.request_id, failure.worker, failure, len(self.tokens))
        await self._drop_attempt()
        if failure.worker and failure.dead:
            self.workers.forget(failure.worker)
            await _quietly(self.workers.cls.worker_failed, failure.worker)
        if self.failures >= self.max_attempts:
            raise RequestFailed(f"request failed after {self.failures} attempts: {failure}")
        exclude = frozenset({failure.worker} if failure.worker else ())
        try:
            await self._start_attempt(failover=True, exclude=exclude)
        except Overloaded as error:
            raise RequestFailed(str(error)) from None
        except _AttemptFailed as again:
            await self._recover(again)

    async def _drop_attempt(self) -> None:
        """Free what the failed attempt still holds on the workers that are alive."""
        if self.placement is not None:
            await self._abort_on_workers()

    async def _abort_on_workers(self) -> None:
        if self._first is not None:  # nobody waits for the prompt worker's first token any more
            self._first.cancel()
            self._first = None
        self.workers.feeds.close(self.placement.token_worker, self._worker_request_id)
        handles = [self.token_handle] if self.placement.local else [self.token_handle, self.prompt_handle]
        for handle in handles:
            if handle is not None:  # None: the attempt failed before reaching that worker
                await _quietly(handle.abort, self._worker_request_id)


async def _quietly(method, *args) -> None:
    """A best-effort call (`method.remote(*args)`): its worker may be gone. It is sent as the
    replica's own call, not as a child of the request being served: Ray cancels a cancelled Serve
    request's child calls (a client that went away), and the abort sent then must still run."""
    try:
        await detached(method, *args)
    except (RayError, asyncio.CancelledError):
        log.debug("best-effort call failed", exc_info=True)
