"""bench_gpu.py: every section runs end to end on the tiny CPU shape and writes its rows, and what
it counts per step (weights read, model FLOPs) agrees with `transformers`' own model."""
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """A script as a module (scripts are no package; they import their folder's others)."""
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # what pickling its functions for a spawned process looks up
    spec.loader.exec_module(module)
    return module


bench_gpu = load_script("bench_gpu")
gpu_roofline = load_script("gpu_roofline")
gpu_step_sections = load_script("gpu_step_sections")


def test_tiny_run_writes_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, str(SCRIPTS / "bench_gpu.py"), "--tiny", "--steps", "3", "--repeats", "1",
                    "--json", str(out)], check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["device"] == "cpu" and result["targets"] is None and result["throughput_ratio_vs_hf"] > 0
    assert result["throughput_floor_s"] is None and result["throughput_ratio_ceiling_vs_hf"] is None  # no CPU peak
    assert not [r for r in rows if "error" in r]
    for section, cache, pipelined in (("decode", "float32", True), ("decode-fp8", "fp8_e4m3", True),
                                      ("decode-sync", "float32", False)):
        decodes = [r for r in rows if r["section"] == section]
        assert {(r["batch"], r["context"]) for r in decodes} == {(1, 64), (4, 64), (1, 256), (4, 256)}
        assert {r["kv_cache"] for r in decodes} == {cache} and {r["async_scheduling"] for r in decodes} == {pipelined}
    # the same weights, the KV at a byte a value instead of four
    pairs = {(r["batch"], r["context"], r["section"]): r["bytes_per_step"] for r in rows if "decode" in r["section"]}
    for (batch, context, section), read in pairs.items():
        if section == "decode":
            kv = read - pairs[batch, context, "decode-fp8"]
            whole = gpu_roofline.decode_kv_bytes(bench_gpu.TINY, batch, context + 3 + 1.5, 4)  # warm 3, steps 3
            assert kv == pytest.approx(3 / 4 * whole)
    for section, backend in (("prefill", "torch"), ("prefill-triton", "triton")):  # on CPU auto is torch
        assert [(r["context"], r["attention"]) for r in rows if r["section"] == section] == [(128, backend),
                                                                                             (512, backend)]
    throughput = {r["engine"]: r for r in rows if r["section"] == "throughput"}
    assert set(throughput) == {"splitserve", "splitserve sampled", "transformers"}
    assert throughput["splitserve sampled"]["output_tokens"] == throughput["splitserve"]["output_tokens"]
    assert [(r["backend"], r["context"]) for r in rows if r["section"] == "transfer"] == [("ipc", 128), ("ipc", 512)]
    for row in (r for r in rows if r["section"].startswith("decode")):
        assert 0 < row["forward_ms"] < row["step_ms"] and 0 < row["outside_forward_ms"] < row["step_ms"]
    for row in rows:
        assert row["device"] == "cpu" and row.get("mbu") is None and row.get("mfu") is None  # no CPU peak
        assert row.get("step_ms", 1) > 0
        assert row["startup_s"] > 0 if row["section"] != "transfer" else "startup_s" not in row


def test_the_forward_clock_times_only_the_steps_after_a_reset():
    """Forwards of untimed (warm-up) steps are never closed; a reset drops them, so the first timed
    step's entry is its own forward alone and every entry pairs with its step."""
    class Runner:
        device = torch.device("cpu")

        def forward(self, seconds):
            time.sleep(seconds)

    runner = Runner()
    clock = gpu_step_sections.ForwardClock(runner)
    for _ in range(3):
        runner.forward(0.02)  # warm-up steps, not timed
    clock.reset()
    for seconds in (0.001, 0.002):
        runner.forward(seconds)
        clock.close_step()
    assert len(clock.steps) == 2 and clock.steps[0] < 0.01 and clock.steps[0] < clock.steps[1]


def test_a_spent_budget_skips_the_sections_left(tmp_path):
    subprocess.run([sys.executable, str(SCRIPTS / "bench_gpu.py"), "--tiny", "--budget", "30", "--json",
                    str(tmp_path / "gpu.json")], check=True, capture_output=True, timeout=120)
    rows = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert [r["section"] for r in rows] == list(bench_gpu.SECTIONS)
    assert all(r["skipped"].endswith("s of the --budget left") for r in rows)


def _die(model, s, args):
    os._exit(3)


def test_a_section_whose_process_dies_is_an_error_row_at_once(monkeypatch):
    monkeypatch.setitem(bench_gpu.SECTIONS, "dies", _die)
    start = time.monotonic()
    rows = bench_gpu.run_section("dies", "no-model", bench_gpu.settings(tiny=True), None, timeout=300)
    assert rows == [{"section": "dies", "error": "its process died (exit code 3)"}]
    assert time.monotonic() - start < 60


def test_the_peak_follows_the_device_name_and_flags_override_it():
    assert gpu_roofline.peaks("NVIDIA H100 80GB HBM3", None, None) == (3.35e12, 989e12)
    assert gpu_roofline.peaks("NVIDIA H200", None, None) == (4.8e12, 989e12)
    assert gpu_roofline.peaks("cpu", 1.0, 2.0) == (1e12, 2e12) and gpu_roofline.peaks("cpu", None, None) == (None, None)


def test_the_throughput_floor_is_the_prefills_flops_then_each_decode_steps_bytes_at_the_peaks():
    c, hbm, flops = bench_gpu.TINY, 1e12, 1e14
    weights = gpu_roofline.decode_weight_bytes(c, 4, 2)
    steps = [weights + gpu_roofline.decode_kv_bytes(c, 4, 32 + i, 2) for i in (1, 2)]  # tokens 2 and 3
    expected = 4 * gpu_roofline.prefill_flops(c, 32) / flops + sum(steps) / hbm
    assert gpu_roofline.throughput_floor_s(c, 4, 32, 3, 2, hbm, flops) == pytest.approx(expected, rel=1e-12)
    assert gpu_roofline.throughput_floor_s(c, 4, 32, 3, 2, None, flops) is None
    # Llama-3-8B's 64 x (512 + 256) on an H200: 0.47 s of prefill, 1.08 s of decode
    h200 = gpu_roofline.peaks("NVIDIA H200", None, None)
    assert gpu_roofline.throughput_floor_s(bench_gpu.LLAMA3_8B, 64, 512, 256, 2, *h200) == pytest.approx(1.55, abs=0.01)


def test_the_report_gives_each_throughput_row_its_share_of_the_floor_and_the_ratio_it_leaves():
    rows = [{"section": "throughput", "engine": "splitserve", "seconds": 3.0, "output_tokens_per_s": 100.0},
            {"section": "throughput", "engine": "transformers", "seconds": 6.0, "output_tokens_per_s": 50.0}]
    result = bench_gpu.report(rows, "NVIDIA H200", 4.8e12, 989e12, "llama3-8b", targets=True, throughput_floor=1.5)
    assert [r["floor_share"] for r in result["rows"]] == [0.5, 0.25]
    assert result["throughput_ratio_vs_hf"] == 2.0 and result["throughput_ratio_ceiling_vs_hf"] == 4.0
    assert result["targets"]["throughput_ge_5x_hf"] is False


def hf_model(c: dict) -> LlamaForCausalLM:
    config = LlamaConfig(**{k: v for k, v in c.items() if k != "architectures"})
    config._attn_implementation = "eager"  # attention as matmuls the FLOP counter sees
    return LlamaForCausalLM(config)


def test_the_weights_a_decode_step_reads_are_the_models_parameters_but_the_embedding():
    c = bench_gpu.TINY
    model = hf_model(c)
    read = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    assert gpu_roofline.decode_weight_bytes(c, batch=4, element=2) == 2 * (read + 4 * c["hidden_size"])


@pytest.mark.parametrize("n", [64, 200])
def test_prefill_flops_are_transformers_counted_flops_with_causal_attention_and_one_sampled_row(n):
    c = bench_gpu.TINY
    model = hf_model(c).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(3, c["vocab_size"], (1, n)))
    layers, heads, head = c["num_hidden_layers"], c["num_attention_heads"], c["hidden_size"] // c["num_attention_heads"]
    # transformers: full (not causal) attention, and the LM head on every position; norms count no FLOPs
    assert counter.get_total_flops() > layers * 4 * n * n * heads * head  # attention was counted
    expected = (counter.get_total_flops() - layers * 2 * n * n * heads * head
                - 2 * (n - 1) * c["vocab_size"] * c["hidden_size"] + layers * 2 * n * 2 * c["hidden_size"])
    assert gpu_roofline.prefill_flops(c, n) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("tiny, shape", [(True, "llama3-8b")] + [(False, shape) for shape in bench_gpu.SHAPES])
def test_every_prompt_length_fits_the_shapes_context(tiny, shape):
    # the engine takes a prompt only below max_model_len, which a model's context bounds (sections add 16)
    s = bench_gpu.settings(tiny, shape)
    longest = max(s["prefill"] + s["transfer"] + s["contexts"] + [s["prompt"] + s["output"]])
    assert longest + 16 <= s["config"]["max_position_embeddings"]
    assert s["prefill"] == ([128, 512] if tiny else [2048] if shape == "gemma2-9b" else [2048, 8192])  # 8k context


def hf_moe(kind: str):
    """A tiny transformers GPT-OSS (sinks, biases everywhere, a window) or Qwen2-MoE (a shared
    expert and its gate, q/k/v biases), and its config.json dict."""
    from transformers import GptOssConfig, GptOssForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256)
    if kind == "gpt_oss":
        config = GptOssConfig(**common, intermediate_size=32, head_dim=16, num_local_experts=4,
                              num_experts_per_tok=2, sliding_window=8)
        model = GptOssForCausalLM(config)
    else:
        config = Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, shared_expert_intermediate_size=48)
        model = Qwen2MoeForCausalLM(config)
    return model, {**json.loads(config.to_json_string()), "architectures": [type(model).__name__]}


@pytest.mark.parametrize("kind", ["gpt_oss", "qwen2_moe"])
def test_a_sparse_models_weights_are_transformers_parameters_but_the_embedding(kind):
    model, c = hf_moe(kind)
    params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    assert gpu_roofline.weight_bytes(c, element=2) == 2 * params  # every expert
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert gpu_roofline.weight_bytes(c, element=2, experts=1) == 2 * (params - experts * 3 / 4)  # 1 of 4


def test_mxfp4_experts_read_17_32_of_a_byte_a_weight():
    _, c = hf_moe("gpt_oss")
    quantized = {**c, "quantization_config": {"quant_method": "mxfp4"}}
    matrices = 2 * 4 * 3 * 64 * 32  # layers x experts x (gate, up, down) x hidden x width
    assert gpu_roofline.weight_bytes(c, 2) - gpu_roofline.weight_bytes(quantized, 2) == matrices * (2 - 17 / 32)


@pytest.mark.parametrize("kind, block", [("dense", [32, 32]), ("qwen2_moe", [32, 32]), ("dense", None)])
def test_fp8_weights_read_a_byte_a_weight_and_their_scales(kind, block):
    """Every projection's and expert's matrix (the shared expert's too; not the router, the
    embedding, the LM head) at a byte and a float32 scale per 32x32 block (scales of a row or a
    tensor not counted) instead of 2 bytes."""
    c = bench_gpu.TINY if kind == "dense" else hf_moe(kind)[1]
    model = hf_model(c) if kind == "dense" else hf_moe(kind)[0]
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if name.endswith("proj.weight") or (".experts." in name and "bias" not in name))
    quantized = {**c, "quantization_config": {"quant_method": "fp8", "weight_block_size": block}}
    saved = gpu_roofline.weight_bytes(c, 2) - gpu_roofline.weight_bytes(quantized, 2)
    assert saved == pytest.approx(matrices * (2 - 1 - (4 / 32 ** 2 if block else 0)), rel=1e-12)


def test_a_decode_reads_the_experts_its_tokens_hit_and_a_windowed_layers_window():
    _, c = hf_moe("gpt_oss")
    assert gpu_roofline.experts_hit(c, 1) == 2 and gpu_roofline.experts_hit(c, 4) == 4 * (1 - 1 / 2 ** 4)  # top 2 of 4
    assert gpu_roofline.decode_weight_bytes(c, 1, 2) == gpu_roofline.weight_bytes(c, 2, experts=2) + 64 * 2
    per_token = 2 * 2 * 16 * 2  # K and V, 2 KV heads of 16 dims, bf16
    assert c["layer_types"] == ["sliding_attention", "full_attention"]
    assert gpu_roofline.decode_kv_bytes(c, 3, 100, 2) == 3 * per_token * (8 + 100)


def test_a_pair_whose_worker_dies_raises_instead_of_waiting():
    with pytest.raises(RuntimeError, match="a worker process ended"):  # kv_pair.Pair, as bench_gpu imports it
        bench_gpu.Pair("demo", "gloo", {"device": "cpu", "max_model_len": -1})
