"""The conversations on disk, kept by the response store's actor beside its responses: a store
opened again answers as the one before it (items, metadata; which changed last); deletes and the
bounds, a shrunk bound at restart too, leave no file behind; a second server keeps its
conversations in memory until it takes the directory over, then on disk too; a file that does not
read is left out, and left there."""
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
    assert files(tmp_path) == {f"{kept[0]}.json", f"{kept[2]}.json"} and again.conversations.bytes == \
        first.conversations.bytes
    again._lock.release()
    smaller = store_at(tmp_path, count=1)  # kept[0] changed last (reads are not written down)
    assert len(smaller.conversations) == 1 and files(tmp_path) == {f"{kept[0]}.json"}


def test_the_bounds_drop_files_too(tmp_path):
    store = store_at(tmp_path, count=2)
    kept = [store.conversation("create", {}, [])["id"] for _ in range(3)]
    assert files(tmp_path) == {f"{kept[1]}.json", f"{kept[2]}.json"}


def test_a_second_server_keeps_its_conversations_in_memory_until_it_takes_the_directory_over(tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setattr(persisted_responses, "TAKE_OVER_WAIT_S", 0.2)
    owner = store_at(tmp_path)
    other = store_at(tmp_path)
    theirs = other.conversation("create", {}, [message("msg_b")])["id"]
    ours = owner.conversation("create", {}, [message("msg_a")])["id"]
    assert files(tmp_path) == {f"{ours}.json"} and not other.take_over()
    owner._lock.release()  # the old cluster is gone
    assert other.take_over()
    assert other.conversation("context", ours) == [message("msg_a")]
    assert other.conversation("context", theirs) == [message("msg_b")]
    assert files(tmp_path) == {f"{ours}.json", f"{theirs}.json"}


def test_a_file_that_does_not_read_is_left_out_and_left_there(tmp_path):
    (tmp_path / "conversations").mkdir()
    (tmp_path / "conversations" / "conv_bad.json").write_text(json.dumps({"sequence": 1, "items": []}))
    store = store_at(tmp_path)
    assert len(store.conversations) == 0 and files(tmp_path) == {"conv_bad.json"}
