"""LoRA adapters loaded and unloaded while the engine serves, against PEFT: what a load computes,
what runs under an unloaded adapter, more adapters than slots (swapped in from host memory), a
name loaded again with other weights, the tensor-parallel ranks' slices, and what a load refuses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.engine.config import ConfigError
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.lora_loading import AdapterNotLoaded, NoAdapterSlot
from splitserve.engine.model.lora import LoraWeights
from splitserve.engine.policies import ScheduledSeq
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.hf_checkpoints import ENGINE_ARGS, NEW_TOKENS, generation_prompts, hf_greedy, hf_logits, prompt_ids
from tests.engine.hf_checkpoints import tokenizers_by_kind  # noqa: F401 (fixture)
from tests.engine.runner_helpers import max_diff, new_seq, run_plan
from tests.engine.test_lora import adapted, check_tp_equals_one_rank  # noqa: F401 (fixture)

KINDS = pytest.mark.parametrize("adapted", ["llama3_gqa_tied", "phi3_fused_partial"], indirect=True)
RUN_TIME = dict(dtype="float32", max_lora_rank=8, **ENGINE_ARGS)


def greedy(params_lora: str) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, lora=params_lora)


@KINDS
def test_adapters_loaded_at_run_time_compute_what_peft_does_beside_one_loaded_at_start(adapted):
    path, dirs, models, base = adapted
    engine = LLMEngine(path, lora_modules={"attn": dirs["attn"]}, max_loras=3, **RUN_TIME)
    engine.load_lora("all", dirs["all"])
    engine.load_lora("mlp", dirs["mlp"])
    assert engine.lora_names == ("attn", "all", "mlp")
    refs, items = [], []
    for i, name in enumerate([None, "all", "attn", "mlp", "all"]):
        ids = prompt_ids(40 + i, 19 + 3 * i, base.config.vocab_size)
        refs.append(hf_logits(base if name is None else models[name], ids))
        items.append(ScheduledSeq(new_seq(engine, str(i), ids[:-1], SamplingParams(lora=name)), len(ids) - 1))
    out = run_plan(engine, items)
    assert max(max_diff(out[str(i)], ref[:-1]) for i, ref in enumerate(refs)) <= 1e-4


@KINDS
def test_what_runs_under_an_unloaded_adapter_finishes_under_it_before_host_memory_lets_go(adapted):
    path, dirs, models, base = adapted
    prompt = generation_prompts(base.config.vocab_size)[0]
    llm = LLM(path, max_loras=1, **RUN_TIME)
    engine = llm.engine
    engine.load_lora("x", dirs["attn"])
    engine.add_request("running", prompt, greedy("x"))
    engine.step()
    engine.unload_lora("x")
    assert engine.lora_names == ()
    with pytest.raises(ValueError, match="no adapter named 'x' is loaded"):
        engine.add_request("late", prompt, greedy("x"))
    with pytest.raises(NoAdapterSlot, match=r"all 1 adapters host memory holds \(max_cpu_loras\) are taken: 0 by"):
        engine.load_lora("y", dirs["mlp"])  # host memory's only place still holds what "running" runs under
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    assert done["running"].outputs[0].token_ids == hf_greedy(models["attn"], prompt, NEW_TOKENS)
    engine.load_lora("y", dirs["mlp"])
    [out] = llm.generate([prompt], greedy("y"))
    assert out.outputs[0].token_ids == hf_greedy(models["mlp"], prompt, NEW_TOKENS)


@KINDS
def test_more_adapters_than_slots_are_served_from_host_memory_as_peft_computes_them(adapted):
    """max_cpu_loras past max_loras: requests under three adapters and the base model, all at once
    through one slot, each get PEFT's greedy tokens; the adapters take the slot in turns."""
    path, dirs, models, base = adapted
    prompts = generation_prompts(base.config.vocab_size)[:2]
    llm = LLM(path, lora_modules={"attn": dirs["attn"]}, max_loras=1, max_cpu_loras=3, **RUN_TIME)
    llm.engine.load_lora("all", dirs["all"])
    llm.engine.load_lora("mlp", dirs["mlp"])
    requests = [(prompt, name) for name in ["all", None, "mlp", "attn", "all"] for prompt in prompts]
    outputs = llm.generate([prompt for prompt, _ in requests], [greedy(name) for _, name in requests])
    assert [o.outputs[0].token_ids for o in outputs] == \
        [hf_greedy(base if name is None else models[name], prompt, NEW_TOKENS) for prompt, name in requests]
    residency = llm.engine.policy.adapters
    assert residency.swaps >= 3 and residency.bound == [0]
    with pytest.raises(NoAdapterSlot, match="all 3 adapters host memory holds"):
        llm.engine.load_lora("more", dirs["attn"])
    llm.engine.unload_lora("all")
    llm.engine.load_lora("more", dirs["attn"])  # nothing ran under "all": its place is free at once
    [out] = llm.generate([prompts[0]], greedy("more"))
    assert out.outputs[0].token_ids == hf_greedy(models["attn"], prompts[0], NEW_TOKENS)
    llm.engine.check_integrity()


@KINDS
def test_a_name_loaded_again_with_other_weights_never_meets_the_old_ones_cached_blocks(adapted):
    path, dirs, models, base = adapted
    prompts = generation_prompts(base.config.vocab_size)[:3]
    llm = LLM(path, max_loras=2, **RUN_TIME)
    for adapter, cached in [("attn", False), ("all", False), ("all", True)]:
        llm.engine.load_lora("x", dirs[adapter])
        outputs = llm.generate(prompts, greedy("x"))
        assert [o.token_ids for o in outputs] == [hf_greedy(models[adapter], p, NEW_TOKENS) for p in prompts]
        # the same files loaded again are the same adapter: its blocks are reused
        assert (sum(o.num_cached_tokens for o in outputs) > 0) == cached, adapter
        llm.engine.unload_lora("x")


@KINDS
def test_a_request_placed_under_an_adapters_identity_is_refused_where_the_name_was_loaded_again(adapted):
    """A cluster's CLS names the identity it placed a request under: an engine where that name was
    loaded again with other files meanwhile refuses it, as neither worker may run other weights."""
    path, dirs, _, base = adapted
    prompt = generation_prompts(base.config.vocab_size)[0]
    engine = LLMEngine(path, max_loras=2, **RUN_TIME)
    placed = engine.load_lora("x", dirs["attn"])
    engine.add_request("same", prompt, SamplingParams(lora="x", lora_identity=placed))
    engine.unload_lora("x")
    assert engine.load_lora("x", dirs["mlp"]) != placed
    with pytest.raises(ValueError, match="not the one the request was placed under"):
        engine.add_request("moved", prompt, SamplingParams(lora="x", lora_identity=placed))
    engine.add_request("new", prompt, SamplingParams(lora="x", lora_identity=engine.lora_identities["x"]))
    with pytest.raises(ValueError, match="lora_identity must be a string, with lora"):
        SamplingParams(lora_identity=placed)


@KINDS
def test_tensor_parallel_ranks_load_their_slices_at_run_time(adapted):
    from tests.engine.tp_helpers import tp_engine

    path, dirs, _, base = adapted
    prompts = generation_prompts(base.config.vocab_size)[:2]
    single = LLM(path, lora_modules=dirs, **RUN_TIME)
    with tp_engine(path, 2, max_loras=1, max_cpu_loras=2, **RUN_TIME) as (engine, followers):
        engine.load_lora("attn", dirs["attn"])
        engine.load_lora("all", dirs["all"])
        engine.unload_lora("attn")
        engine.load_lora("mlp", dirs["mlp"])  # into the place "attn" left in host memory
        check_tp_equals_one_rank(engine, single, prompts, ["all", "mlp", None, "all"])  # one slot: swapped in turns
        assert engine.policy.adapters.swaps == 3
    assert not followers.errors


@KINDS
def test_a_load_refuses_what_it_cannot_serve_and_changes_nothing(adapted, tmp_path):
    path, dirs, _, _ = adapted
    fixed = LLMEngine(path, lora_modules={"attn": dirs["attn"]}, **RUN_TIME)
    with pytest.raises(ConfigError, match="max_loras is 0"):
        fixed.load_lora("all", dirs["all"])
    engine = LLMEngine(path, max_loras=2, **{**RUN_TIME, "max_lora_rank": 4})
    with pytest.raises(ConfigError, match="lora_path: adapter 'big' has rank 8, past max_lora_rank 4"):
        engine.load_lora("big", dirs["all"])
    with pytest.raises(ConfigError, match="lora_path: adapter 'gone'.*adapter_config.json: file not found"):
        engine.load_lora("gone", str(tmp_path / "nowhere"))
    stuffed = tmp_path / "stuffed"
    stuffed.mkdir()
    (stuffed / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
    with open(stuffed / "adapter_model.safetensors", "wb") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte no rank-4 adapter of this model needs
    with pytest.raises(ConfigError, match="holds 1073741824 bytes, more than a rank-4 adapter"):
        engine.load_lora("stuffed", str(stuffed))
    with pytest.raises(ConfigError, match="lora_name must be 1 to"):
        engine.load_lora("", dirs["attn"])
    engine.load_lora("attn", dirs["attn"])
    with pytest.raises(ValueError, match="an adapter named 'attn' is already loaded"):
        engine.load_lora("attn", dirs["mlp"])
    with pytest.raises(AdapterNotLoaded, match="no adapter named 'mlp' is loaded"):
        engine.unload_lora("mlp")
    assert engine.lora_names == ("attn",)
    engine.load_lora("mlp", dirs["mlp"])  # the refused loads took no slot
    assert engine.lora_names == ("attn", "mlp")


@KINDS
def test_a_load_that_would_leave_host_memory_short_is_refused_and_changes_nothing(adapted, monkeypatch):
    from splitserve.engine import lora_loading

    path, dirs, _, _ = adapted
    engine = LLMEngine(path, max_loras=1, max_cpu_loras=2, **RUN_TIME)
    file_bytes = (Path(dirs["all"]) / "adapter_model.safetensors").stat().st_size
    packed = sum(w.a[0].nbytes + w.b[0].nbytes for w in engine.runner.model.modules() if isinstance(w, LoraWeights))
    need = 4 * file_bytes + packed
    enough = lora_loading.HOST_HEADROOM_BYTES + need
    monkeypatch.setattr(lora_loading, "free_bytes", lambda device: enough - 1)
    with pytest.raises(NoAdapterSlot, match=f"loading adapter 'all' takes up to {need} bytes of host memory"):
        engine.load_lora("all", dirs["all"])
    assert engine.lora_names == () and not engine.runner.model.lora_slots.host.adapters
    monkeypatch.setattr(lora_loading, "free_bytes", lambda device: enough)
    engine.load_lora("all", dirs["all"])
    assert engine.lora_names == ("all",)


def test_max_loras_is_bounded_and_holds_the_lora_modules():
    from splitserve.engine.engine_config import EngineConfig

    with pytest.raises(ConfigError, match="max_loras must be 0"):
        EngineConfig(max_loras=65)
    with pytest.raises(ConfigError, match="lora_modules names 2 adapters, past the 1 max_cpu_loras allows"):
        EngineConfig(lora_modules={"a": "x", "b": "y"}, max_loras=1)
    with pytest.raises(ConfigError, match="lora_modules names 3 adapters, past the 2 max_cpu_loras allows"):
        EngineConfig(lora_modules={"a": "x", "b": "y", "c": "z"}, max_loras=1, max_cpu_loras=2)
    for wrong in [dict(max_cpu_loras=2), dict(max_loras=2, max_cpu_loras=1), dict(max_loras=2, max_cpu_loras=1025)]:
        with pytest.raises(ConfigError, match="max_cpu_loras must be from max_loras"):
            EngineConfig(**wrong)
    assert EngineConfig(lora_modules={"a": "x", "b": "y"}, max_loras=1, max_cpu_loras=2).host_loras == 2
    assert EngineConfig(max_loras=3).host_loras == 3
    with pytest.raises(ConfigError, match="max_lora_rank must be in"):
        EngineConfig(max_loras=1, max_lora_rank=0)
