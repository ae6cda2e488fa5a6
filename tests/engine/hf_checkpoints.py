"""Tiny random Hugging Face checkpoints for the tests against transformers: each built with
transformers' own classes and written with its own `save_pretrained`, next to a `tokenizer.json`
trained with `tokenizers` (every byte a token, as in real byte-level vocabularies), and the
transformers-side references (logits, greedy generation) on the same weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (ApertusConfig, ApertusForCausalLM, ArceeConfig, ArceeForCausalLM, Cohere2Config,
                          Cohere2ForCausalLM, CohereConfig, CohereForCausalLM, Ernie4_5Config, Ernie4_5ForCausalLM,
                          Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, Exaone4Config, Exaone4ForCausalLM,
                          Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, Glm4Config,
                          Glm4ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM, GptOssConfig, GptOssForCausalLM,
                          GraniteConfig, GraniteForCausalLM, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM,
                          HeliumConfig, HeliumForCausalLM, HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM,
                          InternLM3Config, LlamaConfig, LlamaForCausalLM, MiniMaxM2Config, MiniMaxM2ForCausalLM,
                          Ministral3Config, Ministral3ForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, NemotronConfig, NemotronForCausalLM, Olmo2Config, Olmo2ForCausalLM,
                          Olmo3Config, Olmo3ForCausalLM, Phi3Config, Phi3ForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, SeedOssConfig, SeedOssForCausalLM,
                          SmolLM3Config, SmolLM3ForCausalLM)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

from splitserve.engine.tokenizer import HFTokenizer

# ASCII only, so every token decodes to complete characters (no held-back partial UTF-8).
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine, said the tailor to his apprentice",
    "Splitwise splits prompt and token phases across machines.",
    "Sarathi-Serve chunks long prefills: stall-free batching (2024)!",
    "paged attention stores keys and values in fixed-size blocks #42",
    "How much wood would a woodchuck chuck? QUITE A LOT; 1234567890",
] * 10
BOS, EOS, PAD = 0, 1, 2  # the trainer's special tokens come first
WEIGHT_STD = 0.2         # HF's 0.02 init gives near-uniform logits; this separates the argmax
MAX_POS = 256
ENGINE_ARGS = dict(device="cpu", block_size=8, num_kv_blocks=96)

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=MAX_POS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
              rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}  # Qwen's long-context setting
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],  # Phi-3.5's shape of scaling
            "long_factor": [1.5 + 0.5 * i for i in range(8)]}
CONFIGS = {
    "llama_mha": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, num_hidden_layers=3)),
    "llama3_gqa_tied": (LlamaConfig, LlamaForCausalLM,
                        dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                             tie_word_embeddings=True)),
    "mistral_gqa": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2, rope_theta=1000000.0)),
    # Mistral 7B v0.1's sliding window, every layer: the 40-token prompt and the generations pass it
    "mistral_window": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=24)),
    "qwen2_bias": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2, rope_theta=1000000.0)),
    # a window on the layers from max_window_layers on: layer 0 attends to everything, layer 1 to 16 tokens
    "qwen2_window": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2, use_sliding_window=True,
                                                        sliding_window=16, max_window_layers=1)),
    "qwen2_yarn": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2, rope_theta=10000.0,
                                                      rope_scaling=YARN_ROPE)),
    # heads wider than hidden_size / heads; attention_bias puts a bias on o_proj too
    "llama_head_dim": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, head_dim=32, attention_bias=True)),
    # per-head q/k norms, heads x head_dim wider than hidden_size, tied embeddings (as the small Qwen3s)
    "qwen3_qk_norm": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=32, rope_theta=1000000.0,
                                                          tie_word_embeddings=True)),
    # Q, K and V stored as one qkv_proj tensor, gate and up as one gate_up_proj; half of each head rotated
    "phi3_fused_partial": (Phi3Config, Phi3ForCausalLM, dict(num_key_value_heads=2, partial_rotary_factor=0.5)),
    # LongRoPE past 48 tokens: the 40-token generation prompt crosses it while decoding
    "phi3_longrope": (Phi3Config, Phi3ForCausalLM, dict(num_key_value_heads=2, original_max_position_embeddings=48,
                                                        rope_scaling=LONGROPE)),
    # Gemma 2: four norms a layer, GELU, scores scaled by query_pre_attn_scalar and soft-capped (caps low
    # enough to bind), a window on the even layers, soft-capped logits, tied embeddings
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                                                     sliding_window=16, attn_logit_softcapping=4.0,
                                                     final_logit_softcapping=8.0)),
    # Gemma 3: Gemma's norms on q and k too, no soft caps, the sliding layer turning at a base of its own
    # and the global one with linear scaling
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # sparse MoE: 4 experts, top 2 renormalized, in every layer
    "mixtral_moe": (MixtralConfig, MixtralForCausalLM, dict(num_key_value_heads=2, num_local_experts=4,
                                                           num_experts_per_tok=2, rope_theta=1000000.0)),
    # 8 narrow experts, top 2 not renormalized, behind a dense first layer; Qwen3's q/k norms
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_key_value_heads=2, head_dim=32, num_experts=8,
                                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                                           norm_topk_prob=False, mlp_only_layers=[0])),
    # top 2 of 4 experts beside a gated shared expert, q/k/v biases
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                           rope_theta=1000000.0)),
    # Cohere (Command R, Aya Expanse): LayerNorms, the attention and the MLP side by side, interleaved
    # rotary pairs, scaled logits (its LM head untied here: tied, these random weights repeat one token)
    "cohere": (CohereConfig, CohereForCausalLM, dict(num_key_value_heads=2, logit_scale=2.5, layer_norm_eps=1e-5,
                                                     tie_word_embeddings=False)),
    # Command R+: Cohere's layers with a LayerNorm over each head of q and of k
    "cohere_qk_norm": (CohereConfig, CohereForCausalLM, dict(num_key_value_heads=2, use_qk_norm=True,
                                                             logit_scale=2.5)),
    # Cohere 2 (Command R7B, Command A): a window on the first layer, the full one without rotary
    # embedding, tied embeddings
    "cohere2": (Cohere2Config, Cohere2ForCausalLM, dict(num_key_value_heads=2, sliding_window=16,
                                                        layer_types=["sliding_attention", "full_attention"],
                                                        logit_scale=2.5)),
    # GLM-4: neighbouring pairs of half of each head rotated, four norms a layer, gate and up stored as
    # one gate_up_proj, q/k/v biases
    "glm4": (Glm4Config, Glm4ForCausalLM, dict(num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5)),
    # GLM-4.5: a dense first layer, then top 2 of 8 experts by sigmoid plus a bias within the best of 2
    # groups, scaled, beside an ungated shared expert; half of each head rotated, q/k/v biases, q/k norms
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM, dict(
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5)),
    # GPT-OSS: top 2 of 4 biased experts, gate and up interleaved, the clamped SwiGLU (a limit low enough
    # to bind), attention sinks, biases on q, k, v and o, a window on the first layer, YaRN
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, dict(
        num_key_value_heads=2, head_dim=16, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=16, swiglu_limit=2.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0})),
    # Granite: the embeddings, each sublayer's output and the logits scaled (by values far from 1), the
    # attention's scale its own, biases on q, k, v and o
    "granite": (GraniteConfig, GraniteForCausalLM, dict(num_key_value_heads=2, embedding_multiplier=6.0,
                                                        residual_multiplier=0.4, attention_multiplier=0.3,
                                                        logits_scaling=0.5, attention_bias=True)),
    # OLMo 2: norms after each sublayer, none before; q's and k's norms across all heads
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, dict(num_key_value_heads=2, rope_theta=500000.0)),
    # OLMo 3: a window on the first layer, which turns unscaled at a base of its own; YaRN on the other
    "olmo3": (Olmo3Config, Olmo3ForCausalLM, dict(
        num_key_value_heads=4, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                            "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})),
    # EXAONE 4: norms after each sublayer, Qwen3's per-head q and k norms, a windowed layer and a full
    # one that turns neither q nor k
    "exaone4": (Exaone4Config, Exaone4ForCausalLM, dict(num_key_value_heads=2, sliding_window=16,
                                                        sliding_window_pattern=2, rope_theta=1000000.0)),
    # Ministral 3: YaRN, and queries past position 32 scaled up (Llama 4's scaling, a beta that binds)
    "ministral3": (Ministral3Config, Ministral3ForCausalLM, dict(
        num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5})),
    # SmolLM3: the middle layer turns neither q nor k (NoPE)
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, dict(num_key_value_heads=2, num_hidden_layers=3,
                                                        no_rope_layers=[1, 0, 1], rope_theta=2000000.0)),
    # Helium: interleaved rotary, q/k/v and MLP biases (o_proj none; its heads span hidden_size)
    "helium": (HeliumConfig, HeliumForCausalLM, dict(num_key_value_heads=2, head_dim=16, attention_bias=True,
                                                     mlp_bias=True)),
    # Seed-OSS: q/k/v biases by default, o_proj's and the MLP's by their own flags
    "seed_oss": (SeedOssConfig, SeedOssForCausalLM, dict(num_key_value_heads=2, head_dim=32, attention_out_bias=True,
                                                         mlp_bias=True)),
    # Ernie 4.5: interleaved rotary, use_bias on every projection, tied by default
    "ernie4_5": (Ernie4_5Config, Ernie4_5ForCausalLM, dict(num_key_value_heads=2, head_dim=32, use_bias=True)),
    # Ernie 4.5 MoE: top-2 of 6 by softmax + a learned bias, weighted by the softmax; a shared expert;
    # layer 0 dense (moe_layer_start_index) and layer 2 (past moe_layer_end_index)
    "ernie4_5_moe": (Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, dict(
        num_key_value_heads=2, head_dim=32, num_hidden_layers=3, moe_num_experts=6, moe_k=2, moe_intermediate_size=32,
        moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=1)),
    # MiniMax-M2: top-2 of 6 by sigmoid + a learned bias, renormalized; q/k norms across heads; a
    # quarter of each head rotated (its rotary_dim)
    "minimax_m2": (MiniMaxM2Config, MiniMaxM2ForCausalLM, dict(num_key_value_heads=2, head_dim=32, rotary_dim=8,
                                                               num_local_experts=6, num_experts_per_tok=2,
                                                               intermediate_size=32)),
    # HunYuan dense: per-head q/k norms after the rotation; its rotary base raised by alpha
    "hunyuan_dense": (HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM, dict(
        num_key_value_heads=2, head_dim=32, rope_parameters={"rope_type": "dynamic", "alpha": 1000.0,
                                                             "factor": 1.0, "rope_theta": 10000.0})),
    # Granite 4 dense (granite-4.0-micro's shape): Granite's multipliers, its shared_mlp the MLP
    "granite4_dense": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, dict(
        num_key_value_heads=2, num_local_experts=0, layer_types=["attention"] * 2, position_embedding_type="rope",
        shared_intermediate_size=96, embedding_multiplier=6.0, residual_multiplier=0.5, logits_scaling=0.5,
        attention_multiplier=0.1)),
    # InternLM3: transformers' Llama under InternLM3's config (its hub names below); biases everywhere
    "internlm3": (InternLM3Config, LlamaForCausalLM, dict(num_key_value_heads=2, head_dim=32, attention_bias=True,
                                                         mlp_bias=True)),
    # Arcee: an MLP without a gate, squared ReLU, biased; Apertus: the same with xIELU (its slopes
    # learned per layer), Qwen3's q/k norms, its norms under its own names
    "arcee": (ArceeConfig, ArceeForCausalLM, dict(num_key_value_heads=2, mlp_bias=True)),
    "apertus": (ApertusConfig, ApertusForCausalLM, dict(num_key_value_heads=2, head_dim=32)),
    # Nemotron (Minitron): LayerNorm1P (a bias, 1 + weight), half of each head rotated, squared ReLU
    "nemotron": (NemotronConfig, NemotronForCausalLM, dict(num_key_value_heads=2, num_hidden_layers=3,
                                                           attention_bias=True, mlp_bias=True)),
}


def _internlm3_hub(config: dict) -> dict:
    """As InternLM3's hub config.json names its class and its biases."""
    rest = {k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias")}
    return {**rest, "architectures": ["InternLM3ForCausalLM"], "qkv_bias": config["attention_bias"],
            "bias": config["mlp_bias"]}


HUB_LAYOUTS = {"internlm3": _internlm3_hub}  # a checkpoint whose config.json transformers writes otherwise than the hub
QWEN_TOKENIZED = (Qwen2Config, Qwen3Config, Qwen2MoeConfig, Qwen3MoeConfig)  # transformers: Qwen2's tokenizer class


# ---- checkpoint construction --------------------------------------------------------------
# Qwen2 and Qwen3 checkpoints get Qwen2's pre-tokenizer (transformers' own regex). transformers 5's
# AutoTokenizer picks the tokenizer class from config.json's model_type, and Qwen2Tokenizer rebuilds
# its pre-tokenizer and NFC normalizer whatever tokenizer.json says; a real Qwen2 tokenizer.json has
# these, so the Qwen2 checkpoint gets them too (the engine reads tokenizer.json as it is).
def train_tokenizer(qwen2: bool = False) -> RawTokenizer:
    tok = RawTokenizer(models.BPE())
    if qwen2:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # every byte is a token, as in real byte-level vocabularies (any text encodes, "{" included)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert [tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>")] == [BOS, EOS, PAD]
    return tok


def save_harmony_tokenizer(path) -> HFTokenizer:
    """A byte-level BPE tokenizer at `path` with GPT-OSS's harmony markers as special tokens of
    their own (as in its tokenizer), `<|return|>` its EOS."""
    raw = train_tokenizer()
    raw.add_special_tokens(["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                            "<|call|>"])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="<|return|>").save_pretrained(path)
    return HFTokenizer(path)


@pytest.fixture(scope="module")
def tokenizers_by_kind() -> dict[bool, RawTokenizer]:
    return {False: train_tokenizer(), True: train_tokenizer(qwen2=True)}


def randomize(model: torch.nn.Module) -> None:
    """Weights with std WEIGHT_STD; norm weights near (not exactly) one and biases non-zero, so a
    parameter that is not loaded, or loaded into the wrong place, changes the logits (GLM-4.5's
    routing bias, a buffer, too)."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, WEIGHT_STD)
            elif param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, WEIGHT_STD)


def write_checkpoint(path, name: str, tokenizers_by_kind: dict[bool, RawTokenizer]):
    config_cls, model_cls, extra = CONFIGS[name]
    raw_tokenizer = tokenizers_by_kind[config_cls in QWEN_TOKENIZED]
    config = config_cls(**{**COMMON, **extra, "vocab_size": raw_tokenizer.get_vocab_size()})
    config._attn_implementation = "eager"  # the plainest reference math
    torch.manual_seed(sum(map(ord, name)))
    model = model_cls(config).eval()
    randomize(model)
    model.save_pretrained(path)
    if name in HUB_LAYOUTS:
        config_file = Path(path) / "config.json"
        config_file.write_text(json.dumps(HUB_LAYOUTS[name](json.loads(config_file.read_text()))))
    PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            add_bos_token=True).save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def ckpt(request, tmp_path_factory, tokenizers_by_kind):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), write_checkpoint(path, request.param, tokenizers_by_kind)


def rewrite_quantized(path: Path, tensors: dict, quantization_config: dict, dense: Path | None = None,
                      decompressed: dict | None = None) -> None:
    """Replace the checkpoint at `path`'s tensors with quantized `tensors` and its config's
    quantization_config; with `dense`, first write there the same checkpoint holding `decompressed`
    (the weights a reference decompresses the quantized ones to)."""
    from safetensors.torch import save_file

    if dense is not None:
        dense.mkdir()
        for file in path.iterdir():
            if file.name != "model.safetensors":
                (dense / file.name).write_bytes(file.read_bytes())
        save_file(decompressed, str(dense / "model.safetensors"))
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))


def prompt_ids(seed: int, length: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [BOS] + torch.randint(PAD + 1, vocab, (length - 1,), generator=g).tolist()


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()


NEW_TOKENS = 12


def generation_prompts(vocab: int) -> list[list[int]]:
    prompts = [prompt_ids(20 + i, n, vocab) for i, n in enumerate((3, 40, 9, 17, 26))]
    return prompts + [prompts[1][:20] + prompt_ids(99, 6, vocab)[1:]]  # shares a 2-block prefix


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int, **options) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=PAD, **options)
    return out[0, len(ids):].tolist()
