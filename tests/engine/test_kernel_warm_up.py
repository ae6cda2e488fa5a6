"""kernel_warm_up on a tiny model under Triton's interpreter: one step per decode split count, each
attending its decode with that many splits, nothing stored in the KV cache, the backend's own
`num_splits` kept; no steps for the torch backend; an MoE model's experts once per tile size; the
sampler's filter kernel once over the vocabulary. That
these steps leave no variant to compile while serving is checked compiled, for sm_90 and sm_80, in
tests/scripts/test_compile_kernels.py."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.attention.triton_paged import TritonPagedBackend, split_counts  # noqa: E402
from splitserve.engine.kernel_warm_up import warm_up  # noqa: E402
from splitserve.engine.llm import LLM  # noqa: E402

pytestmark = pytest.mark.kernels
ENGINE = {"num_kv_blocks": 64, "max_model_len": 512}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the kernels run


def _spy_splits(backend, monkeypatch) -> list[int]:
    """The split count of each decode the backend attends (once per layer)."""
    seen, real = [], backend._splits

    def splits(*args):
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(backend, "_splits", splits)
    return seen


@pytest.mark.parametrize("fixed", [None, 2])
def test_one_step_per_split_count_and_nothing_stored(monkeypatch, caplog, fixed):
    runner = LLM("demo", attention_backend="triton", **ENGINE).engine.runner
    runner.backend = TritonPagedBackend(block_m=16, block_n=16, num_splits=fixed)  # small tiles: a quick interpreter
    layers = runner.model.config.num_hidden_layers
    seen = _spy_splits(runner.backend, monkeypatch)
    runner.kv_cache.layers()[0].normal_()
    before = [layer.clone() for layer in runner.kv_cache.layers()]
    with caplog.at_level(logging.INFO, logger="splitserve.engine"):
        warm_up(runner)
    expected = split_counts() if fixed is None else [fixed]
    assert f"{len(expected)} warm-up steps (decode split counts {expected})" in caplog.text
    assert seen == [s for s in expected for _ in range(layers)]
    assert runner.backend.num_splits == fixed
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_cache.layers()))


def test_the_torch_backend_has_no_steps_and_the_sampler_draws_from_a_row_of_the_vocabulary(monkeypatch):
    from splitserve.engine import triton_sampling

    runner = LLM("demo", attention_backend="torch", **ENGINE).engine.runner
    monkeypatch.setattr(runner, "forward", lambda batch: pytest.fail("a warm-up step ran"))
    drawn, real = [], triton_sampling.draw

    def spy(logits, rows, temperatures, top_k, top_p, min_p, uniforms, token_ids):
        real(logits, rows, temperatures, top_k, top_p, min_p, uniforms, token_ids)
        drawn.append((tuple(logits.shape), top_k, top_p, min_p, 0 <= token_ids.item() < logits.shape[1]))

    monkeypatch.setattr(triton_sampling, "draw", spy)
    warm_up(runner)
    assert drawn == [((1, runner.model.config.vocab_size), [1], [0.5], [0.1], True)]  # every filter on



@pytest.mark.parametrize("kept, max_tokens", [(None, None), ("fp8", None), ("fp8", 512), ("fp8", 511),
                                              ("int", None)])
def test_moe_experts_run_once_per_tile_size_whatever_the_backend(tmp_path, monkeypatch, kept, max_tokens):
    """Each tile size once; experts kept FP8 or packed integers (built as on an H100) read as
    stored in the 16- and 64-row tiles, and dequantized first, as prefills run them, in the 128-row
    one, unless the engine's largest step cannot reach DEQUANTIZE_ASSIGNMENTS an expert (512 tokens
    x top 2 over 8 experts: 128 an expert)."""
    from tests.engine.hf_checkpoints import ENGINE_ARGS, train_tokenizer, write_checkpoint
    from tests.engine.test_fp8 import quantize_checkpoint
    from tests.engine.test_int_weights import pack_checkpoint

    from splitserve.engine import fp8, int_weights
    from splitserve.engine.model import fused_moe

    write_checkpoint(tmp_path, "qwen3_moe", {False: train_tokenizer(), True: train_tokenizer(qwen2=True)})
    if kept == "int":
        pytest.importorskip("compressed_tensors")
        pack_checkpoint(tmp_path, 4, False, 16)
    elif kept:
        quantize_checkpoint(tmp_path)
    if kept:
        monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))
    # the torch attention backend (the CUDA default is Triton's): no warm-up steps, the experts still
    runner = LLM(str(tmp_path), **{**ENGINE_ARGS, "device": DEVICE.type, "attention_backend": "torch"}).engine.runner
    monkeypatch.setattr(runner, "forward", lambda batch: pytest.fail("a warm-up step ran"))
    tiles, real = [], fused_moe.fused_experts

    def spy(x, w13, w2, weights, experts, block_m=None, act=None, b13=None, dequantize_first=None, b2=None):
        tiles.append((block_m, dequantize_first))
        assert experts.shape == (1, 2) and w13.shape[0] == 8  # the model's top-k of its 8 experts
        assert isinstance(w13, {None: torch.Tensor, "fp8": fp8.Stacked, "int": int_weights.Stacked}[kept])
        return real(x, w13, w2, weights, experts, block_m, act, b13, dequantize_first, b2=b2)

    monkeypatch.setattr(fused_moe, "fused_experts", spy)
    warm_up(runner, max_tokens)
    as_stored = [(16, False), (64, False)]  # codes as read: no 128-row tile
    dequantized = [(128, True)] if max_tokens != 511 else []  # from 128 an expert: the 128-row tile only
    assert tiles == (as_stored + dequantized if kept else as_stored + [(128, False)])


@pytest.mark.parametrize("max_tokens", [None, 511])
def test_fp8_projections_run_once_per_launch_shape(tmp_path, monkeypatch, max_tokens):
    """A Qwen3 FP8 checkpoint built as on an H100: each shape of its projections (QKV, o_proj,
    gate-up, down) runs the W8A16 GEMM once at a token count of each tile shape, and once at
    prefills' (W8A8, or the weight dequantized first), unless the engine's largest step is shorter;
    equal shapes once."""
    from tests.engine.hf_checkpoints import ENGINE_ARGS, train_tokenizer, write_checkpoint
    from tests.engine.test_fp8 import quantize_checkpoint

    from splitserve.engine import fp8
    from splitserve.engine.model import fp8_linear

    write_checkpoint(tmp_path, "qwen3_qk_norm", {False: train_tokenizer(), True: train_tokenizer(qwen2=True)})
    quantize_checkpoint(tmp_path)
    monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))
    # the torch attention backend (the CUDA default is Triton's): no warm-up steps, the projections still
    runner = LLM(str(tmp_path), **{**ENGINE_ARGS, "device": DEVICE.type, "attention_backend": "torch"}).engine.runner
    monkeypatch.setattr(runner, "forward", lambda batch: pytest.fail("a warm-up step ran"))
    launches, real = [], fp8_linear.matmul

    def spy(x, weight, scale, block):
        launches.append((x.shape[0], tuple(weight.shape)))
        return real(x, weight, scale, block)

    monkeypatch.setattr(fp8_linear, "matmul", spy)
    warm_up(runner, max_tokens)
    shapes = {(128 + 64 + 64, 64), (64, 128)}  # [out, in]: QKV and gate-up alike (256 rows), o_proj and down alike
    examples = [16, 64, 65] + ([fp8_linear.PREFILL_TOKENS] if max_tokens is None else [])
    assert sorted(launches) == sorted((t, s) for s in shapes for t in examples)
    assert fp8_linear.tile_examples(max_tokens) == examples
    assert fp8_linear.tile_examples(fp8_linear.PREFILL_TOKENS) == [16, 64, 65, fp8_linear.PREFILL_TOKENS]



def test_packed_integer_projections_run_once_per_launch_shape(tmp_path, monkeypatch):
    """A Qwen3 W4A16 checkpoint built as on a GPU: each shape of its projections runs the integer
    GEMM once at a token count of each tile shape and once at prefills' (the weight dequantized)."""
    pytest.importorskip("compressed_tensors")
    from tests.engine.hf_checkpoints import ENGINE_ARGS, train_tokenizer, write_checkpoint
    from tests.engine.test_int_weights import pack_checkpoint

    from splitserve.engine import fp8
    from splitserve.engine.model import int_linear

    write_checkpoint(tmp_path, "qwen3_qk_norm", {False: train_tokenizer(), True: train_tokenizer(qwen2=True)})
    pack_checkpoint(tmp_path, 4, False, 16)
    monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))
    runner = LLM(str(tmp_path), **{**ENGINE_ARGS, "device": DEVICE.type, "attention_backend": "torch"}).engine.runner
    launches, real = [], int_linear.matmul

    def spy(x, packed, scale, zero, scheme):
        launches.append((x.shape[0], packed.shape[0]))
        return real(x, packed, scale, zero, scheme)

    monkeypatch.setattr(int_linear, "matmul", spy)
    warm_up(runner, None)
    examples = [16, 64, 65, int_linear.PREFILL_TOKENS]
    assert sorted(launches) == sorted((t, rows) for rows in (256, 64) for t in examples)
