"""A tiny two-process disaggregated cluster for tests: a rendezvous store, token and prompt
workers in their own processes, and the routing a CLS would do (reserve, then push)."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket

import torch.distributed as dist

from tests.transfer import workers

WAIT_S = 60


class Cluster:
    def __init__(self, backend: str = "gloo", prompt_ids=("p0",), token_ids=("t0",), timeout: float = 20.0,
                 engine_args: dict | None = None):
        self.backend = backend
        self.ctx = mp.get_context("spawn")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        directory = {w: f"127.0.0.1:{_free_port()}" for w in (*prompt_ids, *token_ids)} if backend == "grpc" else None
        args = {**workers.engine_args_for(backend), **(engine_args or {})}
        self.backlog: dict[str, list[tuple]] = {}  # messages read while looking for another kind
        self.workers = {}
        for worker_id in token_ids:
            self._start(worker_id, workers.token_worker, backend, timeout, args, directory)
        for worker_id in prompt_ids:
            self._start(worker_id, workers.prompt_worker, backend, timeout, args, directory)
        for worker_id in self.workers:
            self.expect(worker_id, "ready")

    def _start(self, worker_id, target, backend, timeout, args, directory):
        inbox, outbox = self.ctx.Queue(), self.ctx.Queue()
        proc = self.ctx.Process(target=target, daemon=True, name=worker_id,
                                args=(worker_id, backend, self.store.port, timeout, inbox, outbox, args, directory))
        proc.start()
        self.workers[worker_id] = (proc, inbox, outbox)

    def send(self, worker_id: str, *cmd) -> None:
        self.workers[worker_id][1].put(cmd)

    def expect(self, worker_id: str, kind: str, timeout: float = WAIT_S) -> tuple:
        """The next message of `kind` from a worker (others of the same worker are kept for later)."""
        outbox = self.workers[worker_id][2]
        while True:
            try:
                msg = outbox.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no {kind!r} from {worker_id} in {timeout} s") from None
            if msg[0] == kind:
                return msg
            self.backlog.setdefault(worker_id, []).append(msg)

    def route(self, request_id, prompt, params, prompt_worker="p0", token_worker="t0"):
        """Reserve on the token worker, then hand the ticket to the prompt worker."""
        self.send(token_worker, "reserve", request_id, prompt, params, prompt_worker)
        ticket = self.expect(token_worker, "ticket")[1]
        self.send(prompt_worker, "add", ticket, prompt, params)
        return ticket

    def collect(self, worker_id: str, kinds: tuple[str, ...], count: int, timeout: float = WAIT_S) -> dict:
        """request_id -> message, for `count` messages whose kind is in `kinds`."""
        found = {}
        pending = self.backlog.pop(worker_id, [])
        outbox = self.workers[worker_id][2]
        while len(found) < count:
            msg = pending.pop(0) if pending else outbox.get(timeout=timeout)
            if msg[0] in kinds:
                found[msg[1]] = msg
        return found

    def check(self, worker_id: str) -> tuple:
        self.send(worker_id, "check")
        return self.expect(worker_id, "check")

    def signal(self, worker_id: str, signum: int) -> None:
        os.kill(self.workers[worker_id][0].pid, signum)

    def kill(self, worker_id: str) -> None:
        proc = self.workers[worker_id][0]
        proc.kill()
        proc.join(10)

    def close(self) -> None:
        for worker_id, (proc, inbox, _) in self.workers.items():
            if proc.is_alive():
                inbox.put(("stop",))
        for proc, _, _ in self.workers.values():
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
