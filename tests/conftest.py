import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread each (inherited by the processes tests start): two workers' torch and OpenMP
    # threads on 2 cores spin against each other (test_model_vs_hf ran 14 times slower).
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU (set before any kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["tests.ray_cluster"]  # the shared local Ray head node and splitserve apps


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the `serial` marks added here
def pytest_collection_modifyitems(config, items):
    # Modules with a test on the shared Ray cluster last, so that it runs (and its idle apps take
    # CPU) only while they do; within each half, timing measurements (`quiet`) first, before the
    # cluster holds other tests' apps and workers. Stable: the order is kept otherwise. Both are
    # `serial`: the README's run leaves them out of its parallel part and runs them after it, alone.
    on_cluster = {item.module for item in items if "head_node" in item.fixturenames}
    items.sort(key=lambda item: (item.module in on_cluster, "quiet" not in item.keywords))
    for item in items:
        if item.module in on_cluster or "quiet" in item.keywords:
            item.add_marker(pytest.mark.serial)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
