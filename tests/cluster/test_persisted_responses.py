"""The response store on disk: a store opened again on its directory (a restarted controller)
answers as the one before it did (responses, continuations, input items, LRU order by last kept);
deletes, bounds and a shrunk bound at restart leave no file behind; an in-progress background
response comes back with a fresh lease; a store replacing one waits for its lock, while a second
server on the same directory keeps its responses in memory until it takes the directory over (its
own newer than the files'); a file that does not read is left out, and left there; one that
cannot be written leaves its response in memory."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from splitserve.api.json_pieces import json_text
from splitserve.api.response_store import LEASE_S, Stored
from splitserve.cluster import persisted_responses
from splitserve.cluster.persisted_responses import PersistedResponseStore
from tests.api.test_response_store import get, items, put, response, settle, with_logprobs


def files(root) -> set[str]:
    return {path.name for path in root.iterdir() if path.is_file()} - {".lock"}


def test_a_store_opened_again_answers_as_the_one_before_it(tmp_path):
    first = PersistedResponseStore(10, 1 << 20, tmp_path)
    for n in range(3):
        kept = (with_logprobs if n == 2 else response)(f"resp_{n}", f"answer {n}")
        put(first, kept, items(f"question {n}", "and more"))
    first.delete("resp_1")
    answers = {r: (first.get(r), first.context(r), first.input_items(r)) for r in ("resp_0", "resp_2")}
    first._lock.release()  # the process that held it exited
    again = PersistedResponseStore(10, 1 << 20, tmp_path)
    assert {r: (again.get(r), again.context(r), again.input_items(r)) for r in answers} == answers
    assert get(again, "resp_1") is None and files(tmp_path) == {"resp_0.json", "resp_2.json"}
    assert len(again) == 2 and again.bytes == first.bytes


def test_the_bounds_drop_files_too_and_a_smaller_bound_at_restart_keeps_the_latest(tmp_path):
    store = PersistedResponseStore(3, 1 << 20, tmp_path)
    for n in range(5):  # kept within one tick of the file system's clock: the order is the files' own
        put(store, response(f"resp_{n}"), [])
    assert files(tmp_path) == {"resp_2.json", "resp_3.json", "resp_4.json"}
    put(store, response("resp_2", "kept again"), [])  # a re-keep replaces its file, and is the latest now
    assert json.loads((tmp_path / "resp_2.json").read_text())["response"]["output"][0]["content"][0]["text"] == \
        "kept again"
    store._lock.release()
    smaller = PersistedResponseStore(2, 1 << 20, tmp_path)
    assert files(tmp_path) == {"resp_2.json", "resp_4.json"} and get(smaller, "resp_3") is None


def test_an_in_progress_background_response_comes_back_with_a_fresh_lease(tmp_path):
    first = PersistedResponseStore(10, 1 << 20, tmp_path)
    for response_id in ("resp_a", "resp_b"):
        put(first, {**response(response_id), "status": "in_progress", "background": True, "output": []}, items("?"))
    first._lock.release()
    now = [1000.0]
    again = PersistedResponseStore(10, 1 << 20, tmp_path, clock=lambda: now[0])
    now[0] += LEASE_S * 0.9
    assert again.statuses(["resp_a"]) == ["in_progress"]  # the replica that runs it renews it
    now[0] += LEASE_S * 0.2
    assert again.status("resp_b") == "failed"  # nobody runs it any more
    assert settle(again, {**response("resp_a", "five"), "status": "completed"})
    again._lock.release()
    back = PersistedResponseStore(10, 1 << 20, tmp_path)
    assert [back.status(r) for r in ("resp_a", "resp_b")] == ["completed", "failed"]


def test_a_store_that_replaces_one_waits_for_it_to_give_the_directory_up(tmp_path):
    old = PersistedResponseStore(10, 1 << 20, tmp_path)
    put(old, response("resp_a"), [])
    threading.Timer(0.3, old._lock.release).start()  # its process exits a moment after the new one starts
    assert get(PersistedResponseStore(10, 1 << 20, tmp_path), "resp_a") == response("resp_a")


def test_a_second_server_keeps_its_responses_in_memory_until_it_takes_the_directory_over(tmp_path, monkeypatch):
    monkeypatch.setattr(persisted_responses, "TAKE_OVER_WAIT_S", 0.2)
    owner = PersistedResponseStore(10, 1 << 20, tmp_path)
    other = PersistedResponseStore(10, 1 << 20, tmp_path)
    put(other, response("resp_b"), [])
    assert other.directory is None and get(other, "resp_b") and files(tmp_path) == set()
    put(owner, response("resp_a"), [])
    put(owner, response("resp_c", "older"), [])
    assert files(tmp_path) == {"resp_a.json", "resp_c.json"} and not other.take_over()
    put(other, response("resp_c", "newer"), [])
    owner._lock.release()  # the old cluster is gone
    assert other.take_over() and other.directory == tmp_path
    assert [get(other, r) for r in ("resp_a", "resp_b", "resp_c")] == \
        [response("resp_a"), response("resp_b"), response("resp_c", "newer")]
    assert files(tmp_path) == {"resp_a.json", "resp_b.json", "resp_c.json"}
    other._lock.release()
    assert get(PersistedResponseStore(10, 1 << 20, tmp_path), "resp_c") == response("resp_c", "newer")


def test_a_file_that_does_not_read_is_left_out_and_left_there_and_a_torn_write_removed(tmp_path):
    (tmp_path / "resp_bad.json").write_text('{"response": ')
    (tmp_path / ".resp_c.json.tmp").write_text("{")
    store = PersistedResponseStore(10, 1 << 20, tmp_path)
    assert len(store) == 0 and files(tmp_path) == {"resp_bad.json"}


def test_without_a_directory_it_keeps_them_in_memory():
    store = PersistedResponseStore(10, 1 << 20, None)
    assert put(store, response("resp_a"), []) and get(store, "resp_a") and store.directory is None


def test_a_file_that_cannot_be_written_leaves_the_response_kept_in_memory(tmp_path, monkeypatch):
    store = PersistedResponseStore(10, 1 << 20, tmp_path)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    assert put(store, response("resp_a"), []) and get(store, "resp_a") == response("resp_a")
    assert files(tmp_path) == set()


def test_a_file_written_before_files_were_lines_reads(tmp_path):
    """A response's file from before: one JSON object, no newline at its end."""
    (tmp_path / "resp_a.json").write_text(json.dumps({"sequence": 7, "response": response("resp_a"), "items": []}))
    store = PersistedResponseStore(10, 1 << 20, tmp_path)
    assert get(store, "resp_a") == response("resp_a")
    put(store, response("resp_b"), [])
    store._lock.release()
    assert [r for r in PersistedResponseStore(1, 1 << 20, tmp_path)._entries] == ["resp_b"]  # written after it


def test_a_kept_response_is_written_as_the_text_it_came_as(tmp_path, monkeypatch):
    """The replica encoded it (20k tokens' logprobs: about 0.3 s): the store encodes nothing, and
    its file, read as UTF-8 whatever the locale, holds the same text."""
    kept, question = response("resp_0", "réponse ✓"), items("question")
    text, items_text, dumps = json_text(kept), json_text(question), json.dumps

    def keys_only(value, *args, **kwargs):  # a line's keys ("items") are encoded where it is written
        assert isinstance(value, str), f"encoded again: {value!r}"
        return dumps(value, *args, **kwargs)

    monkeypatch.setattr(json, "dumps", keys_only)
    store = PersistedResponseStore(10, 1 << 20, tmp_path)
    store.put(Stored.of(kept, text), items_text)
    monkeypatch.undo()
    line = (tmp_path / "resp_0.json").read_bytes().decode("utf-8")
    assert text in line and json.loads(line)["response"] == kept and json.loads(line)["items"] == question


def test_a_store_reading_its_files_back_encodes_nothing(tmp_path, monkeypatch):
    """Each kept response's size is its text in the file (20k tokens' logprobs: 0.3 s to encode again)."""
    first = PersistedResponseStore(10, 1 << 20, tmp_path)
    put(first, response("resp_0", "answer"), items("question"))
    first._lock.release()
    monkeypatch.setattr(json, "dumps", lambda *args, **kwargs: pytest.fail("encoded again"))
    again = PersistedResponseStore(10, 1 << 20, tmp_path)
    assert again.bytes == first.bytes and again.get("resp_0") == first.get("resp_0")
