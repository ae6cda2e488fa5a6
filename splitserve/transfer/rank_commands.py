"""What a tensor-parallel leader tells its other ranks about KV transfers (in a step's `Round`), and
what each rank reports back. Slots travel as lists of ints; every rank's block ids are the same."""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.transfer.link import TransferError
from splitserve.transfer.protocol import Span
from splitserve.transfer.transport import TransferTicket


@dataclass(frozen=True)
class PushLayers:
    """During this round's forward pass, push each layer's piece of these parts as it is written."""

    parts: list[tuple[TransferTicket, list[list[int]], Span]]  # each with its piece's slots (per layer group)


@dataclass(frozen=True)
class FinishExport:
    """The prefill is done and its first token sampled: push the whole KV (one-shot parts), then DONE."""

    part: TransferTicket
    slots: list[list[int]]  # per layer group


@dataclass(frozen=True)
class CancelExport:
    """The export ended without a hand-off (the first token ended the request, an abort, an expired
    lease, a failed part): if this rank claimed the part, it says CANCEL, so the token side frees
    the blocks it would otherwise hold until this rank's link ends."""

    part: TransferTicket


@dataclass(frozen=True)
class Expect:
    """Receive this part into these slots (per layer group, of the reservation's `blocks`); report
    it stamped with its link epoch (and its destination, where the prompt rank writes into this
    rank's cache)."""

    part: TransferTicket
    slots: list[list[int]]
    blocks: list[list[int]]


@dataclass(frozen=True)
class Abandon:
    """Stop waiting for this part; a direct one is reported released once its sender stopped writing."""

    part: TransferTicket


@dataclass(frozen=True)
class ForgetPeers:
    """These peers left the cluster: the rank's transport lets go of them (`KVTransport.forget_peers`)."""

    peers: frozenset[str]


@dataclass(frozen=True)
class RankReport:
    stamped: list[TransferTicket] = field(default_factory=list)  # parts expected this round
    landed: list[tuple[TransferTicket, int | TransferError]] = field(default_factory=list)  # finished receives
    push_failures: list[tuple[TransferTicket, TransferError]] = field(default_factory=list)
    released: list[TransferTicket] = field(default_factory=list)  # abandoned direct parts no longer written
