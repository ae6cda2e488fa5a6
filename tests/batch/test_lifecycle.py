"""A batch's lifecycle in the service: a queued batch cancels at once, an active batch's input
stays, an end interrupted while the logs move is applied again, and an invalid input fails at
creation."""
from __future__ import annotations

import asyncio

import pytest

from splitserve.api.errors import RequestError
from splitserve.batch import service as service_module
from splitserve.batch.service import BatchService
from splitserve.batch.store import BatchStore
from tests.batch.batch_helpers import as_jsonl, batch_lines
from tests.batch.test_service import ThreadExecutor, cancel_mid_run


def test_a_queued_batch_cancels_at_once_and_an_active_batchs_input_stays(tmp_path):
    """Cancelling a batch that waits behind another ends it at once (it used to wait for the queue);
    a retried cancel of a cancelling batch answers it; an active batch's input cannot be deleted
    (a resumed batch reads it again)."""
    async def scenario():
        service = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0.05))
        await service.start()
        inputs = [(await service.create_file(as_jsonl(batch_lines(40)), "in.jsonl", "batch"))["id"] for _ in range(2)]
        running, queued = [(await service.create_batch(i, "/v1/completions", "24h"))["id"] for i in inputs]
        while not service.executor.started.is_set():
            await asyncio.sleep(0.01)
        for file_id, status in zip(inputs, ("in_progress", "validating")):
            with pytest.raises(RequestError) as refused:
                service.delete_file(file_id)
            assert (refused.value.status, refused.value.param) == (409, "file_id")
            assert f"which is {status}: cancel the batch" in refused.value.message
        assert service.cancel_batch(queued)["status"] == "cancelled"
        assert service.delete_file(inputs[1])["deleted"]
        assert service.cancel_batch(running)["status"] == "cancelling"
        assert service.cancel_batch(running)["status"] in ("cancelling", "cancelled")  # a retry: no 409
        while service.get_batch(running)["status"] != "cancelled":
            await asyncio.sleep(0.01)
        with pytest.raises(RequestError) as ended:
            service.cancel_batch(running)
        assert ended.value.status == 409 and service.delete_file(inputs[0])["deleted"]
        await service.stop()
        return service.get_batch(running), service.get_batch(queued)

    running, queued = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert 0 < running["request_counts"]["completed"] < 40 and running["output_file_id"]
    assert queued["cancelled_at"] and queued["output_file_id"] is None


def test_a_fault_while_the_logs_move_ends_the_batch_as_it_was_ending(tmp_path, monkeypatch):
    """The end is saved before the logs become files: a run that raises (or a server that dies)
    after moving the output log ends the batch the same way, its output kept (a cancelled batch
    used to open its moved logs anew, empty, and end with no output)."""
    monkeypatch.setattr(service_module, "RERUN_AFTER_S", 0)
    adopt, faults = BatchService._adopt_logs, []

    def adopt_then_die(self, batch_id):
        files = adopt(self, batch_id)
        if not faults:
            faults.append(batch_id)
            raise OSError("the server died while the logs moved")
        return files

    monkeypatch.setattr(BatchService, "_adopt_logs", adopt_then_die)

    async def scenario():
        service = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0.05))
        await service.start()
        return await cancel_mid_run(service, 40, 3)

    batch, output = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert faults and len(output) == batch["request_counts"]["completed"] >= 3


def test_an_invalid_input_fails_its_batch_at_creation_not_behind_the_queue(tmp_path):
    async def scenario():
        service = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0.05))
        await service.start()
        upload = await service.create_file(as_jsonl(batch_lines(40)), "in.jsonl", "batch")
        running = (await service.create_batch(upload["id"], "/v1/completions", "24h"))["id"]
        broken = await service.create_batch((await service.create_file(b"{oops\n", "bad.jsonl", "batch"))["id"],
                                            "/v1/completions", "24h")
        assert service.get_batch(running)["status"] in ("validating", "in_progress")
        await service.stop()
        return broken

    broken = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert broken["status"] == "failed" and broken["errors"]["data"][0]["line"] == 1
