"""Assignments grouped by expert in whole tiles (`model/moe_align.py`): the one-launch Triton
kernel (interpreted on CPU, compiled on CUDA where it is) against the torch ops, and what both
must hold."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.model import moe_align  # noqa: E402
from splitserve.engine.model.fused_moe import BLOCK_M_SIZES  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def routing(tokens: int, top_k: int, num_experts: int, seed: int, skew: bool = False) -> torch.Tensor:
    """[tokens, top_k] distinct experts a token (as topk picks them); `skew`: most on a few experts."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=g)
    if skew:
        scores[:, :3] += 1.0
    return scores.topk(top_k, dim=-1).indices


@pytest.mark.parametrize("block_m", BLOCK_M_SIZES)
@pytest.mark.parametrize("tokens, top_k, num_experts", [
    (1, 8, 128),    # one decode of Qwen3-30B-A3B: most experts idle
    (64, 8, 128),   # a decode batch: 512 assignments, many chunks
    (37, 2, 8),     # Mixtral: every expert busy, groups of many tiles
    (5, 4, 60),     # Qwen1.5-MoE's 60 experts: lanes past the last expert
    (300, 4, 32),   # gpt-oss-20b: 1200 assignments
    (3, 1, 6),      # top 1
])
def test_the_kernel_gives_the_torch_ops_tensors(block_m, tokens, top_k, num_experts):
    for skew in (False, True):
        experts = routing(tokens, top_k, num_experts, seed=tokens + top_k, skew=skew)
        sorted_ids, block_expert = moe_align.align(experts.to(DEVICE), num_experts, block_m)
        expected = moe_align.align_reference(experts, num_experts, block_m)
        assert torch.equal(sorted_ids.cpu(), expected[0]) and torch.equal(block_expert.cpu(), expected[1])


@pytest.mark.parametrize("implementation", ["kernel", "torch"])
@pytest.mark.parametrize("block_m", BLOCK_M_SIZES)
def test_align_groups_every_assignment_once_in_whole_tiles(block_m, implementation):
    ids = torch.tensor([[2, 0], [2, 5], [0, 2], [5, 1]])
    align = moe_align.align if implementation == "kernel" else moe_align.align_reference
    sorted_ids, block_expert = (t.cpu() for t in align(ids.to(DEVICE), 6, block_m))
    count, flat = ids.numel(), ids.flatten()
    assert sorted_ids.numel() % block_m == 0 and block_expert.numel() == sorted_ids.numel() // block_m
    assert sorted(sorted_ids[sorted_ids < count].tolist()) == list(range(count))
    for tile, expert in enumerate(block_expert.tolist()):
        rows = sorted_ids[tile * block_m:(tile + 1) * block_m]
        real = rows[rows < count]
        if expert == 6:  # past the groups: padding only
            assert real.numel() == 0
        else:
            assert real.numel() > 0 and (flat[real.long()] == expert).all()
            assert real.tolist() == sorted(real.tolist())  # in assignment order
    groups = [e for e in block_expert.tolist() if e < 6]
    assert groups == sorted(groups) == [0, 1, 2, 5]  # one tile each, in expert order; 3 and 4 idle


def test_all_on_one_expert_no_assignments_and_the_torch_ops_beyond_the_bound(monkeypatch):
    one = torch.full((40, 1), 3)
    for got, expected in zip(moe_align.align(one.to(DEVICE), 4, 16), moe_align.align_reference(one, 4, 16)):
        assert torch.equal(got.cpu(), expected)
    sorted_ids, block_expert = moe_align.align(torch.empty((0, 2), dtype=torch.long, device=DEVICE), 4, 16)
    assert sorted_ids.numel() == block_expert.numel() == 0
    launches = []
    monkeypatch.setattr(moe_align, "FUSED_ASSIGNMENTS", 15)
    monkeypatch.setattr(moe_align, "align_reference", lambda *a: launches.append(a) or ("torch",))
    assert moe_align.align(torch.zeros((8, 2), dtype=torch.long), 4, 16) == ("torch",) and len(launches) == 1
    moe_align.align(torch.zeros((7, 2), dtype=torch.long, device=DEVICE), 4, 16)  # 14: the kernel
    assert len(launches) == 1
