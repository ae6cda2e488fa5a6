"""Tensor-parallel engines in one process for the tests: rank 0 is an LLMEngine on the calling
thread, every other rank a TPFollower serving on a thread of its own, all meeting through a
TCPStore of their own (as a worker's ranks meet through the cluster's)."""
from __future__ import annotations

import datetime
import itertools
import threading
from contextlib import contextmanager

from dataclasses import replace

import torch
import torch.distributed as dist

from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.tensor_parallel import TPGroup
from splitserve.engine.tp_step import TPFollower

_groups = itertools.count()


def store_server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def join(server: dist.TCPStore, name: str, rank: int, size: int, timeout: float = 30.0) -> TPGroup:
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    return TPGroup(dist.PrefixStore(name, client), rank, size, torch.device("cpu"), timeout)


class Followers:
    """Ranks 1 .. size-1 on threads; `errors` holds what ended a follower's loop."""

    def __init__(self, server, name: str, size: int, model: str, config, timeout: float, setup=None):
        self.followers: dict[int, TPFollower] = {}
        self.errors: dict[int, BaseException] = {}
        self._ready = {rank: threading.Event() for rank in range(1, size)}
        self.threads = [threading.Thread(target=self._run, args=(server, name, rank, size, model, config, timeout,
                                                                 setup), daemon=True) for rank in range(1, size)]
        for thread in self.threads:
            thread.start()

    def _run(self, server, name, rank, size, model, config, timeout, setup) -> None:
        try:
            follower = TPFollower(model, config, join(server, name, rank, size, timeout))
            self.followers[rank] = follower
            if setup is not None:
                setup(follower)
            self._ready[rank].set()
            follower.serve()
        except BaseException as error:  # the test reads it
            self.errors[rank] = error
        finally:
            self._ready[rank].set()

    def wait_ready(self, timeout: float = 30.0) -> None:
        for ready in self._ready.values():
            ready.wait(timeout)

    def join(self, timeout: float = 30.0) -> None:
        for thread in self.threads:
            thread.join(timeout)


@contextmanager
def tp_engine(model: str, size: int, timeout: float = 30.0, setup=None, follower_overrides=None, **overrides):
    """Yields (leader LLMEngine, Followers); `setup(follower)` runs on each follower before it
    serves; `follower_overrides` change the other ranks' engine config (as their devices differ)."""
    config = EngineConfig(**overrides)
    server, name = store_server(), f"tp{next(_groups)}"
    followers = Followers(server, name, size, model, replace(config, **(follower_overrides or {})), timeout, setup)
    engine = LLMEngine(model, config, tp=join(server, name, 0, size, timeout))
    followers.wait_ready()
    try:
        yield engine, followers
    finally:
        try:
            engine.tp_leader.stop()
        finally:
            followers.join()
