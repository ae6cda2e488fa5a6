"""The batch API's errors cross from the manager actor to the routes whole: status, message,
param, type and code, as the service raised them (Ray left out: the manager's `call` and the
proxy, joined by a stand-in for the actor handle)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from splitserve.api.errors import RequestError
from splitserve.batch.store import NotFound
from splitserve.cluster.batch_manager import BatchManager, RemoteBatches
from splitserve.cluster.owned_actor import OwnedActor


class Service:
    def create_file(self, *args):
        raise RequestError("owned elsewhere", status=503, type="service_unavailable", code="batch_store_owned")

    def get_batch(self, batch_id):
        raise NotFound("batch", batch_id)

    def list_files(self, purpose=None):
        return {"object": "list", "data": [], "has_more": False}

    async def create_batch(self, input_file_id, *args):  # the service's coroutines are awaited in the actor
        if input_file_id == "file-missing":
            raise NotFound("file", input_file_id)
        return {"id": "batch_1", "input_file_id": input_file_id}


def remote() -> RemoteBatches:
    manager = BatchManager.__new__(BatchManager)  # its constructor loads a model's metadata: not needed here
    manager.service = Service()
    handle = SimpleNamespace(call=SimpleNamespace(remote=manager.call))  # an actor handle's shape

    async def get_handle():
        return handle

    return RemoteBatches(OwnedActor(get_handle, "batch API's actor"))


def test_errors_keep_every_field_and_results_pass_through():
    batches = remote()
    with pytest.raises(RequestError) as owned:
        asyncio.run(batches.create_file(b"", "x.jsonl", "batch"))
    assert (owned.value.status, owned.value.message, owned.value.param, owned.value.type, owned.value.code) == \
        (503, "owned elsewhere", None, "service_unavailable", "batch_store_owned")
    with pytest.raises(RequestError) as missing:
        asyncio.run(batches.get_batch("batch_x"))
    assert (missing.value.status, missing.value.param, missing.value.type) == (404, "id", "invalid_request_error")
    assert "batch_x" in missing.value.message
    assert asyncio.run(batches.list_files())["object"] == "list"
    assert asyncio.run(batches.create_batch("file-1", "/v1/completions", "24h"))["input_file_id"] == "file-1"
    with pytest.raises(RequestError) as awaited:
        asyncio.run(batches.create_batch("file-missing", "/v1/completions", "24h"))
    assert (awaited.value.status, awaited.value.param) == (404, "id")
