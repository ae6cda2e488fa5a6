"""The cluster-config schema: one pydantic model shared by `splitserve serve --config`, the Serve
builder (`build_app(args)`), the helm chart's values and the simulator's scenarios.

A Serve config file (`deploy/*.yaml`) carries it as the `args` of the splitserve application;
`load_cluster_config` reads either that or a bare cluster config.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, field_validator, model_validator

from splitserve.api.chat_parsers import ChatParsers
from splitserve.api.limits import RequestLimits
from splitserve.api.reasoning import REASONING_PARSERS
from splitserve.api.request_models import ServedModels
from splitserve.api.score_request import label_token_ids
from splitserve.api.tool_calls import LLAMA3_JSON, TOOL_CALL_PARSERS
from splitserve.config.options import (
    BatchAPIOptions,
    EngineOptions,
    HardwareClassConfig,
    IngressOptions,
    PoolConfig,
    SchedulerOptions,
    SLOOptions,
    StrictModel,
    TransferOptions,
)
from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.model.sharding import check_shardable
from splitserve.engine.tokenizer import Tokenizer
from splitserve.placement.hardware import HARDWARE_CLASSES, HardwareProfile
from splitserve.placement.state import AdapterOptions, PrefixOptions

APP_IMPORT_PATH = "splitserve.cluster.app:build_app"
MAX_MODEL_NAMES = 16  # aliases one cluster answers to


class ClusterConfig(StrictModel):
    """One splitserve cluster: the model, its pools of workers, and how they run and are reached."""

    model: str = Field("demo", description="demo (the built-in byte-level Llama) or a Hugging Face checkpoint "
                       "directory (config.json, safetensors, tokenizer.json).")
    served_model_name: str | list[str] | None = Field(None, description="The name clients send as `model`, or "
                                                      "several (aliases; the first names the metrics); null: `model`.")
    reasoning_parser: Literal[REASONING_PARSERS] | None = Field(  # type: ignore[valid-type]
        None, description="Splits a reasoning model's `<think>` ... `</think>` from its chat answer into the "
        "message's `reasoning` (and `reasoning_content`): deepseek_r1, qwen3 or minimax_m2 (one rule: "
        "docs/api.md#reasoning), "
        "or openai_gptoss, GPT-OSS's harmony channels (analysis: reasoning; final: content); "
        "null: the output is all content.")
    tool_call_parser: Literal[TOOL_CALL_PARSERS] = Field(  # type: ignore[valid-type]
        LLAMA3_JSON, description="The format the model writes tool calls in: llama3_json (Llama 3.x), hermes "
        "(`<tool_call>` JSON `</tool_call>`: Qwen2.5, Qwen3, Hermes, SmolLM3), mistral (`[TOOL_CALLS]`: Mistral, "
        "Mixtral, Devstral), granite (`<|tool_call|>`: Granite 3.x), glm45 (`<tool_call>` with `<arg_key>` / "
        "`<arg_value>` pairs: GLM-4.5, 4.6), minimax_m2 (`<minimax:tool_call>` with `<invoke>` / `<parameter>` "
        "tags: MiniMax-M2), qwen3_coder (`<tool_call>` with `<function=...>` / `<parameter=...>` tags: "
        "Qwen3-Coder) or seed_oss (the same tags inside `<seed:tool_call>`: Seed-OSS).")
    score_label_tokens: list[str] | None = Field(
        None, description="A reranker that answers in tokens: /score and /rerank run each (query, document) pair as "
        "one prompt and score it by the LM head's logits at these tokens, the last one's probability against the "
        "first (Qwen3-Reranker: [\"no\", \"yes\"]; one token: the sigmoid of its logit). Each must be one token of "
        "the model's vocabulary. null: they score by the cosine similarity of the texts' embeddings.")
    pools: list[PoolConfig] = Field([PoolConfig(role="prompt"), PoolConfig(role="token")], description="One pool "
                                    "per role: prompt and token together, mixed alone, or all three.")
    hardware_classes: dict[str, HardwareClassConfig] = Field({}, description="Hardware classes beyond the built-in "
                                                             "h100, a100, h100-cap and cpu, by name.")
    engine: EngineOptions = Field(EngineOptions(), description="Engine settings of every worker.")
    transfer: TransferOptions = Field(TransferOptions(), description="KV transfer between prompt and token workers.")
    scheduler: SchedulerOptions = Field(SchedulerOptions(), description="The cluster-level scheduler (CLS).")
    ingress: IngressOptions = Field(IngressOptions(), description="The HTTP front (Ray Serve deployment).")
    batch: BatchAPIOptions = Field(BatchAPIOptions(), description="The batch API (/v1/files, /v1/batches).")
    slo: SLOOptions = Field(SLOOptions(), description="Bounds the metrics count each request against "
                            "(splitserve_slo_met_total).")
    fault_injection: bool = Field(False, description="Lets tests and drills call the workers' fault-injection hooks "
                                  "(crash mid-transfer, fail or stall a step). Off in production: the hooks refuse.")

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

    @model_validator(mode="after")
    def _batch_priority_is_scheduled(self) -> "ClusterConfig":
        if self.batch.priority and self.engine.scheduling_policy != "priority":
            raise ValueError("batch.priority: the engines schedule first come, first served; set "
                             "engine.scheduling_policy: priority for batches to run at a priority")
        return self

    @model_validator(mode="after")
    def _adapter_names_differ(self) -> "ClusterConfig":
        try:
            self.served_models  # ServedModels refuses an adapter named as the model
        except ValueError as error:
            raise ValueError(f"engine.lora_modules: {error}") from None
        return self

    @field_validator("served_model_name")
    @classmethod
    def _names(cls, value: str | list[str] | None) -> str | list[str] | None:
        names = [value] if isinstance(value, str) else value or []
        if value is not None and not names:
            raise ValueError("give at least one name, or null for the model's own")
        if len(names) > MAX_MODEL_NAMES or any(not n or len(n) > 256 for n in names):
            raise ValueError(f"at most {MAX_MODEL_NAMES} names of 1 to 256 characters each, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"names must differ, got {names!r}")
        return value

    @field_validator("score_label_tokens")
    @classmethod
    def _labels(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not 1 <= len(value) <= 2 or not all(value) or len(set(value)) != len(value)):
            raise ValueError(f"one or two distinct non-empty tokens (a reranker's \"no\" and \"yes\"), got {value!r}")
        return value

    def score_labels(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """`score_label_tokens` as token ids (ValueError naming one that is not a single token); ()
        without them."""
        return label_token_ids(tokenizer, self.score_label_tokens or ())

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name clients may send as `model`; the first is the one the metrics carry."""
        if self.served_model_name is None:
            return (self.model,)
        return (self.served_model_name,) if isinstance(self.served_model_name, str) else tuple(self.served_model_name)

    @property
    def served_models(self) -> ServedModels:
        """The model's names and its LoRA adapters' (each a model to clients)."""
        return ServedModels(self.model_names, tuple(self.engine.lora_modules))

    @property
    def chat_parsers(self) -> ChatParsers:
        return ChatParsers(self.reasoning_parser, self.tool_call_parser)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def disaggregated(self) -> bool:
        """Prompt and token pools: workers exchange KV."""
        return any(p.role != "mixed" for p in self.pools)

    def request_limits(self) -> RequestLimits:
        """What one request may ask: the ingress's bounds, and a priority where the engines take one."""
        return self.ingress.limits(priorities=self.engine.scheduling_policy == "priority")

    def engine_config(self, role: str) -> EngineConfig:
        """The engine settings of a worker starting in `role`, alike on each of its ranks (their
        memory profiles must run the same forward). Its KV cache leaves room for every policy a pool
        move may switch it to: every role's where prompt and token pools exist (their workers also
        serve in the mixed pool), the mixed role's alone otherwise."""
        roles = ("prompt", "token", "mixed") if self.disaggregated else ("mixed",)
        policy_for = self.engine.policy_for
        return self.engine.engine_config(policy_for(role), tuple(policy_for(r) for r in roles))

    @property
    def needs_rendezvous(self) -> bool:
        """Workers meet through the controller's store: to exchange KV, or to form TP groups."""
        return self.disaggregated or any(p.tensor_parallel_size > 1 for p in self.pools)

    def check_model(self, model: ModelConfig) -> None:
        """Raise ConfigError naming the pool when `model` cannot be split over its tensor_parallel_size
        (before any worker starts: each would fail to build its shard)."""
        for pool in self.pools:
            try:
                check_shardable(model, pool.tensor_parallel_size)
            except ConfigError as error:
                raise ConfigError(f"pools: the {pool.role} pool's {error}") from None

    def hardware(self, name: str) -> HardwareProfile:
        if name in self.hardware_classes:
            custom = self.hardware_classes[name]
            return HardwareProfile(name, custom.prompt_speed, custom.token_speed)
        if name not in HARDWARE_CLASSES:
            known = sorted({*HARDWARE_CLASSES, *self.hardware_classes})
            raise ValueError(f"hardware class {name!r} is unknown; known: {', '.join(known)} "
                             "(or define it under hardware_classes)")
        return HARDWARE_CLASSES[name]

    def prefix_options(self) -> PrefixOptions:
        """Prefix-aware placement's settings; it acts (`aware`: workers report their prefix caches,
        the ingress names the prompt's blocks) only where the engines cache prefixes."""
        scheduler = self.scheduler
        return PrefixOptions(scheduler.prefix_aware and self.engine.enable_prefix_caching,
                             scheduler.prefill_saved_weight, scheduler.transfer_saved_weight,
                             scheduler.prefix_index_blocks)

    def adapter_options(self) -> AdapterOptions:
        """LoRA-aware placement's settings; it acts only where the engines hold adapter slots."""
        scheduler = self.scheduler
        return AdapterOptions(scheduler.lora_aware and self.engine.max_loras > 0, scheduler.lora_swap_share,
                              scheduler.lora_wait_share)

    def prefix_block_size(self) -> int:
        """The block size requests name their prompts' blocks in to the CLS (the engines'); 0 when
        prefix-aware placement does not act, so they name none."""
        return self.engine.block_size if self.prefix_options().aware else 0

    def digest(self) -> str:
        """Equal for equal configs: a new CLS adopts only workers started with its own."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    def worker_hardware(self, pool: PoolConfig) -> HardwareProfile:
        """What the CLS weighs a worker of `pool` by: its class's speeds for its tensor_parallel_size."""
        return self.hardware(pool.hardware).with_tensor_parallel(pool.tensor_parallel_size)


def load_cluster_config(path: str | Path) -> tuple[ClusterConfig, dict]:
    """A Serve config file (the splitserve application's `args`) or a bare cluster config.
    Returns the config and the file's `http_options` (empty for a bare config)."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    _check_shape(isinstance(raw, dict), path, "the file", "a mapping", raw)
    if "applications" not in raw:
        return ClusterConfig.model_validate(raw), {}
    apps, http_options = raw["applications"], raw.get("http_options") or {}
    _check_shape(isinstance(apps, list) and all(isinstance(a, dict) for a in apps), path, "applications",
                 "a list of mappings", apps)
    _check_shape(isinstance(http_options, dict), path, "http_options", "a mapping", http_options)
    apps = [a for a in apps if a.get("import_path") == APP_IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"{path}: expected one application with import_path {APP_IMPORT_PATH}, found {len(apps)}")
    return ClusterConfig.model_validate(apps[0].get("args") or {}), http_options


def _check_shape(ok: bool, path, what: str, shape: str, value) -> None:
    if not ok:
        raise ValueError(f"{path}: {what} must be {shape}, got {value!r}")
