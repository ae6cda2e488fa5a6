"""A batch file run on one in-process engine (`splitserve batch`, and the batch API's executor
when no cluster serves it): lines prepared like HTTP requests, run in BlendServe (or dfs / fcfs)
order, every result synced to the output or error log as it finishes, so a rerun after a crash
resumes where the logs end."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from splitserve.api.limits import RequestLimits
from splitserve.batch.blend.feeder import BlendOptions
from splitserve.batch.engine_runner import BatchStats, run_batch
from splitserve.batch.lines import BatchLine, prepare_pending, response_body, result_line
from splitserve.batch.results import ResultLog
from splitserve.engine.llm_engine import LLMEngine


def run_lines(engine: LLMEngine, lines: list[BatchLine], model: str, output: ResultLog, errors: ResultLog,
              options: BlendOptions, stop: Callable[[], bool] = lambda: False,
              on_result: Callable[[bool], None] = lambda ok: None, limits: RequestLimits = RequestLimits()
              ) -> BatchStats:
    """Run every line without a result in `output` or `errors`; lines already there count as
    samples of output length. `on_result(ok)` after each line is logged."""
    jobs, finished = prepare_pending(lines, engine.tokenizer, model, engine.max_model_len, output, errors, on_result,
                                     limits)

    def record(key: int, out) -> None:
        line = jobs[key][0]
        body = response_body(line.kind, model, out.text, out.finish_reason, len(out.prompt_token_ids),
                             len(out.token_ids))
        output.append(result_line(line.custom_id, 200, body))
        on_result(True)

    items = [(prepared.prompt, prepared.params) for _, prepared in jobs]
    return run_batch(engine, items, options, record, finished, stop=stop)


class EngineExecutor:
    """The batch service's executor on one in-process engine (run in a thread, off the event loop)."""

    def __init__(self, engine: LLMEngine, model: str, limits: RequestLimits = RequestLimits()):
        self.engine, self.model, self.limits = engine, model, limits

    async def run(self, lines: list[BatchLine], output: ResultLog, errors: ResultLog, options: BlendOptions,
                  stop: Callable[[], bool], on_result: Callable[[bool], None]) -> None:
        await asyncio.to_thread(run_lines, self.engine, lines, self.model, output, errors, options, stop, on_result,
                                self.limits)
