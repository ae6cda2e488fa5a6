import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU (set before any kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["tests.ray_cluster"]  # the shared local Ray head node and splitserve apps


def pytest_collection_modifyitems(config, items):
    # timing measurements first: before the shared Ray cluster holds other tests' apps and workers
    items.sort(key=lambda item: "quiet" not in item.keywords)  # stable: the order is kept otherwise
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
