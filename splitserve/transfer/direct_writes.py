"""Token side of direct transfers (`direct_link`): which ones another process may still write
into, and the given-up ones whose blocks must wait until it cannot.

A direct transfer is being written from `expect` until its sender's last message for it (DONE or
CANCEL) has been read and fenced, or its link has ended (the sender closed it or died). Given up
before that, it is refused if its sender has not claimed it yet (never written: free at once),
and otherwise held until then.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from splitserve.transfer.link import Fabric

if TYPE_CHECKING:
    from splitserve.transfer.protocol import TransferTicket


class DirectWrites:
    def __init__(self, fabric: Fabric, writes_done: Callable[[], torch.cuda.Event | None],
                 on_release: Callable[[], None]):
        """`writes_done`: an event after the receive stream's work so far (None on CPU);
        `on_release`: called, outside this object's lock, after held transfers were released."""
        self._fabric, self._writes_done, self._on_release = fabric, writes_done, on_release
        self._writing: dict[int, TransferTicket] = {}  # by tag
        self._held: dict[int, TransferTicket] = {}
        self._released: list[tuple[TransferTicket, torch.cuda.Event | None]] = []
        self._lock = threading.Lock()

    def expect(self, ticket: TransferTicket) -> None:
        if ticket.dest is not None:
            with self._lock:
                self._writing[ticket.tag] = ticket

    def give_up(self, ticket: TransferTicket) -> bool:
        """Whether the blocks may be freed now; if not, `take_released` returns the ticket later."""
        with self._lock:
            writing = self._writing.get(ticket.tag)
            if writing is None:
                return True
            if self._fabric.give_up(ticket.tag, writing.dest.claim_by):  # unclaimed: never written
                del self._writing[ticket.tag]
                return True
            self._held[ticket.tag] = ticket
            return False

    def sender_done(self, tag: int) -> None:
        """The sender's last message for `tag` was read, and its writes fenced."""
        self._stopped(lambda t: t.tag == tag)

    def link_ended(self, peer: str, epoch: int) -> None:
        """The link's sender closed it or died: it writes none of its transfers any more."""
        self._stopped(lambda t: (t.prompt_peer, t.link_epoch) == (peer, epoch))

    def pending(self) -> bool:
        with self._lock:
            return bool(self._released)

    def take_released(self) -> list[tuple[TransferTicket, torch.cuda.Event | None]]:
        with self._lock:
            released, self._released = self._released, []
        return released

    def _stopped(self, which: Callable[[TransferTicket], bool]) -> None:
        """The transfers `which` selects are no longer written: settle their claims, release the held."""
        with self._lock:
            tags = [tag for tag, ticket in self._writing.items() if which(ticket)]
            for tag in tags:
                del self._writing[tag]
                self._fabric.settle(tag)
            released = [self._held.pop(tag) for tag in tags if tag in self._held]
            self._released += [(ticket, self._writes_done()) for ticket in released]
        if released:
            self._on_release()
