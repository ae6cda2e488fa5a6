"""Direct (same-node) links in one process, over real gloo pairs and a real TCPStore: the claim
that decides whether a given-up transfer may still be written, the bounds a writer keeps, and a
held transfer released by its sender's last message."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import shutil

import pytest
import torch
import torch.distributed as dist

from splitserve.engine.kv_groups import KVGroups
from splitserve.transfer.codec import copy_kv, pack_layer, slot_index, unpack_layer
from splitserve.transfer.direct_link import DirectFabric
from splitserve.transfer import shared_kv
from splitserve.transfer.link import TransferError
from splitserve.transfer.protocol import Span
from splitserve.transfer.shared_kv import SharedCache, mapping_refused, open_shared, share
from splitserve.transfer.torch_link import TorchFabric
from splitserve.transfer.transport import ALL, CacheDest, KVTransport, TransferTicket

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 6, 4, 2, 3


class _Cache:  # what codec's pack/unpack and a direct write read: one layer group of every layer
    def __init__(self, data):
        self.data = data
        self.num_layers = data.shape[0]
        self.groups = KVGroups((None,), (0,) * self.num_layers, tuple(range(self.num_layers)), self.num_layers)

    def layer(self, layer: int) -> torch.Tensor:
        return self.data[layer]


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))


@pytest.fixture
def transports(store):
    """transports(prompt cache, token cache): a prompt and a token side; closed (the prompt side
    first, which ends the token side's receive loops) while the store still serves them."""
    made = []

    def make(source, target):
        made.extend([transport(fabric(store, "p0", source)), transport(fabric(store, "t0", target))])
        return made[-2], made[-1]

    yield make
    for side in made:
        side.close()


def fabric(store, worker: str, cache: torch.Tensor) -> DirectFabric:
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    return DirectFabric(client, worker, cache, TorchFabric(client, worker, torch.device("cpu"), 10), timeout=10)


def transport(fabric: DirectFabric) -> KVTransport:
    return KVTransport(fabric, lambda n, heads: (2, n, heads, DIM), LAYERS, torch.float32, torch.device("cpu"), 10,
                       layout="test-layout")


def caches():
    return torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM), torch.zeros(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)


def test_a_shared_cache_is_the_same_memory_in_place(store):
    cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
    layer = cache[1]  # a view taken before sharing, as the model runner holds
    mapped = open_shared(share(cache))
    mapped[1, 0, 2, 1] = 5.0
    assert layer[0, 2, 1].eq(5.0).all() and cache.untyped_storage().is_shared()


def _fill(shared, value: float) -> None:
    """In another process: the shared cache mapped and written."""
    mapped = open_shared(shared)
    mapped.fill_(value)
    if mapped.is_cuda:
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_another_process_writes_into_a_shared_cache(device):
    """Shared memory on CPU; on CUDA the IPC path a direct transfer takes (two processes, one GPU)."""
    cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM, device=device)
    writer = mp.get_context("spawn").Process(target=_fill, args=(share(cache), 7.0))
    writer.start()
    writer.join(120)
    assert writer.exitcode == 0 and cache.eq(7.0).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_probe_maps_a_cache_in_a_process_of_its_own(device):
    assert mapping_refused(share(torch.zeros(2, 3, device=device)), timeout=120) is None


def test_the_probe_says_why_a_cache_cannot_be_mapped():
    shared = share(torch.zeros(2, 3))
    gone = SharedCache(None, (shared.handle[0], b"/splitserve-no-such-cache", shared.handle[2]), shared.shape,
                       shared.stride, shared.offset, shared.dtype)
    assert "unable to open shared memory object </splitserve-no-such-cache>" in mapping_refused(gone, timeout=120)


def test_a_cache_larger_than_the_free_shared_memory_is_refused_before_any_write(monkeypatch):
    cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
    monkeypatch.setattr(shared_kv.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 100))
    with pytest.raises(ValueError, match=r"does not fit in /dev/shm \(0 MiB free\).*gloo transfer backend"):
        share(cache)
    assert not cache.untyped_storage().is_shared()


def test_copy_kv_equals_pack_then_unpack_across_block_sizes_and_heads():
    src = torch.randn(LAYERS, 2, 5, 4, 4, DIM)
    expected, got = torch.zeros(LAYERS, 2, 3, 8, 2, DIM), torch.zeros(LAYERS, 2, 3, 8, 2, DIM)
    src_slots = slot_index([[4, 0, 2]], 4, 11, torch.device("cpu"), start=3)
    dst_slots = slot_index([[2, 0]], 8, 11, torch.device("cpu"), start=3)
    for layer in range(LAYERS):
        wire = pack_layer(_Cache(src), layer, src_slots, slice(2, 3))
        unpack_layer(_Cache(expected), layer, dst_slots, wire, slice(1, 2))
    written = copy_kv(src, src_slots, got, dst_slots, slice(None), _Cache(src).groups, slice(2, 3), slice(1, 2))
    assert torch.equal(got, expected) and written == LAYERS * 2 * 8 * 1 * DIM * 4


def test_first_come_decides_between_a_claim_and_a_give_up(store):
    prompt, token = fabric(store, "p0", caches()[0]), fabric(store, "t0", caches()[1])
    later = 1e12
    assert token.direct("p0") and prompt.direct("t0") and not token.direct("elsewhere")
    assert prompt.claim("t0", 1, later) and not token.give_up(1, later)  # claimed: the blocks are held
    token.settle(1)
    assert not store.check(["splitserve/kv-claim/t0/1"])
    assert token.give_up(2, later) and not prompt.claim("t0", 2, later)  # given up first: never written
    assert not prompt.claim("t0", 3, 0.0)  # past claim_by
    token.give_up(4, 0.0)
    token.settle(5)  # drops refusals past their claim_by
    assert not store.check(["splitserve/kv-claim/t0/4"])


@pytest.mark.parametrize("pieces", [[(2, 10)], [(2, 5), (5, 6), (6, 10)]])
def test_a_direct_transfer_lands_in_the_reserved_blocks_and_only_headers_travel(transports, pieces):
    """Whole layers, or each layer in pieces (a prompt prefilled in chunks): the same KV lands."""
    source, target = caches()
    prompt, token = transports(source, target)
    blocks = ((5, 1, 3),)
    ticket = token.expect(TransferTicket("r", 0, "p0", "t0", 10, True, "test-layout", start_token=2),
                          lambda *_: pytest.fail("a direct transfer carries no payload"), CacheDest(blocks))
    assert ticket.dest.blocks == blocks and ticket.dest.claim_by > 0
    src_slots = slot_index([[0, 2, 4]], BLOCK, 10, torch.device("cpu"), start=2)
    for lo, hi in pieces:
        for layer in range(LAYERS):
            prompt.write_kv(ticket, layer, _Cache(source), (src_slots[0][lo - 2:hi - 2],), None, Span((lo,), hi))
    prompt.complete(ticket, 42)
    assert token.poll(timeout=10) == [(ticket, 42)]
    dst_slots = slot_index([list(blocks[0])], BLOCK, 10, torch.device("cpu"), start=2)[0]
    assert torch.equal(target.flatten(2, 3)[:, :, dst_slots], source.flatten(2, 3)[:, :, src_slots[0]])
    untouched = torch.ones(BLOCKS * BLOCK, dtype=torch.bool)
    untouched[dst_slots] = False
    assert target.flatten(2, 3)[:, :, untouched].eq(0).all()


def test_a_cache_no_other_process_can_map_takes_the_fallback_links(transports):
    source, target = caches()
    prompt, token = transports(source, target)
    token.fabric.ipc_refused = "refused in this test"  # as a CUDA worker on a platform that refuses CUDA IPC
    landed = []
    ticket = token.expect(TransferTicket("r", 0, "p0", "t0", 10, True, "test-layout"),
                          lambda layer, payload, _: landed.append((layer, payload.clone())), CacheDest(((5, 1, 3),)))
    assert ticket.dest is None  # no block table: the prompt worker sends the KV over the fallback link
    payloads = torch.randn(LAYERS, 2, 10, HEADS, DIM)
    for layer in range(LAYERS):
        prompt.push_layer(ticket, layer, payloads[layer])
    prompt.complete(ticket, 42)
    assert token.poll(timeout=10) == [(ticket, 42)] and target.eq(0).all()
    assert [layer for layer, _ in landed] == list(range(LAYERS))
    assert all(torch.equal(payload, payloads[layer]) for layer, payload in landed)


def test_a_claimed_transfer_given_up_is_held_until_its_sender_ends_it(store, transports):
    source, target = caches()
    prompt, token = transports(source, target)
    ticket = token.expect(TransferTicket("r", 0, "p0", "t0", 8, False, "test-layout"), lambda *_: None,
                          CacheDest(((0, 1),)))
    prompt.claim(ticket)
    assert not token.abandon(ticket)  # the writer may still write: held
    prompt.write_kv(ticket, ALL, _Cache(source), slot_index([[2, 3]], BLOCK, 8, torch.device("cpu")), None)
    assert token.take_released() == []
    prompt.cancel(ticket)
    token.poll(timeout=10)  # wakes on the release
    assert token.take_released() == [ticket] and not store.check(["splitserve/kv-claim/t0/0"])


@pytest.mark.parametrize("dest, match", [(CacheDest(((0, BLOCKS),)), "outside its cache"),
                                         (CacheDest(((0, 1),), heads=(1, 3)), "outside its cache"),
                                         (CacheDest(((0,),)), "do not fit")])
def test_a_writer_never_writes_outside_the_receivers_cache(transports, dest, match):
    source, target = caches()
    prompt, token = transports(source, target)
    ticket = token.expect(TransferTicket("r", 0, "p0", "t0", 8, False, "test-layout"), lambda *_: None, dest)
    with pytest.raises(TransferError, match=match):
        prompt.write_kv(ticket, ALL, _Cache(source), torch.arange(8)[None], None)
    assert target.eq(0).all()
