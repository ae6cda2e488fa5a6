"""The cluster-config schema: one pydantic model shared by `splitserve serve --config`, the Serve
builder (`build_app(args)`), the helm chart's values and the simulator's scenarios.

A Serve config file (`deploy/*.yaml`) carries it as the `args` of the splitserve application;
`load_cluster_config` reads either that or a bare cluster config.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from splitserve.cluster.hardware import HARDWARE_CLASSES, HardwareProfile
from splitserve.cluster.placement.state import PlacementThresholds
from splitserve.engine.blend.feeder import BlendOptions
from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.policies import SLOOptions as PolicySLOOptions

APP_IMPORT_PATH = "splitserve.cluster.app:build_app"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerResources(_Strict):
    """What Ray reserves for each worker of a pool, so KubeRay worker groups can pin pools to nodes."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    accelerator_type: str | None = None  # Ray's accelerator type label, e.g. "H100", "A100"
    resources: dict[str, float] = {}     # custom Ray resources a node group advertises

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r} is not a custom resource; use num_cpus / num_gpus")
            if amount < 0:
                raise ValueError(f"resource {name!r} must be >= 0, got {amount}")
        return resources

    def ray_options(self) -> dict:
        options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class PoolConfig(_Strict):
    role: Literal["prompt", "token", "mixed"]
    num_workers: int = Field(1, ge=1)
    hardware: str = "cpu"
    resources: WorkerResources = WorkerResources()


class HardwareClassConfig(_Strict):
    prompt_speed: float = Field(gt=0)
    token_speed: float = Field(gt=0)


class SLOSchedulingOptions(_Strict):
    """The accelgen policies' settings (engine.policies.plan.SLOOptions, in ms where it is a time);
    the default targets apply to every request of this cluster's model that names none
    (a request names its own in the API's `slo` field)."""

    pivot_tokens: int = Field(512, ge=1)
    pivot_ms: float | None = Field(None, gt=0)  # None: learned from the engine's own iterations
    tile_tokens: int = Field(16, ge=1)
    max_budget_tokens: int = Field(4096, ge=1)
    window_ms: float = Field(750.0, gt=0)
    long_prompt_tokens: int = Field(4096, ge=1)
    default_ttft_ms: float = Field(1000.0, gt=0)
    default_tbt_ms: float = Field(187.5, gt=0)

    def options(self) -> PolicySLOOptions:
        return PolicySLOOptions(
            pivot_tokens=self.pivot_tokens, pivot_time_s=None if self.pivot_ms is None else self.pivot_ms / 1000,
            tile_tokens=self.tile_tokens, max_budget_tokens=self.max_budget_tokens, window_s=self.window_ms / 1000,
            long_prompt_tokens=self.long_prompt_tokens, default_ttft_s=self.default_ttft_ms / 1000,
            default_tbt_s=self.default_tbt_ms / 1000)


class EngineOptions(_Strict):
    """Engine knobs shared by every worker (EngineConfig's fields; the policy follows the pool)."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    prompt_token_budget: int = 2048
    chunk_token_budget: int = 512
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    mixed_policy: Literal["mixed", "prefill_first", "orca", "accelgen"] = "mixed"  # how the mixed pool batches
    prompt_policy: Literal["prompt", "accelgen_prompt"] = "prompt"      # ... and in the prompt pool
    slo_scheduling: SLOSchedulingOptions = SLOSchedulingOptions()

    @model_validator(mode="after")
    def _engine_accepts(self) -> "EngineOptions":
        try:
            self.engine_config("token")
        except ConfigError as error:
            raise ValueError(str(error)) from None
        return self

    def engine_config(self, policy: str) -> EngineConfig:
        names = {f.name for f in fields(EngineConfig)} - {"policy", "slo"}
        return EngineConfig(policy=policy, slo=self.slo_scheduling.options(), **{n: getattr(self, n) for n in names})

    def policy_for(self, role: str) -> str:
        """The engine policy of a worker whose pool is `role`."""
        return {"mixed": self.mixed_policy, "prompt": self.prompt_policy}.get(role, role)


class TransferOptions(_Strict):
    backend: Literal["auto", "gloo", "nccl", "grpc"] = "auto"  # auto: NCCL on CUDA workers, gloo on CPU
    timeout_s: float = Field(30.0, gt=0)
    layerwise_threshold: int = Field(512, ge=1)  # prompt tokens from which KV streams layer by layer


class SchedulerOptions(_Strict):
    policy: Literal["round-robin", "jsq", "splitwise"] = "splitwise"
    mixed_prompt_tokens: float = Field(2048, gt=0)
    mixed_decode_tokens: float = Field(65536, gt=0)
    max_queue_tokens: float = Field(16384, gt=0)          # backpressure: a prompt queue above this takes no more
    max_decode_queue_tokens: float = Field(262144, gt=0)  # backpressure: the same for a token queue
    repurpose_after_s: float = Field(60.0, gt=0)
    report_interval_s: float = Field(0.1, gt=0)  # how often workers report load (not every iteration)
    max_attempts: int = Field(3, ge=1)           # placements per request, failovers included
    replace_dead_workers: bool = True

    def thresholds(self) -> PlacementThresholds:
        """What the placement policy needs (the controller and the simulator use the same)."""
        return PlacementThresholds(
            mixed_prompt_tokens=self.mixed_prompt_tokens, mixed_decode_tokens=self.mixed_decode_tokens,
            max_queue_tokens=self.max_queue_tokens, max_decode_queue_tokens=self.max_decode_queue_tokens,
            repurpose_after_s=self.repurpose_after_s)


class IngressOptions(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.0, ge=0)
    api_key: str | None = None  # default: $SPLITSERVE_API_KEY if set; unset: no authentication
    retry_after_s: int = Field(1, ge=1)


class SLOOptions(_Strict):
    """Bounds the metrics count each completed request against (splitserve_slo_met_total)."""

    ttft_s: float = Field(2.0, gt=0)
    tbt_s: float = Field(0.2, gt=0)   # a request's mean time between tokens
    e2e_s: float = Field(60.0, gt=0)


class BatchAPIOptions(_Strict):
    """/v1/files and /v1/batches: where they persist and how batches are ordered (BlendServe)."""

    dir: str = "~/.cache/splitserve/batches"  # on Kubernetes: a persistent volume, so a restart loses nothing
    order: Literal["blend", "dfs", "fcfs"] = "blend"
    sample_fraction: float = Field(0.01, ge=0, le=1)
    split_threshold: float = Field(0.01, ge=0, le=1)
    memory_fraction: float = Field(0.9, gt=0, le=1)

    def blend_options(self) -> BlendOptions:
        return BlendOptions(self.order, self.sample_fraction, self.split_threshold, self.memory_fraction)


class ClusterConfig(_Strict):
    model: str = "demo"
    served_model_name: str | None = None
    pools: list[PoolConfig] = [PoolConfig(role="prompt"), PoolConfig(role="token")]
    hardware_classes: dict[str, HardwareClassConfig] = {}
    engine: EngineOptions = EngineOptions()
    transfer: TransferOptions = TransferOptions()
    scheduler: SchedulerOptions = SchedulerOptions()
    ingress: IngressOptions = IngressOptions()
    batch: BatchAPIOptions = BatchAPIOptions()
    slo: SLOOptions = SLOOptions()

    @model_validator(mode="after")
    def _pools_make_a_cluster(self) -> "ClusterConfig":
        roles = [p.role for p in self.pools]
        if not roles:
            raise ValueError("pools: at least one pool is needed")
        if len(set(roles)) != len(roles):
            raise ValueError(f"pools: one pool per role, got roles {roles}")
        if ("prompt" in roles) != ("token" in roles):
            raise ValueError("pools: a prompt pool needs a token pool and vice versa (or use mixed workers only)")
        for pool in self.pools:
            self.hardware(pool.hardware)
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def hardware(self, name: str) -> HardwareProfile:
        if name in self.hardware_classes:
            custom = self.hardware_classes[name]
            return HardwareProfile(name, custom.prompt_speed, custom.token_speed)
        if name not in HARDWARE_CLASSES:
            known = sorted({*HARDWARE_CLASSES, *self.hardware_classes})
            raise ValueError(f"hardware class {name!r} is unknown; known: {', '.join(known)} "
                             "(or define it under hardware_classes)")
        return HARDWARE_CLASSES[name]


def load_cluster_config(path: str | Path) -> tuple[ClusterConfig, dict]:
    """A Serve config file (the splitserve application's `args`) or a bare cluster config.
    Returns the config and the file's `http_options` (empty for a bare config)."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if "applications" not in raw:
        return ClusterConfig.model_validate(raw), {}
    apps = [a for a in raw["applications"] if a.get("import_path") == APP_IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"{path}: expected one application with import_path {APP_IMPORT_PATH}, found {len(apps)}")
    return ClusterConfig.model_validate(apps[0].get("args") or {}), raw.get("http_options") or {}
