"""A batch run through the cluster: the feeder's order and memory shares over the KV capacity of
the workers that decode, each request placed and streamed like an API request. A request the
cluster cannot take now (429) waits and is tried again: a batch never drops work."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from splitserve.api import response_bodies as R
from splitserve.api.errors import RequestError
from splitserve.api.limits import RequestLimits
from splitserve.api.lazy_grammar import LazyGrammar
from splitserve.batch.blend.cost import ModelShape
from splitserve.batch.blend.feeder import BatchFeeder, BlendOptions
from splitserve.batch.engine_runner import offline_request
from splitserve.batch.lines import (
    BatchLine,
    Prepared,
    completion_tokens,
    error_line,
    prepare_pending,
    result_line,
)
from splitserve.batch.results import ResultLog
from splitserve.cluster.choices_response import choices_for
from splitserve.cluster.dispatch import Overloaded, RequestFailed, Run, WorkerDirectory

DECODING_POOLS = ("token", "mixed")


class ClusterExecutor:
    def __init__(self, cls, model_shape: ModelShape, tokenizer, vocab_size: int, model: str | tuple[str, ...],
                 max_model_len: int, block_size: int, max_attempts: int, retry_s: float = 1.0,
                 limits: RequestLimits = RequestLimits(), prefix_block_size: int = 0):
        self.workers, self.limits = WorkerDirectory(cls), limits
        self.grammar = LazyGrammar(tokenizer, vocab_size)  # structured output's constraints compile up front
        self.prefix_block_size = prefix_block_size  # ClusterConfig.prefix_block_size
        self.shape, self.tokenizer, self.model = model_shape, tokenizer, model
        self.max_model_len, self.block_size = max_model_len, block_size
        self.max_attempts, self.retry_s = max_attempts, retry_s

    async def kv_tokens(self) -> int:
        """KV capacity of the decoding workers, waiting until they have reported it."""
        while True:
            workers = (await self.workers.cls.status.remote())["workers"].values()
            total = sum(w["total_kv_tokens"] for w in workers if w["pool"] in DECODING_POOLS)
            if total:
                return total
            await asyncio.sleep(self.retry_s)

    async def run(self, lines: list[BatchLine], output: ResultLog, errors: ResultLog, options: BlendOptions,
                  stop: Callable[[], bool], on_result: Callable[[bool], None]) -> None:
        jobs, finished = prepare_pending(lines, self.tokenizer, self.model, self.max_model_len, output, errors,
                                         on_result, self.limits, self.grammar.check)
        requests = [offline_request(key, p.prompt, p.params, p.request.num_choices()[0])
                    for key, (_, p) in enumerate(jobs)]  # a line: one request, its choices sharing one prefill
        feeder = BatchFeeder(requests, options, self.shape, await self.kv_tokens(), self.block_size, finished)
        changed = asyncio.Event()
        running: set[asyncio.Task] = set()

        async def one(key: int) -> None:
            line, prepared = jobs[key]
            ok = await self._request(line, prepared, output, errors, lambda: (feeder.prefilled(key), changed.set()))
            feeder.finished(key, completion_tokens(output.done.get(line.custom_id, {})))
            on_result(ok)
            changed.set()

        try:
            while not feeder.done and not stop():
                for request in feeder.admit():
                    running.add(asyncio.create_task(one(request.key)))
                if not running:
                    raise RuntimeError("the batch stalled: nothing is running and the feeder admits nothing")
                changed.clear()
                waiter = asyncio.create_task(changed.wait())
                done, _ = await asyncio.wait({*running, waiter}, timeout=self.retry_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                for task in done - {waiter}:
                    running.discard(task)
                    task.result()  # a bug in the loop surfaces here
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _request(self, line: BatchLine, prepared: Prepared, output: ResultLog, errors: ResultLog,
                       on_first: Callable[[], None]) -> bool:
        """One line: placed (retried while the cluster is full), its choices collected as the
        endpoint's response, logged. True if it succeeded."""
        while True:
            run = Run(R.new_request_id(line.kind), prepared.prompt, prepared.params, self.workers, self.max_attempts,
                      prefix_block_size=self.prefix_block_size)
            try:
                await run.admit()
                break
            except Overloaded:
                await asyncio.sleep(self.retry_s)
            except RequestFailed as failure:
                errors.append(_failed_line(line, failure))
                return False
        reply = choices_for(line.kind, prepared.request, [run], self.tokenizer, follower_retry_s=self.retry_s)
        first = asyncio.ensure_future(_after_first_token(run, on_first))
        try:
            body = await reply.body()
        except RequestFailed as failure:
            errors.append(_failed_line(line, failure))
            return False
        finally:
            first.cancel()
        output.append(result_line(line.custom_id, 200, body))
        return True


async def _after_first_token(run: Run, then: Callable[[], None]) -> None:
    await run.started.wait()
    then()


def _failed_line(line: BatchLine, failure: RequestFailed) -> dict:
    """A line the cluster could not finish (every attempt failed): a 503, as the API answers."""
    return error_line(line.custom_id, RequestError(str(failure), 503, type="service_unavailable"))
