"""The sections of a cluster config (`ClusterConfig`): pools, engine, transfer, scheduler, ingress,
SLO bounds and the batch API. Every field's description is what the configuration reference
(docs/configuration.md) prints."""
from __future__ import annotations

from dataclasses import fields
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from splitserve.api.limits import RequestLimits
from splitserve.batch.blend.feeder import BlendOptions
from splitserve.batch.expiry import MAX_S as MAX_EXPIRY_S, MIN_S as MIN_EXPIRY_S
from splitserve.engine.config import ConfigError
from splitserve.engine.engine_config import MAX_KV_BLOCKS, EngineConfig
from splitserve.engine.model.sharding import MAX_RANKS
from splitserve.engine.policies import SLOOptions as PolicySLOOptions
from splitserve.engine.sampling_params import MAX_PRIORITY
from splitserve.engine.speculation import MAX_LOOKUP_TOKENS, MAX_SPECULATIVE_TOKENS
from splitserve.placement.state import PlacementThresholds


class StrictModel(BaseModel):
    """Unknown fields are refused; so are inf and NaN in any float field (every bound is finite)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class WorkerResources(StrictModel):
    """What Ray reserves for each worker of a pool, so KubeRay worker groups can pin pools to nodes."""

    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per worker (a worker with 1 or fewer gets one "
                            "torch thread).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves per worker.")
    accelerator_type: str | None = Field(None, description='Ray\'s accelerator type label the worker\'s node must '
                                         'carry, e.g. "H100", "A100".')
    resources: dict[str, float] = Field({}, description="Custom Ray resources per worker, e.g. a KubeRay worker "
                                        "group's `splitserve-token: 1`, so a pool lands only on its own nodes.")

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


class PoolConfig(StrictModel):
    role: Literal["prompt", "token", "mixed"] = Field(description="The pool: prompt (prefill only), token "
                                                     "(decode only) or mixed (whole requests, chunked prefill).")
    num_workers: int = Field(1, ge=1, description="Workers in this pool.")
    hardware: str = Field("cpu", description="Hardware class of the pool's workers: one of h100, a100, h100-cap, "
                          "cpu, or a name under `hardware_classes`. The placement weighs queues by its speeds, "
                          "scaled for tensor_parallel_size.")
    resources: WorkerResources = Field(WorkerResources(), description="What Ray reserves for each worker (for "
                                       "each of its ranks when tensor_parallel_size > 1).")
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_RANKS, description="Devices per worker: a worker "
                                      "is this many ranks (one per device, packed on one node by a Ray placement "
                                      "group) that split the model Megatron-style. Pools may differ.")


class HardwareClassConfig(StrictModel):
    prompt_speed: float = Field(gt=0, description="Relative prefill throughput of one device (h100 = 1.0); "
                                "a worker of several ranks gets the built-in tensor-parallel speedup on top.")
    token_speed: float = Field(gt=0, description="Relative decode throughput of one device (h100 = 1.0).")


class SLOSchedulingOptions(StrictModel):
    """The accelgen policies' settings (engine.policies.plan.SLOOptions, in ms where it is a time);
    the default targets apply to every request of this cluster's model that names none
    (a request names its own in the API's `slo` field)."""

    pivot_tokens: int = Field(512, ge=1, description="Tokens of the pivot iteration whose time T_pf scales the "
                              "token budget (Eq. 6).")
    pivot_ms: float | None = Field(None, gt=0, description="T_pf in ms; null: learned from the engine's own "
                                   "iterations.")
    tile_tokens: int = Field(16, ge=1, description="The budget is floored to a multiple of this.")
    max_budget_tokens: int = Field(4096, ge=1, description="Cap on one iteration's token budget.")
    window_ms: float = Field(750.0, gt=0, description="Gamma: requests within this much slack of the least are "
                             "selected together (best fit).")
    long_prompt_tokens: int = Field(4096, ge=1, description="Prompts this long or longer are prefilled one at a "
                                    "time (ERA).")
    default_ttft_ms: float = Field(1000.0, gt=0, description="TTFT target of a request that names none.")
    default_tbt_ms: float = Field(187.5, gt=0, description="TBT target of a request that names none (a reading "
                                  "speed).")

    def options(self) -> PolicySLOOptions:
        return PolicySLOOptions(
            pivot_tokens=self.pivot_tokens, pivot_time_s=None if self.pivot_ms is None else self.pivot_ms / 1000,
            tile_tokens=self.tile_tokens, max_budget_tokens=self.max_budget_tokens, window_s=self.window_ms / 1000,
            long_prompt_tokens=self.long_prompt_tokens, default_ttft_s=self.default_ttft_ms / 1000,
            default_tbt_s=self.default_tbt_ms / 1000)


class EngineOptions(StrictModel):
    """Engine knobs shared by every worker (EngineConfig's fields; the policy follows the pool)."""

    block_size: int = Field(16, description="Tokens per KV block.")
    kv_cache_memory_bytes: int | None = Field(None, description="KV cache size in bytes; null: 256 MiB on CPU, and "
                                              "on CUDA what gpu_memory_utilization leaves once the model, the "
                                              "largest iteration's activations and gpu_reserve_bytes are counted "
                                              "(a profiling forward at startup, as vLLM).")
    gpu_memory_utilization: float = Field(0.9, description="Share of the GPU's memory a worker may use in all: "
                                          "weights, activations, KV cache and headroom. Memory other processes "
                                          "hold counts against it.")
    gpu_reserve_bytes: int = Field(512 * 2**20, ge=0, description="GPU memory kept out of the KV cache for what its "
                                   "profiling forward cannot see: NCCL communicators opened later (KV transfer "
                                   "links) and CUDA graph pools.")
    num_kv_blocks: int | None = Field(None, le=MAX_KV_BLOCKS, description="KV blocks, instead of a size in bytes.")
    max_num_seqs: int = Field(256, description="Sequences in one worker's batch at most.")
    max_model_len: int | None = Field(None, description="Longest prompt plus output; null: the model's own "
                                      "(max_position_embeddings, or YaRN's stretched context).")
    prompt_token_budget: int = Field(2048, description="Prompt tokens per prompt-pool iteration (Splitwise's MLS).")
    chunk_token_budget: int = Field(512, description="Tokens per mixed-pool iteration (Sarathi-Serve's chunk "
                                    "budget).")
    prompt_chunk_tokens: int = Field(8192, description="Prompt and token workers prefill a longer prompt (a token "
                                     "worker: a preempted sequence's recompute) in chunks of this many tokens: the "
                                     "largest iteration, and so the activation memory the KV cache leaves room for, "
                                     "stays bounded whatever max_model_len, and a recompute never stalls the decodes "
                                     "for a whole prompt. A prompt worker streams each chunk's KV layer by layer as "
                                     "the chunk computes.")
    enable_prefix_caching: bool = Field(True, description="Share the KV of full blocks between prompts with the same "
                                        "prefix.")
    kv_host_cache_bytes: int = Field(0, ge=0, description="Host memory per worker (per rank, with tensor "
                                     "parallelism) that keeps the prefix cache's blocks the KV cache evicts: a later "
                                     "prompt with that prefix copies them back instead of computing them again "
                                     "(vLLM's KV offloading, SGLang's hierarchical cache). 0: none. Pinned on CUDA; "
                                     "refused past the host's free memory.")
    kv_host_write_policy: Literal["write_through", "write_back"] = Field(
        "write_through", description="When the host tier copies a block out (SGLang's hierarchical cache's "
        "names): write_through once its KV is computed, on CUDA on a side stream that overlaps the next "
        "forwards, so an eviction copies nothing (host memory holds the most recently computed blocks, whether "
        "or not the device still does); write_back when the KV cache evicts it, in the step that evicts it "
        "(host memory holds what the device does not: more, where the tier is not much larger than the cache).")
    dtype: str = Field("auto", description="auto (the checkpoint's torch_dtype), float32, bfloat16 or float16.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto", description="auto (the serving dtype) or fp8 (= fp8_e4m3): K and V stored as float8 e4m3 codes, "
        "twice the tokens in the same memory; each layer's K and V scales come from the checkpoint (k_scale, "
        "v_scale) or are 1.0. Prompt and token workers must agree.")
    device: str = Field("auto", description="auto, cpu or cuda[:N].")
    attention_backend: Literal["auto", "torch", "triton", "flash-attn"] = Field(
        "auto", description="auto (on CUDA flash-attn where a FlashAttention-2 kernel runs, else triton; "
        "torch on CPU), torch (the reference), triton (Triton kernels), or flash-attn (Triton, with "
        "FlashAttention-2 for steps of fresh prompts: flash-attn's package where installed, else torch's own "
        "on sm_80 to sm_90 GPUs).")
    cuda_graph_max_batch: int = Field(256, ge=0, description="On CUDA, decode-only steps of up to this many "
                                      "sequences replay CUDA graphs captured at start-up; 0 runs every step eagerly.")
    async_scheduling: bool | None = Field(
        None, description="Each step queues the next iteration on the device before it builds its own outputs "
        "(detokenizing, streaming), so the host's work on one token overlaps the device's on the next; a request "
        "that arrives meanwhile joins one iteration later. null: on for CUDA workers, off on CPU. Prompt "
        "workers, whose steps stream KV layer by layer, always run step by step.")
    load_format: str = Field("auto", description="auto or safetensors (the checkpoint's weights), or dummy (seeded "
                             "random weights for any config.json).")
    seed: int = Field(0, ge=0, lt=2**64, description="Seed of the dummy weights and of the engine's sampler.")
    mixed_policy: Literal["mixed", "prefill_first", "orca", "accelgen"] = Field(
        "mixed", description="How the mixed pool batches: mixed (Sarathi-Serve), prefill_first (vLLM's original), "
        "orca (Splitwise's mixed continuous batching) or accelgen (SLO-aware).")
    prompt_policy: Literal["prompt", "accelgen_prompt"] = Field(
        "prompt", description="How the prompt pool batches: prompt (FCFS whole prompts) or accelgen_prompt.")
    slo_scheduling: SLOSchedulingOptions = Field(SLOSchedulingOptions(), description="The accelgen policies' "
                                                 "settings.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs: every worker serves requests first come, first served, and a request's "
        "`priority` must be 0 (vLLM's rule). priority (vLLM's): a worker's queue is ordered by `priority` (lower "
        "first), then arrival; when KV runs out the lowest-priority running request is preempted first; and a "
        "request that cannot be admitted preempts running ones of a strictly lower priority. Not with the "
        "accelgen policies, which order by their latency targets.")
    lora_modules: dict[str, str] = Field({}, description="LoRA adapters, name: PEFT directory (adapter_config.json "
                                         "and adapter_model.safetensors, readable on every worker's node). Each "
                                         "name is a model clients send as `model`: the base model under that "
                                         "adapter. All are loaded at start; a step runs several at once.")
    max_loras: int = Field(0, ge=0, le=64, description="Slots for LoRA adapters loaded at start (lora_modules) or "
                           "while serving (POST /v1/load_lora_adapter, /v1/unload_lora_adapter: off while 0): "
                           "how many adapters one step may run. Every projection holds this many adapters' weights "
                           "at max_lora_rank from the start.")
    max_lora_rank: int = Field(16, ge=1, le=512, description="With max_loras: the largest rank an adapter may have.")
    max_cpu_loras: int | None = Field(None, ge=1, le=1024, description="With max_loras: LoRA adapters held in host "
                                      "memory (at least max_loras; default: max_loras). More adapters than slots "
                                      "are served: a request's adapter is copied into a slot no running request "
                                      "uses when the request is admitted, and a request waits while every slot "
                                      "runs other adapters' requests.")
    num_speculative_tokens: int = Field(
        0, ge=0, le=MAX_SPECULATIVE_TOKENS, description="Speculative decoding by n-gram prompt lookup (vLLM's ngram "
        "method): a decoding request drafts up to this many tokens a step, the ones that followed the latest "
        "earlier occurrence of its last tokens (prompt and output), and one step checks them all, keeping each "
        "that matches what the model samples (its outputs stay the model's). Pays where outputs copy their "
        "context (code edits, extraction, quoting). 0: off.")
    prompt_lookup_min: int = Field(2, ge=1, le=MAX_LOOKUP_TOKENS, description="With num_speculative_tokens: the "
                                   "fewest last tokens looked up.")
    prompt_lookup_max: int = Field(4, ge=1, le=MAX_LOOKUP_TOKENS, description="With num_speculative_tokens: the "
                                   "most last tokens looked up (the longest ending that occurred before wins).")

    @model_validator(mode="after")
    def _engine_accepts(self) -> "EngineOptions":
        try:
            self.engine_config("token", (self.mixed_policy, self.prompt_policy))  # every policy a worker may run
        except ConfigError as error:
            raise ValueError(str(error)) from None
        return self

    def engine_config(self, policy: str, switch_policies: tuple[str, ...] = ()) -> EngineConfig:
        names = {f.name for f in fields(EngineConfig)} - {"policy", "switch_policies", "slo"}
        return EngineConfig(policy=policy, switch_policies=switch_policies, slo=self.slo_scheduling.options(),
                            **{n: getattr(self, n) for n in names})

    def policy_for(self, role: str) -> str:
        """The engine policy of a worker whose pool is `role`."""
        return {"mixed": self.mixed_policy, "prompt": self.prompt_policy}.get(role, role)


class TransferOptions(StrictModel):
    backend: Literal["auto", "ipc", "gloo", "nccl", "grpc"] = Field(
        "auto", description="KV transfer backend: auto (CUDA workers: written straight into the token worker's "
        "cache through CUDA IPC where the two share a node and the prompt worker sees its GPU, NCCL otherwise; "
        "CPU workers: gloo), ipc (the same, and through shared memory between CPU workers of one node), gloo, "
        "nccl, or grpc (workers that share no collective fabric).")
    timeout_s: float = Field(30.0, gt=0, description="How long a transfer waits on a silent prompt worker, a send "
                             "on its receiver, or a new link on its peer, before that transfer (or link) fails.")
    layerwise_threshold: int = Field(512, ge=1, description="Prompt tokens from which the KV streams layer by layer "
                                     "during the prefill; shorter prompts send it in one push after. Counts the "
                                     "tokens sent: not those the token worker's prefix cache already holds. A prompt "
                                     "prefilled in chunks streams once this many new positions are pending (fewer "
                                     "cost more in messages than they hide) and at its last chunk.")
    lease_s: float = Field(120.0, gt=0, description="Lease of a KV reservation: a transfer not completed this long "
                           "after the token worker reserved the blocks (or after the prompt worker took the prefill) "
                           "is cancelled and its blocks freed on both sides. Must cover the prompt queue's wait.")


class SchedulerOptions(StrictModel):
    policy: Literal["round-robin", "jsq", "splitwise"] = Field(
        "splitwise", description="Placement: round-robin, jsq (join the shortest queue) or splitwise (JSQ plus the "
        "mixed pool and re-purposing).")
    mixed_prompt_tokens: float = Field(2048, gt=0, description="A best prompt queue past this (hardware-weighted "
                                       "tokens; a worker's less the prefill its cached prefix of the prompt saves, "
                                       "with prefix_aware) sends the request to the mixed pool.")
    mixed_decode_tokens: float = Field(65536, gt=0, description="The same for the best token queue (context "
                                       "tokens).")
    max_queue_tokens: float = Field(16384, gt=0, description="Backpressure: a prompt queue above this takes no more "
                                    "work; when no worker can, the API answers 429.")
    max_decode_queue_tokens: float = Field(262144, gt=0, description="Backpressure: the same for a token queue.")
    background_queue_share: float = Field(0.5, gt=0, le=1, description="With priority scheduling, a request of "
                                          "priority above 0 (a batch's, at batch.priority 1) is placed only while "
                                          "some prefilling worker's queue is under this share of max_queue_tokens "
                                          "(else a 429): a backlog of background work leaves the rest of every "
                                          "queue to requests of priority 0 and below.")
    repurpose_after_s: float = Field(60.0, gt=0, description="A worker mixed this long changes pool for good (at "
                                     "most one per period).")
    report_interval_s: float = Field(0.1, gt=0, description="How often the CLS polls each worker's load (also the "
                                     "liveness check).")
    idle_report_interval_s: float = Field(1.0, gt=0, description="How often the CLS polls while no worker has "
                                          "work and nothing was placed since the last poll (at least "
                                          "report_interval_s); a placement brings back the report_interval_s "
                                          "cadence at once.")
    max_attempts: int = Field(3, ge=1, description="Placements per request, failovers included.")
    replace_dead_workers: bool = Field(True, description="Start a replacement for a worker that died or was "
                                       "retired as unhealthy or stuck.")
    stuck_step_s: float = Field(60.0, gt=0, description="An engine step running longer than this marks its worker "
                                "stuck: the worker is killed (its requests fail over) and replaced.")
    drain_timeout_s: float = Field(30.0, gt=0, description="On shutdown or a drain, how long running requests may "
                                   "take to finish before their worker stops anyway.")
    orphan_timeout_s: float = Field(120.0, ge=10, description="Workers outlive a CLS that dies, and the new one "
                                    "(Serve replaces the controller) adopts them with what they run; a worker no "
                                    "CLS has called for this long stops itself (its app was deleted while its CLS "
                                    "was dead). At least 4 x idle_report_interval_s.")
    prefix_aware: bool = Field(True, description="jsq and splitwise weigh what each worker's prefix cache holds of "
                               "the prompt: a worker's queue counts less the work its cached prefix saves, within the "
                               "same eligibility and thresholds (a prompt worker's measured net of its saving: "
                               "mixed_prompt_tokens; workers report their cached blocks with their load). "
                               "Token workers then receive only the KV their prefix cache lacks. Acts only with "
                               "engine.enable_prefix_caching; false: placement blind to caches, the whole prompt's KV "
                               "shipped.")
    prefill_saved_weight: float = Field(1.0, ge=0, description="Prompt-queue tokens one cached prompt token saves on "
                                        "a prompt or mixed worker, before its hardware speed: 1 counts the prefill it "
                                        "saves exactly.")
    transfer_saved_weight: float = Field(1.0, ge=0, description="Token-queue tokens one cached prompt token saves on "
                                         "a token worker: the KV it need not receive.")
    lora_aware: bool = Field(True, description="jsq and splitwise weigh which LoRA adapters each worker's slots hold "
                             "(engine.max_loras): a worker whose slots do not hold a request's adapter counts as more "
                             "loaded, within the same eligibility and thresholds, so each adapter's requests gather "
                             "on the workers holding it (fewer swaps and waits when engine.max_cpu_loras serves more "
                             "adapters than slots). false: placement blind to adapters.")
    lora_swap_share: float = Field(0.05, ge=0, description="What a worker with an idle adapter slot (it copies the "
                                   "adapter in from host memory, evicting another) counts as more loaded, as a "
                                   "share of mixed_prompt_tokens on the prompt side and of mixed_decode_tokens on "
                                   "the token side.")
    lora_wait_share: float = Field(1.0, ge=0, description="The same for a worker whose slots are all busy with other "
                                   "adapters' sequences: the request waits there for one.")
    prefix_index_blocks: int = Field(1 << 20, ge=1, description="Most (worker, KV block) entries the CLS's prefix "
                                     "index keeps: each worker gets an equal share (at most its KV blocks and host "
                                     "tier's slots); past it, its least recently placed or reported blocks are "
                                     "forgotten, a prefix's tail before its root (a missed hit at worst). An entry "
                                     "takes up to about 160 bytes of the CLS's memory (a block several workers hold, "
                                     "less), so the default costs at most some 170 MB, where the workers' caches hold "
                                     "that many blocks.")

    @model_validator(mode="after")
    def _idle_polls_no_faster(self) -> "SchedulerOptions":
        if self.idle_report_interval_s < self.report_interval_s:
            raise ValueError(f"idle_report_interval_s ({self.idle_report_interval_s}) must be at least "
                             f"report_interval_s ({self.report_interval_s})")
        if self.orphan_timeout_s < 4 * self.idle_report_interval_s:
            raise ValueError(f"orphan_timeout_s ({self.orphan_timeout_s}) must be at least 4 x "
                             f"idle_report_interval_s ({self.idle_report_interval_s}): polled workers never orphan")
        return self

    def thresholds(self) -> PlacementThresholds:
        """What the placement policy needs (the controller and the simulator use the same)."""
        return PlacementThresholds(
            mixed_prompt_tokens=self.mixed_prompt_tokens, mixed_decode_tokens=self.mixed_decode_tokens,
            max_queue_tokens=self.max_queue_tokens, max_decode_queue_tokens=self.max_decode_queue_tokens,
            repurpose_after_s=self.repurpose_after_s, background_share=self.background_queue_share)


class IngressOptions(StrictModel):
    num_replicas: int = Field(1, ge=1, description="Ingress replicas (they share one CLS).")
    num_cpus: float = Field(0.0, ge=0, description="CPUs Ray reserves per ingress replica.")
    api_key: str | None = Field(None, min_length=1, description="Bearer key every API route requires; null: $SPLITSERVE_API_KEY "
                                "if set, else no authentication.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 429 answer, in seconds.")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="Largest request body (413 above it), "
                                   "/v1/files uploads aside.")
    max_prompt_chars: int = Field(1_000_000, ge=1, description="Longest prompt (a request's prompts together), or "
                                  "chat messages' text together, or a chat's `prediction`, in characters before "
                                  "tokenization (413 above it).")
    max_stop_strings: int = Field(16, ge=0, description="Most `stop` strings per request.")
    max_stop_string_chars: int = Field(256, ge=1, description="Longest `stop` string, in characters.")
    max_stop_token_ids: int = Field(64, ge=0, description="Most `stop_token_ids` per request.")
    max_chat_messages: int = Field(1024, ge=1, description="Most messages in one chat request.")
    max_prompts: int = Field(128, ge=1, description="Most prompts in one completions request, or inputs in one "
                             "embeddings request (`prompt` or `input` as a list of prompts).")
    max_upload_bytes: int = Field(200 << 20, ge=1024, description="Largest /v1/files upload (413 above it).")
    max_batch_lines: int = Field(50_000, ge=1, description="Most requests in one batch input file.")
    stored_responses: int = Field(10_000, ge=0, description="Most /v1/responses answers kept for "
                                  "previous_response_id and GET (the least recently used go first); 0 keeps none.")
    stored_response_bytes: int = Field(256 << 20, ge=0, description="Most bytes of JSON the kept responses hold "
                                       "together (each with the conversation it read).")
    stored_conversations: int = Field(10_000, ge=0, description="Most /v1/conversations kept (the least "
                                      "recently used go first); 0 keeps none.")
    stored_conversation_bytes: int = Field(256 << 20, ge=0, description="Most bytes of JSON the kept "
                                           "conversations hold together; a change that would make one larger is "
                                           "refused.")
    persist_stored_responses: bool = Field(True, description="Keep the stored responses and conversations on disk "
                                           "too, in `batch.dir`/responses on the head node, so a restart loses "
                                           "none; false keeps them in memory only.")

    def limits(self, priorities: bool = False) -> RequestLimits:
        """`priorities`: the engines schedule by priority (`engine.scheduling_policy`)."""
        bounds = {f.name: getattr(self, f.name) for f in fields(RequestLimits) if f.name != "priorities"}
        return RequestLimits(**bounds, priorities=priorities)


class SLOOptions(StrictModel):
    """Bounds the metrics count each completed request against (splitserve_slo_met_total)."""

    ttft_s: float = Field(2.0, gt=0, description="Time-to-first-token bound.")
    tbt_s: float = Field(0.2, gt=0, description="Bound on a request's mean time between tokens.")
    e2e_s: float = Field(60.0, gt=0, description="End-to-end latency bound.")


class BatchAPIOptions(StrictModel):
    """/v1/files and /v1/batches: where they persist and how batches are ordered (BlendServe)."""

    dir: str = Field("~/.cache/splitserve/batches", description="Where files and batches persist, on the head node "
                     "(the batch API's actor runs there), and stored responses in its `responses` folder; one server "
                     "owns it at a time. On Kubernetes, the head pod's "
                     "volume (the chart's head.batchesClaimName), so a restart loses nothing.")
    min_free_bytes: int = Field(1 << 30, ge=0, description="An upload that would leave the store's filesystem with "
                                "less free space than this is refused (503), so running batches keep room for their "
                                "results.")
    file_expiry_s: int | None = Field(MAX_EXPIRY_S, ge=MIN_EXPIRY_S, description="How long a file uploaded without "
                                      "expires_after, or a batch's output and error files without its "
                                      "output_expires_after, is kept (OpenAI keeps batch files 30 days); null keeps "
                                      "them until deleted.")
    order: Literal["blend", "dfs", "fcfs"] = Field("blend", description="Order of a batch's requests: blend "
                                                   "(BlendServe), dfs (prefix-tree order) or fcfs (file order).")
    sample_fraction: float = Field(0.01, ge=0, le=1, description="Share of requests run first to estimate output "
                                   "lengths.")
    split_threshold: float = Field(0.01, ge=0, le=1, description="Prefix-tree nodes are split while the recomputed "
                                   "prefix stays under this share of unique prompt tokens.")
    memory_fraction: float = Field(0.9, gt=0, le=1, description="Share of the KV cache the dual scanner fills.")
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="The priority a batch's requests run "
                          "at where their line names none; with engine.scheduling_policy priority only (e.g. 1: "
                          "batches yield to interactive requests, which run at 0).")

    def blend_options(self) -> BlendOptions:
        return BlendOptions(self.order, self.sample_fraction, self.split_threshold, self.memory_fraction)
