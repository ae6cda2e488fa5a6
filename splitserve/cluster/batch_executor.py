"""A batch run through the cluster: the feeder's order and memory shares over the KV capacity of
the workers that decode, each request placed and streamed like an API request (the texts an
embeddings, score or rerank line embeds each run whole on a prompt worker). A request the cluster
cannot take now (429) waits and is tried again: a batch never drops work."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from splitserve.api import response_bodies as R
from splitserve.api.prepared_request import PreparedRequest
from splitserve.api.usage import Usage
from splitserve.batch.blend.cost import ModelShape
from splitserve.batch.blend.feeder import BatchFeeder, BlendOptions
from splitserve.batch.engine_runner import offline_request
from splitserve.batch.lines import BatchLine, LineRules, Prepared, answer_line, error_line, prepare_pending
from splitserve.batch.results import ResultLog, line_text
from splitserve.cluster.choices_response import ChoicesResponse, choices_for
from splitserve.cluster.dispatch import Overloaded, RequestFailed, Run, WorkerDirectory
from splitserve.cluster.embedding_runs import embeddings_of
from splitserve.cluster.large_bodies import built, encoded, logprob_tokens
from splitserve.cluster.served_adapters import ServedAdapters
from splitserve.engine.prefix_hash import PrefixNaming
from splitserve.engine.sampling_params import SamplingParams

DECODING_POOLS = ("token", "mixed")


class ClusterExecutor:
    def __init__(self, cls, model_shape: ModelShape, rules: LineRules, block_size: int, max_attempts: int,
                 retry_s: float = 1.0, prefix: PrefixNaming = PrefixNaming(), adapters: ServedAdapters | None = None):
        """`adapters`: the LoRA adapters served now, asked of the CLS as each batch starts (else the
        rules' model and `prefix` as given)."""
        self.workers, self.rules, self.prefix = WorkerDirectory(cls), rules, prefix
        self.shape, self.block_size = model_shape, block_size
        self.max_attempts, self.retry_s = max_attempts, retry_s
        self.adapters = adapters

    async def kv_tokens(self) -> int:
        """KV capacity of the decoding workers, waiting until they have reported it."""
        while True:
            workers = (await self.workers.cls.status.remote())["workers"].values()
            total = sum(w["total_kv_tokens"] for w in workers if w["pool"] in DECODING_POOLS)
            if total:
                return total
            await asyncio.sleep(self.retry_s)

    async def _refresh_adapters(self) -> None:
        """The LoRA adapters the CLS serves now, as a batch starts (with `adapters`)."""
        if self.adapters is not None:
            await self.adapters.refresh(self.workers.cls.lora_table.remote)
            self.rules, self.prefix = replace(self.rules, model=self.adapters.served), self.adapters.prefix

    async def run(self, lines: list[BatchLine], output: ResultLog, errors: ResultLog, options: BlendOptions,
                  stop: Callable[[], bool], on_result: Callable[[bool], None]) -> None:
        """Every line without a result; each prompt of a line is a request of its own in the
        feeder's order (its choices sharing one prefill), the line logged when its last ends. The
        lines are tokenized, and the feeder built and ordered, in a thread: templates and tokenizers
        take milliseconds a line, and the feeder seconds, which for 50,000 lines would hold the
        actor's loop, and every batch call, for minutes."""
        await self._refresh_adapters()
        jobs, finished = await asyncio.to_thread(prepare_pending, lines, self.rules, output, errors, on_result)
        units = [(job, k) for job, (_, prepared) in enumerate(jobs) for k in range(len(prepared.prompts))]
        requests = [offline_request(key, jobs[job][1].prompts[k], jobs[job][1].params[k],
                                    jobs[job][1].runs_per_prompt)
                    for key, (job, k) in enumerate(units)]
        resumed = {key: finished[job] / len(jobs[job][1].prompts) for key, (job, _) in enumerate(units)
                   if job in finished}  # a finished line's output, shared among its prompts
        feeder = await asyncio.to_thread(BatchFeeder, requests, options, self.shape, await self.kv_tokens(),
                                         self.block_size, resumed)
        answers = {job: _LineAnswer(len(prepared.prompts)) for job, (_, prepared) in enumerate(jobs)}
        changed = asyncio.Event()
        running: set[asyncio.Task] = set()

        async def one(key: int) -> None:
            job, k = units[key]
            (line, prepared), answer = jobs[job], answers[job]
            tokens = 0
            if not answer.failed:  # a line with a failed prompt runs no more of them
                try:
                    answer.parts[k], tokens = await self._part(line, prepared, k,
                                                               lambda: (feeder.prefilled(key), changed.set()))
                except RequestFailed as failure:
                    answer.failed = True
                    errors.append(_failed_line(line, failure))
                    on_result(False)
            if len(answer.parts) == answer.prompts:
                await _log_answer(output, line, prepared, answer.body(prepared))
                on_result(True)
            feeder.finished(key, tokens)  # after the log: the loop ends, cancelling what runs, once the feeder is done
            changed.set()

        try:
            while not feeder.done and not stop():
                admitted = await asyncio.to_thread(feeder.admit) if feeder.blend_due else feeder.admit()
                running.update(asyncio.create_task(one(request.key)) for request in admitted)
                if feeder.done:  # blend: the sample was every request left (none valid, all run before a resume)
                    break
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

    async def _part(self, line: BatchLine, prepared: Prepared, k: int, on_first: Callable[[], None]
                    ) -> tuple[tuple[ChoicesResponse, list[dict]] | tuple[float, ...], int]:
        """Prompt `k` of a line, and its output length: its reply and choices (as the endpoint
        numbers them), or the embedding of a text the line embeds. RequestFailed when every attempt failed."""
        run = await self._admitted(line.runs_as, prepared.prompts[k], prepared.params[k])
        if not isinstance(prepared, PreparedRequest):
            (vector,) = await embeddings_of([run], time.monotonic(), lambda _: None)
            on_first()
            return vector, 1
        reply = choices_for(line.runs_as, prepared.request, [run], self.rules.tokenizer,
                            follower_retry_s=self.retry_s, first_prompt=k, parsers=self.rules.parsers)
        first = asyncio.ensure_future(_after_first_token(run, on_first))
        try:
            return (reply, await reply.choices()), reply.usage.completion_tokens
        finally:
            first.cancel()

    async def _admitted(self, kind: str, prompt: list[int], params: SamplingParams) -> Run:
        """A run of `prompt`, placed: tried again while the cluster is full."""
        while True:
            run = Run(R.new_request_id(kind), prompt, params, self.workers, self.max_attempts, prefix=self.prefix)
            try:
                await run.admit()
                return run
            except Overloaded:
                await asyncio.sleep(self.retry_s)


@dataclass
class _LineAnswer:
    """A line's prompts' answers, gathered as they end (in any order)."""
    prompts: int
    # prompt -> its reply and choices, or a text the line embeds -> its embedding
    parts: dict[int, tuple[ChoicesResponse, list[dict]] | tuple[float, ...]] = field(default_factory=dict)
    failed: bool = False

    def body(self, prepared: Prepared) -> dict:
        """The endpoint's response: made of the embeddings in order; or the first prompt's id and
        time, every prompt's choices, usage summed."""
        if not isinstance(prepared, PreparedRequest):
            return prepared.body([self.parts[k] for k in range(self.prompts)])
        replies = [self.parts[k][0] for k in range(self.prompts)]
        first = replies[0]
        return R.response_body(first.kind, first.response_id, first.model, first.created,
                               [c for k in range(self.prompts) for c in self.parts[k][1]],
                               sum((r.usage for r in replies), Usage()))


async def _log_answer(output: ResultLog, line: BatchLine, prepared: Prepared, body: dict) -> None:
    """`body`'s output line, built (a Responses line's Response) and encoded in a thread when it
    carries many tokens' logprobs: on the actor's loop, 20k tokens' at top 5 held it about 0.3 s."""
    result = await built(logprob_tokens(body), answer_line, line, prepared, body)
    output.append(result, await encoded(result, line_text))


async def _after_first_token(run: Run, then: Callable[[], None]) -> None:
    await run.started.wait()
    then()


def _failed_line(line: BatchLine, failure: RequestFailed) -> dict:
    """A line the cluster could not finish (every attempt failed): a 503, as the API answers."""
    return error_line(line.custom_id, failure.as_error())
