"""A running batch's progress (request counts and usage): saved a few times a second rather than
at every result, and once more when its run returns, so a cancelled batch's counts are its output."""
from __future__ import annotations

import asyncio
import time

from splitserve.batch import service as service_module
from splitserve.batch.service import BatchService
from splitserve.batch.store import BatchStore
from tests.batch.batch_helpers import LINE_USAGE, as_jsonl, batch_lines
from tests.batch.test_service import ThreadExecutor, cancel_mid_run


def _counting_saves(store: BatchStore, monkeypatch) -> list[dict]:
    """The request counts of each save of a batch object."""
    saves, update = [], store.update_batch

    def counted(batch_id, **changes):
        if "request_counts" in changes:
            saves.append(changes["request_counts"])
        return update(batch_id, **changes)

    monkeypatch.setattr(store, "update_batch", counted)
    return saves


def test_a_running_batchs_counts_are_saved_a_few_times_a_second_not_per_result(tmp_path, monkeypatch):
    store = BatchStore(tmp_path)
    saves = _counting_saves(store, monkeypatch)

    async def scenario():
        service = BatchService(store, ThreadExecutor(step_s=0.002))
        await service.start()
        upload = await service.create_file(as_jsonl(batch_lines(300)), "in.jsonl", "batch")
        batch_id = (await service.create_batch(upload["id"], "/v1/completions", "24h"))["id"]
        start = time.monotonic()
        while service.get_batch(batch_id)["status"] != "completed":
            await asyncio.sleep(0.01)
        took = time.monotonic() - start
        await service.stop()
        return service.get_batch(batch_id), took

    batch, took = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert batch["request_counts"] == {"total": 300, "completed": 300, "failed": 0}
    assert batch["usage"]["output_tokens"] == 300 * LINE_USAGE.completion_tokens
    assert len(saves) <= 5 + took / service_module.SAVE_EVERY_S, (len(saves), took)  # it was 300 and more


def test_a_cancelled_batchs_counts_are_its_output_lines(tmp_path, monkeypatch):
    """The counts are saved when the run returns, so those between saves are not lost."""
    monkeypatch.setattr(service_module, "SAVE_EVERY_S", 3600.0)
    store = BatchStore(tmp_path)

    async def scenario():
        service = BatchService(store, ThreadExecutor(step_s=0.01))
        await service.start()
        return await cancel_mid_run(service, 100, 5)

    batch, output = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert batch["request_counts"]["completed"] == len(output) >= 5
    assert batch["usage"]["output_tokens"] == len(output) * LINE_USAGE.completion_tokens

