#!/usr/bin/env bash
# The engine's and the KV transfer's GPU checks, for a session lent a GPU machine (an H100 or H200
# through the tool library's `device` entry: nothing can be fetched there, and its Python 3.12 lacks
# a few of splitserve's packages, which travel as wheels in the git-ignored .whl/).
#   bash scripts/gpu_check.sh wheels             # here, once: those packages into .whl/
#   bash scripts/gpu_check.sh tests [SECONDS [FILES...]]  # there (carry .whl): the kernels (compiled) and gpu
#                                                # tests (300 s; FILES: those files alone, in that order)
#   bash scripts/gpu_check.sh kernels            # there: scripts/bench_attention.py (the prefill tile configurations
#                                                # beside torch's FlashAttention-2, decode at 3 and 5 stages),
#                                                # scripts/bench_moe.py (gpt-oss-20b's and Qwen3-30B-A3B's
#                                                # experts), scripts/bench_fp8_linear.py (Qwen3-8B's
#                                                # projections), scripts/bench_sampler.py (the sampler's
#                                                # draw, torch and Triton), scripts/bench_penalties.py
#   bash scripts/gpu_check.sh bench [ARGS...]    # there: scripts/bench_gpu.py ARGS (e.g. --repeats 2)
#   bash scripts/gpu_check.sh lora               # there: scripts/bench_lora.py on a Llama-3-8B shape (a decode
#                                                # step on the base model, under 1 and 16 adapters; graphs
#                                                # replayed, then eager steps), in lora.log
#   bash scripts/gpu_check.sh int-linear         # there: scripts/bench_int_linear.py at 4 and 8 bits (Qwen3-8B's
#                                                # projections packed, group 128 with zero points, beside bf16)
#   bash scripts/gpu_check.sh all [ARGS...]      # there: tests (240 s), kernels (at most 275 s), then bench
#                                                # ARGS in what is left of 570 s
# Logs (tests.log with the device first), gpu.json, attention.json, moe-*.json and fp8-linear.json go to $OUT
# where it is set, else to gpu-check/: 8 files, the most a device call brings back.
# A session has 15 device minutes, the machine's start included, and a machine goes back 30 s after
# a call: `all --repeats 2` as one call of timeout_s 600 is the whole check in one start.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 llguidance==1.9.1"

install_carried() {
  [ -d /tmp/site/pydantic ] ||
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
}

out="${OUT:-gpu-check}"
case "${1:-}" in
  wheels)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    for spec in $WHEELS; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 \
        -d .whl "$spec"
    done
    ls .whl ;;
  tests)
    install_carried
    mkdir -p "$out"
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)"
    } | tee "$out/tests.log"
    # only the files that hold such tests (others import packages the image lacks: jsonschema), those
    # the issue names first: the run is cut at SECONDS; the slowest tests are listed, to plan the next
    first="tests/transfer/test_direct_link.py tests/engine/test_gpu_llama3.py tests/transfer/test_disaggregation.py"
    rest=$(grep -rlE "mark\.(gpu|kernels)|marks=pytest\.mark\.gpu" tests | sort | grep -vxF "${first// /$'\n'}")
    if [ $# -gt 2 ]; then first="${*:3}" rest=""; fi
    # SIGINT at the cut: pytest then still lists what failed so far
    timeout -s INT -k 30 "${2:-300}" python3 -m pytest -q -rfE --durations 15 --timeout 150 -m "gpu or kernels" -p no:cacheprovider \
      $first $rest 2>&1 | tee -a "$out/tests.log" ;;
  kernels)
    install_carried
    mkdir -p "$out"
    timeout 60 python3 scripts/bench_attention.py --json "$out/attention.json" 2>&1 | tee -a "$out/kernels.log"
    for shape in gpt-oss-20b qwen3-30b-a3b; do
      timeout 50 python3 scripts/bench_moe.py --shape $shape --json "$out/moe-$shape.json" 2>&1 | tee -a "$out/kernels.log"
    done
    timeout 65 python3 scripts/bench_fp8_linear.py --json "$out/fp8-linear.json" 2>&1 | tee -a "$out/kernels.log"
    # its table in kernels.log alone: a ninth file would not come back
    timeout 18 python3 scripts/bench_sampler.py --iters 20 --batches 1,16,32,64,256 2>&1 | tee -a "$out/kernels.log"
    timeout 12 python3 scripts/bench_sampler.py --iters 20 --batches 32,256 --warps 16 2>&1 | tee -a "$out/kernels.log"
    timeout 20 python3 scripts/bench_penalties.py --device cuda --iters 10 --batches 1,64,256 2>&1 | tee -a "$out/kernels.log" ;;
  bench)
    install_carried
    mkdir -p "$out"
    shift
    # a section past 400 s (or the --budget) is cut short, within the device's 600 s a command; each
    # section's rows are kept as it ends
    python3 scripts/bench_gpu.py --json "$out/gpu.json" --section-timeout 400 "$@" 2>&1 | tee "$out/bench.log" ;;
  lora)
    install_carried
    mkdir -p "$out"
    for graphs in 256 0; do  # decode steps replaying graphs (adapters by row), then eager (grouped by adapter)
      timeout 120 python3 scripts/bench_lora.py --shape llama3-8b --device cuda --batches 1,64 --spreads 0,1,16 \
        --repeats 2 --steps 10 --cuda-graph-max-batch "$graphs" 2>&1 | tee -a "$out/lora.log"
    done ;;
  int-linear)
    install_carried
    mkdir -p "$out"
    for bits in 4 8; do
      timeout 120 python3 scripts/bench_int_linear.py --bits $bits --json "$out/int$bits-linear.json" 2>&1 \
        | tee -a "$out/int-linear.log"
    done ;;
  all)
    shift
    status=0
    bash scripts/gpu_check.sh tests 240 || status=$?
    bash scripts/gpu_check.sh kernels || status=$?
    bash scripts/gpu_check.sh bench --budget $((570 - SECONDS)) "$@" || status=$?
    exit $status ;;
  *)
    echo "usage: bash scripts/gpu_check.sh wheels | tests [SECONDS [FILES...]] | kernels | bench [bench_gpu.py args] | lora | all [bench_gpu.py args]" >&2
    exit 2 ;;
esac
