"""The engine's knobs, frozen and checked on construction (the model's shape: `config`)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from splitserve.engine.attention.fp8_kv import KV_CACHE_DTYPES
from splitserve.engine.config import ConfigError
from splitserve.engine.lora_adapter import MAX_LORA_RANK
from splitserve.engine.policies import POLICY_CLASSES, SchedulerLimits, SLOOptions, check_scheduling
from splitserve.engine.sampling_params import MAX_LORA_NAME
from splitserve.engine.speculation import SpeculativeConfig

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
MAX_KV_BLOCKS = 2**31 - 1  # num_kv_blocks at most: every block id fits an int32 index
MAX_LORA_ADAPTERS = 64  # adapter slots at most (max_loras, or lora_modules without it)
KV_HOST_WRITE_POLICIES = ("write_through", "write_back")  # the first: the default
MAX_CPU_LORAS = 1024  # adapters held in host memory at most (max_cpu_loras)


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine. Defaults follow Splitwise (prompt budget 2048) and Sarathi-Serve (512)."""

    policy: str = "mixed"
    switch_policies: tuple[str, ...] = ()      # others set_policy may switch to: the memory profile covers them
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None   # KV budget in bytes; default: see memory_profile.kv_cache_budget
    gpu_memory_utilization: float = 0.9        # CUDA: share of the GPU's memory this engine may use in all
    gpu_reserve_bytes: int = 512 * 2**20       # CUDA: kept from the KV cache for NCCL, CUDA graphs (memory_profile)
    num_kv_blocks: int | None = None           # overrides the byte budget when set
    max_num_seqs: int = 256
    max_model_len: int | None = None           # default: the model's max_position_embeddings
    prompt_token_budget: int = 2048            # PromptPolicy / prefill-first: tokens per prefill batch
    chunk_token_budget: int = 512              # MixedPolicy: tokens per hybrid iteration
    prompt_chunk_tokens: int = 8192            # Prompt/TokenPolicy: a longer prompt is prefilled in chunks of this many
    enable_prefix_caching: bool = True
    kv_host_cache_bytes: int = 0               # host memory that keeps the prefix cache's evicted blocks (0: none)
    kv_host_write_policy: str = KV_HOST_WRITE_POLICIES[0]  # when blocks are copied out (host_kv_tier)
    dtype: str = "auto"                        # auto | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"               # auto (the serving dtype) | fp8 | fp8_e4m3 (see attention.fp8_kv)
    device: str = "auto"                       # auto | cpu | cuda | cuda:N
    load_format: str = "auto"                  # auto | safetensors | dummy
    attention_backend: str = "auto"            # auto | torch | triton | flash-attn (see engine.attention)
    cuda_graph_max_batch: int = 256            # CUDA: decode steps up to this many sequences replay a graph; 0: eager
    async_scheduling: bool | None = None       # queue step N+1 before building N's outputs; None: on CUDA
    seed: int = 0
    # LoRA adapters (name, PEFT directory), all loaded at start; a request names one in SamplingParams.lora
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 0       # > 0: slots for that many adapters, loaded at start or run time (LLMEngine.load_lora)
    max_lora_rank: int = 16  # with max_loras: the largest rank an adapter may have
    max_cpu_loras: int | None = None  # with max_loras: adapters held in host memory, swapped into slots (>= max_loras)
    slo: SLOOptions = SLOOptions()             # the SLO-aware (accelgen) policies' settings
    scheduling_policy: str = "fcfs"            # fcfs | priority: requests' SamplingParams.priority orders them
    # speculative decoding by n-gram prompt lookup (`speculation`): drafts a decode may take a step (0: off)
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2  # the shortest context ending looked up
    prompt_lookup_max: int = 4  # the longest

    def __post_init__(self) -> None:
        object.__setattr__(self, "switch_policies", tuple(self.switch_policies))
        pairs = self.lora_modules.items() if isinstance(self.lora_modules, dict) else self.lora_modules
        object.__setattr__(self, "lora_modules", tuple((name, str(path)) for name, path in pairs))
        names = [name for name, _ in self.lora_modules]
        if not 0 <= self.max_loras <= MAX_LORA_ADAPTERS:
            raise ConfigError(f"max_loras must be 0 (the lora_modules, fixed) to {MAX_LORA_ADAPTERS}, "
                              f"got {self.max_loras!r}")
        if self.max_cpu_loras is not None and not (0 < self.max_loras <= self.max_cpu_loras <= MAX_CPU_LORAS):
            raise ConfigError(f"max_cpu_loras must be from max_loras ({self.max_loras}, which must be > 0) to "
                              f"{MAX_CPU_LORAS}, got {self.max_cpu_loras!r}")
        if len(set(names)) != len(names) or any(not isinstance(n, str) or not 0 < len(n) <= MAX_LORA_NAME
                                                for n in names):
            raise ConfigError(f"lora_modules must name each adapter by a distinct name of 1 to {MAX_LORA_NAME} "
                              f"characters, got {names!r}")
        most, bound = (self.host_loras, "max_cpu_loras") if self.max_loras else (MAX_LORA_ADAPTERS, "slots")
        if len(names) > most:
            raise ConfigError(f"lora_modules names {len(names)} adapters, past the {most} {bound} allows")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ConfigError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank!r}")
        named = [("policy", self.policy)] + [("switch_policies", policy) for policy in self.switch_policies]
        for name, policy in named:
            if policy not in POLICY_CLASSES:
                raise ConfigError(f"{name} must be one of {', '.join(POLICY_CLASSES)}, got {policy!r}")
        try:
            check_scheduling(self.scheduling_policy, (policy for _, policy in named))
        except ValueError as error:
            raise ConfigError(str(error)) from None
        for name in ("block_size", "max_num_seqs", "prompt_token_budget", "chunk_token_budget", "prompt_chunk_tokens",
                     "kv_cache_memory_bytes", "num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        self._check_host_tier()
        if self.cuda_graph_max_batch < 0:
            raise ConfigError(f"cuda_graph_max_batch must be >= 0 (0: no CUDA graphs), got {self.cuda_graph_max_batch!r}")
        if self.gpu_reserve_bytes < 0:
            raise ConfigError(f"gpu_reserve_bytes must be >= 0, got {self.gpu_reserve_bytes!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        check_device(self.device)
        if not 0 <= self.seed < 2**64:
            raise ConfigError(f"seed must be in [0, 2**64), got {self.seed!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ConfigError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        try:
            self.speculative
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")

    def _check_host_tier(self) -> None:
        if self.kv_host_cache_bytes < 0 or self.kv_host_cache_bytes and not self.enable_prefix_caching:
            raise ConfigError(f"kv_host_cache_bytes must be >= 0 (0: no host tier), and needs enable_prefix_caching "
                              f"(it keeps the prefix cache's blocks), got {self.kv_host_cache_bytes!r}")
        if self.kv_host_write_policy not in KV_HOST_WRITE_POLICIES:
            raise ConfigError(f"kv_host_write_policy must be one of {', '.join(KV_HOST_WRITE_POLICIES)}, "
                              f"got {self.kv_host_write_policy!r}")

    @property
    def host_loras(self) -> int:
        """With max_loras: the adapters held in host memory at most (max_cpu_loras, by default max_loras)."""
        return self.max_cpu_loras or self.max_loras

    @property
    def speculative(self) -> SpeculativeConfig:
        return SpeculativeConfig(self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max)

    def scheduler_limits(self, max_model_len: int) -> SchedulerLimits:
        return SchedulerLimits(self.max_num_seqs, max_model_len, self.prompt_token_budget, self.chunk_token_budget,
                               self.slo, self.prompt_chunk_tokens, self.scheduling_policy == "priority")


def check_device(name: str) -> None:
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", name):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
