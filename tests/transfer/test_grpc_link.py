"""The gRPC links in one process: order, dtypes, mismatches, and recovery after a reader gives up."""
import time

import pytest
import torch

from splitserve.transfer.grpc_link import GrpcFabric
from splitserve.transfer.link import TransferError
from tests.transfer.cluster import _free_port


@pytest.fixture
def fabrics():
    directory = {"a": f"127.0.0.1:{_free_port()}", "b": f"127.0.0.1:{_free_port()}",
                 "nobody": f"127.0.0.1:{_free_port()}"}
    a, b = GrpcFabric("a", directory, timeout=5), GrpcFabric("b", directory, timeout=5)
    yield a, b
    a.close()
    b.close()


def receive_like(link, tensor, timeout=5.0):
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    link.recv(out, timeout)
    return out


def failure_of(link, timeout=5.0) -> TransferError:
    """The error a sending link reports once it has noticed its stream ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            link.send(torch.zeros(1))
            link.flush(timeout)
        except TransferError as error:
            return error
        time.sleep(0.05)
    pytest.fail(f"the link to {link.peer!r} still works after {timeout} s")


def test_messages_arrive_in_order_with_their_dtype(fabrics):
    a, b = fabrics
    sent = [torch.randn(3, 5).to(torch.bfloat16), torch.arange(4), torch.randn(2, 64, 4, 16)[:, ::2],
            torch.tensor(1.5), torch.empty(0, 3)]
    link = a.link_to("b")
    for tensor in sent:
        link.send(tensor)
    link.flush(5)
    inbound = b.link_from("a")
    for tensor in sent:
        assert torch.equal(receive_like(inbound, tensor), tensor)


def test_shape_mismatch_and_timeout_name_the_peer(fabrics):
    a, b = fabrics
    link, inbound = a.link_to("b"), b.link_from("a")
    link.send(torch.zeros(2))
    with pytest.raises(TransferError, match="'a'.*shape"):
        inbound.recv(torch.empty(3), 5)
    with pytest.raises(TransferError, match="'a'.*nothing received"):
        inbound.recv(torch.empty(3), 0.2)


def test_reader_that_gave_up_makes_the_sender_reconnect(fabrics):
    a, b = fabrics
    link, inbound = a.link_to("b"), b.link_from("a")
    link.send(torch.ones(2))
    receive_like(inbound, torch.ones(2))
    with pytest.raises(TransferError):
        inbound.recv(torch.empty(2), 0.2)
    link.send(torch.full((2,), 7.0))  # late: never read, its stream is dropped
    link.flush(5)
    inbound.close()  # cancels the stream it was reading: the sender learns it on its next send
    assert "CANCELLED" in str(failure_of(link))
    link.close()
    fresh = a.link_to("b")
    fresh.send(torch.full((3,), 9.0))
    assert torch.equal(receive_like(b.link_from("a"), torch.empty(3)), torch.full((3,), 9.0))


def test_clean_close_is_not_a_broken_stream(fabrics):
    a, b = fabrics
    link, inbound = a.link_to("b"), b.link_from("a")
    link.send(torch.ones(2))
    link.flush(5)
    link.close()
    with pytest.raises(TransferError, match="'b'.*closed"):
        link.send(torch.ones(2))
    receive_like(inbound, torch.ones(2))
    with pytest.raises(TransferError, match="nothing received"):  # not "broke"
        inbound.recv(torch.empty(2), 0.3)


def test_unknown_and_unreachable_peers(fabrics):
    a, _ = fabrics
    with pytest.raises(TransferError, match="'zed'.*directory"):
        a.link_to("zed")
    a.timeout = 0.3
    with pytest.raises(TransferError, match="'nobody'.*could not connect"):
        a.link_to("nobody")


def test_a_server_with_a_secret_refuses_senders_without_it():
    directory = {w: f"127.0.0.1:{_free_port()}" for w in ("a", "b", "intruder")}
    a, b = GrpcFabric("a", directory, timeout=5, secret="s3cret"), GrpcFabric("b", directory, timeout=5, secret="s3cret")
    intruder = GrpcFabric("intruder", directory, timeout=5, secret="guess")
    try:
        link = a.link_to("b")
        link.send(torch.arange(3))
        assert torch.equal(receive_like(b.link_from("a"), torch.arange(3)), torch.arange(3))
        error = failure_of(intruder.link_to("b"))
        assert "UNAUTHENTICATED" in str(error) and "secret" in str(error)
    finally:
        for fabric in (a, b, intruder):
            fabric.close()


def test_a_message_larger_than_the_bound_is_refused():
    directory = {w: f"127.0.0.1:{_free_port()}" for w in ("a", "b")}
    a, b = (GrpcFabric(w, directory, timeout=5, max_message_bytes=4096) for w in ("a", "b"))
    try:
        link = a.link_to("b")
        link.send(torch.zeros(100))  # 400 bytes: fits
        assert receive_like(b.link_from("a"), torch.zeros(100)).shape == (100,)
        link.send(torch.zeros(2000))  # 8000 bytes: refused by gRPC itself
        assert isinstance(failure_of(link), TransferError)
    finally:
        a.close()
        b.close()
