"""An embeddings request's runs: each one's embedding once it finishes, in order, each observed;
one that fails fails the request, and the others still running are stopped, not left to run."""
from __future__ import annotations

import asyncio

import pytest

from splitserve.cluster.dispatch import RequestFailed
from splitserve.cluster.embedding_runs import embeddings_of
from splitserve.engine.sampling_params import SamplingParams


class FakeRun:
    """A run that finishes after `delay` s with `embedding` (None: it fails)."""

    def __init__(self, name: str, embedding, delay: float = 0.0):
        self.request_id, self.prompt, self.params = name, [1, 2, 3], SamplingParams(max_tokens=1, embed=True)
        self.failures = self.refusals = 0
        self.cached_tokens, self.finish_reason, self.aborted = 2, None, False
        self._embedding, self._delay, self.embedding = embedding, delay, None

    async def deltas(self):
        await asyncio.sleep(self._delay)
        if self._embedding is None:
            raise RequestFailed(f"{self.request_id} failed on every worker")
        self.embedding, self.finish_reason = self._embedding, "length"
        yield ()

    async def abort(self) -> None:
        self.aborted, self.finish_reason = True, "abort"


def test_each_runs_embedding_in_order_and_each_observed():
    seen = []
    runs = [FakeRun("a", (1.0, 0.0), delay=0.02), FakeRun("b", (0.0, 1.0))]
    assert asyncio.run(embeddings_of(runs, 0.0, seen.append)) == [(1.0, 0.0), (0.0, 1.0)]
    assert [(o.outcome, o.prompt_tokens, o.generated_tokens, o.cached_prompt_tokens) for o in seen] == [
        ("completed", 3, 0, 2)] * 2
    assert not any(run.aborted for run in runs)


def test_a_failed_run_fails_the_request_and_stops_the_others():
    seen = []
    runs = [FakeRun("a", None), FakeRun("slow", (1.0,), delay=30.0)]
    with pytest.raises(RequestFailed, match="a failed"):
        asyncio.run(asyncio.wait_for(embeddings_of(runs, 0.0, seen.append), 10))
    assert runs[1].aborted and [o.outcome for o in seen] == ["failed"]


def test_a_run_that_ends_without_an_embedding_fails_rather_than_answers_nothing():
    run = FakeRun("a", (1.0,))
    run._embedding = ()  # finishes, yet no embedding came with it

    async def ended():
        run.finish_reason = "length"
        yield ()
    run.deltas = ended
    with pytest.raises(RequestFailed, match="without its embedding"):
        asyncio.run(embeddings_of([run], 0.0, lambda _: None))
