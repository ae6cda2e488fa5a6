"""A sparse layer's routing in one launch (`model/moe_routing.py`), interpreted on CPU (compiled on
CUDA where it is), against `moe.route`'s torch ops."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.model import moe_routing  # noqa: E402
from splitserve.engine.model.moe import route  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])  # Qwen3-MoE's and Mixtral's, Qwen2-MoE's
@pytest.mark.parametrize("tokens, num_experts, top_k", [(1, 128, 8), (33, 8, 2), (7, 60, 4), (5, 32, 1), (3, 4, 4)])
def test_the_kernel_routes_as_the_torch_ops(dtype, renormalize, tokens, num_experts, top_k):
    g = torch.Generator().manual_seed(tokens * num_experts + top_k)
    logits = (torch.randn(tokens, num_experts, generator=g) * 3).to(dtype)
    weights, experts = moe_routing.route(logits.to(DEVICE), top_k, renormalize)
    expected_weights, expected_experts = route(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and experts.dtype == torch.int64
    assert torch.equal(experts.cpu(), expected_experts)  # most likely first
    torch.testing.assert_close(weights.cpu(), expected_weights, atol=1e-6, rtol=1e-5)


def test_ties_take_the_lower_expert_and_bad_top_k_is_refused():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]], device=DEVICE)
    weights, experts = moe_routing.route(logits, 2, True)
    assert experts.tolist() == [[1, 2]] and weights.cpu().tolist() == [[0.5, 0.5]]
    with pytest.raises(ValueError, match="top_k"):
        moe_routing.route(logits, 5, True)
    assert moe_routing.route(logits[:0], 2, True)[1].shape == (0, 2)
