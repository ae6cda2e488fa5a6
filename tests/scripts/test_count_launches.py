"""scripts/count_launches.py: the kernels a decode step's forward launches on a GPU, counted on the
CPU through the model's own code."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_launches.py"


def test_a_dense_and_a_sparse_layer_launch_what_the_cuda_path_does(tmp_path):
    out = tmp_path / "launches.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "qwen3-8b,qwen3-30b-a3b,gpt-oss-20b", "--batch",
                           "4", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    dense, sparse, biased = json.loads(out.read_text())["rows"]
    # two norms, QKV, the rotary (Qwen3's q and k norms inside it), the KV store, attention, O, gate-up, the
    # gated activation, down
    assert dense["layer_kernels"] == {"_add_rms_norm_kernel": 2, "_rotary_kernel": 1, "store_kv_kernel": 1,
                                      "paged_decode_kernel": 1, "aten.linear": 4, "_gated_kernel": 1}
    # the router and the routing, the grouping, the experts' two kernels and the sum over each token's experts
    assert sparse["layer_kernels"] == {"_add_rms_norm_kernel": 2, "_rotary_kernel": 1, "store_kv_kernel": 1,
                                       "paged_decode_kernel": 1, "aten.linear": 3, "_route_kernel": 1,
                                       "_align_kernel": 1, "gate_up_kernel": 1, "down_kernel": 1, "aten.sum": 1}
    # GPT-OSS's biases (router, experts' gate-up and down, O) all inside those launches
    assert biased["layer_kernels"] == sparse["layer_kernels"]
    assert dense["per_layer"] == 10 and sparse["per_layer"] == 13
    assert dense["outside_kernels"] == sparse["outside_kernels"] == {"aten.embedding": 1, "_add_rms_norm_kernel": 1}
