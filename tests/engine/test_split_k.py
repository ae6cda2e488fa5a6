"""How a decode GEMM's launch splits over K (`model/split_k.py`); the split kernels themselves are
checked through the GEMMs that use them (test_fp8_linear, test_int_linear)."""
import torch

from splitserve.engine.model import split_k


def test_splits_fill_the_multiprocessors():
    """About two programs a multiprocessor, each split at least MIN_SPLIT_STEPS k tiles long."""
    assert split_k.split_count(32, 64, None) == 1  # not a GPU
    assert split_k.split_count(32, 64, 132) == 9  # o_proj of a 4096-wide model on an H100: 288 programs
    assert split_k.split_count(224, 64, 132) == 2
    assert split_k.split_count(300, 64, 132) == 1  # enough tiles already
    assert split_k.split_count(1, 6, 132) == 1  # too few k tiles to share
    assert split_k.split_count(1, 4096, 132) == split_k.MAX_SPLITS
    assert split_k.split_count(32, 64, 132, min_steps=16) == 4


def test_a_plan_reads_at_least_four_times_its_sums_in_weights():
    """A 16-row tile's sums are 64 bytes a column: a split reads 256 a column at least, 256 k
    columns of bytes (FP8) or 512 of half bytes (4-bit words); whole k tiles, none empty."""
    assert split_k.plan(32, 4096, 16, 64, 132, True, 1.0) == (8, 512)  # 9 splits of 64 k tiles: 8 tiles each
    assert split_k.plan(32, 2048, 16, 64, 132, True, 1.0) == (8, 256)  # 4 k tiles at least
    assert split_k.plan(32, 2048, 16, 64, 132, True, 0.5) == (4, 512)  # 8 tiles at least
    assert split_k.plan(32, 4096, 64, 64, 132, True, 0.5) == (2, 2048)  # 64 rows: 32 k tiles at least
    assert split_k.plan(32, 4096, 16, 64, 132, False, 1.0) == (1, 4096)  # a prefill tile never splits
    assert split_k.plan(split_k.COUNTERS + 1, 4096, 16, 64, 132, True, 1.0) == (1, 4096)  # more tiles than counters
    assert split_k.plan(32, 4096, 16, 64, 132, True, 1.0, splits=3) == (3, 1408)  # forced: the last split shorter
    assert split_k.plan(32, 100, 16, 32, None, True, 1.0) == (1, 128)  # not a GPU


def test_a_launch_that_does_not_split_stores_into_its_output():
    out = torch.empty(3, 5)
    assert split_k.partials(1, 3, 5, out) is out
    assert split_k.partials(4, 3, 5, out).shape == (4, 3, 5)
