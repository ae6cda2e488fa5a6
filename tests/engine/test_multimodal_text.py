"""Multimodal checkpoints (Gemma 3 4B and up: Gemma3ForConditionalGeneration; Mistral Small 3.1
and 3.2, Ministral 3: Mistral3ForConditionalGeneration) served text-only: the language model's
weights load from under `language_model.`, the vision tower's are skipped, and its greedy tokens on
text prompts equal transformers' whole model's. A hub config.json lists only the text_config values
that differ from transformers' defaults: those defaults fill in."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Mistral3Config,
                          Mistral3ForConditionalGeneration, PreTrainedTokenizerFast)

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


MISTRAL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=0,
                    eos_token_id=1, pad_token_id=PAD)
PIXTRAL = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               image_size=28, patch_size=14, head_dim=16)
# Ministral 3's YaRN and Llama 4's query scaling past position 32 (beta high enough to bind)
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.5}


@pytest.mark.parametrize("text, arch", [({"model_type": "mistral", "sliding_window": None}, "MistralForCausalLM"),
                                        ({"model_type": "ministral3", "rope_parameters": MINISTRAL3_ROPE},
                                         "Ministral3ForCausalLM")])
@pytest.mark.parametrize("tied", [False, True])
def test_a_mistral3_checkpoint_served_text_only_generates_as_the_whole_model(tmp_path, tokenizers_by_kind,  # noqa: F811
                                                                             text, arch, tied):
    """Mistral Small 3.x's (a Mistral inside) and Ministral 3's; transformers 5 ties the LM head by
    the wrapper's tie_word_embeddings (its default: tied), whatever the text_config says."""
    raw = tokenizers_by_kind[False]
    vocab = raw.get_vocab_size()
    config = Mistral3Config(text_config={**MISTRAL_TEXT, **text, "vocab_size": vocab + 1}, vision_config=PIXTRAL,
                            image_token_index=vocab, tie_word_embeddings=tied)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(4)
    hf = Mistral3ForConditionalGeneration(config).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path)
    ours = load_model_config(tmp_path)
    assert (ours.architecture, ours.weights_prefix, ours.tie_word_embeddings) == (arch, "language_model.", tied)
    assert ours.sliding_window is None
    prompts = generation_prompts(vocab)[:4]
    llm = LLM(str(tmp_path), dtype="float32", chunk_token_budget=16, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_a_hub_mistral_small_text_config_keeps_its_nulls_over_the_defaults():
    """mistralai/Mistral-Small-3.1-24B-Instruct-2503's text_config: `sliding_window: null` is no
    window (MistralConfig's default is 4096); a text_config of another model type is refused."""
    text = {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
            "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
            "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
            "sliding_window": None, "vocab_size": 131072}
    hub = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "torch_dtype": "bfloat16",
           "image_token_index": 10, "text_config": text, "vision_config": {"model_type": "pixtral"}}
    ours = ModelConfig.from_hf(hub, source="Mistral-Small-3.1")
    assert (ours.architecture, ours.sliding_window, ours.rope_theta) == ("MistralForCausalLM", None, 1e9)
    assert (ours.num_hidden_layers, ours.head_dim, ours.tie_word_embeddings, ours.torch_dtype) == (
        40, 128, False, "bfloat16")
    assert ModelConfig.from_hf({**hub, "text_config": {k: v for k, v in text.items() if k != "sliding_window"}}
                               ).sliding_window == 4096  # transformers' default where the config names none
    with pytest.raises(ConfigError, match="text_config model_type 'llama' is not supported; supported: mistral"):
        ModelConfig.from_hf({**hub, "text_config": {**text, "model_type": "llama"}}, source="x")


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

