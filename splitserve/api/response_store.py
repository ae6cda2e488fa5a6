"""The responses this server keeps (`store`), for `previous_response_id` and for retrieving, deleting
and listing a response's input items. An entry is a Response object and the conversation items it
read (the stored context it continued, then its own input), so a continuation never depends on an
earlier entry that may have gone. Bounded: past `max_responses` entries or `max_bytes` of their
JSON, the least recently used go first; an entry larger than `max_bytes` is not kept. Entries are
kept as JSON text (`Stored`), which the callers (the ingress replicas) encode and decode: a
response with 20k tokens' logprobs at top 5 is 5.4 MB of text but 38 MB of Python objects, each for
the collector's full passes to walk (`scripts/bench_response_store.py`), and a string crosses
between processes with nothing inside to pickle. A response whose output carries logprobs also
keeps that output without them (`Stored.trimmed`, counted in the bounds): a continuation decodes
only what its prompt reads. A background response is kept in progress, then
settled with its end unless it was cancelled or deleted meanwhile; the replica running it renews
its lease (`statuses`, asked every half second). One whose lease lapses (that replica is gone) is
run again from the start by another replica (`adopt`), at most MAX_RUNS times in all, when its
request was kept for that (`rerun`: not a streamed one, whose events were sent); otherwise it ends
failed rather than in progress forever. A background response that streams has its events recorded
too (in memory, with the entry, counted in its bytes) for any replica to stream again from a
sequence number. Plain data in and out, so it can run as one actor that every ingress replica
calls. Every entry kept or dropped passes `_kept` or `_dropped`, which a store on disk overrides.
The same actor keeps the conversations (`conversation`), so one call reaches either."""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from splitserve.api.conversation_store import ConversationStore
from splitserve.api.errors import RequestError
from splitserve.api.json_pieces import json_text
from splitserve.api.responses_bodies import read_back

MAX_ITEMS_PAGE = 100
LEASE_S = 15.0  # a background response nobody renewed for this long has lost the replica that ran it
MAX_RUNS = 3  # a background response whose replica died this often may be what kills them: it fails
CONVERSATION_CALLS = frozenset({"create", "get", "update", "delete", "add", "items", "item", "delete_item", "context"})


class Stored(NamedTuple):
    """A response as the store keeps it: its JSON text, the fields of it the store reads, and what a
    continuation of it decodes where that is not `text` (`trimmed`: an object whose `output` is the
    response's as `read_back` gives it; "" where read_back leaves the output as it is)."""
    id: str
    status: str
    background: bool
    text: str
    trimmed: str

    @classmethod
    def of(cls, response: dict, text: str) -> Stored:
        """`response`, whose JSON is `text`; a TypeError or KeyError for one without an id, a status
        and a list of output items."""
        if not isinstance(response["id"], str) or not isinstance(response["status"], str):
            raise TypeError(f"a response's id and status are strings, not {response['id']!r}, {response['status']!r}")
        if not isinstance(response["output"], list) or not all(isinstance(item, dict) for item in response["output"]):
            raise TypeError("a response's output is a list of items")
        output = read_back(response["output"])
        trimmed = "" if output is response["output"] else json_text({"output": output})
        return cls(response["id"], response["status"], bool(response.get("background")), text, trimmed)

    @classmethod
    def encode(cls, response: dict) -> Stored:
        return cls.of(response, json_text(response))

    def changed(self, **fields) -> Stored:
        """The response with `fields` set (decoded and encoded again: for a small one)."""
        return Stored.encode({**json.loads(self.text), **fields})

    @property
    def context(self) -> str:
        """The JSON a continuation decodes, whose `output` it reads."""
        return self.trimmed or self.text

    @property
    def size(self) -> int:
        """The characters it holds."""
        return len(self.text) + len(self.trimmed)


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int, clock: Callable[[], float] = time.monotonic,
                 conversations: ConversationStore | None = None):
        """`conversations`: none kept without."""
        self.max_responses, self.max_bytes, self.clock = max_responses, max_bytes, clock
        self.conversations = ConversationStore(0, 0) if conversations is None else conversations
        # id -> the response, the JSON of the items it read, and the two's size
        self._entries: OrderedDict[str, tuple[Stored, str, int]] = OrderedDict()
        self._leases: dict[str, float] = {}  # background responses in progress -> when their lease lapses
        self._events: dict[str, list[str]] = {}  # a streamed background response's SSE events, in order
        # a background response in progress that may run again -> its rerun (request, turn, runs so far);
        # one without a lease awaits a replica to adopt it
        self._reruns: dict[str, dict] = {}
        self.bytes = 0  # the entries' JSON and the recorded events

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: Stored, items: str, rerun: dict | None = None) -> bool:
        """Keep `response`, which read `items` (their JSON list); False when it is too large to keep. A
        background one in progress with a `rerun` (what running it again takes) may be adopted by
        another replica."""
        response_id, size = response.id, response.size + len(items)
        earlier = self._entries.pop(response_id, None)
        self._leases.pop(response_id, None)
        self._reruns.pop(response_id, None)
        self.bytes -= earlier[2] if earlier else 0
        if size > self.max_bytes or self.max_responses == 0:
            self._forget_events(response_id)
            if earlier:
                self._dropped(response_id)
            return False
        self._entries[response_id] = response, items, size
        self.bytes += size
        if response.status == "in_progress" and response.background:
            self._leases[response_id] = self.clock() + LEASE_S
            if rerun is not None:
                self._reruns[response_id] = {**rerun, "runs": 1}
        self._kept(response, items)
        self._evict()
        return True

    def get(self, response_id: str) -> str | None:
        """The response's JSON."""
        entry = self._use(response_id)
        return entry and entry[0].text

    def context(self, response_id: str) -> tuple[str, str] | None:
        """What a continuation of the response reads: the JSON of its items and its `context` (its
        output follows them); a RequestError while it is in progress (a background one not yet ended)."""
        entry = self._use(response_id)
        if entry is not None and entry[0].status == "in_progress":
            raise RequestError(f"previous_response_id: {response_id!r} is still in progress; continue it once it "
                               "has ended", param="previous_response_id")
        return entry and (entry[1], entry[0].context)

    def input_items(self, response_id: str) -> str | None:
        """The JSON of the items the response read."""
        entry = self._use(response_id)
        return entry and entry[1]

    def status(self, response_id: str) -> str | None:
        self._lapse()
        return self._status(response_id)

    def _status(self, response_id: str) -> str | None:
        entry = self._entries.get(response_id)
        return entry and entry[0].status

    def statuses(self, response_ids: list[str]) -> list[str | None]:
        """Their statuses, asked by the replica running them: the leases of those in progress renewed."""
        self._lapse()
        for response_id in response_ids:
            if response_id in self._leases:
                self._leases[response_id] = self.clock() + LEASE_S
        return [self._status(response_id) for response_id in response_ids]

    def settle(self, response: Stored) -> bool:
        """A background response's end, kept in place of its in-progress state; False (and not
        kept) when it was cancelled or is gone."""
        entry = self._entries.get(response.id)
        if entry is None or entry[0].status != "in_progress":
            return False
        return self.put(response, entry[1])

    def adopt(self, most: int) -> list[tuple[str, dict]]:
        """Up to `most` background responses whose replica is gone (each as JSON, in progress) with
        their reruns, for the replica that asks to run them again from the start: leased to it now."""
        self._lapse()
        adopted = []
        for response_id in [r for r in self._reruns if r not in self._leases][:most]:
            self._reruns[response_id]["runs"] += 1
            self._leases[response_id] = self.clock() + LEASE_S
            adopted.append((self._entries[response_id][0].text, self._reruns[response_id]))
        return adopted

    def cancel(self, response_id: str) -> str | None:
        """The JSON of the background response cancelled (again: as it is); a RequestError for one
        that is not a background response in progress."""
        entry = self._use(response_id)
        if entry is None:
            return None
        response, items, _ = entry
        if response.status == "in_progress" and response.background:
            self.put(response.changed(status="cancelled"), items)
        elif response.status != "cancelled":
            raise RequestError(f"only a background response in progress can be cancelled; {response_id!r} is "
                               f"{response.status}", param="response_id")
        return self.get(response_id)

    def append_events(self, response_id: str, first: int, events: list[str]) -> int:
        """Record a background stream's events, the first of them number `first`; the number the
        store holds after. Fewer than `first` (a restarted store lost them): the replica sends
        again from there. -1: the response is gone or no longer in progress."""
        entry = self._entries.get(response_id)
        if entry is None or entry[0].status != "in_progress":
            return -1
        recorded = self._events.setdefault(response_id, [])
        if first <= len(recorded):
            new = events[len(recorded) - first:]
            recorded += new
            self.bytes += sum(map(len, new))
            self._evict()
        return len(self._events[response_id]) if response_id in self._entries else -1

    def events(self, response_id: str, after: int = -1) -> tuple[list[str], bool] | None:
        """A background stream's events after number `after`, and whether it has ended; None when
        no such response is kept; a RequestError when none of its events are (its stream records
        an empty list first)."""
        if after < -1:
            raise RequestError(f"starting_after: must be 0 or more, got {after}", param="starting_after")
        entry = self._use(response_id)
        if entry is None:
            return None
        if response_id not in self._events:
            raise RequestError(f"no stream of {response_id!r} is kept (it was not created with background and "
                               "stream, or the store restarted since): retrieve it without stream", param="stream")
        return self._events[response_id][after + 1:], entry[0].status != "in_progress"

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        self._leases.pop(response_id, None)
        self._reruns.pop(response_id, None)
        self._forget_events(response_id)
        if entry is not None:
            self.bytes -= entry[2]
            self._dropped(response_id)
        return entry is not None

    def conversation(self, method: str, *args):
        """`ConversationStore.<method>(*args)`, one of CONVERSATION_CALLS."""
        if method not in CONVERSATION_CALLS:
            raise ValueError(f"no conversation call {method!r}")
        return getattr(self.conversations, method)(*args)

    def _use(self, response_id: str) -> tuple[Stored, str, int] | None:
        self._lapse()
        if response_id in self._entries:
            self._entries.move_to_end(response_id)
        return self._entries.get(response_id)

    def _lapse(self) -> None:
        """Background responses whose lease lapsed await a replica to run them again (`adopt`), or,
        with no rerun left, end failed."""
        now = self.clock()
        for response_id in [r for r, lapses in self._leases.items() if lapses <= now]:
            del self._leases[response_id]
            if self._reruns.get(response_id, {"runs": MAX_RUNS})["runs"] < MAX_RUNS:
                continue
            response, items, _ = self._entries[response_id]
            self.put(response.changed(status="failed", error={
                "code": "server_error", "message": "the server stopped running this background response before it "
                "ended (the replica that ran it, or the cluster's controller, was restarted); send it again"}), items)

    def _evict(self) -> None:
        """The least recently used go until the store is within its bounds."""
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            self.delete(next(iter(self._entries)))

    def _forget_events(self, response_id: str) -> None:
        self.bytes -= sum(map(len, self._events.pop(response_id, ())))

    def event_bytes(self) -> int:
        return sum(len(event) for events in self._events.values() for event in events)

    def _kept(self, response: Stored, items: str) -> None:
        """`response` is kept now, in place of any earlier state of it; `items`: the JSON of those it read."""

    def _dropped(self, response_id: str) -> None:
        """The response is no longer kept (deleted, or dropped to stay within the bounds)."""
