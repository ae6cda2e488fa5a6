"""ClusterExecutor without Ray: a batch's lines are tokenized and checked off the batch actor's
event loop (its other batches' requests and the API's batch calls go on meanwhile)."""
from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest

from splitserve.batch.blend.cost import ModelShape
from splitserve.batch.blend.feeder import BlendOptions
from splitserve.batch.lines import LineRules, parse_input
from splitserve.batch.results import ResultLog
from splitserve.cluster.batch_executor import ClusterExecutor, _log_answer
from splitserve.engine.tokenizer import ByteTokenizer
from tests.batch.batch_helpers import answered, as_jsonl, batch_lines
from tests.cluster.test_run_response import chat_logprobs_body
from tests.loop_ticks import loop_ticks_during


class _CLS:
    """Answers the executor's one question: the decoding workers' KV capacity."""

    class status:
        @staticmethod
        async def remote() -> dict:
            return {"workers": {"w0": {"pool": "token", "total_kv_tokens": 4096}}}


def executor(max_model_len: int) -> ClusterExecutor:
    return ClusterExecutor(_CLS(), ModelShape(1e6, 64, 64, 2), LineRules(ByteTokenizer(), "demo", max_model_len, 64),
                           block_size=16, max_attempts=1)


def run(executor: ClusterExecutor, lines: list[dict], tmp_path, on_result=lambda ok: None) -> None:
    """`executor` runs `lines` (their results logged under tmp_path, appended to what is there)."""
    parsed = parse_input(as_jsonl(lines), "/v1/completions", len(lines))
    with ResultLog(tmp_path / "out.jsonl") as output, ResultLog(tmp_path / "errors.jsonl") as errors:
        asyncio.run(asyncio.wait_for(executor.run(parsed, output, errors, BlendOptions(), lambda: False, on_result),
                                     60))


def test_a_batch_with_nothing_left_to_run_ends(tmp_path):
    """Every line refused, or every line run before a resume: the blend order starts on an empty
    sample and admits nothing, which the loop took for a stall (a RuntimeError failed the batch)."""
    results = []
    run(executor(max_model_len=16), batch_lines(3), tmp_path, results.append)  # ~90-token prompts
    assert results == [False] * 3
    assert len((tmp_path / "errors.jsonl").read_text().splitlines()) == 3
    (tmp_path / "out.jsonl").write_bytes(as_jsonl([answered(f"req-{i}") for i in range(3)]))
    run(executor(max_model_len=4096), batch_lines(3), tmp_path, results.append)
    assert results == [False] * 3  # nothing ran again


def test_a_batchs_lines_are_prepared_while_the_event_loop_runs(tmp_path):
    """5,000 prompts longer than the model takes: each is tokenized, then refused (a 400 logged),
    about 0.25 ms a line here; prepared on the loop, it ticked not once meanwhile."""
    lines = parse_input(as_jsonl(batch_lines(5_000)), "/v1/completions", 5_000)
    results: list[tuple[bool, threading.Thread]] = []

    async def scenario() -> None:
        with ResultLog(tmp_path / "out.jsonl") as output, ResultLog(tmp_path / "errors.jsonl") as errors:
            await executor(max_model_len=16).run(lines, output, errors, BlendOptions(), lambda: False,
                                                 lambda ok: results.append((ok, threading.current_thread())))

    ticks = asyncio.run(asyncio.wait_for(loop_ticks_during(scenario()), 60))
    assert len(results) == 5_000 and not any(ok for ok, _ in results)
    assert ticks >= 10
    assert threading.main_thread() not in {thread for _, thread in results}  # asyncio.run's loop is the main one
    assert len((tmp_path / "errors.jsonl").read_text().splitlines()) == 5_000


@pytest.mark.quiet
def test_logging_an_answer_with_many_tokens_logprobs_lets_the_event_loop_run(tmp_path):
    """A line's answer with 40k tokens' logprobs at top 5 is encoded in a thread, in pieces: on the
    batch actor's loop, one call of the encoder held it throughout (20k tokens': 0.3 s on a busy
    core, 0.09 s on a fast one; it did not tick once)."""
    body = chat_logprobs_body(40_000)
    line = parse_input(as_jsonl(batch_lines(1)), "/v1/completions", 1)[0]

    async def scenario() -> int:
        with ResultLog(tmp_path / "out.jsonl") as output:
            return await loop_ticks_during(_log_answer(output, line, SimpleNamespace(responses=None), body))

    assert asyncio.run(scenario()) >= 10
    logged = json.loads((tmp_path / "out.jsonl").read_text())
    assert logged["custom_id"] == line.custom_id and logged["response"]["body"] == body
