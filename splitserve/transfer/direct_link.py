"""Same-node KV transfer with no wire: the prompt worker writes KV straight into the token worker's
reserved blocks, through CUDA IPC on GPUs and shared memory on CPU (`shared_kv`).

Every worker publishes in the rendezvous store its memory domain, the CUDA devices it sees and a
handle to its own cache. A token worker stamps a ticket with its block table (`CacheDest`) when
the prompt peer shares its memory domain and sees its cache's device, and a process of its own
could map its CUDA cache when it started (where the platform refuses CUDA IPC, every peer gets
`fallback`'s links); that prompt worker maps the cache (once per link) and writes into those
blocks only. Metadata (HELLO, headers, the first token) travels on a gloo pair of its own, so the
protocol, its order and its failures are the transport's as on any link; payloads never travel.
Peers that share no memory get `fallback`'s links (NCCL, gloo).

Claims: a token worker that gives a transfer up cannot know whether its prompt worker will still
write (it may hold the ticket in its queue, or never get it). One key per transfer in the store
decides, first come first served (`compare_set`): the prompt worker claims it before its first
write, the token worker marks it given up. Given up first: never written, freed at once. Claimed
first: held until the prompt worker's last message for it. A claim is refused after the ticket's
`claim_by` (a monotonic time: both workers run on one node), so a refusal's key can be dropped
after that.

CUDA order: the writes run on a copy stream of the sender's (on the receiver's device) after the
compute stream has written the layer; before a transfer's last message the sender records an
interprocess event after its writes (`seal`), and the receiver's stream waits on that event when
it reads the message (`fence`), before the request can decode. The sender's compute stream waits
for the writes only then, so a layer's write overlaps the next layer's compute. On CPU the
writes are plain copies, done before the message that follows them.
"""
from __future__ import annotations

import heapq
import logging
import pickle
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from splitserve.transfer.codec import Slots, copy_kv, slot_index
from splitserve.transfer.link import Fabric, Link, TransferError
from splitserve.transfer.shared_kv import mapping_refused, memory_domain, open_shared, share, visible_devices
from splitserve.transfer.torch_link import TorchFabric

log = logging.getLogger("splitserve.transfer")
EVENT_BYTES = 64  # a CUDA IPC event handle (zeros on CPU)
_SLOT_CACHE = 256  # destinations whose slots a sender keeps (a transfer's layers reuse them)
# Closed links' interprocess events, each kept its link's timeout after the close: the receiver
# fences on the event as it reads the last messages (using an imported event its exporter destroyed
# is undefined), and reads them within that time or fails the link.
_closed_events: deque[tuple[float, torch.cuda.Event]] = deque()
_closed_lock = threading.Lock()


class DirectFabric(Fabric):
    def __init__(self, store: dist.Store, worker_id: str, cache: torch.Tensor, fallback: Fabric, timeout: float = 60.0):
        """`cache`: this worker's KV cache data (shared in place: on CPU it moves into shared memory)."""
        self.worker_id, self.fallback, self.store, self.timeout, self._cache = worker_id, fallback, store, timeout, cache
        self._meta = TorchFabric(dist.PrefixStore("splitserve/kv-direct", store), worker_id, torch.device("cpu"),
                                 timeout)
        self._info = {"domain": memory_domain(), "devices": visible_devices(), "cache": share(cache)}
        self.ipc_refused = mapping_refused(self._info["cache"], timeout) if cache.is_cuda else None
        if self.ipc_refused:
            log.warning("%s: another process cannot map this KV cache (%s): its transfers take %s's links",
                        worker_id, self.ipc_refused, type(fallback).__name__)
        store.set(self._key(worker_id), pickle.dumps(self._info))
        self._peers: dict[str, dict] = {}
        self._direct: dict[str, bool] = {}  # decided once per peer: every ticket from it agrees
        self._refusals: list[tuple[float, str]] = []  # (claim_by, key) of transfers given up unclaimed

    def direct(self, peer: str) -> bool:
        if self.ipc_refused:
            return False
        if peer not in self._direct:
            info = self._peer_info(peer)
            device = self._info["cache"].device_uuid
            self._direct[peer] = info is not None and info["domain"] == self._info["domain"] and (
                device is None or device in info["devices"])
        return self._direct[peer]

    def claim(self, receiver: str, tag: int, deadline: float) -> bool:
        """No store: no claim (never a write the receiver may not expect)."""
        if time.monotonic() > deadline:
            return False
        key = self._claim_key(receiver, tag)
        try:
            if self.store.compare_set(key, "", "claimed") != b"claimed":
                return False
            if time.monotonic() > deadline:  # the receiver may have dropped a refusal meanwhile: never write
                self.store.delete_key(key)
                return False
        except RuntimeError:  # torch.distributed's store errors
            log.warning("could not claim KV transfer %s from the rendezvous store", key, exc_info=True)
            return False
        return True

    def give_up(self, tag: int, deadline: float) -> bool:
        """No store: not refused (the blocks are held until the sender ends the transfer or its link)."""
        key = self._claim_key(self.worker_id, tag)
        try:
            refused = self.store.compare_set(key, "", "given-up") == b"given-up"
        except RuntimeError:
            log.warning("could not give KV transfer %s up in the rendezvous store", key, exc_info=True)
            return False
        if refused:
            heapq.heappush(self._refusals, (deadline, key))
        self._drop_refusals()
        return refused

    def settle(self, tag: int) -> None:
        self._delete(self._claim_key(self.worker_id, tag))
        self._drop_refusals()

    def link_to(self, peer: str, epoch: int = 0) -> Link:
        return self.fallback.link_to(peer, epoch)

    def direct_link_to(self, peer: str, epoch: int = 0) -> Link:
        cache = self._map_cache(peer)  # per link: a dead peer's mapping goes with its last link
        return DirectLink(self._meta.link_to(peer, epoch), cache, self._cache.device, self.timeout)

    def link_from(self, peer: str, epoch: int = 0) -> Link:
        if not self.direct(peer):
            return self.fallback.link_from(peer, epoch)
        return DirectLink(self._meta.link_from(peer, epoch), None, self._cache.device, self.timeout)

    def retire(self, sender: str, receiver: str, epoch: int) -> None:
        self.fallback.retire(sender, receiver, epoch)

    def retired(self, sender: str, receiver: str, epoch: int) -> bool:
        return self.fallback.retired(sender, receiver, epoch)

    def _peer_info(self, peer: str) -> dict | None:
        if peer not in self._peers:
            if not self.store.check([self._key(peer)]):
                return None  # not published (yet): a worker of another backend
            self._peers[peer] = pickle.loads(self.store.get(self._key(peer)))
        return self._peers[peer]

    def _map_cache(self, peer: str) -> torch.Tensor:
        info = self._peer_info(peer)
        try:
            if info is None:
                raise ValueError("it published no cache")
            return open_shared(info["cache"])
        except (ValueError, RuntimeError) as error:
            raise TransferError(peer, f"cannot map its KV cache: {error}") from error

    def _drop_refusals(self) -> None:
        """A refusal is needed until its transfer's claim_by: no claim succeeds after that."""
        now = time.monotonic()
        while self._refusals and self._refusals[0][0] < now:
            self._delete(heapq.heappop(self._refusals)[1])

    def _delete(self, key: str) -> None:
        """Best effort: a key left behind costs the store a few bytes, never a transfer."""
        try:
            self.store.delete_key(key)
        except RuntimeError:
            log.warning("could not delete %s from the rendezvous store", key, exc_info=True)

    @staticmethod
    def _key(worker_id: str) -> str:
        return f"splitserve/kv-shared/{worker_id}"

    @staticmethod
    def _claim_key(receiver: str, tag: int) -> str:
        return f"splitserve/kv-claim/{receiver}/{tag}"


class DirectLink(Link):
    direct = True

    def __init__(self, meta: Link, peer_cache: torch.Tensor | None, device: torch.device, timeout: float):
        """Sender: `peer_cache` is the receiver's cache, mapped, and `device` this worker's;
        receiver: None, and `device` its cache's."""
        super().__init__(meta.peer)
        self._meta, self._peer_cache, self._device, self._timeout = meta, peer_cache, device, timeout
        self._slots: dict = {}
        cuda = device.type == "cuda" if peer_cache is None else peer_cache.device.type == "cuda"
        self._copy = self._sealed = self._peer_sealed = None
        try:
            if peer_cache is not None:  # the first message: the event the receiver fences on
                if cuda:
                    self._copy = torch.cuda.Stream(peer_cache.device)
                    self._sealed = torch.cuda.Event(interprocess=True)
                    self._sealed.record(self._copy)
                meta.send_meta(_event_tensor(self._sealed))
            else:
                handle = torch.empty(EVENT_BYTES, dtype=torch.uint8)
                meta.recv_meta(handle, timeout)
                if cuda:
                    self._peer_sealed = torch.cuda.Event.from_ipc_handle(device, bytes(handle.tolist()))
        except TransferError:
            meta.close()
            raise

    # ---- sender ------------------------------------------------------------------------------
    def write(self, source, source_slots, layers, source_heads, dest, starts, num_tokens) -> int:
        peer = self._live_cache()
        slots = self._dest_slots(dest, starts, num_tokens, peer)
        data, groups = source.data, source.groups  # the peer's cache is laid out alike: the same model
        if self._copy is None:
            return copy_kv(data, source_slots, peer, slots, layers, groups, source_heads, _heads(dest.heads))
        for device in {data.device, peer.device}:  # after the layer's KV, and the slots, were written
            self._copy.wait_stream(torch.cuda.current_stream(device))
        for index in (*source_slots, *slots):  # made on other streams: not reused before the copy read them
            index.record_stream(self._copy)
        with torch.cuda.stream(self._copy):
            return copy_kv(data, source_slots, peer, slots, layers, groups, source_heads, _heads(dest.heads))

    def seal(self) -> None:
        if self._copy is not None:
            self._sealed.record(self._copy)
            torch.cuda.current_stream(self._device).wait_stream(self._copy)  # the source blocks outlive the writes

    def send(self, tensor: torch.Tensor) -> None:
        raise TransferError(self.peer, "a direct link carries no payloads")

    def send_meta(self, tensor: torch.Tensor) -> None:
        self._meta.send_meta(tensor)

    def flush(self, timeout: float) -> None:
        if self._copy is not None:
            self._copy.synchronize()
        self._meta.flush(timeout)

    def unsent(self, timeout: float) -> int:
        writing = self._copy is not None and not self._copy.query()
        return self._meta.unsent(timeout) + int(writing)

    def close(self) -> None:
        """The receiver may reuse every block this link wrote once it sees the link closed."""
        if self._copy is not None:
            self._copy.synchronize()
            _keep_closed(self._sealed, self._timeout)
        self._peer_cache = None
        self._meta.close()

    def join(self, timeout: float) -> None:
        self._meta.join(timeout)

    # ---- receiver ----------------------------------------------------------------------------
    def recv(self, out: torch.Tensor, timeout: float) -> None:
        raise TransferError(self.peer, "a direct link carries no payloads")

    def recv_meta(self, out: torch.Tensor, timeout: float) -> None:
        self._meta.recv_meta(out, timeout)

    def fence(self) -> None:
        if self._peer_sealed is not None:
            torch.cuda.current_stream().wait_event(self._peer_sealed)

    # ---- internals ---------------------------------------------------------------------------
    def _live_cache(self) -> torch.Tensor:
        if self._peer_cache is None:
            raise TransferError(self.peer, "the link is closed")
        return self._peer_cache

    def _dest_slots(self, dest, starts: tuple[int, ...], num_tokens: int, peer: torch.Tensor) -> Slots:
        """The receiver's slots of positions starts[group] .. num_tokens - 1 per layer group; never
        outside its cache or heads."""
        key = (dest, starts, num_tokens)
        if key not in self._slots:
            _, _, num_blocks, block_size, heads, _ = peer.shape
            if any(not 0 <= b < num_blocks for table in dest.blocks for b in table) or \
                    (dest.heads is not None and not 0 <= dest.heads[0] < dest.heads[1] <= heads):
                raise TransferError(self.peer, f"the ticket names blocks or heads outside its cache "
                                               f"({num_blocks} blocks, {heads} KV heads)")
            try:
                slots = slot_index([list(table) for table in dest.blocks], block_size, num_tokens, peer.device, starts)
            except ValueError as error:
                raise TransferError(self.peer, f"the ticket's blocks do not fit the KV sent: {error}") from error
            if len(self._slots) >= _SLOT_CACHE:
                self._slots.pop(next(iter(self._slots)))
            self._slots[key] = slots
        return self._slots[key]


def _keep_closed(event: torch.cuda.Event, seconds: float) -> None:
    now = time.monotonic()
    with _closed_lock:
        while _closed_events and _closed_events[0][0] < now:
            _closed_events.popleft()
        _closed_events.append((now + seconds, event))


def _heads(heads: tuple[int, int] | None) -> slice | None:
    return None if heads is None else slice(*heads)


def _event_tensor(event: torch.cuda.Event | None) -> torch.Tensor:
    data = b"\0" * EVENT_BYTES if event is None else bytes(event.ipc_handle()).ljust(EVENT_BYTES, b"\0")
    return torch.tensor(list(data), dtype=torch.uint8)
