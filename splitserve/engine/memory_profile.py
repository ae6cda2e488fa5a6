"""Sizes the KV cache on CUDA as vLLM does: once the weights are loaded, run the largest iteration
the scheduler can form, with a throwaway cache of one block, and give the KV cache what is left of
the device's `gpu_memory_utilization` share after what is in use, that iteration's peak and a
headroom (`kv_budget`).

The largest iteration (`profile_lengths`): the most tokens any policy the engine may run computes
(`Policy.max_step_tokens` of `policy` and `switch_policies`) over max_num_seqs sequences that all
sample, with the sampler's costliest float32 work (penalties, top-k over the whole vocabulary,
top-p, min-p, logprobs) and a pass of prompt logprobs. Activations grow with the tokens and the
sampled rows, not with the contexts: the CUDA attention backends read the paged cache in place, so
fresh prompts are as costly as anything. (The torch backend, the CPU oracle, copies each decode's
context out of the cache; that is not covered. The penalties' counts, kept across steps, are held
outside any one iteration: the headroom holds them, `headroom_bytes`.)

Tensor parallelism: every rank profiles its own shard, in lockstep. The batch follows from the
config alone, so every rank runs the same forward without a message, and its all-reduces pair up;
only rank 0 runs the logits and the sampler, which have no collectives, as in serving. Each rank
sizes its own cache from its own measurement; `build_shard` then keeps the fewest blocks of any.
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from splitserve.engine.attention import AttentionBackend
from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.kv_cache import CPU_KV_CACHE_BYTES, KVCache
from splitserve.engine.model.lora import NO_ADAPTER, every_slot_live
from splitserve.engine.model.sharding import Shard
from splitserve.engine.model_builder import LoadedModel
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.penalties import ROW_BYTES_PER_ID
from splitserve.engine.policies import POLICY_CLASSES, Plan, ScheduledSeq
from splitserve.engine.prompt_logprobs import ROWS_PER_PASS, prompt_logprobs
from splitserve.engine.sampler import Sampler
from splitserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from splitserve.engine.sequence import Sequence

log = logging.getLogger("splitserve.engine")
GiB = 2**30


@dataclass(frozen=True)
class MemoryProfile:
    """One device's memory around the profiling iteration, in bytes. `in_use` is measured once the
    iteration's memory is freed: the weights, what the first forward keeps (cuBLAS workspaces,
    kernels, a TP group's NCCL buffers) and other processes' memory."""

    total: int
    in_use: int
    weights: int      # this process's tensors before the iteration (the model); part of in_use
    activations: int  # the iteration's peak above what stayed after it


def kv_cache_budget(config: EngineConfig, loaded: LoadedModel, backend: AttentionBackend, shard: Shard) -> int:
    """Bytes for this rank's KV cache: kv_cache_memory_bytes if set; on CPU, CPU_KV_CACHE_BYTES;
    on CUDA, what the memory profile leaves."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if loaded.device.type != "cuda":
        return CPU_KV_CACHE_BYTES
    lengths = profile_lengths(config, loaded.max_model_len)
    try:
        profile = measure(loaded.device, lambda: run_largest_step(loaded, lengths, config, backend, shard))
    except torch.cuda.OutOfMemoryError as error:
        raise ConfigError(f"the largest iteration ({sum(lengths)} tokens, {len(lengths)} sequences) does not fit "
                          f"on {loaded.device} beside the model; lower max_num_seqs, prompt_token_budget, "
                          "chunk_token_budget or max_model_len") from error
    headroom = headroom_bytes(config, loaded.config, loaded.dtype, loaded.max_model_len, shard)
    budget = kv_budget(profile, config.gpu_memory_utilization, headroom)
    block_bytes = KVCache.bytes_per_block(loaded.config, config.block_size, loaded.dtype, shard, config.kv_cache_dtype)
    log.info("KV cache on %s (rank %d of %d): weights %.2f GiB, peak activations %.2f GiB (%d tokens, %d "
             "sequences), headroom %.2f GiB, KV cache %.2f GiB = %d blocks = %d tokens", loaded.device, shard.rank,
             shard.size, profile.weights / GiB, profile.activations / GiB, sum(lengths), len(lengths),
             headroom / GiB, budget / GiB, budget // block_bytes, budget // block_bytes * config.block_size)
    return budget


def profile_lengths(config: EngineConfig, max_model_len: int) -> list[int]:
    """Tokens per sequence of the largest iteration: the most any policy the engine may run
    computes, over as many sequences as max_num_seqs allows, none longer than a sequence can be;
    single tokens first, as the model runner orders a batch."""
    limits = config.scheduler_limits(max_model_len)
    num_tokens = max(POLICY_CLASSES[name].max_step_tokens(limits) for name in (config.policy, *config.switch_policies))
    rows = min(limits.max_num_seqs, num_tokens)
    extra, lengths = num_tokens - rows, []  # extra: tokens beyond one per sequence
    for _ in range(rows):
        add = min(extra, limits.longest_sequence - 1)
        lengths.append(1 + add)
        extra -= add
    return sorted(lengths)


def run_largest_step(loaded: LoadedModel, lengths: list[int], config: EngineConfig, backend: AttentionBackend,
                     shard: Shard) -> None:
    """One iteration of fresh prompts `lengths` long through this rank's part of serving: the
    forward on every rank; on rank 0 also the logits, a pass of prompt logprobs and the sampler,
    as `LLMEngine._run`, under a LoRA adapter slot where the model has some (its products'
    temporaries; every slot is padded to one rank, and computed here loaded or not). KV goes to a
    throwaway one-block cache (all slots alias: only memory matters); the model is only read, and
    nothing of the iteration outlives the call."""
    block_size = config.block_size
    cache = KVCache(loaded.config, 1, block_size, loaded.dtype, loaded.device, shard, config.kv_cache_dtype)
    runner = ModelRunner(loaded.model, cache, backend, loaded.device)
    slot = 0 if loaded.model.lora_slots.capacity else NO_ADAPTER
    seqs = [Sequence(f"profile-{i}", [0] * n, costliest_params(loaded.config), adapter_slot=slot)
            for i, n in enumerate(lengths)]
    plan = Plan(tuple(ScheduledSeq(seq, seq.num_tokens) for seq in seqs))
    tables = {seq.seq_id: [[0] * -(-seq.num_tokens // block_size)] * cache.groups.num_groups for seq in seqs}
    with every_slot_live(loaded.model):
        if shard.rank != 0:  # as TPFollower.serve
            runner.forward(runner.prepare(list(plan.scheduled), tables))
            return
        forward = runner.execute(plan, tables)
    for rows in forward.prompt_rows[:1]:  # one pass of at most ROWS_PER_PASS rows: no other pass is larger
        prompt_logprobs(loaded.model.compute_logits, replace(rows, hidden=rows.hidden[:ROWS_PER_PASS]))
    Sampler().sample(forward.logits, forward.seqs)


def costliest_params(config: ModelConfig) -> SamplingParams:
    """Every float32 [rows, vocab] path of the sampler (structured output's masks aside)."""
    return SamplingParams(temperature=0.8, top_k=config.vocab_size, top_p=0.9, min_p=0.05, min_tokens=1,
                          stop_token_ids=(0,), repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                          logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS, allowed_token_ids=(0,))


def measure(device: torch.device, run: Callable[[], None]) -> MemoryProfile:
    """Runs `run` once on a CUDA device and measures around it with the caching allocator's stats."""
    gc.collect()
    torch.cuda.empty_cache()  # cached free blocks would serve part of the peak unseen
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    activations = torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)
    return MemoryProfile(total, total - free, weights, activations)


def headroom_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, max_model_len: int,
                   shard: Shard) -> int:
    """gpu_reserve_bytes, and a KV transfer's receive buffer: one layer of the longest prompt on the
    wire (`transfer.codec.wire_shape` with this rank's KV heads), which the transport allocates as
    the layer arrives. The reserve also absorbs a short prompt's one-shot push of every layer.
    On rank 0, the penalties' counts, kept across steps: a row of the vocabulary for each of
    max_num_seqs sequences (`penalties.ROW_BYTES_PER_ID`). With async scheduling (CUDA's default), rank 0 also
    holds an iteration's logits and logprobs (both float32, `model_runner.Forward`), a row a
    sequence, while the next iteration, the profiled peak, runs."""
    token_bytes = KVCache.bytes_per_block(model, 1, dtype, shard, config.kv_cache_dtype)
    layer_token_bytes = token_bytes // model.num_hidden_layers
    held = 0
    if shard.rank == 0:
        held = config.max_num_seqs * model.vocab_size * ROW_BYTES_PER_ID
        if config.async_scheduling is not False:
            held += config.max_num_seqs * model.vocab_size * 2 * torch.float32.itemsize
    return config.gpu_reserve_bytes + layer_token_bytes * max_model_len + held


def kv_budget(profile: MemoryProfile, utilization: float, headroom: int) -> int:
    """Of the device's memory, `utilization` may be used in all; what is in use, the largest
    iteration's peak and the headroom come off it first."""
    allowed = int(profile.total * utilization)
    budget = allowed - profile.in_use - profile.activations - headroom
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} allows "
            f"{allowed / GiB:.2f} of {profile.total / GiB:.2f} GiB, but {profile.in_use / GiB:.2f} GiB are in use "
            f"(weights, other processes), the largest iteration needs {profile.activations / GiB:.2f} GiB and the "
            f"headroom (gpu_reserve_bytes, a KV transfer buffer) {headroom / GiB:.2f} GiB; raise "
            "gpu_memory_utilization, or lower max_num_seqs, the token budgets or max_model_len")
    return budget
