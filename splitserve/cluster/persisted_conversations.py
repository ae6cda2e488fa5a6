"""The conversations on disk: each a file of `JsonFiles` lines, the Conversation and its items as
one line, then a line of the items each add appended (an add costs what it adds: a long
conversation is not written again at each turn); a change of its metadata or a deleted item writes
it whole again. So a restarted store has every conversation it kept, the least recently changed
dropped first. The response store's actor keeps them in a directory beside its own, once it owns
its directory (`attach`); until then, in memory."""
from __future__ import annotations

import logging

from splitserve.api.conversation_store import ConversationStore, json_size
from splitserve.api.errors import RequestError
from splitserve.cluster.json_files import JsonFiles

log = logging.getLogger(__name__)


class PersistedConversations(ConversationStore):
    def __init__(self, max_conversations: int, max_bytes: int):
        super().__init__(max_conversations, max_bytes)
        self.files: JsonFiles | None = None

    def attach(self, files: JsonFiles) -> None:
        """The conversations of `files` read; then those kept in memory meanwhile (newer) are kept on
        disk too. A file past the bounds (which may have shrunk) is removed."""
        meanwhile = [(conversation, items) for conversation, items, _ in self._entries.values()]
        self._entries.clear()
        self.bytes = 0
        read = []
        for name, lines in files.read():
            try:
                conversation = dict(lines[0]["conversation"])
                items = [item for line in lines for item in line["items"]]
                self._put(conversation, items, "items", json_size(conversation, *items))
            except (KeyError, TypeError, ValueError):
                log.exception("stored conversation %s does not read; left out (and left there)", name)
                continue
            except RequestError:  # larger than the bounds, which may have shrunk
                pass
            read.append(name)
        for name in read:
            if name not in self._entries:  # past the bounds
                files.remove(name)
        self.files = files
        for conversation, items in meanwhile:
            self._put(conversation, items, "items", json_size(conversation, *items))

    def _kept(self, conversation: dict, items: list[dict]) -> None:
        if self.files is not None:
            self.files.write(conversation["id"], {"conversation": conversation, "items": items})

    def _added(self, conversation: dict, items: list[dict]) -> None:
        if self.files is not None:
            self.files.append(conversation["id"], {"items": items})

    def _dropped(self, conversation_id: str) -> None:
        if self.files is not None:
            self.files.remove(conversation_id)
