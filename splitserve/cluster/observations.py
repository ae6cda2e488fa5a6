"""An ingress replica's request observations, sent to the CLS's metrics in batches: one actor
call a second per replica, not one per request; to the CLS of the moment (a restarted controller
makes a new one)."""
from __future__ import annotations

import asyncio
import logging

from ray.exceptions import RayError

from splitserve.api.errors import RequestError
from splitserve.cluster.background import background
from splitserve.cluster.metrics import RequestObservation
from splitserve.cluster.owned_actor import OwnedActor

FLUSH_S = 1.0
log = logging.getLogger("splitserve.observations")


class ObservationBuffer:
    def __init__(self):
        self._pending: list[RequestObservation] = []
        self._task: asyncio.Task | None = None

    def add(self, observation: RequestObservation) -> None:
        self._pending.append(observation)

    async def flush(self, cls: OwnedActor) -> None:
        batch, self._pending = self._pending, []
        if batch:
            try:
                await cls.call("record_requests", batch)
            except (RayError, RequestError):  # the CLS is restarting: these observations are lost, serving goes on
                log.warning("dropped %d request observations: the CLS did not take them", len(batch))

    def start(self, cls: OwnedActor) -> None:
        """Flush every FLUSH_S from now on (idempotent)."""
        if self._task is None:
            self._task = background(self._flush_forever(cls))

    async def _flush_forever(self, cls: OwnedActor) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush(cls)
