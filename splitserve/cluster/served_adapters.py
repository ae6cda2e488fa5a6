"""What an ingress replica (or the batch API's actor) takes as `model`: the base model's names and
the LoRA adapters the CLS serves now. With adapters loaded while serving (`engine.max_loras`), the
view is asked of the CLS again at most every REFRESH_S (and at once after a load or unload this
replica ran), so a load on one replica reaches the others within that; the CLS itself refuses a
request under an adapter it no longer serves, whatever a replica's view."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from ray.exceptions import RayError

from splitserve.api.errors import RequestError
from splitserve.api.request_models import ServedModels
from splitserve.config import ClusterConfig
from splitserve.engine.prefix_hash import PrefixNaming

log = logging.getLogger("splitserve.ingress")
REFRESH_S = 1.0


class ServedAdapters:
    def __init__(self, config: ClusterConfig, prefix: PrefixNaming):
        self.served = config.served_models
        # names blocks under each adapter's identity; as served at start: lora_modules, each named by its name
        self.prefix = replace(prefix, lora_identities=tuple((name, name) for name in config.engine.lora_modules))
        self._names, self._changes = config.model_names, config.engine.max_loras > 0
        self._checked = -REFRESH_S
        self._lock = asyncio.Lock()

    async def refresh(self, table: Callable[[], Awaitable[dict[str, str]]], now: bool = False) -> None:
        """Ask `table` (the CLS's `lora_table`) again if the view is older than REFRESH_S (`now`: anyway).
        A CLS that does not answer (restarting) leaves the view as it was: the request goes on to
        the placement, which says what is wrong."""
        if not self._changes or not now and time.monotonic() - self._checked < REFRESH_S:
            return
        async with self._lock:
            if not now and time.monotonic() - self._checked < REFRESH_S:  # another request refreshed it meanwhile
                return
            self._checked = time.monotonic()
            try:
                identities = await table()
            except (RequestError, RayError) as error:
                log.warning("the LoRA adapters served could not be asked of the CLS: %s", error)
                return
            if tuple(identities.items()) != self.prefix.lora_identities:
                self.served = ServedModels(self._names, tuple(identities))
                self.prefix = replace(self.prefix, lora_identities=tuple(identities.items()))
