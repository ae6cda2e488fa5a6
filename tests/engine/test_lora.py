"""LoRA adapters against PEFT: adapters trained shapes (random weights) saved by `peft`'s own
`save_pretrained`, their logits and greedy text checked against PEFT's model on the same base,
several adapters and the base model in one step, and what an adapter this engine cannot serve
is refused with."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from splitserve.engine.config import ConfigError
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.policies import ScheduledSeq
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixture)
    ENGINE_ARGS,
    NEW_TOKENS,
    generation_prompts,
    hf_greedy,
    hf_logits,
    prompt_ids,
    tokenizers_by_kind,
    write_checkpoint,
)
from tests.engine.runner_helpers import max_diff, new_seq, run_plan

LORA_STD = 0.05  # with the adapters' scales, a change as large as the base weights' own (rsLoRA's: 16 / sqrt(8))
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS = {  # name: its LoraConfig's options
    "attn": dict(r=4, lora_alpha=8, target_modules=ATTENTION),
    "all": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ATTENTION + ["gate_proj", "up_proj", "down_proj"]),
    "mlp": dict(r=2, lora_alpha=4, target_modules=["up_proj", "down_proj"]),
}


def save_adapter(base, path, seed: int, **options) -> torch.nn.Module:
    """PEFT's model of `base` (a copy) with one random adapter, saved at `path`."""
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, LORA_STD)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=["llama3_gqa_tied", "qwen2_bias", "phi3_fused_partial"])
def adapted(request, tmp_path_factory, tokenizers_by_kind):
    """(base checkpoint, {adapter: its directory}, {adapter: PEFT's model}, the base model)."""
    root = tmp_path_factory.mktemp(request.param)
    base = write_checkpoint(root / "base", request.param, tokenizers_by_kind)
    dirs, models = {}, {}
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        if request.param.startswith("phi3"):  # Phi-3 names its fused projections
            options = {**options, "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
        dirs[name] = str(root / name)
        models[name] = save_adapter(base, dirs[name], seed, **options)
    return str(root / "base"), dirs, models, base


def test_prefill_and_decode_logits_match_peft_with_adapters_and_the_base_in_one_step(adapted):
    path, dirs, models, base = adapted
    engine = LLMEngine(path, dtype="float32", lora_modules=dirs, **ENGINE_ARGS)
    vocab = base.config.vocab_size
    names = [None, *dirs, None, "attn"]  # the second "attn" apart from the first: its rows are not one run
    refs, items = [], []
    for i, name in enumerate(names):
        ids = prompt_ids(40 + i, 19 + 3 * i, vocab)
        refs.append(hf_logits(base if name is None else models[name], ids))
        items.append(ScheduledSeq(new_seq(engine, str(i), ids[:-1], SamplingParams(lora=name)), len(ids) - 1))
    out = run_plan(engine, items)
    diffs = [max_diff(out[str(i)], ref[:-1]) for i, ref in enumerate(refs)]
    assert max(diffs) <= 1e-4, diffs
    same = prompt_ids(40, 19, vocab)  # every adapter changes the logits
    assert min(max_diff(hf_logits(models[name], same), refs[0]) for name in dirs) > 0.1


def test_greedy_generation_matches_peft_and_the_prefix_cache_keeps_adapters_apart(adapted):
    path, dirs, models, base = adapted
    prompts = generation_prompts(base.config.vocab_size)[:3]
    llm = LLM(path, dtype="float32", lora_modules=dirs, chunk_token_budget=16, **ENGINE_ARGS)
    for name in [None, *dirs, None]:  # each adapter's prompts after the same prompts' blocks were cached
        ref = base if name is None else models[name]
        expected = [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, lora=name)
        outputs = llm.generate(prompts, params)
        assert [o.token_ids for o in outputs] == expected, name
    again = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, lora="attn"))
    assert sum(o.num_cached_tokens for o in again) > 0  # an adapter's own blocks are reused


def test_a_merged_adapter_is_what_the_engine_computes(adapted):
    """PEFT's merge_and_unload (the adapter folded into the base weights) as a second reference."""
    path, dirs, models, base = adapted
    merged = PeftModel.from_pretrained(copy.deepcopy(base), dirs["all"]).merge_and_unload()
    ids = prompt_ids(7, 25, base.config.vocab_size)
    engine = LLMEngine(path, dtype="float32", lora_modules={"all": dirs["all"]}, **ENGINE_ARGS)
    seq = new_seq(engine, "a", ids, SamplingParams(lora="all"))
    assert max_diff(run_plan(engine, [ScheduledSeq(seq, len(ids))])["a"], hf_logits(merged, ids)) <= 1e-4


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_ranks_hold_their_slices_of_each_adapter(adapted, size):
    """Column-parallel parts keep their rows of B, row-parallel projections their columns of A (at
    4 ranks two KV heads are each on two ranks): TP output equals one rank's under every adapter."""
    from tests.engine.tp_helpers import tp_engine

    path, dirs, _, base = adapted
    prompts = generation_prompts(base.config.vocab_size)[:2]
    args = dict(dtype="float32", lora_modules=dirs, **ENGINE_ARGS)
    single = LLM(path, **args)
    with tp_engine(path, size, **args) as (engine, followers):
        check_tp_equals_one_rank(engine, single, prompts, [None, *dirs])
    assert not followers.errors


def check_tp_equals_one_rank(engine: LLMEngine, single: LLM, prompts: list, names: list) -> None:
    """Under each adapter of `names` (None: the base), the TP engine's greedy tokens and logprobs
    are the one-rank LLM's."""
    for name in names:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, lora=name)
        want = single.generate(prompts, params)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{name}-{i}", prompt, params)
        got = {}
        while engine.has_unfinished_requests():
            got.update((out.request_id, out) for out in engine.step() if out.finished)
        for i, ref in enumerate(want):
            out = got[f"{name}-{i}"].outputs[0]
            assert out.token_ids == ref.token_ids, name
            pairs = list(zip(out.logprobs, ref.outputs[0].logprobs))
            assert len(pairs) == 6 and all(abs(g[k] - w[k]) < 1e-4 for g, w in pairs for k in w)


def test_a_request_naming_no_loaded_adapter_is_refused(adapted):
    path, dirs, _, _ = adapted
    engine = LLMEngine(path, dtype="float32", lora_modules={"attn": dirs["attn"]}, **ENGINE_ARGS)
    assert engine.lora_names == ("attn",)
    with pytest.raises(ValueError, match="lora: no adapter named 'mlp' is loaded"):
        engine.add_request("x", [3, 4, 5], SamplingParams(lora="mlp"))
    assert engine.num_requests == 0


def _edited(src: str, dst, **changes) -> str:
    """A copy of the adapter at `src` whose adapter_config.json has `changes`."""
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return str(dst)


@pytest.mark.parametrize("changes, message", [
    (dict(use_dora=True), "sets use_dora=True"),
    (dict(bias="all"), "sets bias='all'"),
    (dict(modules_to_save=["lm_head"]), "sets modules_to_save"),
    (dict(rank_pattern={"q_proj": 2}), "sets rank_pattern"),
    (dict(r=0), "r must be an integer"),
    (dict(r=5), r"are not \[r, in\] and \[out, r\] with r=5"),
    (dict(peft_type="IA3"), "is a IA3 adapter"),
])
def test_an_adapter_this_engine_cannot_serve_is_a_config_error(adapted, tmp_path, changes, message):
    path, dirs, _, _ = adapted
    bad = _edited(dirs["attn"], tmp_path / "bad", **changes)
    with pytest.raises(ConfigError, match=f"adapter 'bad'.*{message}"):
        LLMEngine(path, dtype="float32", lora_modules={"bad": bad}, **ENGINE_ARGS)


def test_an_adapter_of_other_modules_or_shapes_is_a_config_error(adapted, tmp_path):
    path, _, _, base = adapted
    save_adapter(base, tmp_path / "head", 0, r=2, target_modules=["lm_head"])
    # (with tied embeddings PEFT also saves the head's base weight: refused first, naming it)
    with pytest.raises(ConfigError, match=r"adapter 'head' (adapts lm_head, which is not one of this model's dense|"
                                          r"holds 'base_model.model.lm_head.base_layer.weight', which is not a LoRA)"):
        LLMEngine(path, dtype="float32", lora_modules={"head": str(tmp_path / "head")}, **ENGINE_ARGS)
    with pytest.raises(ConfigError, match="adapter 'none'.*no adapter_model.safetensors or adapter_model.bin"):
        (tmp_path / "none").mkdir()
        (tmp_path / "none" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
        LLMEngine(path, dtype="float32", lora_modules={"none": str(tmp_path / "none")}, **ENGINE_ARGS)


def test_adapter_names_are_bounded_and_distinct():
    from splitserve.engine.engine_config import EngineConfig

    with pytest.raises(ConfigError, match="lora_modules names 65 adapters, past the 64 slots allows"):
        EngineConfig(lora_modules={f"a{i}": "x" for i in range(65)})
    with pytest.raises(ConfigError, match="distinct name"):
        EngineConfig(lora_modules=[("a", "x"), ("a", "y")])
    with pytest.raises(ValueError, match="lora must be an adapter's name"):
        SamplingParams(lora="")
