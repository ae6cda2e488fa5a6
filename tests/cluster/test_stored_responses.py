"""A background stream through `StoredResponses` (no Ray: the store is a local ResponseStore behind
a stand-in for its actor): its client may read a few events and go away while it runs on; every
event reaches the store before the end is settled, so a replay from any number gives the rest; a
store that restarted mid-stream (its events lost) is sent them again; a cancel stops the stream's
run within the poll and ends it for its client; a background response the store cannot keep has
its runs stopped. A response in a conversation reads its items first and adds its own input and
output once it completes (a background one once settled), not when it failed or was cancelled. A
background response whose replica died is run again by another. A stored response's input items
come in cursor pages."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from splitserve.api.errors import RequestError
from splitserve.api.conversation_store import ConversationStore
from splitserve.api.json_pieces import json_text
from splitserve.api.response_store import ResponseStore, Stored
from splitserve.api.responses_request import ResponsesRequest
from splitserve.api import response_store
from splitserve.cluster import stored_responses
from splitserve.cluster.stored_responses import StoredResponses
from tests.api.test_conversation_store import message
from tests.api.test_response_store import get, items, put, response, with_logprobs

EVENTS = 12


class LocalStore:
    """The store actor's `call`, answered by a local ResponseStore (which a test may replace)."""

    def __init__(self):
        self.store = ResponseStore(100, 1 << 20, conversations=ConversationStore(10, 1 << 20))

    async def call(self, method: str, *args):
        await asyncio.sleep(0)
        return getattr(self.store, method)(*args)


async def nothing() -> None:
    """The abort of a background response that was kept: never called."""
    raise AssertionError("aborted")


def pending(response_id: str = "resp_a") -> dict:
    return {"id": response_id, "object": "response", "status": "in_progress", "background": True, "output": []}


def made_events(stream, gap_s: float = 0.01, closed: list | None = None):
    """EVENTS events, a gap apart; the whole response set before the last, as ResponseEvents does."""
    async def events():
        try:
            for n in range(EVENTS):
                await asyncio.sleep(gap_s)
                if n == EVENTS - 1:
                    stream.whole = {**pending(), "status": "completed", "output": [{"n": n}]}
                yield f"event: e\ndata: {n}\n\n".encode()
        finally:
            if closed is not None:
                closed.append(True)
    return events()


async def read(stream, count: int | None = None) -> list[bytes]:
    got = []
    async for event in stream:
        got.append(event)
        if len(got) == count:
            break
    await stream.aclose()
    return got


async def settled(local: LocalStore, response_id: str = "resp_a", timeout_s: float = 5) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (response := get(local.store, response_id))["status"] == "in_progress":
        assert asyncio.get_running_loop().time() < deadline, response
        await asyncio.sleep(0.01)
    return response


def test_the_client_goes_away_and_the_stream_runs_on_for_a_replay_from_any_event(monkeypatch):
    monkeypatch.setattr(stored_responses, "EVENT_FLUSH_S", 0.02)
    monkeypatch.setattr(stored_responses, "RESUME_POLL_S", 0.01)
    local = LocalStore()
    stored = StoredResponses(local, enabled=True)
    stream = SimpleNamespace(whole=None)

    async def scenario():
        client = await stored.stream_in_background(pending(), [], None, made_events(stream), stream, nothing)
        first = await read(client, 3)  # then the client goes away
        after = await stored.call("events", "resp_a", 2)
        rest = await read(stored.replay("resp_a", 2, after))  # waits for what is not recorded yet
        return first, rest, await settled(local)

    first, rest, ended = asyncio.run(scenario())
    assert [e.decode().split("data: ")[1].strip() for e in first + rest] == [str(n) for n in range(EVENTS)]
    assert ended["status"] == "completed" and ended["output"] == [{"n": EVENTS - 1}]
    assert local.store.events("resp_a") == ([e.decode() for e in first + rest], True)


def test_a_store_that_restarted_mid_stream_is_sent_every_event_again(monkeypatch):
    monkeypatch.setattr(stored_responses, "EVENT_FLUSH_S", 0.02)
    local = LocalStore()
    stored = StoredResponses(local, enabled=True)
    stream = SimpleNamespace(whole=None)

    async def scenario():
        client = await stored.stream_in_background(pending(), [], None, made_events(stream, gap_s=0.02), stream,
                                                   nothing)
        got = []
        async for event in client:
            got.append(event)
            if len(got) == EVENTS // 2:  # the store restarts: the response read back from disk, no events
                restarted = ResponseStore(100, 1 << 20)
                restarted.put(Stored.encode(get(local.store, "resp_a")), "[]")
                local.store = restarted
        return got, await settled(local)

    got, ended = asyncio.run(scenario())
    assert len(got) == EVENTS and ended["status"] == "completed"
    assert local.store.events("resp_a") == ([e.decode() for e in got], True)


def test_one_send_to_a_store_that_lost_its_events_sends_them_all_again():
    """As the last send before the end is settled must: no later send would make up for it."""
    local = LocalStore()
    local.store.put(Stored.encode(pending()), "[]")
    stored = StoredResponses(local, enabled=True)
    events = [f"data: {n}\n\n".encode() for n in range(5)]
    assert asyncio.run(stored._send("resp_a", 3, events)) == 5  # it had recorded 3; the store has none
    assert local.store.events("resp_a") == ([e.decode() for e in events], False)


def test_a_cancel_stops_the_run_and_ends_the_clients_stream(monkeypatch):
    monkeypatch.setattr(stored_responses, "CANCEL_POLL_S", 0.02)
    local = LocalStore()
    stored = StoredResponses(local, enabled=True)
    stream, closed = SimpleNamespace(whole=None), []

    async def scenario():
        client = await stored.stream_in_background(pending(), [], None, made_events(stream, 0.05, closed), stream,
                                                   nothing)
        got = []
        async for event in client:
            got.append(event)
            if len(got) == 2:
                local.store.cancel("resp_a")
        return got

    got = asyncio.run(scenario())
    assert 2 <= len(got) < EVENTS and closed == [True]  # the events' generator closed: its run aborted
    assert get(local.store, "resp_a")["status"] == "cancelled"


class FullStore(LocalStore):
    async def call(self, method: str, *args):
        raise RequestError("the response store is restarting; retry shortly", status=503)


@pytest.mark.parametrize("streams", [False, True])
def test_a_background_response_the_store_cannot_keep_has_its_runs_stopped(streams):
    """Its client is told 503 and nobody would read its runs: they are aborted, and its end (or its
    stream) is never started."""
    stored, aborted, started = StoredResponses(FullStore(), enabled=True), [], []

    async def abort():
        aborted.append(True)

    async def end():
        started.append(True)
        return {}

    stream = SimpleNamespace(whole=None)
    events = made_events(stream)
    keep = stored.stream_in_background(pending(), [], None, events, stream, abort) if streams else \
        stored.run_in_background(pending(), [], None, end, abort)
    with pytest.raises(RequestError) as refused:
        asyncio.run(keep)
    assert refused.value.status == 503 and aborted == [True] and not started and not stored._running
    asyncio.run(events.aclose())


@pytest.mark.parametrize("background", [True, False])
def test_only_a_kept_response_may_run_in_background(background):
    stored = StoredResponses(LocalStore(), enabled=False)
    request = SimpleNamespace(background=background, store=None, previous_response_id=None, conversation=None)
    if background:
        with pytest.raises(RequestError) as refused:
            asyncio.run(stored.context(request))
        assert refused.value.param == "background"
    else:
        assert asyncio.run(stored.context(request)) == []


def test_a_continuation_reads_the_previous_items_and_output_without_its_logprobs():
    local = LocalStore()
    stored = StoredResponses(local, enabled=True)
    put(local.store, with_logprobs("resp_a", "five"), items("2+3?"))
    request = ResponsesRequest.model_validate({"model": "m", "input": "and 4?", "previous_response_id": "resp_a"})
    assert asyncio.run(stored.context(request)) == items("2+3?") + response("resp_a", "five")["output"]


def in_conversation(local: LocalStore, **fields) -> tuple[str, ResponsesRequest]:
    cid = local.store.conversation("create", {}, [message("msg_earlier")])["id"]
    return cid, ResponsesRequest.model_validate({"model": "m", "input": "and now?", "conversation": cid, **fields})


def ended(response_id: str, cid: str, status: str = "completed") -> dict:
    return {**pending(response_id), "background": False, "status": status, "conversation": {"id": cid},
            "output": [message(f"msg_out_{response_id}")]}


def test_a_response_in_a_conversation_reads_it_and_adds_its_turn_once_it_completed():
    local = LocalStore()
    stored = StoredResponses(local, enabled=True)
    cid, request = in_conversation(local, store=False)
    assert asyncio.run(stored.context(request)) == [message("msg_earlier")]
    turn = [message("msg_turn")]
    asyncio.run(stored.end(ended("resp_a", cid, "failed"), [], turn, kept=False))
    assert [i["id"] for i in local.store.conversation("context", cid)] == ["msg_earlier"]
    asyncio.run(stored.end(ended("resp_b", cid), [], turn, kept=False))
    assert [i["id"] for i in local.store.conversation("context", cid)] == ["msg_earlier", "msg_turn", "msg_out_resp_b"]
    assert get(local.store, "resp_b") is None  # store false: the conversation keeps it, not the response store
    local.store.conversation("delete", cid)  # deleted meanwhile: the response is still answered
    asyncio.run(stored.end(ended("resp_c", cid), [], [message("msg_c")], kept=True))
    assert get(local.store, "resp_c")["status"] == "completed"


def test_a_conversation_with_a_previous_response_or_an_item_it_holds_is_a_400():
    local = LocalStore()
    stored = StoredResponses(local, enabled=True)
    for fields, param in (({"previous_response_id": "resp_x"}, "conversation"),
                          ({"input": [message("msg_earlier")]}, "input")):
        with pytest.raises(RequestError) as refused:
            asyncio.run(stored.context(in_conversation(local, **fields)[1]))
        assert (refused.value.status, refused.value.param) == (400, param)
    request = ResponsesRequest.model_validate({"model": "m", "input": "hi", "conversation": {"id": "conv_gone"}})
    with pytest.raises(RequestError) as missing:
        asyncio.run(stored.context(request))
    assert (missing.value.status, missing.value.param) == (404, "conversation")


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_background_response_adds_its_turn_once_settled_unless_cancelled(cancelled):
    local = LocalStore()
    stored = StoredResponses(local, enabled=True)
    cid = in_conversation(local)[0]
    release = asyncio.Event()

    async def end():
        await release.wait()
        return {**ended("resp_a", cid), "background": True}

    async def scenario():
        await stored.run_in_background({**pending(), "conversation": {"id": cid}}, [], [message("msg_turn")], end,
                                       nothing)
        if cancelled:
            local.store.cancel("resp_a")
        release.set()
        await asyncio.gather(*stored._running.values(), return_exceptions=True)

    asyncio.run(scenario())
    expected = ["msg_earlier"] if cancelled else ["msg_earlier", "msg_turn", "msg_out_resp_a"]
    assert [i["id"] for i in local.store.conversation("context", cid)] == expected
    assert get(local.store, "resp_a")["status"] == ("cancelled" if cancelled else "completed")


def test_a_background_response_whose_replica_died_is_run_again_by_another(monkeypatch):
    """Replica A admitted it and died (its tasks gone, nobody renews its lease); replica B, once it
    calls the store (a client's poll), adopts it within ADOPT_POLL_S of the lapse and settles it,
    adding its turn to its conversation."""
    monkeypatch.setattr(response_store, "LEASE_S", 0.2)
    monkeypatch.setattr(stored_responses, "ADOPT_POLL_S", 0.02)
    local = LocalStore()
    cid, request = in_conversation(local, background=True)
    asked = []

    async def run_again(pending: dict, rerun: dict) -> dict:
        asked.append(rerun)
        return {**ended(pending["id"], cid), "background": True}

    async def never() -> dict:
        await asyncio.Event().wait()

    async def scenario():
        replica_a = StoredResponses(local, enabled=True)
        turn = [message("msg_turn")]
        await replica_a.run_in_background({**pending(), "conversation": {"id": cid}}, [], turn, never, nothing,
                                          request.model_dump(mode="json", exclude_none=True))
        await asyncio.sleep(0.01)  # it runs
        for task in [*replica_a._running.values(), replica_a._poller]:  # replica A dies
            task.cancel()
        replica_b = StoredResponses(local, enabled=True, run_again=run_again)
        assert json.loads(await replica_b.call("get", "resp_a"))["status"] == "in_progress"
        return await settled(local)

    assert asyncio.run(scenario())["output"] == [message("msg_out_resp_a")]
    [rerun] = asked
    assert rerun["runs"] == 2 and rerun["request"]["conversation"] == cid and rerun["turn"] == [message("msg_turn")]
    assert [i["id"] for i in local.store.conversation("context", cid)] == ["msg_earlier", "msg_turn", "msg_out_resp_a"]


def test_input_items_come_in_cursor_pages_newest_first_by_default():
    local = LocalStore()
    local.store.put(Stored.encode(pending()), json_text([message(f"msg_in{i}") for i in range(3)]))
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(stored_responses=StoredResponses(local, True))))

    def page(response_id: str = "resp_a", **query) -> tuple[int, dict]:
        answer = asyncio.run(stored_responses.input_items(request, response_id, **query))
        return answer.status_code, json.loads(answer.body)

    status, first = page(limit=2)
    assert status == 200 and [i["id"] for i in first["data"]] == ["msg_in2", "msg_in1"] and first["has_more"]
    status, rest = page(limit=2, after=first["last_id"])
    assert [i["id"] for i in rest["data"]] == ["msg_in0"] and not rest["has_more"]
    assert [i["id"] for i in page(order="asc")[1]["data"]] == ["msg_in0", "msg_in1", "msg_in2"]
    for bad, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
        status, error = page(**bad)
        assert status == 400 and error["error"]["param"] == param
    status, error = page("resp_x")
    assert status == 404 and error["error"]["param"] == "response_id"
