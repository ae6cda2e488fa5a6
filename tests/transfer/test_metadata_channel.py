"""Metadata travels on the host: headers, HELLO and first tokens are CPU tensors on each link's
metadata channel, payloads alone on the data path, and the two keep their own order (gloo: two
tags on one pair group; gRPC: one ordered stream). A link whose sends stop leaving fails it; a
pair whose link failed meets again on the next epoch. A process that closed its transport exits
cleanly."""
from __future__ import annotations

import dataclasses
import datetime
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from splitserve.transfer.link import Fabric, Link, TransferError
from splitserve.transfer.torch_link import TorchFabric
from splitserve.transfer.transport import KVTransport, TransferTicket

ROOT = Path(__file__).resolve().parents[2]

LAYERS, KV_HEADS, DIM = 2, 2, 4


class RecordingLink(Link):
    """One direction of an in-memory link that records what went where. The receiving end reads
    the record through cursors and leaves it whole, so a test can read it while the loop runs."""

    def __init__(self, peer: str, meta: list, data: list, stuck: bool = False):
        super().__init__(peer)
        self.meta, self.data, self.stuck = meta, data, stuck
        self._read = {id(meta): 0, id(data): 0}  # entries of each record this end has received

    def send(self, tensor):
        self.data.append(tensor.clone())

    def send_meta(self, tensor):
        self.meta.append(tensor.clone())

    def recv(self, out, timeout):
        out.copy_(self._next(self.data, timeout))

    def recv_meta(self, out, timeout):
        out.copy_(self._next(self.meta, timeout))

    def _next(self, record: list, timeout: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        while len(record) <= self._read[id(record)]:
            if time.monotonic() > deadline:
                raise TransferError(self.peer, f"nothing received in {timeout} s")
            time.sleep(0.01)
        self._read[id(record)] += 1
        return record[self._read[id(record)] - 1]

    def flush(self, timeout):
        pass

    def unsent(self, timeout):
        if self.stuck:
            raise TransferError(self.peer, f"a send has not left after {timeout} s (the peer stopped reading)")
        return 0

    def close(self):
        pass


class RecordingFabric(Fabric):
    def __init__(self, worker_id: str, wires: dict, stuck: bool = False):
        self.worker_id, self.wires, self.stuck = worker_id, wires, stuck

    def link_to(self, peer, epoch=0):
        meta, data = self.wires.setdefault((self.worker_id, peer), ([], []))
        return RecordingLink(peer, meta, data, self.stuck)

    def link_from(self, peer, epoch=0):
        meta, data = self.wires.setdefault((peer, self.worker_id), ([], []))
        return RecordingLink(peer, meta, data)


def transport(fabric: Fabric, layer_groups: tuple[int, ...] = ()) -> KVTransport:
    return KVTransport(fabric, lambda n, heads: (2, n, heads, DIM), LAYERS, torch.float32, torch.device("cpu"), 5.0,
                       layout="test-layout", layer_groups=layer_groups)


def test_headers_hello_and_first_token_ride_the_metadata_channel_as_cpu_tensors():
    wires: dict = {}
    prompt, token = transport(RecordingFabric("p0", wires)), transport(RecordingFabric("t0", wires))
    ticket = TransferTicket("r", 7, "p0", "t0", 3, True, "test-layout")
    written = {}
    token.expect(ticket, lambda layer, wire, _: written.setdefault(layer, wire.clone()))
    layers = [torch.randn(2, 3, KV_HEADS, DIM) for _ in range(LAYERS)]
    for layer, payload in enumerate(layers):
        prompt.push_layer(ticket, layer, payload)
    prompt.complete(ticket, first_token_id=42)
    meta, data = wires[("p0", "t0")]
    assert all(t.device.type == "cpu" for t in meta) and len(data) == LAYERS  # only payloads on the data path
    assert [tuple(t.shape) for t in meta] == [(4,), (512,), (4,), (4,), (4,)]  # HELLO header + layout, 3 headers
    assert meta[-1].tolist() == [7, -2, 3, 42]  # DONE carries the first token
    assert token.poll(timeout=5.0) == [(ticket, 42)]
    assert all(torch.equal(written[i], layers[i]) for i in range(LAYERS))


def test_a_link_whose_sends_stop_leaving_is_reaped_without_waiting():
    wires: dict = {}
    prompt = transport(RecordingFabric("p0", wires, stuck=True))
    ticket = TransferTicket("r", 1, "p0", "t0", 3, False, "test-layout")
    prompt.push_all(ticket, torch.zeros(LAYERS, 2, 3, KV_HEADS, DIM), KV_HEADS)
    assert not prompt.all_sent({"t0"})
    errors = prompt.reap()
    assert [e.peer for e in errors] == ["t0"] and "stopped reading" in str(errors[0])
    assert prompt.all_sent({"t0"}) and prompt.reap() == []  # the link is gone: nothing left to send on it


def gloo_pair(timeout: float = 10) -> tuple[Link, Link]:
    """A gloo link from worker a to worker b, both ends in this process."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    links = {}

    def join(worker, peer, sending):
        fabric = TorchFabric(dist.TCPStore("127.0.0.1", store.port, is_master=False), worker, torch.device("cpu"),
                             timeout)
        links[worker] = fabric.link_to(peer) if sending else fabric.link_from(peer)

    threads = [threading.Thread(target=join, args=("a", "b", True)), threading.Thread(target=join, args=("b", "a", False))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return links["a"], links["b"]


def test_gloo_keeps_the_metadata_and_the_data_in_their_own_order():
    sender, receiver = gloo_pair()
    sender.send_meta(torch.tensor([1, 2]))
    sender.send(torch.full((3,), 7.0))
    sender.send_meta(torch.tensor([3, 4]))
    meta, data = torch.empty(2, dtype=torch.int64), torch.empty(3)
    receiver.recv_meta(meta, 10)
    assert meta.tolist() == [1, 2]
    receiver.recv_meta(meta, 10)  # the second header, ahead of the payload: its own channel
    assert meta.tolist() == [3, 4]
    receiver.recv(data, 10)
    assert data.tolist() == [7.0, 7.0, 7.0]
    sender.flush(10)  # gloo's sends leave as the receiver takes them
    assert sender.unsent(10) == 0
    with pytest.raises(TransferError, match="nothing|timed out|Timed out|timeout"):
        receiver.recv_meta(meta, 0.5)


def test_a_gloo_send_is_seen_to_leave_without_the_sender_waiting_on_it():
    """gloo completes a send's work only inside `wait`: were nobody to wait, every send would look
    unsent, and the link would be failed `timeout` after its first push."""
    sender, receiver = gloo_pair(timeout=1)
    sender.send(torch.full((4,), 3.0))
    out = torch.empty(4)
    receiver.recv(out, 10)
    deadline = time.monotonic() + 5
    while sender.unsent(1) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.2)  # past the timeout: nothing is left that could count as stuck
    assert sender.unsent(1) == 0 and out.tolist() == [3.0] * 4


def test_an_idle_gloo_link_outlives_the_timeout():
    """A receive loop waits for the next header past the link's timeout: a quiet pair is no failure."""
    sender, receiver = gloo_pair(timeout=0.5)
    threading.Timer(1.0, lambda: sender.send_meta(torch.tensor([5, 6]))).start()
    header = torch.empty(2, dtype=torch.int64)
    receiver.recv_meta(header, 30)
    assert header.tolist() == [5, 6]


def test_an_error_in_one_message_fails_that_peers_transfers_instead_of_leaving_them_waiting():
    wires: dict = {}
    prompt, token = transport(RecordingFabric("p0", wires)), transport(RecordingFabric("t0", wires))
    ticket = TransferTicket("r", 3, "p0", "t0", 3, True, "test-layout")

    def broken_write(layer, wire, offset):
        raise RuntimeError("the cache write failed")

    token.expect(ticket, broken_write)
    prompt.push_layer(ticket, 0, torch.zeros(2, 3, KV_HEADS, DIM))
    [(failed, error)] = token.poll(timeout=5.0)
    assert failed == ticket and isinstance(error, TransferError) and "the cache write failed" in str(error)


def test_a_failed_link_epoch_is_not_dialled_again_and_the_next_one_is():
    """A dead token worker would hold every later push to it for the whole timeout as the prompt
    side tried to open the link again (the soak test saw 60 s steps): after one failure, pushes on
    that epoch fail at once; a ticket of the next epoch (the token side moved on) dials afresh."""
    attempts = []

    class FailsOnce(RecordingFabric):
        def link_to(self, peer, epoch=0):
            attempts.append((peer, epoch))
            if epoch == 0:
                raise TransferError(peer, "could not connect")
            return super().link_to(peer, epoch)

    prompt = transport(FailsOnce("p0", {}))
    ticket = TransferTicket("r", 1, "p0", "t0", 3, True, "test-layout")
    for _ in range(3):
        with pytest.raises(TransferError):
            prompt.push_layer(ticket, 0, torch.zeros(2, 3, KV_HEADS, DIM))
    prompt.push_layer(dataclasses.replace(ticket, link_epoch=1), 0, torch.zeros(2, 3, KV_HEADS, DIM))
    assert attempts == [("t0", 0), ("t0", 1)]
    with pytest.raises(TransferError, match="epoch 0"):  # the old epoch stays given up
        prompt.complete(ticket, first_token_id=1)


def test_a_broken_link_costs_its_transfers_and_the_pair_meets_again_on_the_next_epoch():
    wires: dict = {}
    opened = []

    class BreaksFirst(RecordingFabric):
        def link_from(self, peer, epoch=0):
            opened.append(epoch)
            link = super().link_from(peer, epoch)
            if epoch == 0:
                link.recv_meta = lambda out, timeout: (_ for _ in ()).throw(TransferError(peer, "connection closed"))
            return link

    prompt, token = transport(RecordingFabric("p0", wires)), transport(BreaksFirst("t0", wires))
    first = token.expect(TransferTicket("r0", 1, "p0", "t0", 3, False, "test-layout"), lambda *_: None)
    [(failed, error)] = token.poll(timeout=5.0)
    assert first.link_epoch == 0 and failed == first and "connection closed" in str(error)
    second = token.expect(TransferTicket("r1", 2, "p0", "t0", 3, False, "test-layout"), lambda *_: None)
    assert second.link_epoch == 1
    prompt.push_all(second, torch.zeros(LAYERS, 2, 3, KV_HEADS, DIM), KV_HEADS)
    prompt.complete(second, first_token_id=5)
    assert token.poll(timeout=5.0) == [(second, 5)] and opened == [0, 1]


def test_a_silent_peer_fails_the_transfer_waiting_on_it_not_the_link():
    wires: dict = {}
    prompt, token = transport(RecordingFabric("p0", wires)), transport(RecordingFabric("t0", wires))
    opened = token.expect(TransferTicket("open", 0, "p0", "t0", 3, False, "test-layout"), lambda *_: None)
    prompt.cancel(opened)
    assert token.poll(timeout=5.0)[0][0] == opened  # the link is up
    token.timeout = 0.3
    stalled = token.expect(TransferTicket("r0", 1, "p0", "t0", 3, False, "test-layout"), lambda *_: None)
    time.sleep(0.4)
    [(failed, error)] = token.poll()
    assert failed == stalled and "nothing received" in str(error)
    token.abandon(stalled)
    prompt.push_all(stalled, torch.zeros(LAYERS, 2, 3, KV_HEADS, DIM), KV_HEADS)  # the peer wakes up: drained, dropped
    prompt.complete(stalled, first_token_id=1)
    later = token.expect(TransferTicket("r1", 2, "p0", "t0", 3, False, "test-layout"), lambda *_: None)
    prompt.push_all(later, torch.zeros(LAYERS, 2, 3, KV_HEADS, DIM), KV_HEADS)
    prompt.complete(later, first_token_id=7)
    assert later.link_epoch == 0 and token.poll(timeout=5.0) == [(later, 7)]


PROMPT_SIDE = """
import sys, torch, torch.distributed as dist
from splitserve.transfer.torch_link import TorchFabric
from tests.transfer.test_metadata_channel import LAYERS, KV_HEADS, DIM, TransferTicket, transport
prompt = transport(TorchFabric(dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False), "p0",
                               torch.device("cpu"), 10.0))
for i in range(3):
    ticket = TransferTicket(f"r{i}", i, "p0", "t0", 3, False, "test-layout")
    prompt.push_all(ticket, torch.zeros(LAYERS, 2, 3, KV_HEADS, DIM), KV_HEADS)
    prompt.complete(ticket, first_token_id=i)
prompt.close()  # and the process exits at once
"""


def test_a_process_exits_cleanly_once_it_closed_its_gloo_transport():
    """`close` waits for the threads its links run: one woken inside a torch call while the
    interpreter shuts down would abort the process (SIGABRT, after its transfers were done)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    token = transport(TorchFabric(store, "t0", torch.device("cpu"), 10.0))
    tickets = [token.expect(TransferTicket(f"r{i}", i, "p0", "t0", 3, False, "test-layout"), lambda *_: None)
               for i in range(3)]
    done = subprocess.run([sys.executable, "-c", PROMPT_SIDE, str(store.port)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    landed, deadline = [], time.monotonic() + 10
    while len(landed) < 3 and time.monotonic() < deadline:
        landed += token.poll(timeout=1.0)
    token.close()
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(landed, key=lambda r: r[1]) == [(ticket, i) for i, ticket in enumerate(tickets)]


def test_forgetting_a_peer_closes_the_link_to_it_and_the_thread_it_ran():
    """A token worker that left the cluster: the prompt side's link to it (a gloo group, a store
    connection and a sender thread), which nothing sends on any more, is closed."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    token = transport(TorchFabric(store, "t0", torch.device("cpu"), 10.0))
    prompt = transport(TorchFabric(dist.TCPStore("127.0.0.1", store.port, is_master=False), "p0",
                                   torch.device("cpu"), 10.0))
    before = set(threading.enumerate())
    ticket = token.expect(TransferTicket("r", 1, "p0", "t0", 3, False, "test-layout"), lambda *_: None)
    prompt.push_all(ticket, torch.zeros(LAYERS, 2, 3, KV_HEADS, DIM), KV_HEADS)
    prompt.complete(ticket, first_token_id=7)
    assert token.poll(timeout=10.0) == [(ticket, 7)]
    [sender] = [t for t in set(threading.enumerate()) - before if t.name == "kv-send-t0"]
    prompt.forget_peers({"t1", "t0/tp1"})  # others: nothing closes
    assert sender.is_alive()
    prompt.forget_peers({"t0", "t0/tp1"})
    sender.join(5.0)
    assert not sender.is_alive()
    token.close()
