"""An actor the controller deployment owns (the CLS, the batch API's actor, the response store),
as an ingress replica reaches it: asked of the deployment once and cached. Ray restarts any of
them that crashes, in place (the same handle answers again); Serve replaces the controller replica
when its CLS is gone for good (killed), and the new replica makes new actors. A call that finds
the cached one dead or restarting forgets it, asks the deployment again and tries again, for a few
seconds."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from ray.exceptions import ActorUnavailableError, RayActorError

from splitserve.api.errors import RequestError

RESTART_WAIT_S = 10.0  # an actor Ray restarts is back in seconds (a new process: ~3 s on 2 busy cores)
RETRY_S = 0.25


class OwnedActor:
    def __init__(self, resolve: Callable[[], Awaitable], name: str):
        self._resolve, self.name, self._handle = resolve, name, None

    async def get(self):
        if self._handle is None:
            self._handle = await self._resolve()
        return self._handle

    def forget(self, handle) -> None:
        """Drop `handle` (found dead) unless a newer one already replaced it."""
        if self._handle is handle:
            self._handle = None

    async def call(self, method: str, *args):
        """The actor's answer (a method that raised: its RayTaskError). A dead or restarting actor
        is asked of the deployment again and called again, every RETRY_S for up to RESTART_WAIT_S
        (Ray restarting it, or Serve replacing the controller: the call did not run, or its effect
        died with it); then a 503 RequestError."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            handle = await self.get()
            try:
                return await getattr(handle, method).remote(*args)
            except RayActorError:
                self.forget(handle)
            if time.monotonic() >= deadline:
                raise RequestError(f"the {self.name} is restarting (Serve replaces the controller and its actors "
                                   "when one dies, Ray restarts an actor that crashed); retry shortly", status=503,
                                   type="service_unavailable")
            await asyncio.sleep(RETRY_S)


async def through_restart(method, *args):
    """`method.remote(*args)`, asked again every RETRY_S while Ray restarts the actor (it crashed:
    ActorUnavailableError), for up to RESTART_WAIT_S. An actor gone for good raises at once."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while True:
        try:
            return await method.remote(*args)
        except ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(RETRY_S)
