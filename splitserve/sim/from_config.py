"""A deployment's `ClusterConfig` (deploy/*.yaml, the helm values' serveConfigV2) as a simulator
scenario: the same pools, hardware classes, placement policy, thresholds and engine limits, so
a cluster designed in the simulator is the cluster that gets deployed.

Hardware classes map to performance profiles: h100 / a100 / h100-cap to the Splitwise profiles
of a paper model; any other class (cpu, ...) to rows of a profile CSV measured by
`splitserve profile --hardware <class>`.

Tensor parallelism: a pool with its own tensor_parallel_size N > 1 is simulated with the profile
rows at TP N and a KV budget of N GPUs (or N ranks' engine.kv_cache_memory_bytes: a rank keeps its
KV heads' part of every token, and so does its host tier). A TP-1 pool (the default, a model that
fits one device) stands in for the target's TP (`SimTarget.tensor_parallel`, `--tensor-parallel`,
default 8): the paper models have no TP-1 profiles, so a TP-1 pool simulates a DGX of the paper's
setup, as before pools had a TP; with a measured profile it takes that class's rows, whatever
their TP. Either way the CLS weighs a pool's workers by the speeds the controller gives them: the
class's, scaled for the pool's own tensor_parallel_size (`ClusterConfig.worker_hardware`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitserve.config import ClusterConfig, PoolConfig
from splitserve.engine.attention import fp8_kv
from splitserve.engine.config import ModelConfig
from splitserve.engine.demo import demo_model_config
from splitserve.engine.kv_cache import CPU_KV_CACHE_BYTES
from splitserve.engine.kv_groups import kv_groups
from splitserve.engine.loader import load_model_config
from splitserve.placement.state import Role
from splitserve.sim.host_kv import HostKVModel
from splitserve.sim.overhead import ServingOverhead
from splitserve.sim.perf_model import MODEL_SHAPES, ModelShape, PerfModel, load_perf_models
from splitserve.sim.scenario import PoolSpec, Scenario
from splitserve.sim.transfer import TransferModel

PROFILE_HARDWARE = {"h100": "h100-80gb", "a100": "a100-80gb", "h100-cap": "h100-80gb-pcap"}
GPU_MEMORY_BYTES = 80e9 * 0.9  # per GPU, at the engine's default gpu_memory_utilization
WEIGHT_BYTES = {"llama2-70b": 140e9, "bloom-176b": 352e9}  # fp16
CPU_DTYPE_BYTES = 4  # the engine runs float32 on CPU


@dataclass(frozen=True)
class SimTarget:
    """What the config does not say: which model's profiles stand in for it, the network, and what
    the serving stack adds to the profiled engine times (`splitserve profile --url`)."""

    model: str = "llama2-70b"
    tensor_parallel: int = 8          # what a TP-1 pool stands in for (its own TP otherwise)
    profile: Path | None = None       # a `splitserve profile` CSV for classes the paper did not measure
    bandwidth_gbps: float = 400.0     # KV transfer link (InfiniBand between DGX machines)
    latency_s: float = 0.005
    overhead: ServingOverhead = ServingOverhead()

    def __post_init__(self) -> None:
        if not (isinstance(self.tensor_parallel, int) and self.tensor_parallel >= 1):
            raise ValueError(f"tensor_parallel (--tensor-parallel) must be an integer >= 1, "
                             f"got {self.tensor_parallel!r}")


def scenario_from_config(config: ClusterConfig, target: SimTarget = SimTarget()) -> Scenario:
    pools = tuple(pool_spec(pool, config, target) for pool in config.pools)
    models = {spec.setup: perf_model_for(pool, target) for spec, pool in zip(pools, config.pools)}
    hardware = {spec.setup: config.worker_hardware(pool) for spec, pool in zip(pools, config.pools)}
    engine = config.engine
    budget = kv_budget_tokens(config, target, target.tensor_parallel)
    shape = model_shape(target.model)
    return Scenario(pools=pools, perf_models=models, kv_budget_tokens=budget,
                    placement=config.scheduler.policy, thresholds=config.scheduler.thresholds(),
                    transfer=transfer_model(config, target), block_size=engine.block_size,
                    report_interval_s=config.scheduler.report_interval_s, max_num_seqs=engine.max_num_seqs,
                    max_model_len=engine.max_model_len or 4096, prompt_token_budget=engine.prompt_token_budget,
                    chunk_token_budget=engine.chunk_token_budget, prompt_chunk_tokens=engine.prompt_chunk_tokens,
                    hardware=hardware, overhead=target.overhead,
                    slo=engine.slo_scheduling.options(),
                    role_policies={role.value: engine.policy_for(role.value) for role in Role},
                    prefix_caching=engine.enable_prefix_caching, prefix=config.prefix_options(),
                    kv_windows=shape.kv_windows, kv_group_share=shape.kv_group_share,
                    scheduling_policy=engine.scheduling_policy, max_loras=engine.max_loras,
                    adapters=config.adapter_options(), host_kv=host_kv_model(config, target))


def host_kv_model(config: ClusterConfig, target: SimTarget) -> HostKVModel | None:
    """The host tier engine.kv_host_cache_bytes gives a worker at the target's TP (`pool_spec`: at another)."""
    tokens = host_kv_tokens(config, target, target.tensor_parallel)
    through = config.engine.kv_host_write_policy == "write_through"
    return HostKVModel(tokens, write_through=through) if tokens else None


def pool_spec(pool: PoolConfig, config: ClusterConfig, target: SimTarget) -> PoolSpec:
    """A config pool as simulated; one whose workers run at another TP than the target's has its own
    KV budget and host tier (the others: the scenario's)."""
    ranks = perf_model_for(pool, target).tensor_parallel
    budget, host = (None, None) if ranks == target.tensor_parallel else \
        (kv_budget_tokens(config, target, ranks), host_kv_tokens(config, target, ranks))
    return PoolSpec(Role(pool.role), pool.num_workers, pool.hardware, pool.tensor_parallel_size, budget, host)


def perf_model_for(pool: PoolConfig, target: SimTarget) -> PerfModel:
    """The pool's Splitwise profile at its TP (a TP-1 pool: the target's), or its measured one."""
    hardware, own = pool.hardware, pool.tensor_parallel_size
    if hardware in PROFILE_HARDWARE:
        models = load_perf_models()
        key = (target.model, PROFILE_HARDWARE[hardware], own if own > 1 else target.tensor_parallel)
    else:
        if target.profile is None:
            raise ValueError(f"hardware class {hardware!r} has no Splitwise profile: measure one with "
                             f"`splitserve profile --hardware {hardware} --out FILE` and pass it as the profile")
        models = load_perf_models(target.profile)
        fits = [k for k in models if k[1] == hardware and own in (1, k[2])]
        named = [k for k in fits if k[0] == target.model]
        profiled = sorted({k[0] for k in fits})
        if not named and len(profiled) > 1:
            raise ValueError(f"the profile has {hardware} rows of several models ({', '.join(profiled)}) and none "
                             f"of {target.model!r}: keep one model's rows or name it as the model")
        key = (named or fits or [(target.model, hardware, own)])[0]
    if key not in models:
        raise ValueError(f"the {pool.role} pool ({hardware}, tensor_parallel_size {own}) has no performance "
                         f"profile for (model, hardware, tensor_parallel) = {key}; have {sorted(models)}")
    return models[key]


def model_shape(model: str, kv_cache_dtype: str = "auto") -> ModelShape:
    """Layers and KV bytes per token: the paper models as splitwise-sim sizes them (bf16), or a
    model this engine loads (the demo; a checkpoint directory), at float32 on CPU; with an FP8
    cache (`kv_cache_dtype`), a byte a value."""
    if model in MODEL_SHAPES:
        shape = MODEL_SHAPES[model]
        return ModelShape(shape.num_layers, shape.kv_bytes_per_token // 2) if fp8_kv.is_fp8(kv_cache_dtype) else shape
    config = demo_model_config() if model == "demo" else load_model_config(model)
    return shape_of(config, 1 if fp8_kv.is_fp8(kv_cache_dtype) else CPU_DTYPE_BYTES)


def shape_of(config: ModelConfig, element_bytes: int) -> ModelShape:
    """A model this engine loads, its KV `element_bytes` a value, in the engine's layer groups."""
    layers, groups = config.num_hidden_layers, kv_groups(config)
    return ModelShape(layers, layers * 2 * config.num_key_value_heads * config.head_dim * element_bytes,
                      groups.windows, groups.size / layers, groups.group_of, config.num_key_value_heads)


def kv_budget_tokens(config: ClusterConfig, target: SimTarget, tensor_parallel: int) -> int:
    """A worker's KV budget: what the config's kv_cache_memory_bytes holds on each of `tensor_parallel`
    ranks if it sets them; else, for a paper model, what `tensor_parallel` GPUs leave after the
    weights, and for a model this engine runs on CPU, the engine's own CPU default."""
    per_token = model_shape(target.model, config.engine.kv_cache_dtype).kv_bytes_per_token
    if config.engine.kv_cache_memory_bytes:
        return ranks_tokens(config, target, tensor_parallel, config.engine.kv_cache_memory_bytes)
    if target.model not in WEIGHT_BYTES:
        return CPU_KV_CACHE_BYTES // per_token
    return int((GPU_MEMORY_BYTES * tensor_parallel - WEIGHT_BYTES[target.model]) // per_token)


def host_kv_tokens(config: ClusterConfig, target: SimTarget, tensor_parallel: int) -> int:
    """What engine.kv_host_cache_bytes holds on each of `tensor_parallel` ranks (0: no host tier)."""
    return ranks_tokens(config, target, tensor_parallel, config.engine.kv_host_cache_bytes)


def ranks_tokens(config: ClusterConfig, target: SimTarget, tensor_parallel: int, rank_bytes: int) -> int:
    """The tokens `rank_bytes` on each of `tensor_parallel` ranks hold: a rank keeps its KV heads' part
    of every token (a model of fewer KV heads than ranks repeats each head on several)."""
    shape = model_shape(target.model, config.engine.kv_cache_dtype)
    ranks = tensor_parallel if shape.kv_heads is None else min(tensor_parallel, shape.kv_heads)
    return rank_bytes * ranks // shape.kv_bytes_per_token


def transfer_model(config: ClusterConfig, target: SimTarget) -> TransferModel:
    shape = model_shape(target.model, config.engine.kv_cache_dtype)
    return TransferModel(bandwidth_bytes_per_s=target.bandwidth_gbps * 1e9 / 8, latency_s=target.latency_s,
                         kv_bytes_per_token=shape.kv_bytes_per_token, num_layers=shape.num_layers,
                         layerwise_threshold=config.transfer.layerwise_threshold, layer_groups=shape.kv_layer_groups)
