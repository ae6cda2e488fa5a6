"""The conversations on disk, kept by the response store's actor beside its responses: a store
opened again answers as the one before it (items, metadata; which changed last); deletes and the
bounds, a shrunk bound at restart too, leave no file behind; a second server keeps its
conversations in memory until it takes the directory over, then on disk too; a file that does not
read is left out, and left there. An add appends a line (the file is not written again); a line a
crash cut short is cut off, and the next add starts a line of its own."""
from __future__ import annotations

import json

from splitserve.cluster import persisted_responses
from splitserve.cluster.persisted_responses import PersistedResponseStore
from tests.api.test_conversation_store import message


def store_at(root, count: int = 10, size: int = 1 << 20) -> PersistedResponseStore:
    return PersistedResponseStore(10, 1 << 20, root, max_conversations=count, max_conversation_bytes=size)


def files(root) -> set[str]:
    return {path.name for path in (root / "conversations").iterdir()}


def test_a_store_opened_again_answers_as_the_one_before_it(tmp_path):
    first = store_at(tmp_path)
    kept = [first.conversation("create", {"n": str(n)}, [message(f"msg_{n}")])["id"] for n in range(3)]
    first.conversation("add", kept[0], [message("msg_more")])
    first.conversation("delete_item", kept[0], "msg_0")
    first.conversation("delete", kept[1])
    answers = {c: (first.conversation("get", c), first.conversation("context", c)) for c in (kept[0], kept[2])}
    first._lock.release()  # the process that held it exited
    again = store_at(tmp_path)
    assert {c: (again.conversation("get", c), again.conversation("context", c)) for c in answers} == answers
    assert files(tmp_path) == {f"{kept[0]}.jsonl", f"{kept[2]}.jsonl"} and again.conversations.bytes == \
        first.conversations.bytes
    again._lock.release()
    smaller = store_at(tmp_path, count=1)  # kept[0] changed last (reads are not written down)
    assert len(smaller.conversations) == 1 and files(tmp_path) == {f"{kept[0]}.jsonl"}


def test_the_bounds_drop_files_too(tmp_path):
    store = store_at(tmp_path, count=2)
    kept = [store.conversation("create", {}, [])["id"] for _ in range(3)]
    assert files(tmp_path) == {f"{kept[1]}.jsonl", f"{kept[2]}.jsonl"}


def test_a_second_server_keeps_its_conversations_in_memory_until_it_takes_the_directory_over(tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setattr(persisted_responses, "TAKE_OVER_WAIT_S", 0.2)
    owner = store_at(tmp_path)
    other = store_at(tmp_path)
    theirs = other.conversation("create", {}, [message("msg_b")])["id"]
    ours = owner.conversation("create", {}, [message("msg_a")])["id"]
    assert files(tmp_path) == {f"{ours}.jsonl"} and not other.take_over()
    owner._lock.release()  # the old cluster is gone
    assert other.take_over()
    assert other.conversation("context", ours) == [message("msg_a")]
    assert other.conversation("context", theirs) == [message("msg_b")]
    assert files(tmp_path) == {f"{ours}.jsonl", f"{theirs}.jsonl"}


def test_a_file_that_does_not_read_is_left_out_and_left_there(tmp_path):
    (tmp_path / "conversations").mkdir()
    (tmp_path / "conversations" / "conv_bad.jsonl").write_text(json.dumps({"sequence": 1, "items": []}))
    store = store_at(tmp_path)
    assert len(store.conversations) == 0 and files(tmp_path) == {"conv_bad.jsonl"}


def test_an_add_appends_a_line_and_a_torn_one_is_cut_off(tmp_path):
    store = store_at(tmp_path)
    cid = store.conversation("create", {}, [message("msg_0")])["id"]
    path = tmp_path / "conversations" / f"{cid}.jsonl"
    for n in (1, 2):
        before = path.read_bytes()
        store.conversation("add", cid, [message(f"msg_{n}")])
        assert path.read_bytes().startswith(before)  # appended, not written again
    assert len(path.read_text().splitlines()) == 3
    store._lock.release()
    with open(path, "a") as file:  # a crash in the middle of the next add
        file.write('{"sequence": 99, "items": [{"type": "mess')
    again = store_at(tmp_path)
    assert [i["id"] for i in again.conversation("context", cid)] == ["msg_0", "msg_1", "msg_2"]
    assert again.conversations.bytes == store.conversations.bytes
    again.conversation("add", cid, [message("msg_3")])
    again.conversation("update", cid, {"k": "v"})  # written whole again
    assert len(path.read_text().splitlines()) == 1
    again.conversation("add", cid, [message("msg_4")])
    again._lock.release()
    last = store_at(tmp_path)
    assert [i["id"] for i in last.conversation("context", cid)] == [f"msg_{n}" for n in range(5)]
    assert last.conversation("get", cid)["metadata"] == {"k": "v"}
