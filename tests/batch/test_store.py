"""The batch store's objects: ids in creation order, bounded ids and metadata, and object files
it cannot read left out of its lists."""
from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient

from splitserve.batch.service import BatchService
from splitserve.batch.store import BatchStore
from tests.batch.batch_helpers import as_jsonl, batch_lines
from tests.batch.batch_server import make_app
from tests.batch.test_service import ThreadExecutor


def test_ids_metadata_and_unreadable_objects_are_bounded(tmp_path, caplog):
    service = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0))
    with TestClient(make_app(service)) as http:
        for path in ("/v1/files/file-" + "a" * 300, "/v1/batches/batch_" + "a" * 300, "/v1/files/file-a%00b"):
            answer = http.get(path)
            assert answer.status_code == 404 and answer.json()["error"]["message"].startswith("No such")
        file_id = asyncio.run(service.create_file(as_jsonl(batch_lines(1)), "in.jsonl", "batch"))["id"]
        for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}):
            answer = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                    "completion_window": "24h", "metadata": metadata})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "metadata"
        (tmp_path / "batches" / "batch_torn.json").write_bytes(b"")  # a store copied half-way
        (tmp_path / "files" / "file-torn.json").write_bytes(b"{")
        assert http.get("/v1/batches").status_code == 200 and len(http.get("/v1/files").json()["data"]) == 1
    assert "batch_torn.json is unreadable" in caplog.text and "file-torn.json is unreadable" in caplog.text


def test_objects_made_in_one_second_list_and_resume_in_creation_order(tmp_path):
    store = BatchStore(tmp_path, clock=lambda: 1_800_000_000)
    files = [store.add_file(b"{}\n", f"{i}.jsonl", "batch")["id"] for i in range(8)]
    batches = [store.new_batch(files[0], "/v1/completions", "24h", None)["id"] for _ in range(8)]
    assert [f["id"] for f in store.files()] == files[::-1] and [b["id"] for b in store.batches()] == batches[::-1]
