"""A multimodal checkpoint (Gemma 3 4B and up: Gemma3ForConditionalGeneration) served text-only:
its language model's weights load from under `language_model.`, the vision tower's are skipped,
and its greedy tokens on text prompts equal transformers' whole model's. A hub config.json lists
only the text_config values that differ from transformers' defaults: those defaults fill in."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, PreTrainedTokenizerFast

from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.llm import LLM
from splitserve.engine.loader import CheckpointError, load_model_config
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixture)
    ENGINE_ARGS, NEW_TOKENS, PAD, generation_prompts, hf_greedy, randomize, tokenizers_by_kind,
)

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, query_pre_attn_scalar=24, sliding_window=16, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
            pad_token_id=PAD)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory, tokenizers_by_kind):  # noqa: F811
    path = tmp_path_factory.mktemp("gemma3_multimodal")
    raw = tokenizers_by_kind[False]
    vocab = raw.get_vocab_size()
    config = Gemma3Config(text_config={**TEXT, "vocab_size": vocab + 3}, vision_config=VISION, mm_tokens_per_image=4,
                          boi_token_index=vocab, eoi_token_index=vocab + 1, image_token_index=vocab + 2)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(3)
    model = Gemma3ForConditionalGeneration(config).eval()
    randomize(model)
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(path)
    return str(path), model


def test_text_only_greedy_matches_the_whole_model(multimodal):
    path, hf = multimodal
    config = load_model_config(path)
    assert (config.architecture, config.weights_prefix, config.local_rope_theta) == (
        "Gemma3ForCausalLM", "language_model.", 10000.0)
    prompts = generation_prompts(hf.config.text_config.vocab_size)[:4]
    llm = LLM(path, dtype="float32", chunk_token_budget=16, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_a_tensor_outside_the_language_model_and_the_skipped_parts_is_named(multimodal, tmp_path):
    from safetensors.torch import load_file, save_file

    from splitserve.engine.engine_config import EngineConfig
    from splitserve.engine.model_builder import build_model

    path, _ = multimodal
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((Path(path) / name).read_text())
    tensors = load_file(f"{path}/model.safetensors")
    save_file({**tensors, "audio_tower.w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor 'audio_tower.w' is neither the language model's"):
        build_model(str(tmp_path), EngineConfig(device="cpu", num_kv_blocks=64))


def test_a_sparse_hub_text_config_takes_transformers_defaults():
    """google/gemma-3-4b-it's config.json, as the hub has it (its text_config lists 6 values)."""
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
           "eos_token_id": [1, 106], "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
           "mm_tokens_per_image": 256,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    ours = ModelConfig.from_hf(hub, source="gemma-3-4b-it")
    theirs = Gemma3Config(**{k: v for k, v in hub.items() if k != "architectures"}).text_config
    assert (ours.vocab_size, ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim) == (
        theirs.vocab_size, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim)
    assert ours.attention_scale == theirs.query_pre_attn_scalar ** -0.5 and ours.max_positions == 131072
    assert ours.sliding_layers == tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
    assert ours.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert (ours.rope_scaling.rope_type, ours.rope_scaling.factor) == ("linear", 8.0)
    assert ours.local_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert ours.eos_token_ids == (1, 106) and ours.torch_dtype == "bfloat16" and ours.tie_word_embeddings
    with pytest.raises(ConfigError, match="missing required field 'text_config'"):
        ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"]}, source="x")

