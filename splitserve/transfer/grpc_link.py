"""gRPC links, for workers that share no collective fabric: each only needs an address.

Every worker serves at `directory[worker_id]`. `link_to(peer)` opens one client-streaming RPC
(generic handler, bytes in and out, no generated code) that carries every message of the link in
order; the sender names itself in the call metadata, and the peer's server puts each message in
that sender's inbox, which `link_from` reads. A message is one tensor: a text header (dtype,
shape) and its raw bytes, so bfloat16 travels like any other dtype.

- `send` only queues; grpc's own thread asks for the next message once the last one is written,
  and `flush` waits for that count.
- A stream that ends without its goodbye message (sender dead or gave up; a bare end of stream
  proves nothing) leaves a marker after its last message: its reader fails at once.
- A receiving link that is closed (after a timeout, say) drops and cancels the stream it read:
  a late payload is never read as a header, and the sender reconnects after its next send fails.
- Each incoming stream holds a daemon server thread for its life; `max_peers` bounds the senders
  streaming into one worker at once (one more is refused with RESOURCE_EXHAUSTED).
- Internal surface, so closed: the server binds only the address the directory gives this worker
  (the cluster's own, not every interface); with a `secret`, a call that does not carry it is
  refused with UNAUTHENTICATED (compared in constant time); a message larger than
  `max_message_bytes` (the largest KV a reservation can take) is refused by gRPC itself.
"""
from __future__ import annotations

import collections
import hmac
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures

import grpc
import numpy as np
import torch

from splitserve.transfer.link import Fabric, Link, TransferError

_SERVICE, _METHOD = "splitserve.KVStream", "Push"
_SENDER_KEY = "splitserve-sender"
_SECRET_KEY = "splitserve-secret"
_END = object()  # ends a sender's request stream
_GOODBYE = b""  # the last message of a stream that ends on purpose (a tensor's has a header)
_BROKEN = "the stream broke (the sender died or gave up on it)"


class _Inbox:
    """One sender's messages, over all its streams: (stream id, bytes), or None when it broke."""

    def __init__(self):
        self.messages: queue.SimpleQueue = queue.SimpleQueue()
        self.dropped: set[int] = set()  # streams a reader gave up on: their rest is skipped
        self.live: dict[int, grpc.ServicerContext] = {}

    def drop(self, stream: int) -> None:
        self.dropped.add(stream)
        context = self.live.get(stream)
        if context is not None:
            context.cancel()


class _DaemonThreads(futures.Executor):
    """A daemon thread per call. A stream's handler lives as long as the stream, and a pool's
    threads are joined at interpreter exit: a worker with a peer still streaming in never exits."""

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()

        def run():
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # handed to grpc through the future, as a pool does
                    future.set_exception(error)

        threading.Thread(target=run, daemon=True, name="kv-grpc-stream").start()
        return future


class GrpcFabric(Fabric):
    """Serves this worker's inboxes at once; links to peers are opened on demand."""

    def __init__(self, worker_id: str, directory: Mapping[str, str] | Callable[[str], str],
                 timeout: float = 60.0, max_peers: int = 16, secret: str | None = None, max_message_bytes: int = -1):
        self.worker_id, self.timeout = worker_id, timeout
        self._directory, self._secret = directory, secret
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes)]
        self._inboxes: dict[str, _Inbox] = {}
        self._streams = itertools.count()
        self._lock = threading.Lock()
        try:
            address = self._address(worker_id)
        except TransferError:
            raise ValueError(f"worker {worker_id!r} has no address in the gRPC directory") from None
        self._server = self._serve(address, max_peers)

    def link_to(self, peer: str, epoch: int = 0) -> Link:  # each link is a stream of its own: no epoch needed
        metadata = ((_SENDER_KEY, self.worker_id),) + (((_SECRET_KEY, self._secret),) if self._secret else ())
        return _GrpcSender(peer, self._address(peer), metadata, self.timeout, self._options)

    def link_from(self, peer: str, epoch: int = 0) -> Link:
        return _GrpcReceiver(peer, self._inbox(peer))

    def close(self) -> None:
        """Stops serving; streams still open from peers break."""
        self._server.stop(grace=None)

    def _address(self, worker: str) -> str:
        try:
            return self._directory[worker] if isinstance(self._directory, Mapping) else self._directory(worker)
        except KeyError:
            raise TransferError(worker, "no address in the gRPC directory") from None

    def _inbox(self, sender: str) -> _Inbox:
        with self._lock:
            return self._inboxes.setdefault(sender, _Inbox())

    def _serve(self, address: str, max_peers: int) -> grpc.Server:
        handler = grpc.method_handlers_generic_handler(
            _SERVICE, {_METHOD: grpc.stream_unary_rpc_method_handler(self._receive)})
        server = grpc.server(_DaemonThreads(), handlers=[handler], options=[*self._options, ("grpc.so_reuseport", 0)],
                             maximum_concurrent_rpcs=max_peers)
        try:
            server.add_insecure_port(address)
        except RuntimeError as error:
            raise ValueError(f"worker {self.worker_id!r} cannot serve gRPC at {address!r}: {error}") from error
        server.start()
        return server

    def _receive(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """One sender's stream, for its whole life: every message into that sender's inbox."""
        metadata = dict(context.invocation_metadata())
        if self._secret is not None and not hmac.compare_digest(metadata.get(_SECRET_KEY, "").encode(),
                                                                self._secret.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "the call does not carry this cluster's secret")
        sender = metadata.get(_SENDER_KEY)
        if sender is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no {_SENDER_KEY!r} in the call metadata")
        inbox, stream = self._inbox(sender), next(self._streams)
        inbox.live[stream] = context
        try:
            for message in messages:
                if message == _GOODBYE:
                    return b""
                inbox.messages.put((stream, message))
        except grpc.RpcError:
            pass
        finally:
            inbox.live.pop(stream)
        inbox.messages.put((stream, None))
        return b""


class _GrpcSender(Link):
    def __init__(self, peer: str, address: str, metadata: tuple, timeout: float, options: list):
        super().__init__(peer)
        self._timeout = timeout
        self._channel = grpc.insecure_channel(address, options=options)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise TransferError(peer, f"could not connect to {address} in {timeout} s") from None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._progress = threading.Condition()
        self._queued = self._sent = 0
        self._queued_at: collections.deque[float] = collections.deque()  # of the sends not yet written
        self._ended = self._closed = False
        push = self._channel.stream_unary(f"/{_SERVICE}/{_METHOD}")
        self._call = push.future(self._requests(), metadata=metadata, wait_for_ready=True)
        self._call.add_done_callback(self._on_end)

    def send(self, tensor: torch.Tensor) -> None:
        self._check()
        with self._progress:
            self._queued += 1
            self._queued_at.append(time.monotonic())
        self._queue.put(tensor)

    def unsent(self, timeout: float) -> int:
        self._check()
        with self._progress:
            waiting = self._queued - self._sent
            if waiting and time.monotonic() - self._queued_at[0] > timeout:
                raise TransferError(self.peer, f"a send has not left after {timeout} s (the peer stopped reading)")
        return waiting

    def flush(self, timeout: float) -> None:
        """Returns once everything queued is written. A stream that broke after that is reported
        by the next send, as the other backends do: an idle link to a dead peer is no failure."""
        if self._closed:
            raise TransferError(self.peer, "the link is closed")
        with self._progress:
            self._progress.wait_for(lambda: self._ended or self._sent == self._queued, timeout)
            unsent = self._queued - self._sent
        if unsent:
            self._check()
            raise TransferError(self.peer, f"{unsent} messages still unsent after {timeout} s")

    def recv(self, out: torch.Tensor, timeout: float) -> None:
        raise TransferError(self.peer, "a sending link cannot receive")

    def close(self) -> None:
        """Ends the stream now: a clean end if everything has left, else the call is cancelled and
        the unsent rest dropped (flush first to deliver it)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_END)
        with self._progress:
            if self._sent == self._queued:  # the server sees the stream finish, not break
                self._progress.wait_for(lambda: self._ended, self._timeout)
        self._channel.close()

    def _requests(self) -> Iterator[bytes]:
        """The request stream, on grpc's thread: it asks for the next message only once the last
        one is written, and encoding here overlaps the copy off the device with the caller's work."""
        while (tensor := self._queue.get()) is not _END:
            yield _encode(tensor)
            with self._progress:
                self._sent += 1
                self._queued_at.popleft()
                self._progress.notify_all()
        yield _GOODBYE

    def _on_end(self, _call) -> None:
        with self._progress:
            self._ended = True
            self._progress.notify_all()

    def _check(self) -> None:
        if self._closed:
            raise TransferError(self.peer, "the link is closed")
        if self._ended:  # the stream only ends early: the call failed or the peer hung up
            error = self._call.exception()
            raise TransferError(self.peer, "the peer ended the stream" if error is None
                                else f"gRPC {error.code().name}: {error.details()}")


class _GrpcReceiver(Link):
    def __init__(self, peer: str, inbox: _Inbox):
        super().__init__(peer)
        self._inbox = inbox
        self._stream: int | None = None  # the stream of the last message read
        self._failure: str | None = None

    def send(self, tensor: torch.Tensor) -> None:
        raise TransferError(self.peer, "a receiving link cannot send")

    def flush(self, timeout: float) -> None:
        raise TransferError(self.peer, "a receiving link cannot send")

    def unsent(self, timeout: float) -> int:
        raise TransferError(self.peer, "a receiving link cannot send")

    def recv(self, out: torch.Tensor, timeout: float) -> None:
        while True:
            if self._failure is not None:
                raise TransferError(self.peer, self._failure)
            try:
                stream, message = self._inbox.messages.get(timeout=timeout)
            except queue.Empty:
                raise TransferError(self.peer, f"nothing received in {timeout} s") from None
            if stream in self._inbox.dropped:
                continue
            if message is not None:
                break
            if stream == self._stream:  # a marker of a stream never read from is a stale one
                self._failure = _BROKEN
        self._stream = stream
        _decode_into(out, message, self.peer)

    def close(self) -> None:
        if self._stream is not None:
            self._inbox.drop(self._stream)
        self._failure = "the link is closed"


def _encode(tensor: torch.Tensor) -> bytes:
    tensor = tensor.detach().to("cpu").contiguous()
    header = f"{tensor.dtype} {' '.join(map(str, tensor.shape))}".encode()
    return b"".join((len(header).to_bytes(2, "little"), header, tensor.view(-1).view(torch.uint8).numpy()))


def _decode_into(out: torch.Tensor, message: bytes, peer: str) -> None:
    size = int.from_bytes(message[:2], "little")
    dtype, *dims = message[2:2 + size].decode().split()
    shape = tuple(map(int, dims))
    if (dtype, shape) != (str(out.dtype), tuple(out.shape)):
        raise TransferError(peer, f"expected a {out.dtype} tensor of shape {tuple(out.shape)}, got {dtype} {shape}")
    direct = out.device.type == "cpu" and out.is_contiguous()
    staging = out if direct else torch.empty(out.shape, dtype=out.dtype)
    staging.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(message, np.uint8, offset=2 + size)
    if not direct:
        out.copy_(staging)
