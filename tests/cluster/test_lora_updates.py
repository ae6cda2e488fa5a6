"""The CLS's table of LoRA adapters loaded while serving, with stand-in workers (no Ray): a load
every worker takes, one a worker refuses (none keeps it), an unload, the table given to a worker
that starts later, the table a new CLS adopts, and the placement gate."""
from __future__ import annotations

import asyncio
import re

import pytest
from ray.exceptions import RayActorError, RayTaskError

from splitserve.cluster.dispatch import RequestFailed
from splitserve.cluster.lora_updates import AdapterUnavailable, LoraUpdateError, RunTimeAdapters
from splitserve.config import ClusterConfig
from splitserve.engine.config import ConfigError
from splitserve.engine.lora_loading import AdapterNotLoaded, NoAdapterSlot


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def run():
            return self.fn(*args)
        return run()


class _Worker:
    """A worker's LoRA calls over a dict of what its engine holds; `refuse`: what its load raises."""

    def __init__(self, held: dict | None = None, refuse: Exception | None = None, slots: int = 4):
        self.held, self.refuse, self.slots = dict(held or {}), refuse, slots
        self.load_lora, self.unload_lora = _Remote(self._load), _Remote(self._unload)
        self.lora_adapters = _Remote(lambda: dict(self.held))

    def _load(self, name, path):
        if self.refuse is not None:
            raise RayTaskError("load_lora", "", self.refuse)
        if len(self.held) == self.slots:
            raise RayTaskError("load_lora", "", NoAdapterSlot("all adapter slots are taken"))
        self.held[name] = (path, f"{name}:{path}")
        return self.held[name][1]

    def _unload(self, name):
        if name not in self.held:
            raise RayTaskError("unload_lora", "", AdapterNotLoaded(f"no adapter named {name!r} is loaded"))
        del self.held[name]


def _table(max_loras: int = 4, lora_modules: dict | None = None) -> RunTimeAdapters:
    return RunTimeAdapters(ClusterConfig.model_validate({"engine": {"max_loras": max_loras,
                                                                    "lora_modules": lora_modules or {}}}))


def test_a_load_every_worker_takes_is_served_until_unloaded():
    table, workers = _table(), {"a": _Worker(), "b": _Worker()}
    asyncio.run(table.load(workers, "sql", "/adapters/sql"))
    assert table.table() == {"sql": "sql:/adapters/sql"} and all("sql" in w.held for w in workers.values())
    assert (table.check("sql"), table.check(None)) == ("sql:/adapters/sql", None)
    with pytest.raises(LoraUpdateError, match="already loaded") as again:
        asyncio.run(table.load(workers, "sql", "/adapters/other"))
    assert again.value.status == 400
    asyncio.run(table.unload(workers, "sql"))
    assert table.table() == {} and not any(w.held for w in workers.values())
    with pytest.raises(AdapterUnavailable, match="no LoRA adapter of that name is loaded") as refused:
        table.check("sql")
    assert isinstance(refused.value, RequestFailed) and refused.value.as_error().status == 404
    with pytest.raises(LoraUpdateError, match="no adapter named 'sql' is loaded") as missing:
        asyncio.run(table.unload(workers, "sql"))
    assert missing.value.status == 404


@pytest.mark.parametrize("refusal, status", [(ConfigError("lora_path: adapter 'sql': no such file"), 400),
                                             (NoAdapterSlot("all 4 adapter slots (max_loras) are taken"), 409)])
def test_a_load_one_worker_refuses_is_kept_by_none(refusal, status):
    workers = {"a": _Worker(), "b": _Worker(refuse=refusal), "c": _Worker()}
    table = _table()
    with pytest.raises(LoraUpdateError, match=re.escape(str(refusal))) as error:
        asyncio.run(table.load(workers, "sql", "/adapters/sql"))
    assert error.value.status == status
    assert table.table() == {} and not any(w.held for w in workers.values())


def test_a_worker_that_dies_during_a_load_does_not_fail_it():
    dead = _Worker(refuse=RayActorError())
    dead.load_lora = _Remote(lambda name, path: (_ for _ in ()).throw(RayActorError()))
    workers = {"a": _Worker(), "dead": dead}
    table = _table()
    asyncio.run(table.load(workers, "sql", "/adapters/sql"))
    assert table.table() == {"sql": "sql:/adapters/sql"}


async def _give(table: RunTimeAdapters, worker: _Worker) -> None:
    async with table.updates:
        await table.give(worker)


def test_a_worker_that_starts_later_is_given_the_table():
    table = _table(lora_modules={"chat": "/adapters/chat", "code": "/adapters/code"})
    workers = {"a": _Worker({"chat": (None, "chat"), "code": (None, "code")})}
    asyncio.run(table.load(workers, "sql", "/adapters/sql"))
    asyncio.run(table.unload(workers, "code"))  # loaded at start: a new worker loads it, then unloads it
    new = _Worker({"chat": (None, "chat"), "code": (None, "code")})
    asyncio.run(_give(table, new))
    assert table.listing() == {"chat": None, "sql": "/adapters/sql"}
    assert new.held == workers["a"].held == {"chat": (None, "chat"), "sql": ("/adapters/sql", "sql:/adapters/sql")}
    broken = _Worker({"chat": (None, "chat"), "code": (None, "code")}, refuse=ConfigError("gone"))
    with pytest.raises(RayTaskError):  # its start fails: the controller tries again
        asyncio.run(_give(table, broken))


def test_a_new_cls_serves_what_every_adopted_worker_holds_alike():
    table = _table(lora_modules={"chat": "/adapters/chat"})
    same, other = ("/adapters/sql", "sql:1"), ("/adapters/sql", "sql:2")
    workers = {"a": _Worker({"chat": (None, "chat"), "sql": same, "half": ("/h", "h")}),
               "b": _Worker({"chat": (None, "chat"), "sql": same, "odd": ("/o", "o")})}
    asyncio.run(table.adopt(workers))
    assert table.table() == {"chat": "chat", "sql": "sql:1"} and table.paths == {"sql": "/adapters/sql"}
    assert all(set(w.held) == {"chat", "sql"} for w in workers.values())  # what not all held is unloaded
    split = {"a": _Worker({"sql": same}), "b": _Worker({"sql": other})}
    table = _table()
    asyncio.run(table.adopt(split))  # two identities under one name: served by neither
    assert table.table() == {} and not any(w.held for w in split.values())


def test_updates_are_refused_where_max_loras_is_zero():
    table = _table(max_loras=0, lora_modules={"chat": "/adapters/chat"})
    for update in (table.load({}, "sql", "/adapters/sql"), table.unload({}, "chat")):
        with pytest.raises(LoraUpdateError, match="engine.max_loras") as error:
            asyncio.run(update)
        assert error.value.status == 404
    with pytest.raises(LoraUpdateError, match="the base model's name"):
        asyncio.run(_table().load({}, "demo", "/adapters/sql"))


def test_the_cls_places_no_request_under_an_adapter_it_does_not_serve():
    from splitserve.cluster.controller import Controller
    from splitserve.placement import PlacementRequest

    controller = Controller({"engine": {"max_loras": 2}})
    with pytest.raises(AdapterUnavailable, match="`gone` does not exist"):
        asyncio.run(controller.place(PlacementRequest("r", 4, 4), (), "gone"))


def test_a_worker_holding_other_adapters_than_the_table_is_mended():
    """A load that reached a worker after the CLS gave up on it (or a CLS that died mid-load)."""
    async def run():
        table = _table(lora_modules={"chat": "/adapters/chat"})
        workers = {"a": _Worker({"chat": (None, "chat")})}
        await table.load(workers, "sql", "/adapters/sql")
        stray = _Worker({"chat": (None, "chat"), "late": ("/adapters/late", "late:x"),
                         "sql": ("/adapters/old", "sql:/adapters/old")})
        table.mend("stray", stray, {name: identity for name, (_, identity) in stray.held.items()})
        await asyncio.sleep(0.05)
        assert stray.held == workers["a"].held and table.counters["lora_mends"] == 1
        table.mend("stray", stray, {"chat": "chat"})  # differs again at once: not before MEND_EVERY_S
        table.mend("fine", stray, table.table())  # holds what is served: nothing to do
        async with table.updates:  # an update under way: a report may differ from the table meanwhile
            table.mend("busy", stray, {})
        await asyncio.sleep(0.05)
        assert table.counters["lora_mends"] == 1
    asyncio.run(run())


def test_the_controllers_poll_mends_a_worker_whose_report_shows_other_adapters():
    from splitserve.cluster.controller import Controller
    from splitserve.cluster.worker_stats import WorkerStats
    from splitserve.placement.state import Role, WorkerLoad
    from tests.cluster.remote_method import RemoteMethod

    controller = Controller({"engine": {"max_loras": 2}, "pools": [{"role": "mixed"}]})
    worker = _Worker({"late": ("/adapters/late", "late:x")})
    worker.report = RemoteMethod((WorkerLoad(), WorkerStats(), None, {"late": "late:x"}))
    controller.handles["mixed-0.0"] = worker
    controller.state.add_worker("mixed-0.0", Role.MIXED, controller.config.hardware("cpu"), WorkerLoad(), 0.0)

    async def run():
        await controller._poll("mixed-0.0")
        await asyncio.sleep(0.05)
    asyncio.run(run())
    assert worker.held == {} and controller.counters["lora_mends"] == 1


def test_a_load_waiting_on_a_workers_start_reaches_that_worker_too():
    async def run():
        table, workers = _table(), {"a": _Worker()}
        async with table.updates:  # a worker starting: given the table, then joining the pools
            loading = asyncio.ensure_future(table.load(workers, "sql", "/adapters/sql"))
            await asyncio.sleep(0.01)
            workers["b"] = _Worker()
        await loading
        assert all("sql" in w.held for w in workers.values())
    asyncio.run(run())
