import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU (set before any kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["tests.ray_cluster"]  # the shared local Ray head node and splitserve apps


def pytest_collection_modifyitems(config, items):
    # Modules with a test on the shared Ray cluster last, so that it runs (and its idle apps take
    # CPU) only while they do; within each half, timing measurements (`quiet`) first, before the
    # cluster holds other tests' apps and workers. Stable: the order is kept otherwise.
    on_cluster = {item.module for item in items if "head_node" in item.fixturenames}
    items.sort(key=lambda item: (item.module in on_cluster, "quiet" not in item.keywords))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
