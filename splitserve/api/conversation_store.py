"""The conversations this server keeps (OpenAI's Conversations API): a Conversation object (id,
created_at, metadata) and its items in order, each with an id unique in the conversation. A
response created with `conversation` reads its items before its own input and, once it ends,
adds that input and its output to it. Bounded as the response store is: past `max_conversations`
or `max_bytes` of their JSON, the least recently used go first; a change that would make one
conversation larger than `max_bytes` is refused (a 400). A conversation's size is its JSON's, kept
up to date by each change (an add costs what it adds, not what the conversation holds). Plain data
in and out; the response store's actor keeps it (`ResponseStore.conversation`). Every conversation
kept, grown or dropped passes `_kept`, `_added` or `_dropped`, which a store on disk overrides."""
from __future__ import annotations

import json
import time
from collections import OrderedDict

from splitserve.api.cursor_page import cursor_page, in_order
from splitserve.api.errors import RequestError
from splitserve.api.responses_bodies import new_id, read_back

MAX_ITEMS_PAGE = 100


class ConversationStore:
    def __init__(self, max_conversations: int, max_bytes: int):
        self.max_conversations, self.max_bytes = max_conversations, max_bytes
        # id -> the conversation, its items, and the size of their JSON; the least recently used first
        self._entries: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.bytes = 0  # the entries' sizes, summed

    def __len__(self) -> int:
        return len(self._entries)

    def create(self, metadata: dict[str, str], items: list[dict]) -> dict:
        """A new conversation holding `items`."""
        if self.max_conversations == 0:
            raise RequestError("this server keeps no conversations (ingress.stored_conversations is 0)",
                               param="conversation")
        _check_new(items, set())
        conversation = {"id": new_id("conv"), "object": "conversation", "created_at": int(time.time()),
                        "metadata": metadata}
        self._put(conversation, items, "items", json_size(conversation, *items))
        return conversation

    def get(self, conversation_id: str) -> dict:
        return self._use(conversation_id)[0]

    def update(self, conversation_id: str, metadata: dict[str, str]) -> dict:
        conversation, items, size = self._use(conversation_id)
        updated = {**conversation, "metadata": metadata}
        self._put(updated, items, "metadata", size - json_size(conversation) + json_size(updated))
        return updated

    def delete(self, conversation_id: str) -> dict:
        self._use(conversation_id)
        self._drop(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    def add(self, conversation_id: str, items: list[dict]) -> dict:
        """`items` added after the conversation's own: the list of them, as OpenAI answers it."""
        conversation, earlier, size = self._use(conversation_id)
        _check_new(items, {item["id"] for item in earlier})
        self._put(conversation, earlier + items, "items", size + json_size(*items), added=items)
        return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None, "has_more": False}

    def items(self, conversation_id: str, limit: int = 20, order: str = "desc", after: str | None = None,
              logprobs: bool = False) -> dict:
        """A cursor page of its items (OpenAI's default: newest first); their output texts' logprobs
        only when asked (`logprobs`: `include`)."""
        items = self._use(conversation_id)[1]
        page = cursor_page(in_order(items[::-1], order), limit, after, MAX_ITEMS_PAGE)
        return page if logprobs else {**page, "data": read_back(page["data"])}

    def item(self, conversation_id: str, item_id: str, logprobs: bool = False) -> dict:
        items = self._use(conversation_id)[1]
        item = items[_index(items, item_id)]
        return item if logprobs else read_back([item])[0]

    def delete_item(self, conversation_id: str, item_id: str) -> dict:
        """The conversation, without the item."""
        conversation, items, size = self._use(conversation_id)
        index = _index(items, item_id)
        self._put(conversation, items[:index] + items[index + 1:], "item_id", size - json_size(items[index]))
        return conversation

    def context(self, conversation_id: str) -> list[dict]:
        """What a response in the conversation reads before its own input: every item, in order (their
        text: without logprobs, which no prompt holds)."""
        return read_back(self._use(conversation_id, param="conversation")[1])

    def _use(self, conversation_id: str, param: str = "conversation_id") -> tuple[dict, list[dict], int]:
        if conversation_id not in self._entries:
            raise RequestError(f"{param}: no stored conversation {conversation_id!r} (never created, deleted, or "
                               "dropped to keep the store within its bounds)", status=404, param=param)
        self._entries.move_to_end(conversation_id)
        return self._entries[conversation_id]

    def _put(self, conversation: dict, items: list[dict], param: str, size: int, added: list[dict] | None = None
             ) -> None:
        """Kept (the latest used), `size` bytes of JSON, grown by `added` (None: changed otherwise);
        a RequestError naming `param` when it alone is past the bounds."""
        if size > self.max_bytes:
            raise RequestError(f"{param}: the conversation would hold {size} bytes of JSON, more than this server "
                               f"keeps ({self.max_bytes}, ingress.stored_conversation_bytes)", param=param)
        earlier = self._entries.pop(conversation["id"], None)
        self.bytes += size - (earlier[2] if earlier else 0)
        self._entries[conversation["id"]] = conversation, items, size
        if added is None:
            self._kept(conversation, items)
        else:
            self._added(conversation, added)
        while len(self._entries) > self.max_conversations or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, conversation_id: str) -> None:
        self.bytes -= self._entries.pop(conversation_id)[2]
        self._dropped(conversation_id)

    def _kept(self, conversation: dict, items: list[dict]) -> None:
        """`conversation` (with its `items`) is kept now, in place of any earlier state of it."""

    def _added(self, conversation: dict, items: list[dict]) -> None:
        """`items` were added to `conversation`, as it was kept before."""

    def _dropped(self, conversation_id: str) -> None:
        """The conversation is no longer kept (deleted, or dropped to stay within the bounds)."""


def json_size(*values) -> int:
    """The bytes of JSON of `values`, one after another."""
    return sum(len(json.dumps(value)) for value in values)


def _check_new(items: list[dict], ids: set[str]) -> None:
    """Each item's id is new to the conversation: an item appears once (ids name them)."""
    for item in items:
        if item["id"] in ids:
            raise RequestError(f"items: an item with id {item['id']!r} is already in the conversation; send it "
                               "without its id to add it again", param="items")
        ids.add(item["id"])


def _index(items: list[dict], item_id: str) -> int:
    for index, item in enumerate(items):
        if item["id"] == item_id:
            return index
    raise RequestError(f"item_id: no item {item_id!r} in the conversation", status=404, param="item_id")
