"""compile_kernels.py compiles, with Triton's own compiler and no GPU, every kernel variant the CUDA
engine launches for the Llama-3-8B shape on sm_90 and sm_80: the start-up (kernel_warm_up and the
graph capture) compiles all of them, so a serving mix compiles none; none spills registers or needs
more shared memory than a block may have; a second start on the same Triton cache compiles nothing;
the prefill's query tiles are 128 rows on sm_90 and 64 on sm_80, its loop over the key tiles
every row sees whole issues fewer instructions than its masked loop, and both ask for a tile's K
and V a whole iteration before they wait for them (copy slack 1); an MoE shape's expert kernels
(GPT-OSS's read as MXFP4 bytes) and Gemma 2's variants (soft-capped scores, its norm, 256-dim
heads), over either cache, are compiled at start-up too, none spilling, Gemma's prefill copying
as far ahead where a third K and V buffer fits a block's shared memory (not an L40S's); an FP8
cache is widened by e4m3 conversion on sm_90 and bit moves on sm_80, and its decode asks for a tile
two iterations before it waits for it (5 stages), as a bf16 cache's decode does at 5 stages (what
bench_attention.py times against the engine's 3). With LoRA adapter slots, the
decode graphs' adapter kernels are compiled at start-up too, without spills. Without the
warm-up, serving compiles; in float32 the attention kernels spill: the script fails on both."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from splitserve.engine.attention.triton_paged import prefill_shared_bytes  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compile_kernels.py"
KERNELS = {"_add_rms_norm_kernel", "_rotary_kernel", "store_kv_kernel", "paged_decode_kernel", "merge_splits_kernel",
           "paged_prefill_kernel", "_gated_kernel", "draw_kernel"}


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory) -> Path:
    """One Triton cache for the module: a variant another test compiled is found, not compiled
    again. What the tests check does not depend on it (the script records a variant's phase when
    its process first meets it, cached or not)."""
    return tmp_path_factory.mktemp("triton-cache")


@pytest.fixture
def run(tmp_path, triton_cache):
    return lambda *args: _run(tmp_path, "--cache-dir", str(triton_cache), *args)


def _run(tmp_path, *args) -> tuple[int, dict]:
    out = tmp_path / "kernels.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out), *args], capture_output=True, text=True,
                          timeout=600)
    assert out.exists(), done.stderr[-3000:]
    return done.returncode, json.loads(out.read_text())["archs"]


def _files(folder: Path) -> list[Path]:
    return sorted(f.relative_to(folder) for f in folder.rglob("*") if f.is_file())


def test_the_start_up_compiles_every_variant_a_serving_mix_launches(run, triton_cache):
    code, archs = run("--steps", "40")
    assert code == 0 and set(archs) == {"sm_90", "sm_80"}
    for arch, report in archs.items():
        variants = report["variants"]
        assert not report["problems"]
        assert {v["kernel"] for v in variants} == KERNELS
        assert {v["phase"] for v in variants} == {"start-up"}
        splits = sorted(int(v["spec"].split("NUM_SPLITS=")[1].split()[0]) for v in variants
                        if v["kernel"] == "paged_decode_kernel")
        assert splits == [1, 2, 4, 8, 16], arch  # one variant per split count, whatever the step
        assert max(v["shared_bytes"] for v in variants) > 40_000 and all(v["registers"] > 0 for v in variants)
        [prefill] = [v for v in variants if v["kernel"] == "paged_prefill_kernel"]
        assert f"BLOCK_M={128 if arch == 'sm_90' else 64} " in prefill["spec"]
        whole, masked = prefill["loops"]  # one key tile each: the same dots, without and with the masks
        assert whole["mma"] == masked["mma"] > 0 and whole["instructions"] < masked["instructions"]
        assert whole["copy_slack"] == masked["copy_slack"] == 1, arch
        _check_prefill_shared(prefill, cache_bytes=2)
        # over a bf16 cache the decode keeps Triton's 3 stages: a tile asked for as it is waited for
        assert {loop["copy_slack"] for v in variants if v["kernel"] == "paged_decode_kernel" for loop in v["loops"]} \
            == {0}, arch

    compiled = _files(triton_cache)
    assert compiled
    code, warm = run("--steps", "0")
    assert code == 0
    for arch, report in warm.items():  # the same variants, all found in the cache: it gained no file
        assert {(v["kernel"], v["spec"]) for v in report["variants"]} == \
            {(v["kernel"], v["spec"]) for v in archs[arch]["variants"]}
    assert _files(triton_cache) == compiled


def _tile(spec: str, name: str = "BLOCK_M") -> int:
    return int(spec.split(f"{name}=")[1].split()[0])


def _check_prefill_shared(prefill: dict, cache_bytes: int) -> None:
    """The engine's estimate of the pipelined prefill's shared memory, which chooses its stages,
    bounds what Triton compiled (bfloat16 queries)."""
    tiles = (_tile(prefill["spec"], name) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_D"))
    assert prefill_shared_bytes(*tiles, q_bytes=2, cache_bytes=cache_bytes) >= prefill["shared_bytes"]


def test_an_moe_shape_compiles_its_expert_kernels_at_start_up(run):
    code, archs = run("--shape", "qwen3-30b-a3b", "--arch", "90", "--steps", "10")
    report = archs["sm_90"]
    assert code == 0 and not report["problems"]
    # its experts' kernels gate in their own pass: no dense MLP's
    assert {v["kernel"] for v in report["variants"]} == \
        KERNELS - {"_gated_kernel"} | {"_route_kernel", "_align_kernel", "gate_up_kernel", "down_kernel"}
    assert {v["phase"] for v in report["variants"]} == {"start-up"}
    moe = [v["spec"] for v in report["variants"] if v["kernel"] == "gate_up_kernel"]
    assert sorted(int(spec.split("BLOCK_M=")[1].split()[0]) for spec in moe) == [16, 64, 128]


@pytest.mark.parametrize("arch, kv_cache_dtype", [("90", "auto"), ("90", "fp8"), ("80", "auto"), ("80", "fp8"),
                                                  ("89", "auto")])
def test_gemma2_compiles_its_variants_at_start_up_without_spills(run, arch, kv_cache_dtype):
    code, archs = run("--shape", "gemma2-9b", "--arch", arch, "--steps", "10", "--kv-cache-dtype",
                       kv_cache_dtype)
    report = archs[f"sm_{arch}"]
    assert code == 0 and not report["problems"]
    assert {v["phase"] for v in report["variants"]} == {"start-up"}
    specs = {v["kernel"]: v["spec"] for v in report["variants"]}
    assert "SOFTCAP=True" in specs["paged_prefill_kernel"] and "BLOCK_N=32" in specs["paged_prefill_kernel"]
    assert "GEMMA=True" in specs["_add_rms_norm_kernel"]
    [prefill] = [v for v in report["variants"] if v["kernel"] == "paged_prefill_kernel"]
    # three buffers of 32 keys' 256-dim K and V and the query tile: 129 KiB, over an L40S's 99 KiB a block
    slack = 0 if (arch, kv_cache_dtype) == ("89", "auto") else 1
    assert {loop["copy_slack"] for loop in prefill["loops"]} == {slack}
    if slack:
        _check_prefill_shared(prefill, cache_bytes=1 if kv_cache_dtype == "fp8" else 2)


@pytest.mark.parametrize("arch", ["90", "80"])
def test_an_fp8_cache_compiles_its_variants_at_start_up_without_spills(run, arch):
    """The attention kernels widen e4m3 codes by the GPU's conversion from sm_89, by integer bit
    moves before (an A100 has no float8)."""
    code, archs = run("--kv-cache-dtype", "fp8", "--arch", arch, "--steps", "20")
    report = archs[f"sm_{arch}"]
    assert code == 0 and not report["problems"]
    assert {v["phase"] for v in report["variants"]} == {"start-up"}
    for v in report["variants"]:
        if v["kernel"] in ("paged_decode_kernel", "paged_prefill_kernel"):
            assert "FP8_KV=True" in v["spec"] and f"NATIVE_FP8={arch == '90'}" in v["spec"], v
        if v["kernel"] == "paged_decode_kernel":
            assert [loop["copy_slack"] for loop in v["loops"]] == [1], v


@pytest.mark.parametrize("arch", ["90", "80"])
def test_lora_adapter_slots_compile_their_kernels_at_start_up_without_spills(run, arch):
    """With adapter slots the decode graphs run every projection's adapters by row: the shrink and
    expand kernels are captured at start-up (a variant per projection's shape), serving compiles
    none, and none spills."""
    code, archs = run("--max-loras", "4", "--max-lora-rank", "16", "--arch", arch, "--steps", "10")
    report = archs[f"sm_{arch}"]
    assert code == 0 and not report["problems"]
    assert {v["phase"] for v in report["variants"]} == {"start-up"}
    assert {v["kernel"] for v in report["variants"]} == KERNELS | {"_shrink_kernel", "_expand_kernel"}


def test_the_decode_at_five_stages_asks_for_a_tile_a_whole_iteration_before_it_waits(run):
    code, archs = run("--arch", "90", "--steps", "0", "--decode-stages", "5")
    report = archs["sm_90"]
    decodes = [v for v in report["variants"] if v["kernel"] == "paged_decode_kernel"]
    assert code == 0 and not report["problems"] and len(decodes) == 5  # a variant per split count
    assert all(loop["copy_slack"] == 1 for v in decodes for loop in v["loops"])


def test_without_the_warm_up_serving_compiles_and_the_script_fails(run):
    code, archs = run("--arch", "90", "--steps", "40", "--no-warm-up")
    assert code == 1
    assert any("paged_prefill_kernel" in p and "first compiled while serving" in p for p in archs["sm_90"]["problems"])


def test_a_variant_that_spills_fails_the_script(run):
    code, archs = run("--arch", "80", "--dtype", "float32", "--steps", "0")
    assert code == 1
    spilled = [v for v in archs["sm_80"]["variants"] if v["spill_bytes"]]
    problems = archs["sm_80"]["problems"]
    assert spilled and all(any(v["kernel"] in p and "spilled" in p for p in problems) for v in spilled)


def test_gpt_oss_compiles_its_variants_at_start_up_without_spills(run):
    """Its experts read as MXFP4 bytes (their 64-row gate-up tile spilled on sm_80 until it took 32
    columns), and dequantized first (prefills: the tensors' 64- and 128-row variants, the
    dequantization); its windowed layers' 128 keys cap the warm-up's split counts at the power of
    two a serving step picks (they once compiled a 3-split decode nothing else launches)."""
    code, archs = run("--shape", "gpt-oss-20b", "--arch", "80", "--steps", "10")
    report = archs["sm_80"]
    assert code == 0 and not report["problems"]
    moe = [v["spec"] for v in report["variants"] if v["kernel"] in ("gate_up_kernel", "down_kernel")]
    assert sorted(_tile(spec) for spec in moe if "PACKED=True" in spec) == [16, 16, 64, 64]
    assert sorted(_tile(spec) for spec in moe if "PACKED=False" in spec) == [64, 64, 128, 128]
    assert sum(v["kernel"] == "_dequantize_packed_kernel" for v in report["variants"]) == 1
    assert {v["phase"] for v in report["variants"]} == {"start-up"}
    splits = sorted(int(v["spec"].split("NUM_SPLITS=")[1].split()[0]) for v in report["variants"]
                    if v["kernel"] == "paged_decode_kernel")
    assert splits == [1, 2, 4, 8, 16]


def test_fp8_experts_compile_where_triton_reads_float8_and_are_dense_elsewhere(run):
    """Qwen3-30B-A3B-FP8's experts and attention projections stay FP8 on sm_90 (their kernels, the
    W8A16 GEMM's once per tile shape, compiled at start-up, none spilling; its projections' few
    outputs split the decode tiles over K; prefills run both W8A8: the experts' 128-row variants
    multiply codes by codes, with no dequantization); on sm_80, where Triton has no e4m3, they are
    dequantized at load, so the dense experts' variants and cuBLAS."""
    code, archs = run("--shape", "qwen3-30b-a3b-fp8", "--steps", "10")
    assert code == 0 and not archs["sm_90"]["problems"] and not archs["sm_80"]["problems"]
    for arch, fp8 in (("sm_90", True), ("sm_80", False)):
        moe = [v["spec"] for v in archs[arch]["variants"] if v["kernel"] in ("gate_up_kernel", "down_kernel")]
        codes, tensors = ([_tile(spec) for spec in moe if f"FP8={kind}" in spec] for kind in (True, False))
        assert sorted(codes) == ([16, 16, 64, 64] if fp8 else []), arch
        assert sorted(tensors) == ([128, 128] if fp8 else [16, 16, 64, 64, 128, 128]), arch
        assert sorted(_tile(spec) for spec in moe if "W8A8=True" in spec) == ([128, 128] if fp8 else []), arch
        assert not any(v["kernel"] == "_dequantize_kernel" for v in archs[arch]["variants"]), arch
        for kernel in ("_quantize_kernel", "_w8a8_kernel"):
            assert sum(v["kernel"] == kernel for v in archs[arch]["variants"]) == fp8, (arch, kernel)
        gemm = sorted((v["spec"].split("BLOCK_M=")[1].split()[0], v["spec"].split("SPLIT=")[1].split()[0])
                      for v in archs[arch]["variants"] if v["kernel"] == "_fp8_matmul_kernel")
        assert gemm == ([("128", "False"), ("16", "True"), ("64", "True")] if fp8 else []), arch


def test_fp8_projections_compile_w8a8_where_the_gpu_has_fp8_tensor_cores(run):
    """Llama-3-8B FP8-dynamic's projections (one scale a row) on an L40S (sm_89: FP8 mma, 99 KiB of
    shared memory a block) and an H100: prefills quantize their activations and run the W8A8 GEMM
    (its weight scales applied once, after the k loop), both compiled at start-up, fitting, none
    spilling, the GEMM's loop on the FP8 tensor cores; nothing dequantizes the projections."""
    code, archs = run("--shape", "llama3-8b-fp8-dynamic", "--arch", "89", "--arch", "90", "--steps", "2")
    assert code == 0
    for arch in ("sm_89", "sm_90"):
        report = archs[arch]
        assert not report["problems"] and {v["phase"] for v in report["variants"]} == {"start-up"}
        gemm = [v for v in report["variants"] if v["kernel"] == "_w8a8_kernel"]
        assert len(gemm) == 1 and "W_SCALES=column" in gemm[0]["spec"] and gemm[0]["loops"][0]["mma"] > 0
        assert sum(v["kernel"] == "_quantize_kernel" for v in report["variants"]) == 1
        assert not any(v["kernel"] == "_dequantize_kernel" for v in report["variants"])


def test_packed_integer_projections_compile_the_integer_gemm_at_start_up(run):
    """Llama-3-8B W4A16's projections (4 bits, groups of 128, zero points) stay packed on sm_90 and
    sm_80: the integer GEMM's three tiles and its prefills' dequantization compiled at start-up,
    none spilling, nothing compiled while serving; every tile's loop runs on the tensor cores."""
    code, archs = run("--shape", "llama3-8b-w4a16", "--steps", "10")
    assert code == 0
    for arch, report in archs.items():
        assert not report["problems"] and {v["phase"] for v in report["variants"]} == {"start-up"}, arch
        gemm = {int(v["spec"].split("BLOCK_M=")[1].split()[0]): v for v in report["variants"]
                if v["kernel"] == "_int_matmul_kernel"}
        assert sorted(gemm) == [16, 64, 128] and all(v["loops"][0]["mma"] > 0 for v in gemm.values()), arch
        assert sum(v["kernel"] == "_int_dequantize_kernel" for v in report["variants"]) == 1, arch
