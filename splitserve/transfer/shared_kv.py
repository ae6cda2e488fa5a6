"""A KV cache that another process on the same node maps into its own address space.

CUDA: an IPC handle of the cache's allocation (any CUDA memory can be shared; the opener must see
the device, which it finds by UUID: two processes number their visible devices differently).
CPU: the cache's storage moves, in place, into shared memory kept by torch's shm manager, which
unlinks it when the last process holding it exits (so a crash leaks nothing); tensors viewing the
cache stay valid.

Whether another process can map a CUDA cache depends on the platform (a sandboxed runtime or a
driver may refuse CUDA IPC), so `mapping_refused` tries it once in a child process.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch


SHM_DIR = "/dev/shm"  # where torch's shared memory lives on Linux
# the child of mapping_refused: maps the cache and reads one element through the mapping
_MAP_AND_READ = ("import pickle, sys\n"
                 "from splitserve.transfer.shared_kv import open_shared\n"
                 "open_shared(pickle.load(sys.stdin.buffer)).view(-1)[:1].cpu()\n")


@dataclass(frozen=True)
class SharedCache:
    """What another process needs to map a cache tensor (picklable)."""

    device_uuid: str | None  # None: host memory
    handle: tuple  # CUDA: UntypedStorage._share_cuda_(); CPU: _share_filename_cpu_()
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


def memory_domain() -> str:
    """Processes with the same domain can map each other's memory: one boot of one machine, and
    one /dev/shm and temp directory (a container with its own mounts is another domain)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = os.uname().nodename
    mounts = [os.stat(path) for path in (SHM_DIR, tempfile.gettempdir()) if os.path.exists(path)]
    identity = f"{boot}|" + "|".join(f"{s.st_dev}:{s.st_ino}" for s in mounts)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def visible_devices() -> tuple[str, ...]:
    """UUIDs of the CUDA devices this process sees, in its own numbering."""
    if not torch.cuda.is_available():
        return ()
    return tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))


def share(data: torch.Tensor) -> SharedCache:
    storage = data.untyped_storage()
    if data.device.type == "cuda":
        uuid = str(torch.cuda.get_device_properties(data.device).uuid)
        handle = storage._share_cuda_()
    else:
        uuid = None
        free = shutil.disk_usage(SHM_DIR).free if os.path.isdir(SHM_DIR) else 0
        if not storage.is_shared() and storage.nbytes() > free:  # past it, a write would kill the process (SIGBUS)
            raise ValueError(f"a KV cache of {storage.nbytes() / 2**20:.0f} MiB does not fit in {SHM_DIR} "
                             f"({free / 2**20:.0f} MiB free): give the worker more shared memory, a smaller "
                             "cache, or the gloo transfer backend")
        handle = storage._share_filename_cpu_()  # in place: views of `data` now see shared memory
    return SharedCache(uuid, tuple(handle), tuple(data.shape), tuple(data.stride()), data.storage_offset(), data.dtype)


def open_shared(shared: SharedCache) -> torch.Tensor:
    """The other process's cache, mapped here; raises ValueError when this process cannot see it."""
    if shared.device_uuid is None:
        storage = torch.UntypedStorage._new_shared_filename_cpu(*shared.handle)
    else:
        devices = visible_devices()
        if shared.device_uuid not in devices:
            raise ValueError(f"CUDA device {shared.device_uuid} is not visible to this process (it sees {devices})")
        _, *rest = shared.handle  # the sharer's own device index means nothing here
        storage = torch.UntypedStorage._new_shared_cuda(devices.index(shared.device_uuid), *rest)
    with torch.inference_mode(False):  # written into in and outside forward passes
        view = torch.empty(0, dtype=shared.dtype, device=storage.device)
        return view.set_(storage, shared.offset, shared.shape, shared.stride)


def mapping_refused(shared: SharedCache, timeout: float) -> str | None:
    """None when another process maps the cache and reads through it; else why not (the child's
    last error line, or that it took longer than `timeout` seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's packages
    try:
        child = subprocess.run([sys.executable, "-c", _MAP_AND_READ], input=pickle.dumps(shared), env=env,
                               capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"a process mapping it took over {timeout:.0f} s"
    if child.returncode == 0:
        return None
    lines = child.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"a process mapping it exited with {child.returncode}"
