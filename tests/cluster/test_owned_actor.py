"""An actor of the controller deployment as the ingress reaches it (no Ray: stand-in handles): asked
of the deployment once; a call that finds it dead asks again and tries again for a while, so a
restarted controller's new actor is found (a 503 once the wait is over); a method that raised
passes its error through."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from splitserve.api.errors import RequestError
from splitserve.cluster import owned_actor
from splitserve.cluster.owned_actor import OwnedActor


def handle(answer):
    async def remote(*args):
        if isinstance(answer, Exception):
            raise answer
        return answer(*args)
    return SimpleNamespace(status=SimpleNamespace(remote=remote))


@pytest.mark.parametrize("dead_for", [3, 10**9])
def test_a_dead_actor_is_asked_for_again_until_the_new_one_answers_or_the_wait_is_over(dead_for, monkeypatch):
    monkeypatch.setattr(owned_actor, "RETRY_S", 0.001)
    monkeypatch.setattr(owned_actor, "RESTART_WAIT_S", 0.2)
    dead = handle(ActorDiedError())
    asked = []

    async def resolve():  # the deployment hands out the dead one a while, then the new one
        asked.append(1)
        return dead if len(asked) <= dead_for else handle(lambda: "new")

    actor = OwnedActor(resolve, "cluster controller (CLS)")

    async def calls():
        try:
            first = await actor.call("status")
        except RequestError as gone:
            first = gone
        return first, await actor.call("status") if dead_for == 3 else None

    first, second = asyncio.run(calls())
    if dead_for == 3:
        assert (first, second) == ("new", "new") and len(asked) == 4  # asked again per dead handle, then cached
    else:
        assert (first.status, first.type) == (503, "service_unavailable") and "cluster controller (CLS)" in first.message
        assert len(asked) > 3  # it kept asking until the wait was over


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


@pytest.mark.parametrize("restarting_for, answered", [(3, True), (10**9, False)])
def test_an_actor_ray_restarts_is_asked_again_through_its_restart_and_a_dead_one_once(restarting_for, answered,
                                                                                        monkeypatch):
    """`through_restart`: the same handle answers once Ray has restarted the actor (a crash), within
    RESTART_WAIT_S; an actor gone for good is not asked twice."""
    monkeypatch.setattr(owned_actor, "RETRY_S", 0.001)
    monkeypatch.setattr(owned_actor, "RESTART_WAIT_S", 0.2)
    calls = []

    class Method:
        @staticmethod
        async def remote(*args):
            calls.append(args)
            if len(calls) <= restarting_for:
                raise ActorUnavailableError("restarting", b"\0" * 16)
            return "back"

    if answered:
        assert asyncio.run(owned_actor.through_restart(Method, 7)) == "back" and calls == [(7,)] * 4
    else:
        with pytest.raises(ActorUnavailableError):
            asyncio.run(owned_actor.through_restart(Method, 7))
        assert 10 < len(calls) < 10**9
    calls.clear()  # from now on: gone for good
    Method.remote = staticmethod(_dead(calls))
    with pytest.raises(ActorDiedError):
        asyncio.run(owned_actor.through_restart(Method, 7))
    assert calls == [(7,)]


def _dead(calls: list):
    async def remote(*args):
        calls.append(args)
        raise ActorDiedError()
    return remote
