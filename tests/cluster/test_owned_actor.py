"""An actor of the controller deployment as the ingress reaches it (no Ray: stand-in handles): asked
of the deployment once; a call that finds it dead asks again and tries once more, so a restarted
controller's new actor is found (a 503 while the deployment still has only the dead one); a method
that raised passes its error through."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from splitserve.api.errors import RequestError
from splitserve.cluster.owned_actor import OwnedActor


def handle(answer):
    async def remote(*args):
        if isinstance(answer, Exception):
            raise answer
        return answer(*args)
    return SimpleNamespace(status=SimpleNamespace(remote=remote))


def test_a_dead_actor_is_asked_for_again_and_a_503_while_the_new_one_is_not_there_yet():
    dead = handle(ActorDiedError())
    handles = [dead, dead, dead, handle(lambda: "new")]  # the deployment still hands out the dead one at first
    asked = []

    async def resolve():
        asked.append(1)
        return handles[len(asked) - 1]

    actor = OwnedActor(resolve, "cluster controller (CLS)")

    async def calls():
        with pytest.raises(RequestError) as gone:
            await actor.call("status")
        return gone.value, await actor.call("status"), await actor.call("status")

    gone, *answers = asyncio.run(calls())
    assert (gone.status, gone.type) == (503, "service_unavailable") and "cluster controller (CLS)" in gone.message
    assert answers == ["new", "new"] and len(asked) == 4  # once per dead handle, then cached


def test_a_method_that_raised_keeps_the_handle_and_passes_its_error():
    failing = RayTaskError("status", "traceback", KeyError("w"))
    asked = []

    async def resolve():
        asked.append(1)
        return handle(failing)

    actor = OwnedActor(resolve, "CLS")

    async def calls():
        for _ in range(2):
            with pytest.raises(RayTaskError):
                await actor.call("status")

    asyncio.run(calls())
    assert len(asked) == 1


def test_forget_drops_only_the_handle_found_dead():
    first, second = handle(lambda: 1), handle(lambda: 2)
    queue = [first, second]

    async def resolve():
        return queue.pop(0)

    actor = OwnedActor(resolve, "CLS")

    async def steps():
        assert await actor.get() is first
        actor.forget(first)
        assert await actor.get() is second
        actor.forget(first)  # a stale report: the newer handle stays
        return await actor.get()

    assert asyncio.run(steps()) is second
