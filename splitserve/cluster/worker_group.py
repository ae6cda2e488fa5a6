"""One worker's Ray actors: rank 0 (the `Worker`), the other ranks (`ShardWorker`s) and their
placement group. All are detached and named after the app and the worker id, so that they outlive
the CLS that started them and a new CLS finds them again (`find_workers`, `WorkerActors.find`).

Names: rank 0 `<app>-<role>-<slot>.<incarnation>`, rank r `<rank 0's name>-tp<r>`, the placement
group `<rank 0's name>-ranks`, all in WORKER_NAMESPACE. Worker ids are never reused: a new CLS
numbers its incarnations past those it adopts."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayError
from ray.util import placement_group_table
from ray.util.placement_group import PlacementGroup, get_placement_group, remove_placement_group

WORKER_NAMESPACE = "splitserve"  # where the worker actors are named (ray.get_actor)
_WORKER_ID = re.compile(r"(prompt|token|mixed)-(\d+)\.(\d+)")
_OTHER_RANK = re.compile(r"(.+)-tp\d+")
_GROUP = "-ranks"


def shard_name(name: str, rank: int) -> str:
    return f"{name}-tp{rank}"


def group_name(name: str) -> str:
    return name + _GROUP


@dataclass(frozen=True)
class NamedWorker:
    """A worker's rank 0 as Ray names it: the slot it fills in its pool, and its incarnation."""
    name: str
    worker_id: str
    role: str
    slot: int
    incarnation: int


def parse_worker(app: str, name: str) -> NamedWorker | None:
    """The worker `name` is, if it names the rank 0 of one of `app`'s workers."""
    prefix = f"{app}-"
    found = _WORKER_ID.fullmatch(name[len(prefix):]) if name.startswith(prefix) else None
    if found is None:
        return None
    role, slot, incarnation = found.groups()
    return NamedWorker(name, found.group(0), role, int(slot), int(incarnation))


def find_workers(app: str) -> list[NamedWorker]:
    """`app`'s live workers (rank 0s), oldest incarnation first."""
    named = (parse_worker(app, name) for name in _named())
    return sorted((w for w in named if w is not None), key=lambda w: w.incarnation)


def stop_strays(app: str) -> list[str]:
    """Stops the other ranks, and removes the placement groups, of `app`'s workers whose rank 0 is
    gone (it died while no CLS ran: nothing else would stop them); their names."""
    names = _named()

    def stray(rank0: str) -> bool:
        return parse_worker(app, rank0) is not None and rank0 not in names
    ranks = [name for name in names if (other := _OTHER_RANK.fullmatch(name)) and stray(other.group(1))]
    for name in ranks:
        try:
            _kill(ray.get_actor(name, namespace=WORKER_NAMESPACE))
        except ValueError:  # gone meanwhile
            pass
    groups = [name for name in _live_groups() if name.endswith(_GROUP) and stray(name.removesuffix(_GROUP))]
    for name in groups:
        remove_placement_group(get_placement_group(name))
    return ranks + groups


def _named() -> set[str]:
    return {actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["namespace"] == WORKER_NAMESPACE}


def _live_groups() -> set[str]:
    return {g["name"] for g in placement_group_table().values() if g["state"] != "REMOVED"}


@dataclass
class WorkerActors:
    handle: object  # rank 0: the actor every call goes to
    shards: list = field(default_factory=list)
    group: PlacementGroup | None = None

    @classmethod
    def find(cls, name: str, size: int) -> "WorkerActors":
        """Rank 0 named `name` and whichever of its other ranks and its placement group are alive."""
        shards = []
        for rank in range(1, size):
            try:
                shards.append(ray.get_actor(shard_name(name, rank), namespace=WORKER_NAMESPACE))
            except ValueError:  # dead: the worker is incomplete, and its TP steps fail
                pass
        group = get_placement_group(group_name(name)) if size > 1 and group_name(name) in _live_groups() else None
        return cls(ray.get_actor(name, namespace=WORKER_NAMESPACE), shards, group)

    def kill(self) -> None:
        """Rank 0 last: it may be the caller (an orphan), and removing the group kills its ranks."""
        for actor in self.shards:
            _kill(actor)
        if self.group is not None:
            remove_placement_group(self.group)
        _kill(self.handle)


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except (RayError, ValueError):  # already gone
        pass
