"""What the two sides of a `KVTransport` agree on: the ticket a transfer travels against, the
message header and its kinds, the HELLO handshake's layout, and the errors a foreign or broken
sender causes. The sending side (`transport`) and the receiving side (`receiver`) both build on it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from splitserve.transfer.link import Fabric, TransferError

# A header is int64[4] = (tag, kind, num_tokens, value); kind >= 0 is a layer index (a piece of it: `Span`)
ALL, DONE, CANCEL, HELLO = -1, -2, -3, -4
LAYOUT_BYTES = 512  # HELLO's payload: the layout string, utf-8, zero-padded
log = logging.getLogger("splitserve.transfer")


class ProtocolError(TransferError):
    """A message broke the protocol (the link itself works)."""


class IncompatibleKV(ProtocolError):
    """Two workers whose KV cannot be exchanged (different model, dtype or layout)."""

    def __init__(self, peer: str, this_worker: str, ours: str, theirs: str):
        super().__init__(peer, f"worker {this_worker!r} has KV layout [{ours}] but worker {peer!r} has "
                               f"[{theirs}]: they serve different models or settings and cannot exchange KV")


class Span(NamedTuple):
    """The positions a layer message carries: for a layer of group g, starts[g] .. end - 1. A
    layer-wise transfer sends each layer as pieces in position order, one per prefill step that
    computed some of it (a prompt prefilled in chunks streams each chunk's KV as it lands); the
    token side writes each piece where the layer's previous one ended."""

    starts: tuple[int, ...]  # per layer group
    end: int

    def tokens(self, group: int) -> int:
        return self.end - self.starts[group]


@dataclass(frozen=True)
class CacheDest:
    """Where a direct transfer's KV goes in the token rank's cache."""

    blocks: tuple[tuple[int, ...], ...]  # the reservation's block tables (per layer group), from position 0
    heads: tuple[int, int] | None = None  # the part's KV heads among the rank's own; None: all
    claim_by: float = 0.0  # the sender claims the transfer by this time.monotonic() (one node: one clock)


@dataclass(frozen=True)
class TransferTicket:
    request_id: str
    tag: int
    prompt_peer: str
    token_peer: str
    num_tokens: int
    layerwise: bool
    kv_layout: str = ""  # the token worker's (`kv_layout` in handoff)
    start_token: int = 0  # the first prompt position whose KV travels (the token side holds those before)
    link_epoch: int = 0  # the token side's link from prompt_peer that carries it (stamped by `expect`)
    prompt_rank: int = 0  # a part: the ranks it goes between and the KV heads [lo, hi) it carries
    token_rank: int = 0
    heads: tuple[int, int] | None = None
    parts: tuple["TransferTicket", ...] = ()  # a whole transfer: its parts (`kv_routes.split_ticket`)
    dest: CacheDest | None = None  # a direct part: written into these blocks (stamped by `expect`)
    # per layer group (engine.kv_groups): the first position whose KV its layers send, where a
    # windowed group's first decode reaches back less far than start_token; (): start_token for all
    group_starts: tuple[int, ...] = ()

    def __post_init__(self):
        if not 0 <= self.start_token < self.num_tokens:  # at least the last token's KV travels
            raise ValueError(f"TransferTicket start_token must be in [0, num_tokens={self.num_tokens}), "
                             f"got {self.start_token}")
        if not all(isinstance(s, int) and self.start_token <= s < self.num_tokens for s in self.group_starts):
            raise ValueError(f"TransferTicket group_starts must be in [start_token={self.start_token}, "
                             f"num_tokens={self.num_tokens}), got {self.group_starts}")

    @property
    def num_sent_tokens(self) -> int:
        """Tokens whose KV travels in the layers of a group sending the most: positions
        start_token .. num_tokens-1."""
        return self.num_tokens - self.start_token

    def start_of(self, group: int) -> int:
        """The first position whose KV the layers of `group` send."""
        return self.group_starts[group] if self.group_starts else self.start_token

    def starts(self, num_groups: int) -> tuple[int, ...]:
        """`start_of` every group."""
        return self.group_starts or (self.start_token,) * num_groups

    def span(self, num_groups: int) -> Span:
        """All it sends: every layer whole."""
        return Span(self.starts(num_groups), self.num_tokens)


def message_tokens(ticket: TransferTicket, kind: int, layer_groups: tuple[int, ...]) -> int:
    """The tokens a whole-layer KV message announces (`layer_groups`: each layer's group): a
    layer's, or for ALL every layer's, summed (its payload is the layers' one after the other)."""
    layers = layer_groups if kind == ALL else (layer_groups[kind],)
    return sum(ticket.num_tokens - ticket.start_of(group) for group in layers)


def header(tag: int, kind: int, num_tokens: int, value: int) -> torch.Tensor:
    return torch.tensor([tag, kind, num_tokens, value], dtype=torch.int64)


def layout_tensor(layout: str) -> torch.Tensor:
    data = layout.encode().ljust(LAYOUT_BYTES, b"\0")
    return torch.tensor(list(data), dtype=torch.uint8)


def layout_from_tensor(payload: torch.Tensor) -> str:
    return bytes(payload.tolist()).rstrip(b"\0").decode(errors="replace")


def announce_retired(fabric: Fabric, sender: str, receiver: str, epoch: int) -> None:
    """Best effort: the other side learns it at its next transfer, or from its own failure."""
    try:
        fabric.retire(sender, receiver, epoch)
    except Exception:  # the rendezvous store is gone: nothing else would reach the peer either
        log.warning("could not announce that the KV link %s->%s (epoch %d) is retired", sender, receiver,
                    epoch, exc_info=True)
