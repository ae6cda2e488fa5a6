"""LoRA adapters by row (`model/triton_lora.py`, what a captured decode step runs) against the torch
path by row (`model.lora.add_rows_torch`) and that against the grouped path eager steps run: rows
under several slots, under none, merged projections of two and three uneven parts, ranks short of
the slots' (zero-padded). The kernels run under Triton's interpreter on CPU, compiled on CUDA
where it is (the `kernels` mark)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.model.lora import LoraSlots, LoraWeights, add_rows_torch  # noqa: E402
from splitserve.engine.model.triton_lora import add_rows  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def weights(parts: list[int], k: int, rank: int, slots: int, dtype: torch.dtype, seed: int = 0):
    """A [slots, parts * rank, k], B [slots, sum(parts), rank]; each slot's last rank column zero (a
    smaller adapter padded to the slots' rank)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, len(parts) * rank, k, generator=g) * 0.2
    b = torch.randn(slots, sum(parts), rank, generator=g) * 0.2
    b[..., -1] = 0
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parts, k, rank", [([48], 64, 8), ([32, 16], 40, 4), ([64, 16, 16], 200, 16),
                                            ([24, 8, 8], 130, 3)])
def test_the_kernels_add_each_rows_adapter_as_the_torch_path_does(dtype, parts, k, rank):
    a, b = weights(parts, k, rank, 3, dtype)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, k, generator=g) * 0.5).to(DEVICE, dtype)
    out = (torch.randn(7, sum(parts), generator=g) * 0.5).to(DEVICE, dtype)
    row_slots = torch.tensor([2, -1, 0, 2, 1, -1, 2], device=DEVICE)
    want = add_rows_torch(x, out.clone(), a, b, row_slots, parts)
    got = add_rows(x, out.clone(), a, b, row_slots, parts)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(got[row_slots < 0], out[row_slots < 0])  # a row under no adapter is left as it was


def test_rows_by_slot_equal_the_grouped_path_eager_steps_run():
    parts, k, rank = [32, 16, 16], 48, 8
    a, b = weights(parts, k, rank, 4, torch.float32, seed=2)
    slots = LoraSlots(4, rank)
    lora = LoraWeights(slots, a.cpu(), b.cpu(), parts)
    lora.live = {0, 1, 3}
    x, out = torch.randn(6, k), torch.randn(6, sum(parts))
    adapters = [1, -1, 3, 1, 0, -1]
    slots.set(adapters, list(range(7)), torch.device("cpu"))
    grouped = lora.add_to(x, out.clone())
    slots.rows = torch.tensor(adapters)
    by_row = lora.add_to(x, out.clone())
    torch.testing.assert_close(by_row, grouped, atol=1e-5, rtol=1e-5)
    assert not torch.equal(grouped, out)
