"""KV cache sizing by memory profile (`splitserve.engine.memory_profile`): the largest iteration
each policy can form, the profiling forward on CPU (the measurement is CUDA's), and the arithmetic
on given numbers. The end-to-end check on a GPU is the last test (skipped without CUDA)."""
from __future__ import annotations

import gc
import json
import weakref
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from splitserve.engine import memory_profile
from splitserve.engine.attention import TorchPagedBackend
from splitserve.engine.config import ConfigError
from splitserve.engine.demo import DEMO_MODEL_CONFIG, demo_model_config
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.kv_cache import CPU_KV_CACHE_BYTES, KVCache
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.memory_profile import (MemoryProfile, costliest_params, headroom_bytes, kv_budget,
                                              kv_cache_budget, measure, profile_lengths, run_largest_step)
from splitserve.engine.model.sharding import Shard
from splitserve.engine.model_builder import build_model
from splitserve.engine.policies import SLOOptions
from splitserve.engine.prompt_logprobs import ROWS_PER_PASS

GiB = 2**30
CPU = dict(device="cpu", max_num_seqs=8, prompt_token_budget=64, chunk_token_budget=48)


# ---- the largest iteration ----------------------------------------------------------------------
@pytest.mark.parametrize("overrides, max_model_len, tokens, rows", [
    (dict(policy="mixed"), 2048, 512, 256),                                   # the chunk budget
    (dict(policy="mixed", max_num_seqs=600), 2048, 600, 600),                 # decodes alone pass it
    (dict(policy="token"), 2048, 255 + 2048, 256),                            # decodes + the prompt budget
    (dict(policy="prompt", prompt_token_budget=512), 4096, 255 + 4095, 256),  # decodes + one long prompt
    (dict(policy="prefill_first", max_num_seqs=8, prompt_token_budget=100), 1000, 999, 8),
    (dict(policy="orca", max_num_seqs=8, prompt_token_budget=3000), 1000, 3000, 8),
    (dict(policy="accelgen", slo=SLOOptions(max_budget_tokens=64)), 2048, 64, 64),
    (dict(policy="mixed", switch_policies=("token", "accelgen_prompt")), 8192, 255 + 8191, 256),
])
def test_profile_runs_the_largest_iteration_the_policies_allow(overrides, max_model_len, tokens, rows):
    lengths = profile_lengths(EngineConfig(**overrides), max_model_len)
    assert sum(lengths) == tokens and len(lengths) == rows
    assert lengths == sorted(lengths) and 1 <= lengths[0] and lengths[-1] <= max_model_len - 1


def test_config_names_the_policies_and_a_reserve():
    with pytest.raises(ConfigError, match="switch_policies must be one of .*'decode'"):
        EngineConfig(switch_policies=("token", "decode"))
    with pytest.raises(ConfigError, match="gpu_reserve_bytes"):
        EngineConfig(gpu_reserve_bytes=-1)
    assert EngineConfig(switch_policies=["token"]).switch_policies == ("token",)


# ---- the profiling forward, on CPU --------------------------------------------------------------
def watch(model) -> tuple[list[int], list[int], list[int]]:
    """Tokens per forward, rows per compute_logits call and all-reduce sizes, as they happen."""
    tokens, rows, reduced = [], [], []
    model.register_forward_hook(lambda module, args, out: tokens.append(args[0].shape[0]))
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: rows.append(hidden.shape[0]) or compute_logits(hidden)
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            if proj.reduce is not None:
                reduce = proj.reduce
                proj.reduce = lambda x, reduce=reduce: reduced.append(x.shape) or reduce(x)
    return tokens, rows, reduced


def test_profiling_forward_runs_the_largest_iteration_and_leaves_nothing(monkeypatch):
    config = EngineConfig(policy="token", max_model_len=200, **CPU)
    loaded = build_model("demo", config)
    weights = {name: t.clone() for name, t in loaded.model.state_dict().items()}
    caches = []

    class RecordedCache(KVCache):
        def __init__(self, *args):
            super().__init__(*args)
            caches.append(weakref.ref(self))

    monkeypatch.setattr(memory_profile, "KVCache", RecordedCache)
    tokens, rows, _ = watch(loaded.model)
    lengths = profile_lengths(config, loaded.max_model_len)
    run_largest_step(loaded, lengths, config, TorchPagedBackend(), Shard())
    assert tokens == [7 + 199]  # every other sequence's decode and one longest prompt
    assert rows == [8, 198]  # a row per sequence to sample, then the prompt's logprobs
    gc.collect()
    assert len(caches) == 1 and caches[0]() is None  # the throwaway cache is gone
    assert all(torch.equal(t, weights[name]) for name, t in loaded.model.state_dict().items())


def test_a_model_with_adapters_profiles_its_step_under_one(tmp_path):
    """Every token runs under the first adapter, so the peak holds the adapters' products too."""
    from splitserve.engine.demo import demo_model_config
    from splitserve.engine.dummy_adapter import write_adapter

    adapter = write_adapter(tmp_path / "a", demo_model_config(), ["q_proj", "down_proj"], 4, 0)
    config = EngineConfig(policy="token", max_model_len=200, lora_modules={"a": adapter}, **CPU)
    loaded = build_model("demo", config)
    seen = []
    set_groups = loaded.model.lora_slots.set
    loaded.model.lora_slots.set = lambda *args: set_groups(*args) or seen.append(list(loaded.model.lora_slots.groups))
    run_largest_step(loaded, profile_lengths(config, loaded.max_model_len), config, TorchPagedBackend(), Shard())
    assert seen == [[(0, slice(0, 7 + 199))]]


def test_a_model_with_slots_for_adapters_profiles_its_step_under_one_before_any_is_loaded():
    """max_loras: no adapter is loaded at start, yet the peak must hold an adapter's products:
    every projection computes slot 0's during the profile, and none after."""
    from splitserve.engine.model.lora import LoraWeights

    config = EngineConfig(policy="token", max_model_len=200, max_loras=2, max_lora_rank=8, **CPU)
    loaded = build_model("demo", config)
    weights = [m for m in loaded.model.modules() if isinstance(m, LoraWeights)]
    computed = []
    for w in weights:
        w.add_to = lambda x, out, w=w, add=w.add_to: computed.append(0 in w.live) or add(x, out)
    run_largest_step(loaded, profile_lengths(config, loaded.max_model_len), config, TorchPagedBackend(), Shard())
    assert len(computed) == len(weights) == 4 * loaded.config.num_hidden_layers and all(computed)
    assert not any(w.live for w in weights)


def test_prompt_logprobs_pass_is_one_pass():
    config = EngineConfig(policy="prefill_first", max_model_len=2 * ROWS_PER_PASS, **{**CPU, "max_num_seqs": 1})
    loaded = build_model("demo", config)
    _, rows, _ = watch(loaded.model)
    run_largest_step(loaded, profile_lengths(config, loaded.max_model_len), config,
                     TorchPagedBackend(), Shard())
    assert rows == [1, ROWS_PER_PASS]


def test_tensor_parallel_ranks_run_the_same_forward_and_only_rank_0_samples():
    """Each rank derives the batch from the config, so the all-reduces pair up without a message."""
    config = EngineConfig(policy="mixed", **CPU)
    seen = []
    for rank in (0, 1):
        loaded = build_model("demo", config, Shard(rank, 2), reduce=lambda x: x)  # no peer: an identity sum
        tokens, rows, reduced = watch(loaded.model)
        run_largest_step(loaded, profile_lengths(config, loaded.max_model_len), config,
                         TorchPagedBackend(), Shard(rank, 2))
        seen.append((tokens, rows, reduced))
    (tokens0, rows0, reduced0), (tokens1, rows1, reduced1) = seen
    assert tokens0 == tokens1 == [48] and reduced0 == reduced1 and len(reduced0) == 2 * 4
    assert rows0 == [8, 40] and rows1 == []


def test_costliest_params_take_every_float32_path_of_the_sampler():
    params = costliest_params(demo_model_config())
    assert params.top_k == 259 and params.top_p < 1 and params.min_p > 0 and params.has_penalties
    assert params.logprobs and params.prompt_logprobs and params.min_tokens and params.stop_token_ids
    assert not params.greedy


# ---- the arithmetic -----------------------------------------------------------------------------
def test_budget_is_the_share_less_what_is_in_use_the_peak_and_the_headroom():
    # 80 GiB GPU: 20 in use (weights, CUDA context), the largest iteration peaks at 3, headroom 1
    profile = MemoryProfile(total=80 * GiB, in_use=20 * GiB, weights=16 * GiB, activations=3 * GiB)
    assert kv_budget(profile, 0.9, 1 * GiB) == int(80 * GiB * 0.9) - 24 * GiB
    assert kv_budget(profile, 0.5, 1 * GiB) == 40 * GiB - 24 * GiB
    assert kv_budget(profile, 0.9, 0) - kv_budget(profile, 0.9, 5 * GiB) == 5 * GiB


def test_other_processes_memory_counts_against_the_share():
    alone = MemoryProfile(total=80 * GiB, in_use=20 * GiB, weights=16 * GiB, activations=3 * GiB)
    shared = replace(alone, in_use=30 * GiB)  # another process holds 10 GiB
    assert kv_budget(alone, 0.9, GiB) - kv_budget(shared, 0.9, GiB) == 10 * GiB


def test_nothing_left_is_an_error_that_says_what_to_change():
    profile = MemoryProfile(total=80 * GiB, in_use=20 * GiB, weights=16 * GiB, activations=3 * GiB)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.25 allows 20.00 of 80.00 GiB.*20.00 GiB are "
                                          r"in use.*needs 3.00 GiB.*raise gpu_memory_utilization"):
        kv_budget(profile, 0.25, GiB)


def test_headroom_is_the_reserve_one_layer_of_the_longest_prompt_on_the_wire_and_the_penalties_counts():
    """The counts only on rank 0, the one that samples: a float32 count and a bool mark of each
    vocabulary id for each of max_num_seqs sequences, whatever their contexts."""
    model = demo_model_config()  # 4 KV heads of 32
    config = EngineConfig(gpu_reserve_bytes=100, max_num_seqs=8, async_scheduling=False)
    counts = 8 * model.vocab_size * (4 + 1)
    assert headroom_bytes(config, model, torch.float16, 2048, Shard()) == 100 + 2 * 4 * 32 * 2 * 2048 + counts
    assert headroom_bytes(config, model, torch.float16, 2048, Shard(1, 2)) == 100 + 2 * 2 * 32 * 2 * 2048
    fp8 = replace(config, kv_cache_dtype="fp8")  # a byte a value
    assert headroom_bytes(fp8, model, torch.float16, 2048, Shard()) == 100 + 2 * 4 * 32 * 1 * 2048 + counts


def test_async_scheduling_adds_what_an_iteration_in_flight_holds_on_rank_0():
    """Its logits and logprobs, float32 whatever the model's dtype, a row for each of max_num_seqs."""
    model = demo_model_config()
    wire = 2 * 4 * 32 * 2 * 2048
    config = EngineConfig(gpu_reserve_bytes=100, max_num_seqs=8)  # None: on, as on CUDA
    held = 8 * model.vocab_size * (4 + 4) + 8 * model.vocab_size * (4 + 1)  # and the penalties' counts
    assert headroom_bytes(config, model, torch.float16, 2048, Shard()) == 100 + wire + held
    assert headroom_bytes(replace(config, async_scheduling=True), model, torch.float16, 2048, Shard()) == \
        100 + wire + held
    assert headroom_bytes(config, model, torch.float16, 2048, Shard(1, 2)) == 100 + wire // 2  # no logits


def test_measure_reads_the_peak_above_what_stays(monkeypatch):
    """The CUDA measurement on a fake allocator: 6 GiB reserved during the run, 2 after."""
    state = dict(reserved=2 * GiB, peak=2 * GiB)
    fake = dict(empty_cache=lambda: None, synchronize=lambda device: None,
                reset_peak_memory_stats=lambda device: state.update(peak=state["reserved"]),
                memory_allocated=lambda device: 2 * GiB, memory_reserved=lambda device: state["reserved"],
                max_memory_reserved=lambda device: state["peak"], mem_get_info=lambda device: (50 * GiB, 80 * GiB))
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    profile = measure(torch.device("cuda"), lambda: state.update(peak=6 * GiB))
    assert profile == MemoryProfile(total=80 * GiB, in_use=30 * GiB, weights=2 * GiB, activations=4 * GiB)


def test_explicit_budget_wins_and_cpu_has_a_default():
    loaded = build_model("demo", EngineConfig(device="cpu"))
    backend = TorchPagedBackend()
    assert kv_cache_budget(EngineConfig(kv_cache_memory_bytes=12345), loaded, backend, Shard()) == 12345
    assert kv_cache_budget(EngineConfig(), loaded, backend, Shard()) == CPU_KV_CACHE_BYTES


# ---- on a GPU -------------------------------------------------------------------------------------
def dummy_checkpoint(path, vocab: int, **shape) -> str:
    """A checkpoint directory for load_format="dummy": config.json and a word-level tokenizer."""
    config = {**DEMO_MODEL_CONFIG, "vocab_size": vocab, "torch_dtype": "bfloat16", "bos_token_id": None,
              "eos_token_id": 1, **shape}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer = RawTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return str(path)


@pytest.fixture
def gpu_memory_returned():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_profiled_engine_runs_its_largest_iteration_within_its_share(tmp_path, gpu_memory_returned):
    """No reserve: the profile's measured peak is all that stands between a full device and the
    iteration, so an underestimate beyond the CUDA context's slack shows as OOM or as more reserved."""
    model = dummy_checkpoint(tmp_path, vocab=32_000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    utilization, seqs, tokens_each = 0.5, 128, 128
    free, total = torch.cuda.mem_get_info()
    engine = LLMEngine(model, device="cuda", dtype="bfloat16", load_format="dummy", policy="mixed",
                       max_num_seqs=seqs, chunk_token_budget=seqs * tokens_each, gpu_memory_utilization=utilization,
                       gpu_reserve_bytes=0, cuda_graph_max_batch=0,  # graphs' pool is what the reserve holds
                       enable_prefix_caching=False)
    lengths = profile_lengths(engine.config, engine.max_model_len)
    assert engine.kv_cache.data.nbytes > utilization * total - (total - free) - 4 * GiB  # the cache fills the share
    params = replace(costliest_params(engine.model_config), max_tokens=2)  # the sampler work the profile ran
    for i in range(seqs):  # prompts that together make exactly the budget: one iteration of every row
        engine.add_request(str(i), [2 + (i * tokens_each + j) % 30_000 for j in range(tokens_each)], params)
    seen = []
    torch.cuda.reset_peak_memory_stats()
    engine.step(before_forward=lambda plan: seen.append((plan.num_tokens, len(plan.scheduled))))
    assert seen == [(sum(lengths), len(lengths))] == [(seqs * tokens_each, seqs)]
    assert torch.cuda.max_memory_reserved() <= utilization * total
    while engine.has_unfinished_requests():  # and decodes with the cache full
        engine.step()
    assert torch.cuda.max_memory_reserved() <= utilization * total


@pytest.mark.gpu
def test_a_share_too_small_for_the_largest_iteration_is_refused(gpu_memory_returned):
    total = torch.cuda.mem_get_info()[1]
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        LLMEngine("demo", device="cuda", gpu_memory_utilization=256 * 2**20 / total)
