"""The cluster-level scheduler's state: every worker's last report (its LoRA adapter slots too), what
was placed on it since, the pools, and the indexes of their prefix caches and adapter slots;
placement and rebalancing go through the chosen policy."""
from __future__ import annotations

import dataclasses
from bisect import insort
from collections.abc import Collection

from splitserve.placement.adapter_index import AdapterIndex
from splitserve.placement.affinity import Affinity
from splitserve.placement.base import PlacementPolicy, can_decode, can_prompt, can_run_whole, combined_load
from splitserve.placement.hardware import HardwareProfile, hardware_profile
from splitserve.placement.prefix_index import PrefixIndex
from splitserve.placement.registry import make_placement_policy
from splitserve.placement.state import (
    AdapterOptions,
    Placement,
    PlacementRequest,
    PlacementThresholds,
    PoolMove,
    PrefixDelta,
    PrefixOptions,
    Role,
    WorkerLoad,
    WorkerState,
)

NOTHING_EXCLUDED: frozenset[str] = frozenset()


def _worker_id(worker: WorkerState) -> str:
    return worker.worker_id


class ClusterState:
    """The CLS's view of the workers; one instance, owned by the controller (or the simulator).

    Invariants: every worker is in exactly one pool list, `_members[worker.pool]`, and each list is
    sorted by worker id (the policies' scans rely on it for deterministic tie-breaking); the prefix
    and adapter indexes hold only workers in the cluster, the adapter index what their states say.
    """

    def __init__(self, policy: str | PlacementPolicy = "splitwise",
                 thresholds: PlacementThresholds = PlacementThresholds(), prefix: PrefixOptions = PrefixOptions(),
                 adapters: AdapterOptions = AdapterOptions()):
        self.policy = make_placement_policy(policy) if isinstance(policy, str) else policy
        if not isinstance(self.policy, PlacementPolicy):
            raise ValueError(f"policy must be a policy name or a PlacementPolicy, got {policy!r}")
        if not isinstance(thresholds, PlacementThresholds):
            raise ValueError(f"thresholds must be a PlacementThresholds, got {thresholds!r}")
        if not isinstance(prefix, PrefixOptions):
            raise ValueError(f"prefix must be a PrefixOptions, got {prefix!r}")
        if not isinstance(adapters, AdapterOptions):
            raise ValueError(f"adapters must be an AdapterOptions, got {adapters!r}")
        self.thresholds, self.prefix, self.adapters = thresholds, prefix, adapters
        self.prefix_index = PrefixIndex(prefix.max_index_blocks)
        self.adapter_index = AdapterIndex()  # kept with adapter-aware placement on
        # workers placed on under an adapter, by `WorkerState.adapter_wait`: held, an idle slot, busy slots
        self.adapter_placements = [0, 0, 0]
        self.workers: dict[str, WorkerState] = {}
        self._members: dict[Role, list[WorkerState]] = {role: [] for role in Role}

    # ---- membership ----------------------------------------------------------------------
    def add_worker(self, worker_id: str, home: Role | str, hardware: HardwareProfile | str,
                   load: WorkerLoad = WorkerLoad(), now: float = 0.0) -> None:
        """A new worker joins its home pool (`home` and `hardware` may be given by name)."""
        if not worker_id or not isinstance(worker_id, str):
            raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
        if worker_id in self.workers:
            raise ValueError(f"worker_id {worker_id!r} is already in the cluster")
        if home not in set(Role):  # a Role is also its str value
            raise ValueError(f"home must be one of {', '.join(r.value for r in Role)}, got {home!r}")
        home = Role(home)
        profile = hardware_profile(hardware) if isinstance(hardware, str) else hardware
        worker = WorkerState(worker_id, home, profile, home, load, reported_at=now)
        self.workers[worker_id] = worker
        insort(self._members[home], worker, key=_worker_id)
        if self.adapters.aware:
            self.adapter_index.update(worker)

    def remove_worker(self, worker_id: str) -> None:
        """A dead (or drained) worker leaves its pool; an unknown id is a no-op."""
        worker = self.workers.pop(worker_id, None)
        if worker is not None:
            self._members[worker.pool].remove(worker)
            self.prefix_index.remove(worker_id)
            self.adapter_index.remove(worker_id)

    def members(self, pool: Role) -> list[WorkerState]:
        """The workers in `pool`, sorted by id: the live list, for policies to scan, not to modify."""
        return self._members[pool]

    def pools(self) -> dict[Role, list[str]]:
        return {role: [w.worker_id for w in members] for role, members in self._members.items()}

    # ---- reports and placement -----------------------------------------------------------
    def report(self, worker_id: str, load: WorkerLoad, now: float,
               prefix: PrefixDelta | None = None) -> list[PoolMove]:
        """A worker's periodic report replaces its load and the estimate of what was placed on it
        since, and updates the prefix index (`prefix`: its cache's change, with prefix-aware
        placement on); then the policy rebalances the pools. Returns the moves it applied."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return []
        if prefix is not None and self.prefix.aware:
            self.prefix_index.apply(worker_id, prefix)
        worker.load = load
        worker.placed_prompt_tokens = worker.placed_decode_tokens = worker.placed_kv_tokens = 0
        worker.placed_adapters, worker.reported_at = (), now
        if self.adapters.aware:
            self.adapter_index.update(worker)
        return self._apply_all(self.policy.rebalance(self, now, worker), now)

    def idle(self) -> bool:
        """No worker has work, by its last report, nor was given any since."""
        return all(w.load.idle and w.placed_prompt_tokens == w.placed_decode_tokens == 0
                   for w in self.workers.values())

    def place(self, request: PlacementRequest, now: float,
              exclude: Collection[str] = ()) -> tuple[Placement | None, list[PoolMove]]:
        """Prompt and token workers for a request (None: cannot admit now), and the pool moves made
        for it. `exclude`: worker ids not to use (a retry after a failure)."""
        excluded = frozenset(exclude) if exclude else NOTHING_EXCLUDED
        if request.priority > 0 and not self._room_for_background():
            return None, []
        placement, moves = self._followed(request, excluded), []
        if placement is None:
            choose = self.policy.choose_prompt_only if request.prompt_only else self.policy.choose
            placement, moves = choose(self, request, now, excluded)
        self._apply_all(moves, now)
        if placement is not None:
            # Until their next reports, the chosen workers' queues count this request, their slots
            # its adapter, and the prefix index counts its prompt's blocks as theirs.
            prompt = self._worker(placement.prompt_worker)
            prompt.placed_prompt_tokens += request.num_prompt_tokens
            token, decode_tokens = self._worker(placement.token_worker), request.num_prompt_tokens + request.max_tokens
            token.placed_decode_tokens += decode_tokens
            token.placed_kv_tokens += token.load.kv_tokens(decode_tokens)
            lora = request.lora
            for worker in {prompt.worker_id: prompt, token.worker_id: token}.values() if lora else ():
                wait = worker.adapter_wait(lora)
                self.adapter_placements[wait] += 1
                if wait:
                    worker.placed_adapters += (lora,)
                    if self.adapters.aware:
                        self.adapter_index.placed(worker, lora)
            if request.prefix_hashes and self.prefix.aware:
                self.prefix_index.placed(placement.prompt_worker, request.prefix_hashes)
                if placement.token_worker != placement.prompt_worker:
                    self.prefix_index.placed(placement.token_worker, request.prefix_hashes)
        return placement, moves

    def _room_for_background(self) -> bool:
        """Whether some worker that prefills (prompt or mixed pool) has a prompt queue under the
        background share of the backpressure bound."""
        bound = self.thresholds.background_share * self.thresholds.max_queue_tokens
        return any(worker.prompt_queue() < bound
                   for role in (Role.PROMPT, Role.MIXED) for worker in self._members[role])

    def affinity(self, request: PlacementRequest) -> Affinity | None:
        """What the request's cached prefix saves on the workers holding it, and what its adapter
        costs where no slot holds it; None when neither applies (no cached prefix: no hashes,
        prefix-aware placement off, or no worker holds its first block; no adapter, or
        adapter-aware placement off): blind placement."""
        lora = request.lora if self.adapters.aware else None
        cached = {}
        if request.prefix_hashes and self.prefix.aware and not self.prefix_index.empty:
            cached = self.prefix_index.cached_tokens(request.prefix_hashes)
        if not cached and lora is None:
            return None
        return Affinity(cached, self.prefix, self.thresholds, lora, self.adapters)

    def _followed(self, request: PlacementRequest, exclude: frozenset[str]) -> Placement | None:
        """The followed placement, if both its workers are still here and qualify (as one running
        it whole where it is local)."""
        follow = request.follow
        if follow is None:
            return None
        prompt, token = self.workers.get(follow.prompt_worker), self.workers.get(follow.token_worker)
        if prompt is None or token is None:
            return None
        if follow.local:
            return follow if can_run_whole(prompt, self.thresholds, request, exclude) else None
        qualify = can_prompt(prompt, self.thresholds, exclude) and can_decode(token, self.thresholds, request, exclude)
        return follow if qualify else None

    def _apply_all(self, moves: list[PoolMove], now: float) -> list[PoolMove]:
        for move in moves:
            self._apply(move, now)
        return moves

    def _apply(self, move: PoolMove, now: float) -> None:
        worker = self._worker(move.worker_id)
        if move.repurposed:
            if move.to_pool is Role.MIXED:
                raise ValueError(f"to_pool of a re-purposing move must be prompt or token, got {move}")
            worker.home = move.to_pool
        if move.to_pool is not worker.pool:
            self._members[worker.pool].remove(worker)
            insort(self._members[move.to_pool], worker, key=_worker_id)
            worker.pool = move.to_pool
        if worker.pool is not Role.MIXED or worker.home is Role.MIXED:
            worker.mixed_since = None  # not a guest in the mixed pool
        elif worker.mixed_since is None:
            worker.mixed_since = now  # a guest's stay (what re-purposing measures) starts now

    def _worker(self, worker_id: str) -> WorkerState:
        if worker_id not in self.workers:
            raise ValueError(f"worker_id {worker_id!r} is not in the cluster (placement policy bug?)")
        return self.workers[worker_id]

    # ---- inspection ----------------------------------------------------------------------
    def snapshot(self) -> dict:
        """JSON-able view for the status endpoint and the simulator's logs."""
        return {
            "policy": self.policy.name,
            "thresholds": dataclasses.asdict(self.thresholds),
            "workers": {worker_id: self._describe(w) for worker_id, w in sorted(self.workers.items())},
            "pools": {role.value: ids for role, ids in self.pools().items()},
        }

    def _describe(self, worker: WorkerState) -> dict:
        return {
            "home": worker.home.value, "pool": worker.pool.value, "hardware": worker.hardware.name,
            **dataclasses.asdict(worker.load),
            "placed_prompt_tokens": worker.placed_prompt_tokens, "placed_decode_tokens": worker.placed_decode_tokens,
            "placed_kv_tokens": worker.placed_kv_tokens, "placed_adapters": list(worker.placed_adapters),
            "prompt_queue": worker.prompt_queue(), "token_queue": worker.token_queue(),
            "combined_load": combined_load(worker, self.thresholds),
            "mixed_since": worker.mixed_since, "reported_at": worker.reported_at,
            "prefix_blocks": self.prefix_index.num_entries(worker.worker_id),
        }

    def check_integrity(self) -> None:
        """Raise RuntimeError if the pool lists and the workers disagree, or the prefix index is unsound."""
        listed = [w for members in self._members.values() for w in members]
        if sorted(w.worker_id for w in listed) != sorted(self.workers):
            raise RuntimeError("pool lists do not hold every worker exactly once")
        for role, members in self._members.items():
            if any(w.pool is not role or self.workers.get(w.worker_id) is not w for w in members):
                raise RuntimeError(f"a worker listed in the {role.value} pool is not in it")
            if [w.worker_id for w in members] != sorted(w.worker_id for w in members):
                raise RuntimeError(f"the {role.value} pool is not sorted by worker id")
        self.prefix_index.check_integrity(self.workers.keys())
        self.adapter_index.check_integrity(self.workers.values() if self.adapters.aware else ())
