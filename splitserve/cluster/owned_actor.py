"""An actor the controller deployment owns (the CLS, the batch API's actor, the response store),
as an ingress replica reaches it: asked of the deployment once and cached. Serve restarts the
controller replica when its CLS dies, and the new replica makes new actors; a call that finds the
cached one dead forgets it and asks the deployment again."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from ray.exceptions import RayActorError

from splitserve.api.errors import RequestError


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
        """The actor's answer (a method that raised: its RayTaskError). A dead actor is asked of the
        deployment again and called once more (the call did not run, or its effect died with it); a
        503 RequestError when that one is dead too (the controller is still being replaced)."""
        for _ in range(2):
            handle = await self.get()
            try:
                return await getattr(handle, method).remote(*args)
            except RayActorError:
                self.forget(handle)
        raise RequestError(f"the {self.name} is restarting (Serve replaces the controller and its actors when "
                           "one dies); retry shortly", status=503, type="service_unavailable")
