"""LoRA adapters loaded and unloaded while the cluster serves (vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`), as the CLS runs them: the one table of what the cluster serves.

- A load goes to every worker (each engine writes a free slot of its own; a worker's ranks each
  their slice); the adapter is served once all have it. If any refuses (a path it cannot read, an
  adapter it cannot serve, no free slot), the others unload it again and the load fails with that
  worker's reason: no worker is left holding what the cluster does not serve.
- An unload first takes the name out of the table, so `place` admits no new request under it
  (`AdapterUnavailable`, a 404), then tells every worker: what runs under it finishes there.
- A worker that starts later (a replacement) is given the table before it takes a request
  (`give`): lora_modules unloaded since are unloaded, every adapter loaded at run time loaded; one
  that cannot load one fails its start (the controller tries again).
- A CLS adopting the workers a dead one left serves the adapters all of them hold alike
  (`adopt`); the others are unloaded from the workers holding them.
- A worker whose report shows adapters other than the table's (a load that reached it after its
  CLS gave up on it: timed out, or died and was replaced) is mended (`mend`): what it should not
  hold unloaded, what it lacks loaded, at most once per MEND_EVERY_S.
Loads and unloads take turns (`updates`, a lock), and with each worker's start from its `give`
until it joins the pools, so no worker misses one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from ray.exceptions import RayError, RayTaskError

from splitserve.api.errors import RequestError
from splitserve.cluster.background import background
from splitserve.cluster.dispatch import RequestFailed
from splitserve.config import ClusterConfig
from splitserve.engine.config import ConfigError
from splitserve.engine.lora_loading import AdapterNotLoaded, NoAdapterSlot

log = logging.getLogger("splitserve.controller")
LOAD_TIMEOUT_S = 120.0  # a worker reads the adapter's files between two steps
MEND_EVERY_S = 10.0  # a worker that still differs after a mend is mended again this much later


class LoraUpdateError(Exception):
    """A load or unload refused (crosses Ray as the cause of a RayTaskError)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code

    def as_error(self) -> RequestError:
        return RequestError(self.message, status=self.status, param="lora_name", code=self.code)


class AdapterUnavailable(RequestFailed):
    """A request under an adapter the cluster no longer serves (unloaded since it was admitted)."""

    def as_error(self) -> RequestError:
        return RequestError(str(self), status=404, param="model", code="model_not_found")


class RunTimeAdapters:
    """The CLS's table: every adapter served, name -> identity (`lora_adapter`); those loaded at
    run time also by path."""

    def __init__(self, config: ClusterConfig, counters: Counter | None = None):
        """`counters`: the controller's (`lora_mends` counts the workers mended)."""
        self.enabled = config.engine.max_loras > 0
        self._model_names = set(config.model_names)
        self._at_start = tuple(config.engine.lora_modules)  # every worker loads these as it starts
        self.identities = {name: name for name in self._at_start}  # loaded at start: named by their names
        self.paths: dict[str, str] = {}  # those loaded at run time
        self.counters = Counter() if counters is None else counters
        self._mended: dict[str, float] = {}  # worker -> when its last mend began
        self.updates = asyncio.Lock()

    def table(self) -> dict[str, str]:
        return dict(self.identities)

    def listing(self) -> dict[str, str | None]:
        """Each adapter served -> the path it was loaded from while serving (None: lora_modules)."""
        return {name: self.paths.get(name) for name in self.identities}

    def check(self, lora: str | None) -> str | None:
        """`place`'s gate: AdapterUnavailable unless `lora` (None: the base model) is served; its identity."""
        if lora is None:
            return None
        if lora not in self.identities:
            raise AdapterUnavailable(f"The model `{lora}` does not exist: no LoRA adapter of that name is loaded "
                                     "(it was unloaded)")
        return self.identities[lora]

    async def load(self, workers: dict[str, object], name: str, path: str) -> None:
        """On every worker of `workers` (the controller's live handles, read once no other update
        or worker start is under way)."""
        if not self.enabled:
            raise LoraUpdateError("loading LoRA adapters while serving is off: set engine.max_loras (slots for "
                                  "adapters) in the cluster config", status=404, code="not_enabled")
        if name in self._model_names:
            raise LoraUpdateError(f"lora_name: {name!r} is the base model's name")
        async with self.updates:
            if name in self.identities:
                raise LoraUpdateError(f"lora_name: an adapter named {name!r} is already loaded (unload it first)")
            handles = dict(workers)
            results = await asyncio.gather(*(_call(h.load_lora, name, path) for h in handles.values()),
                                           return_exceptions=True)
            refusals = [r for r in results if isinstance(r, LoraUpdateError)]
            if refusals:
                held = [h for h, r in zip(handles.values(), results) if isinstance(r, str)]
                await asyncio.gather(*(_call(h.unload_lora, name) for h in held), return_exceptions=True)
                raise refusals[0]
            identities = {r for r in results if isinstance(r, str)}
            if len(identities) > 1:  # the workers read other files under one path: they would not agree
                await asyncio.gather(*(_call(h.unload_lora, name) for h in handles.values()), return_exceptions=True)
                raise LoraUpdateError(f"lora_path: the workers read different adapters at {path!r} (each node "
                                      "must hold the same files)")
            self.identities[name] = identities.pop() if identities else name  # no worker yet: `give` names it
            self.paths[name] = path

    async def unload(self, workers: dict[str, object], name: str) -> None:
        if not self.enabled:
            raise LoraUpdateError("unloading LoRA adapters while serving is off: set engine.max_loras in the "
                                  "cluster config", status=404, code="not_enabled")
        async with self.updates:
            if name not in self.identities:
                raise LoraUpdateError(f"lora_name: no adapter named {name!r} is loaded", status=404,
                                      code="lora_not_found")
            del self.identities[name]
            handles = dict(workers)
            self.paths.pop(name, None)
            await asyncio.gather(*(_call(h.unload_lora, name) for h in handles.values()), return_exceptions=True)

    async def give(self, handle) -> None:
        """A new worker, the table as it stands (called holding `updates`, until the worker joins);
        a RayError (or timeout) if it refused a load."""
        if not self.enabled:
            return
        for name in self._at_start:
            if self.identities.get(name) != name:  # unloaded (or loaded again from elsewhere) since
                await asyncio.wait_for(handle.unload_lora.remote(name), LOAD_TIMEOUT_S)
        for name, path in self.paths.items():
            identity = await asyncio.wait_for(handle.load_lora.remote(name, path), LOAD_TIMEOUT_S)
            self.identities[name] = identity  # named by the workers (none ran at its load, or its files changed)

    async def adopt(self, handles: dict[str, object]) -> None:
        """After adoption: serve the adapters every adopted worker holds alike (name, path, identity)."""
        if not self.enabled or not handles:
            return
        held = await asyncio.gather(*(_call(h.lora_adapters) for h in handles.values()), return_exceptions=True)
        tables = [{name: tuple(entry) for name, entry in r.items()} for r in held if isinstance(r, dict)]
        if not tables:
            return
        common = {name: entry for name, entry in tables[0].items() if all(t.get(name) == entry for t in tables)}
        for handle, table in zip(handles.values(), held):
            extra = [name for name in table if name not in common] if isinstance(table, dict) else []
            await asyncio.gather(*(_call(handle.unload_lora, name) for name in extra), return_exceptions=True)
        self.identities = {name: identity for name, (_, identity) in common.items()}
        self.paths = {name: path for name, (path, _) in common.items() if path is not None}


    def mend(self, worker_id: str, handle, held: dict[str, str] | None) -> None:
        """After a poll: mend the worker in the background if what it `held` (None: it does not
        report adapters) differs from the table, and no update is under way (it would differ)."""
        if held is None or held == self.identities or self.updates.locked():
            return
        if time.monotonic() - self._mended.get(worker_id, -MEND_EVERY_S) < MEND_EVERY_S:
            return
        self._mended[worker_id] = time.monotonic()
        background(self._mend(worker_id, handle))

    def forget(self, worker_id: str) -> None:
        self._mended.pop(worker_id, None)

    async def _mend(self, worker_id: str, handle) -> None:
        async with self.updates:
            try:
                held = await _call(handle.lora_adapters)
                for name, (_, identity) in held.items():
                    if self.identities.get(name) != identity:
                        await _call(handle.unload_lora, name)
                for name, path in self.paths.items():
                    if name not in held or held[name][1] != self.identities[name]:
                        await _call(handle.load_lora, name, path)
                self.counters["lora_mends"] += 1
                log.warning("worker %s held adapters other than the cluster serves (%s); mended", worker_id,
                            sorted(held))
            except (LoraUpdateError, RayError) as error:  # tried again after MEND_EVERY_S, if it still differs
                log.error("mending worker %s's adapters failed: %s", worker_id, error)


async def _call(method, *args):
    """A worker's answer; its refusal as LoraUpdateError. A worker that died meanwhile raises its
    RayActorError: it is being replaced, and its replacement is given the table (`give`)."""
    try:
        return await asyncio.wait_for(method.remote(*args), LOAD_TIMEOUT_S)
    except RayTaskError as error:
        cause = error.cause
        if isinstance(cause, NoAdapterSlot):
            raise LoraUpdateError(str(cause), status=409, code="lora_slots_full") from None
        if isinstance(cause, AdapterNotLoaded):
            raise LoraUpdateError(str(cause), status=404, code="lora_not_found") from None
        if isinstance(cause, (ConfigError, ValueError)):
            raise LoraUpdateError(str(cause)) from None
        raise
    except asyncio.TimeoutError:
        raise LoraUpdateError(f"a worker did not answer within {LOAD_TIMEOUT_S:.0f} s", status=503) from None
