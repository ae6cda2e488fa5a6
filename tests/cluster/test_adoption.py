"""A new CLS adopts the workers a dead one left only where they can serve it: the slot exists in
its config, the worker runs that config and joined this app's rendezvous store, all its ranks live,
and no newer incarnation fills the slot. An adopted worker is sent back to its home pool; any other
is stopped, with the reason logged. A CLS Ray restarted starts itself and answers once it has
adopted its workers, and tells each the live workers in its first report (no Ray: stand-in
actors)."""
from __future__ import annotations

import asyncio
import logging

import pytest
from ray.exceptions import RayActorError

from splitserve.cluster import adoption
from splitserve.cluster import controller as controller_module
from splitserve.cluster.worker_group import WorkerActors, parse_worker
from splitserve.cluster.worker_stats import WorkerStats
from splitserve.config import ClusterConfig
from splitserve.placement import PlacementRequest
from splitserve.placement.state import WorkerLoad
from tests.cluster.remote_method import RemoteMethod

CONFIG = ClusterConfig.model_validate({"pools": [{"role": "prompt", "num_workers": 1, "tensor_parallel_size": 2},
                                                 {"role": "token", "num_workers": 2}]})
RENDEZVOUS = ("10.0.0.1", 29500, "secret")
LOAD = WorkerLoad(pending_prompt_tokens=7)


class _Rank0:
    def __init__(self, **info):
        self.info = RemoteMethod(info.pop("error", None) or {"config_digest": CONFIG.digest(),
                                                             "rendezvous": list(RENDEZVOUS[:2]), **info})
        self.set_role, self.load = RemoteMethod(None), RemoteMethod(LOAD)


def _adopt(monkeypatch, workers: dict[str, tuple[_Rank0, int]]):
    """`workers`: name -> (rank 0, how many of its ranks live); returns (adopted, newest, killed names)."""
    killed = []
    found = sorted((parse_worker("app", name) for name in workers), key=lambda w: w.incarnation)
    monkeypatch.setattr(adoption, "find_workers", lambda app: found if app == "app" else [])
    monkeypatch.setattr(adoption, "stop_strays", lambda app: [])
    monkeypatch.setattr(WorkerActors, "find", classmethod(
        lambda cls, name, size: cls(workers[name][0], [object()] * (workers[name][1] - 1))))
    names = {id(rank0): name for name, (rank0, _) in workers.items()}
    monkeypatch.setattr(WorkerActors, "kill", lambda self: killed.append(names[id(self.handle)]))
    adopted, newest = asyncio.run(adoption.adopt_workers("app", CONFIG, RENDEZVOUS))
    return adopted, newest, killed


def test_each_slot_keeps_its_newest_worker_sent_home_and_the_rest_stop(monkeypatch):
    prompt, old_token, token = _Rank0(), _Rank0(), _Rank0()
    adopted, newest, killed = _adopt(monkeypatch, {"app-prompt-0.4": (prompt, 2), "app-token-1.2": (old_token, 1),
                                                   "app-token-1.6": (token, 1)})
    assert sorted((a.found.worker_id, a.pool.role, a.found.slot, a.load) for a in adopted) == [
        ("prompt-0.4", "prompt", 0, LOAD), ("token-1.6", "token", 1, LOAD)]
    assert newest == 6 and killed == ["app-token-1.2"]
    assert prompt.set_role.calls == [("prompt",)] and token.set_role.calls == [("token",)]
    assert old_token.info.calls == []  # superseded: not even asked


@pytest.mark.parametrize("name, rank0, ranks, reason", [
    ("app-token-2.1", _Rank0(), 1, "the config has no such slot"),
    ("app-mixed-0.1", _Rank0(), 1, "the config has no such slot"),
    ("app-token-0.1", _Rank0(config_digest="0123"), 1, "it runs another config"),
    ("app-token-0.1", _Rank0(rendezvous=["10.0.0.2", 29500]), 1, "it joined another rendezvous store"),
    ("app-prompt-0.1", _Rank0(), 1, "1 of its ranks are gone"),
    ("app-token-0.1", _Rank0(error=RayActorError()), 1, "it did not answer"),
])
def test_a_worker_that_cannot_serve_this_cls_is_stopped_with_the_reason(monkeypatch, caplog, name, rank0, ranks,
                                                                        reason):
    with caplog.at_level(logging.WARNING, "splitserve.controller"):
        adopted, newest, killed = _adopt(monkeypatch, {name: (rank0, ranks)})
    assert adopted == [] and killed == [name] and newest == 1
    assert f"is not adopted: {reason}" in caplog.text
    assert rank0.set_role.calls == []


def test_nothing_found_adopts_nothing(monkeypatch):
    assert _adopt(monkeypatch, {}) == ([], -1, [])


def test_a_cls_ray_restarted_places_its_first_request_on_the_workers_it_adopts(monkeypatch):
    """Nobody calls `start` on a CLS Ray restarted after a crash: with `start_on_call` its first
    `place` starts it and waits for the adoption, instead of refusing (no worker ready)."""
    config = {"pools": [{"role": "mixed"}]}
    rank0 = _Rank0(config_digest=ClusterConfig.model_validate(config).digest(), rendezvous=None)
    rank0.report = RemoteMethod((LOAD, WorkerStats(), None, None))
    found = parse_worker("app", "app-mixed-0.3")

    async def adopt_workers(app, cluster, rendezvous):
        await asyncio.sleep(0.2)  # asking Ray and the workers takes a moment
        return [adoption.Adopted(found, cluster.pools[0], WorkerActors(rank0), LOAD)], 3

    monkeypatch.setattr(controller_module, "adopt_workers", adopt_workers)

    async def run():
        cls = controller_module.Controller(config, "app", start_on_call=True)
        placement = await cls.place(PlacementRequest("r1", num_prompt_tokens=8, max_tokens=4))
        health = await cls.health()
        cls._started.cancel()
        return cls, placement, health

    cls, placement, health = asyncio.run(run())
    assert placement.prompt_worker == "mixed-0.3" and health["ready"] and health["workers"] == 1
    assert cls.counters["workers_adopted"] == 1 and next(cls._incarnations) == 4


def test_an_adopted_workers_first_report_names_every_live_worker(monkeypatch):
    """So it closes its links to workers that died while no CLS ran (nobody named them gone); a
    worker this CLS started is never told."""
    config = {"pools": [{"role": "mixed", "num_workers": 2}]}
    adopted, started = _Rank0(), _Rank0()
    for rank0 in (adopted, started):
        rank0.report = RemoteMethod((LOAD, WorkerStats(), None, None))

    async def adopt_workers(app, cluster, rendezvous):
        found = parse_worker("app", "app-mixed-0.3")
        return [adoption.Adopted(found, cluster.pools[0], WorkerActors(adopted), LOAD)], 3

    monkeypatch.setattr(controller_module, "adopt_workers", adopt_workers)

    async def run():
        cls = controller_module.Controller(config, "app")
        await cls._adopt_all()
        cls._add("mixed-1.4", cls.config.pools[0], 1, WorkerActors(started), LOAD)
        for _ in range(2):
            await cls._poll("mixed-0.3")
            await cls._poll("mixed-1.4")

    asyncio.run(run())
    assert adopted.report.calls == [(True, (), ("mixed-0.3", "mixed-1.4")), (False, (), None)]
    assert started.report.calls == [(False, (), None)] * 2
