"""The response store: a continuation reads the conversation and the output of the response it
names (without its output's logprobs); bounded by count and by bytes, least recently used first;
input items in OpenAI's pages; a background response settled with its end unless cancelled or
deleted meanwhile, adopted by another replica once the one running it stops renewing its lease
(failed when it kept no rerun, or has run MAX_RUNS times); a background stream's events recorded
in order (sent again after a restarted store lost them), read from a number on, counted in the
bounds. The store takes and gives JSON text, as an ingress replica encodes and decodes it."""
from __future__ import annotations

import json

import pytest

from splitserve.api.errors import RequestError
from splitserve.api.json_pieces import json_text
from splitserve.api.response_store import LEASE_S, MAX_RUNS, ResponseStore, Stored


def response(response_id: str, text: str = "ok") -> dict:
    return {"id": response_id, "object": "response", "status": "completed", "output": [
        {"type": "message", "id": f"msg_{response_id}", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]}


def with_logprobs(response_id: str, text: str = "ok") -> dict:
    """A response whose output text carries its tokens' logprobs."""
    kept = response(response_id, text)
    kept["output"][0]["content"][0]["logprobs"] = [{"token": text, "logprob": -0.5, "bytes": list(text.encode()),
                                                    "top_logprobs": [{"token": "x", "logprob": -2.0, "bytes": [120]}]}]
    return kept


def items(*texts: str) -> list[dict]:
    return [{"type": "message", "id": f"msg_in{i}", "role": "user", "status": "completed",
             "content": [{"type": "input_text", "text": text}]} for i, text in enumerate(texts)]


def put(store: ResponseStore, response: dict, items: list[dict], rerun: dict | None = None) -> bool:
    return store.put(Stored.encode(response), json_text(items), rerun)


def get(store: ResponseStore, response_id: str) -> dict | None:
    return _decoded(store.get(response_id))


def settle(store: ResponseStore, response: dict) -> bool:
    return store.settle(Stored.encode(response))


def cancel(store: ResponseStore, response_id: str) -> dict | None:
    return _decoded(store.cancel(response_id))


def _decoded(text: str | None) -> dict | None:
    return None if text is None else json.loads(text)


def context(store: ResponseStore, response_id: str) -> list[dict]:
    """What a continuation reads: the items, then the output."""
    items_text, text = store.context(response_id)
    return json.loads(items_text) + json.loads(text)["output"]


def test_a_continuation_reads_the_items_then_the_output():
    store = ResponseStore(10, 1 << 20)
    assert put(store, response("resp_a", "five"), items("2+3?"))
    assert get(store, "resp_a") == response("resp_a", "five")
    assert context(store, "resp_a") == items("2+3?") + response("resp_a", "five")["output"]
    assert json.loads(store.input_items("resp_a")) == items("2+3?")
    assert get(store, "resp_b") is store.context("resp_b") is store.input_items("resp_b") is None


def test_the_store_keeps_and_answers_the_text_it_was_given_and_reads_only_a_few_fields_of_it():
    store, text = ResponseStore(10, 1 << 20), json_text(response("resp_a", "é"))
    assert "é" in text and store.put(Stored.of(response("resp_a"), text), "[]")
    assert store.get("resp_a") is text and store.context("resp_a")[1] is text and store.bytes == len(text) + 2
    pending = Stored.encode({**response("resp_b"), "status": "in_progress", "background": True})
    assert pending[:3] == ("resp_b", "in_progress", True)
    assert pending.changed(status="cancelled").text == json_text({**json.loads(pending.text), "status": "cancelled"})
    for bad in ({"id": 1, "status": "completed"}, {"id": "resp_c", "status": None}, {"id": "resp_c"}, ["resp_c"]):
        with pytest.raises((TypeError, KeyError)):
            Stored.encode(bad)


def test_a_continuation_decodes_the_output_without_its_logprobs_which_count_in_the_bounds():
    store, kept = ResponseStore(10, 1 << 20), with_logprobs("resp_a", "five")
    assert put(store, kept, items("2+3?")) and get(store, "resp_a") == kept
    assert context(store, "resp_a") == items("2+3?") + response("resp_a", "five")["output"]
    stored = Stored.encode(kept)
    assert store.bytes == len(stored.text) + len(json_text({"output": response("resp_a", "five")["output"]})) \
        + len(json_text(items("2+3?")))
    assert store.settle(stored) is False and store.delete("resp_a") and store.bytes == 0


def test_past_its_count_the_least_recently_used_go_first():
    store = ResponseStore(2, 1 << 20)
    put(store, response("resp_a"), [])
    put(store, response("resp_b"), [])
    get(store, "resp_a")  # used: resp_b is now the oldest
    put(store, response("resp_c"), [])
    assert [r for r in ("resp_a", "resp_b", "resp_c") if get(store, r)] == ["resp_a", "resp_c"]


def test_past_its_bytes_the_oldest_go_and_one_too_large_is_not_kept():
    one = len(json_text(response("resp_0"))) + len(json_text(items("x" * 100)))
    store = ResponseStore(100, 3 * one)
    for i in range(5):
        assert put(store, response(f"resp_{i}"), items("x" * 100))
    assert len(store) == 3 and store.bytes == 3 * one and get(store, "resp_1") is None
    assert not put(store, response("resp_big"), items("x" * 4 * one)) and get(store, "resp_big") is None
    assert put(ResponseStore(0, 1 << 20), response("resp_a"), []) is False


def test_a_response_kept_again_replaces_itself_and_a_deleted_one_is_gone():
    store = ResponseStore(10, 1 << 20)
    put(store, response("resp_a", "first"), [])
    put(store, response("resp_a", "second"), items("x"))
    assert len(store) == 1 and get(store, "resp_a")["output"][0]["content"][0]["text"] == "second"
    assert store.delete("resp_a") and not store.delete("resp_a")
    assert get(store, "resp_a") is None and store.bytes == 0


def test_a_background_response_settles_unless_cancelled_or_deleted_meanwhile():
    store = ResponseStore(10, 1 << 20)
    pending = {**response("resp_a"), "status": "in_progress", "background": True, "output": []}
    put(store, pending, items("2+3?"))
    assert store.status("resp_a") == "in_progress"
    with pytest.raises(RequestError, match="still in progress") as refused:
        store.context("resp_a")
    assert refused.value.param == "previous_response_id"
    assert settle(store, {**response("resp_a", "five"), "status": "completed"})
    assert get(store, "resp_a")["status"] == "completed" and context(store, "resp_a")[0] == items("2+3?")[0]
    with pytest.raises(RequestError, match="completed"):
        cancel(store, "resp_a")
    put(store, {**pending, "id": "resp_b"}, [])
    assert cancel(store, "resp_b")["status"] == "cancelled" == cancel(store, "resp_b")["status"]
    assert not settle(store, {**response("resp_b"), "status": "completed"}) and store.status("resp_b") == "cancelled"
    put(store, {**pending, "id": "resp_c"}, [])
    store.delete("resp_c")
    assert not settle(store, {**response("resp_c"), "status": "completed"}) and get(store, "resp_c") is None
    put(store, {**response("resp_d"), "status": "in_progress"}, [])  # not a background one
    with pytest.raises(RequestError, match="background"):
        cancel(store, "resp_d")
    assert cancel(store, "resp_x") is None and store.statuses(["resp_b", "resp_x"]) == ["cancelled", None]


def test_a_background_response_whose_lease_lapses_ends_failed_and_a_renewed_one_does_not():
    now = [0.0]
    store = ResponseStore(10, 1 << 20, clock=lambda: now[0])
    pending = {**response("resp_a"), "status": "in_progress", "background": True, "output": []}
    put(store, pending, items("2+3?"))
    put(store, {**pending, "id": "resp_b"}, [])
    for _ in range(3):  # the replica running resp_b asks about it every half second; nobody asks about resp_a
        now[0] += LEASE_S * 0.6
        assert store.statuses(["resp_b"]) == ["in_progress"]
    lapsed = get(store, "resp_a")
    assert lapsed["status"] == "failed" and lapsed["error"]["code"] == "server_error"
    assert "send it again" in lapsed["error"]["message"] and context(store, "resp_a")[0] == items("2+3?")[0]
    assert not settle(store, {**response("resp_a"), "status": "completed"})  # too late: failed stays
    assert settle(store, {**response("resp_b", "five"), "status": "completed"})
    now[0] += LEASE_S * 2  # an ended one has no lease left to lapse
    assert get(store, "resp_b")["status"] == "completed"
    put(store, {**response("resp_c"), "status": "in_progress"}, [])  # a foreground one holds no lease
    now[0] += LEASE_S * 2
    assert store.status("resp_c") == "in_progress"


def streaming(store: ResponseStore, response_id: str = "resp_a") -> dict:
    pending = {**response(response_id), "status": "in_progress", "background": True, "output": []}
    put(store, pending, items("2+3?"))
    return pending


def test_one_whose_replica_died_is_adopted_by_another_at_most_max_runs_times_in_all():
    now = [0.0]
    store = ResponseStore(10, 1 << 20, clock=lambda: now[0])
    pending = {**response("resp_a"), "status": "in_progress", "background": True, "output": []}
    rerun = {"request": {"model": "demo", "input": "2+3?"}, "turn": None}
    put(store, pending, items("2+3?"), rerun)
    assert store.adopt(4) == []  # its replica holds it
    for runs in range(2, MAX_RUNS + 1):
        now[0] += LEASE_S + 1  # that replica died
        assert store.status("resp_a") == "in_progress"
        [(adopted, again)] = store.adopt(4)
        assert (json.loads(adopted), again) == (pending, {**rerun, "runs": runs})
        assert store.adopt(4) == [] and store.statuses(["resp_a"]) == ["in_progress"]  # the adopter holds it
    now[0] += LEASE_S + 1  # it may be what kills them
    assert store.adopt(4) == [] and get(store, "resp_a")["status"] == "failed"
    put(store, {**pending, "id": "resp_b"}, [], rerun)
    now[0] += LEASE_S + 1
    assert cancel(store, "resp_b")["status"] == "cancelled" and store.adopt(4) == []  # a cancelled orphan stays so
    put(store, {**pending, "id": "resp_c"}, [], rerun)
    assert settle(store, {**response("resp_c"), "status": "completed"})
    now[0] += LEASE_S + 1
    assert store.adopt(4) == [] and get(store, "resp_c")["status"] == "completed"


def test_a_background_streams_events_are_read_from_a_number_on_until_it_ends():
    store = ResponseStore(10, 1 << 20)
    streaming(store)
    with pytest.raises(RequestError):
        store.events("resp_a")  # not known to stream yet
    assert store.append_events("resp_a", 0, []) == 0  # as its stream starts
    assert store.events("resp_a") == ([], False)  # nothing recorded yet: a reader waits
    assert store.append_events("resp_a", 0, ["e0", "e1"]) == 2
    assert store.append_events("resp_a", 1, ["e1", "e2", "e3"]) == 4  # a resend overlaps: the new part kept
    assert store.append_events("resp_a", 6, ["e6"]) == 4  # a gap: send again from 4
    assert store.events("resp_a") == (["e0", "e1", "e2", "e3"], False)
    assert store.events("resp_a", after=1) == (["e2", "e3"], False) and store.events("resp_a", 9) == ([], False)
    assert settle(store, {**response("resp_a", "five"), "status": "completed"})
    assert store.events("resp_a", after=2) == (["e3"], True)  # the events stay with the ended response
    assert store.append_events("resp_a", 4, ["late"]) == -1 and store.append_events("resp_x", 0, ["e"]) == -1
    assert store.events("resp_x") is None
    with pytest.raises(RequestError) as refused:
        store.events("resp_a", after=-2)
    assert refused.value.param == "starting_after"


def test_a_response_that_was_not_streamed_in_background_has_no_events_to_stream():
    store = ResponseStore(10, 1 << 20)
    put(store, response("resp_a"), [])
    with pytest.raises(RequestError, match="not created with background and stream") as refused:
        store.events("resp_a")
    assert refused.value.param == "stream"


def test_recorded_events_count_in_the_bounds_and_go_with_their_response():
    store = ResponseStore(10, 3000)
    streaming(store)
    base = store.bytes
    store.append_events("resp_a", 0, ["x" * 500])
    assert store.bytes == base + 500
    put(store, response("resp_b"), [])
    store.append_events("resp_a", 1, ["x" * 3000])  # past the bound: the least recently used go first
    assert get(store, "resp_a") is None and store.bytes == len(json_text(response("resp_b"))) + 2
    streaming(store, "resp_c")
    store.append_events("resp_c", 0, ["y" * 100])
    store.delete("resp_c")
    assert store.bytes == len(json_text(response("resp_b"))) + 2 and store.events("resp_c") is None
