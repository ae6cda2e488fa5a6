"""What to simulate: the pools, their hardware and performance models, the placement policy, the KV
transfer and the engine limits. Values only; `splitserve.sim.cluster.simulate` runs one."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from splitserve.engine.policies import POLICY_CLASSES, SchedulerLimits, SLOOptions, check_scheduling
from splitserve.placement import PLACEMENT_POLICIES, PlacementThresholds, Role
from splitserve.placement.hardware import HardwareProfile
from splitserve.placement.state import MAX_ADAPTER_SLOTS, AdapterOptions, PrefixOptions
from splitserve.sim.drafts import DraftModel
from splitserve.sim.host_kv import HostKVModel, WorkerHostTier
from splitserve.sim.overhead import ServingOverhead
from splitserve.sim.transfer import TransferModel
from splitserve.sim.worker import PerfModel

SPEED_PROMPT_TOKENS = 1024  # the prefill that rates a hardware class's prompt speed
SPEED_DECODE_BATCH, SPEED_DECODE_CONTEXT = 16, 1024  # the decode that rates its token speed


@dataclass(frozen=True)
class PoolSpec:
    """`count` workers whose home pool is `role`, on hardware class `hardware`, each of
    `tensor_parallel` ranks as its cluster config says (1: one engine, or whatever machine the
    perf model was measured on). `kv_budget_tokens`, `host_kv_tokens`: each worker's KV cache and
    host tier in tokens; None: the scenario's."""

    role: Role
    count: int
    hardware: str
    tensor_parallel: int = 1
    kv_budget_tokens: int | None = None
    host_kv_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.role not in set(Role):
            raise ValueError(f"role must be one of {', '.join(r.value for r in Role)}, got {self.role!r}")
        object.__setattr__(self, "role", Role(self.role))
        if not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"count of the {self.role.value} pool must be an integer >= 0, got {self.count!r}")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel of the {self.role.value} pool must be an integer >= 1, "
                             f"got {self.tensor_parallel!r}")

    @property
    def setup(self) -> str:
        """The key of this pool's perf model and speed profile in a `Scenario`: its hardware, and
        its TP unless 1, so pools of one class at different TP keep their own."""
        return self.hardware if self.tensor_parallel == 1 else f"{self.hardware}/tp{self.tensor_parallel}"


@dataclass(frozen=True)
class Scenario:
    """A cluster to simulate. `perf_models` maps each pool's `setup` (its hardware name, with its TP
    unless 1) to its performance model; `hardware` gives the CLS's speed profiles by setup (by
    default derived from the models: `hardware_profiles`). `kv_budget_tokens`: KV cache per worker,
    in tokens (rounded down to whole blocks), for pools that set none of their own. `overhead`:
    what the serving stack adds to the engine's times (none by default, as in the Splitwise simulator).
    `role_policies`: the engine policy a worker runs while in each pool, on start and after every pool
    move (the cluster's `engine.policy_for`; a pool not named runs the policy of its own name).
    `prefix_caching`: the workers cache prefixes, which matters only for requests whose prompts
    share blocks (`RequestSpec.prefix_blocks`); `prefix`: how placement and imports use them.
    `kv_windows`, `kv_group_share`: the model's KV layer groups (`perf_model.ModelShape`): a
    sequence holds a block of each group per block of tokens, a windowed group's only within its
    window (and one block is the block manager's NULL_BLOCK); a block holds `kv_group_share` of a
    token's KV bytes, so the budget holds 1 / kv_group_share blocks per token block."""

    pools: tuple[PoolSpec, ...]
    perf_models: Mapping[str, PerfModel]
    kv_budget_tokens: int
    placement: str = "splitwise"
    thresholds: PlacementThresholds = PlacementThresholds()
    transfer: TransferModel = TransferModel()
    block_size: int = 16
    report_interval_s: float = 0.1
    max_num_seqs: int = 256
    max_model_len: int = 16384
    prompt_token_budget: int = 2048
    chunk_token_budget: int = 512
    prompt_chunk_tokens: int = 8192
    hardware: Mapping[str, HardwareProfile] = field(default_factory=dict)
    overhead: ServingOverhead = ServingOverhead()
    slo: SLOOptions = SLOOptions()  # the accelgen policies' settings (pivot time: each worker's model)
    role_policies: Mapping[str, str] = field(default_factory=dict)
    prefix_caching: bool = True
    prefix: PrefixOptions = PrefixOptions()
    kv_windows: tuple[int | None, ...] = (None,)
    kv_group_share: float = 1.0
    scheduling_policy: str = "fcfs"  # or "priority": the engines order by RequestSpec.priority (EngineConfig's)
    # LoRA adapters (`RequestSpec.adapter`): each worker's device slots (engine.max_loras; every
    # adapter is in its host memory, as engine.max_cpu_loras allows), the seconds a swap into a slot
    # adds to the iteration that makes it, and how placement weighs the slots
    max_loras: int = 0
    lora_swap_s: float = 0.0
    adapters: AdapterOptions = AdapterOptions()
    drafts: DraftModel | None = None  # speculative decoding (engine.num_speculative_tokens): `sim.drafts`
    host_kv: HostKVModel | None = None  # the prefix cache's host tier (engine.kv_host_cache_bytes): `sim.host_kv`

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))
        if not any(pool.count for pool in self.pools):
            raise ValueError("pools must hold at least one worker")
        missing = sorted({p.setup for p in self.pools} - set(self.perf_models))
        if missing:
            raise ValueError(f"perf_models has no model for hardware {', '.join(missing)}")
        if self.placement not in PLACEMENT_POLICIES:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENT_POLICIES)}, got {self.placement!r}")
        for name in ("block_size", "max_num_seqs", "max_model_len", "prompt_token_budget", "chunk_token_budget",
                     "prompt_chunk_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        object.__setattr__(self, "kv_windows", tuple(self.kv_windows))
        if not self.kv_windows or any(w is not None and (not isinstance(w, int) or w < 1) for w in self.kv_windows):
            raise ValueError(f"kv_windows must be one per layer group, each None or an integer >= 1, got "
                             f"{self.kv_windows!r}")
        if not (isinstance(self.kv_group_share, (int, float)) and 0 < self.kv_group_share <= 1):
            raise ValueError(f"kv_group_share must be in (0, 1], got {self.kv_group_share!r}")
        if self.transfer.layer_groups and 1 + max(self.transfer.layer_groups) != len(self.kv_windows):
            raise ValueError(f"transfer.layer_groups names {1 + max(self.transfer.layer_groups)} KV layer groups, "
                             f"kv_windows {len(self.kv_windows)}")
        reserved = any(w is not None for w in self.kv_windows)  # NULL_BLOCK
        for pool in self.pools:
            tokens = (self.num_blocks_of(pool) - reserved) // len(self.kv_windows) * self.block_size
            if tokens < self.max_model_len:
                owner = f"the {pool.role.value} pool's " if pool.kv_budget_tokens is not None else ""
                raise ValueError(f"{owner}kv_budget_tokens={self.kv_budget_tokens_of(pool)} holds fewer tokens "
                                 f"than max_model_len={self.max_model_len}; raise kv_budget_tokens or lower "
                                 "max_model_len")
        for role, policy in self.role_policies.items():
            if role not in {r.value for r in Role} or policy not in POLICY_CLASSES:
                raise ValueError(f"role_policies maps a pool ({', '.join(r.value for r in Role)}) to a policy "
                                 f"({', '.join(POLICY_CLASSES)}), got {role!r}: {policy!r}")
        check_scheduling(self.scheduling_policy, map(self.policy_for, Role))
        if not isinstance(self.max_loras, int) or not 0 <= self.max_loras <= MAX_ADAPTER_SLOTS:
            raise ValueError(f"max_loras must be an integer from 0 to {MAX_ADAPTER_SLOTS}, got {self.max_loras!r}")
        swap_s = self.lora_swap_s
        if not (isinstance(swap_s, (int, float)) and math.isfinite(swap_s) and swap_s >= 0):
            raise ValueError(f"lora_swap_s must be a finite number >= 0, got {self.lora_swap_s!r}")
        if self.host_kv is not None and not self.prefix_caching:
            raise ValueError("host_kv keeps the prefix cache's blocks: it needs prefix_caching")
        for pool in self.pools if self.host_kv is not None else ():
            if self.host_tier_of(pool).blocks < 1:
                raise ValueError(f"the {pool.role.value} pool's host tier holds {self.host_tokens_of(pool)} tokens, "
                                 f"less than a KV block")
        if not (math.isfinite(self.report_interval_s) and self.report_interval_s > 0):
            raise ValueError(f"report_interval_s must be a finite number > 0, got {self.report_interval_s!r}")

    def policy_for(self, role: Role) -> str:
        """The engine policy of a worker while its pool is `role`."""
        return self.role_policies.get(role.value, role.value)

    def host_tier_of(self, pool: PoolSpec) -> WorkerHostTier | None:
        """The host tier of each worker of `pool` (its blocks: of one layer group's, as `num_blocks_of`);
        None without a tier."""
        if self.host_kv is None:
            return None
        block_bytes = self.block_size * self.transfer.kv_bytes_per_token * self.kv_group_share
        return WorkerHostTier(int(self.host_tokens_of(pool) // self.block_size / self.kv_group_share + 1e-9),
                              block_bytes / self.host_kv.bytes_per_s, self.host_kv.write_through)

    def host_tokens_of(self, pool: PoolSpec) -> int:
        return self.host_kv.tokens if pool.host_kv_tokens is None else pool.host_kv_tokens

    def kv_budget_tokens_of(self, pool: PoolSpec) -> int:
        return self.kv_budget_tokens if pool.kv_budget_tokens is None else pool.kv_budget_tokens

    def num_blocks_of(self, pool: PoolSpec) -> int:
        """KV blocks of each worker of `pool` (of one layer group's)."""
        return int(self.kv_budget_tokens_of(pool) // self.block_size / self.kv_group_share + 1e-9)  # float error

    @property
    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(self.max_num_seqs, self.max_model_len, self.prompt_token_budget,
                               self.chunk_token_budget, self.slo, self.prompt_chunk_tokens,
                               self.scheduling_policy == "priority")

    def hardware_profiles(self) -> dict[str, HardwareProfile]:
        """Speed profiles of the pools' setups: the given ones, else derived from the models."""
        derived = derive_hardware_profiles({p.setup: self.perf_models[p.setup] for p in self.pools})
        return {name: self.hardware.get(name, profile) for name, profile in derived.items()}


def derive_hardware_profiles(models: Mapping[str, PerfModel]) -> dict[str, HardwareProfile]:
    """Prompt speed proportional to 1 / prefill_time(1024), token speed to 1 / decode_time(16, 1024),
    each normalised so the fastest class has 1.0."""
    prompt = {name: 1.0 / m.prefill_time(SPEED_PROMPT_TOKENS) for name, m in models.items()}
    token = {name: 1.0 / m.decode_time(SPEED_DECODE_BATCH, SPEED_DECODE_CONTEXT) for name, m in models.items()}
    fastest_prompt, fastest_token = max(prompt.values()), max(token.values())
    return {name: HardwareProfile(name, prompt[name] / fastest_prompt, token[name] / fastest_token)
            for name in sorted(models)}
