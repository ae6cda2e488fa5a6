"""Checkpoint loading against checkpoints written by transformers' own `save_pretrained`."""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from splitserve.engine.config import ConfigError
from splitserve.engine.demo import DEMO_MODEL_CONFIG, demo_model_config, demo_tokenizer
from splitserve.engine.dummy_weights import init_dummy_weights
from splitserve.engine.loader import CheckpointError, iter_checkpoint_tensors, load_model_config, load_weights

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def make_llama(seed=0, **overrides):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**SHAPE, **overrides})).eval()


def make_qwen2(seed=0, **overrides):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, **overrides})).eval()


def make_qwen3(seed=0, **overrides):
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**{**SHAPE, "head_dim": 16, **overrides})).eval()


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("make", [make_llama, make_qwen2, make_qwen3])
@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_round_trip_matches_every_tensor(tmp_path, make, shard_size):
    source = make(seed=0)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    source.save_pretrained(tmp_path, **kwargs)
    sharded = (tmp_path / "model.safetensors.index.json").is_file()
    assert sharded == (shard_size is not None)
    target = make(seed=1)
    load_weights(target, tmp_path)
    assert_same_weights(source, target)


def test_round_trip_qwen2_has_biases(tmp_path):
    make_qwen2().save_pretrained(tmp_path)
    names = {name for name, _ in iter_checkpoint_tensors(tmp_path)}
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert load_model_config(tmp_path).attention_bias


def test_qwen3_has_head_norms_and_no_biases(tmp_path):
    make_qwen3().save_pretrained(tmp_path)
    names = {name for name, _ in iter_checkpoint_tensors(tmp_path)}
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= names
    cfg = load_model_config(tmp_path)
    assert cfg.qk_norm and not cfg.attention_bias and cfg.head_dim == 16
    assert cfg.sliding_window is None  # use_sliding_window is false, as in every released Qwen3


def test_qwen3_attention_bias_biases_o_proj_too(tmp_path):
    """As transformers builds it (the o_proj bias itself checked against transformers on Llama's
    `llama_head_dim` checkpoint in test_model_vs_hf)."""
    make_qwen3(attention_bias=True).save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    assert cfg.attention_bias and cfg.attention_out_bias


def test_dummy_weights_leave_gemma_norms_neutral(tmp_path):
    """Gemma's norms scale by 1 + weight: dummy weights give them zeros, as its own init does."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from splitserve.engine.model.llama import LlamaForCausalLM as Ours

    Gemma2ForCausalLM(Gemma2Config(**SHAPE, head_dim=16)).save_pretrained(tmp_path)
    ours = Ours(load_model_config(tmp_path), max_model_len=64)
    init_dummy_weights(ours, seed=0)
    layer = ours.model.layers[0]
    assert torch.equal(layer.pre_feedforward_layernorm.weight, torch.zeros(32))
    assert torch.equal(ours.model.norm.weight, torch.zeros(32))


def test_tied_embeddings_load_both_names(tmp_path):
    source = make_llama(seed=0, tie_word_embeddings=True)
    source.save_pretrained(tmp_path)
    assert "lm_head.weight" not in {name for name, _ in iter_checkpoint_tensors(tmp_path)}
    target = make_llama(seed=1, tie_word_embeddings=True)
    load_weights(target, tmp_path)
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert_same_weights(source, target)
    assert load_model_config(tmp_path).tie_word_embeddings


def test_phi3_fused_tensors_load_as_their_parts(tmp_path):
    """Phi-3 stores Q, K and V as one qkv_proj tensor and gate and up as one gate_up_proj: our
    merged projections hold the same rows; a fused tensor of the wrong size is named."""
    from splitserve.engine.model.llama import LlamaForCausalLM as OurLlama

    torch.manual_seed(0)
    source = Phi3ForCausalLM(Phi3Config(**SHAPE, pad_token_id=0)).eval()
    source.save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    ours = OurLlama(config, max_model_len=64)
    load_weights(ours, tmp_path)
    for mine, theirs in zip(ours.model.layers, source.model.layers):
        assert torch.equal(mine.self_attn.qkv_proj.weight, theirs.self_attn.qkv_proj.weight)
        assert torch.equal(mine.mlp.gate_up_proj.weight, theirs.mlp.gate_up_proj.weight)
    state = source.state_dict()
    state["model.layers.1.self_attn.qkv_proj.weight"] = state["model.layers.1.self_attn.qkv_proj.weight"][:-8]
    save_state(tmp_path, state)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.self_attn.qkv_proj.weight' has shape \(56, 32\), "
                                              r"the model expects \(64, 32\)"):
        load_weights(ours, tmp_path)


def test_dtype_converts_the_model(tmp_path):
    source = make_llama()
    source.save_pretrained(tmp_path)
    target = make_llama(seed=1)
    load_weights(target, tmp_path, torch.bfloat16)
    weight = target.model.layers[0].mlp.up_proj.weight
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, source.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16))


def test_model_config_and_generation_config_eos_override(tmp_path):
    make_llama(eos_token_id=2).save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    assert (cfg.architecture, cfg.num_key_value_heads, cfg.head_dim) == ("LlamaForCausalLM", 2, 8)
    assert cfg.eos_token_ids == (2,)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 7]}))
    assert load_model_config(tmp_path).eos_token_ids == (2, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 9}))
    assert load_model_config(tmp_path).eos_token_ids == (9,)


def test_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="no_such_dir"):
        load_model_config(tmp_path / "no_such_dir")
    with pytest.raises(CheckpointError, match="no_such_dir"):
        list(iter_checkpoint_tensors(tmp_path / "no_such_dir"))


def test_missing_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        load_model_config(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_malformed_json_names_the_file(tmp_path, name):
    make_llama().save_pretrained(tmp_path)
    (tmp_path / name).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{name}: malformed JSON"):
        load_model_config(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="config.json.*GPT2LMHeadModel"):
        load_model_config(tmp_path)


def test_no_safetensors(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_weights(make_llama(), tmp_path)


def test_missing_shard(tmp_path):
    make_llama().save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: shard listed in .*index.json does not exist"):
        load_weights(make_llama(), tmp_path)


def test_corrupt_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        load_weights(make_llama(), tmp_path)


def save_state(tmp_path, state):
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))


def test_unknown_tensor_name(tmp_path):
    model = make_llama()
    save_state(tmp_path, {**model.state_dict(), "model.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="model.safetensors: tensor 'model.extra.weight' has no matching"):
        load_weights(model, tmp_path)


def test_rotary_inv_freq_is_skipped(tmp_path):
    source = make_llama()
    save_state(tmp_path, {**source.state_dict(), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    target = make_llama(seed=1)
    load_weights(target, tmp_path)
    assert_same_weights(source, target)


def test_shape_mismatch(tmp_path):
    make_llama(vocab_size=80).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor '(lm_head|model.embed_tokens).weight' has shape \(80, 32\)"):
        load_weights(make_llama(), tmp_path)


def test_parameter_never_loaded(tmp_path):
    state = make_llama().state_dict()
    del state["model.norm.weight"]
    save_state(tmp_path, state)
    with pytest.raises(CheckpointError, match="model.safetensors: checkpoint has no tensor for parameters \\['model.norm.weight'\\]"):
        load_weights(make_llama(), tmp_path)


def test_dummy_init_is_deterministic_per_seed():
    a, b, c = make_qwen2(seed=1), make_qwen2(seed=2), make_qwen2(seed=3)
    init_dummy_weights(a, seed=0)
    init_dummy_weights(b, seed=0)
    init_dummy_weights(c, seed=1)
    assert_same_weights(a, b)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert torch.equal(a.model.norm.weight, torch.ones(32))
    assert torch.equal(a.model.layers[0].self_attn.q_proj.bias, torch.zeros(32))
    std = a.model.layers[1].mlp.down_proj.weight.std().item()
    assert 0.015 < std < 0.025


def test_dummy_runs_are_independent_draws_whatever_the_thread_count(monkeypatch):
    monkeypatch.setattr("splitserve.engine.dummy_weights.DUMMY_CHUNK", 100)  # the embedding (64 x 32) is 21 runs, the last cut short
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = make_qwen2()
        init_dummy_weights(serial, seed=0)
        torch.set_num_threads(2)
        parallel = make_qwen2()
        init_dummy_weights(parallel, seed=0)
    finally:
        torch.set_num_threads(threads)
    assert_same_weights(serial, parallel)
    runs = serial.model.embed_tokens.weight.view(-1).split(100)
    assert len({tuple(run[:8].tolist()) for run in runs}) == len(runs)  # no two runs share a generator
    assert not torch.equal(serial.model.layers[0].self_attn.q_proj.weight.view(-1)[:100], runs[0])


def test_the_demo_keeps_one_generators_weights():
    from splitserve import LLM
    from splitserve.engine.demo import DEMO_SEED
    from splitserve.engine.model.llama import checkpoint_tensors

    model = LLM("demo").engine.runner.model
    name, first = next((n, p) for n, p in checkpoint_tensors(model) if p.dim() > 1)
    expected = torch.empty(first.shape).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(DEMO_SEED))
    assert torch.equal(first, expected), name


def test_demo_model_config():
    cfg = demo_model_config()
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads) == (259, 4, 32, 4)
    assert cfg.eos_token_ids == demo_tokenizer().eos_token_ids == (257,)
    assert cfg.bos_token_id == demo_tokenizer().bos_token_id == 256
    assert DEMO_MODEL_CONFIG["vocab_size"] == demo_tokenizer().vocab_size


@pytest.mark.parametrize("make", [make_llama, make_qwen2, make_qwen3])
def test_our_merged_projections_are_named_and_shaped_as_hugging_face_names_its_weights(make):
    from splitserve.engine.config import ModelConfig
    from splitserve.engine.model.llama import LlamaForCausalLM as Ours
    from splitserve.engine.model.llama import checkpoint_tensors

    theirs = make()
    config = {**theirs.config.to_dict(), "architectures": [type(theirs).__name__]}
    ours = Ours(ModelConfig.from_hf(config, source="test"), 64)
    assert {n: tuple(t.shape) for n, t in checkpoint_tensors(ours)} == \
        {n: tuple(t.shape) for n, t in theirs.state_dict().items()}
    assert not any(name.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for name, _ in checkpoint_tensors(ours))
