"""glibc allocator settings for long CPU runs, and peak-memory readings. No-ops off glibc."""
import ctypes
import gc
import os
import sys

import torch


def peak_memory_gb(device: torch.device) -> float | None:
    """Peak memory so far: allocated GPU memory on CUDA, the process's peak RSS on Linux/macOS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
    except ImportError:                               # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)


def _glibc():
    """The C library when it is glibc (Linux), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
    except OSError:                                   # e.g. musl
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def limit_heap_fragmentation() -> None:
    """Serve allocations of 4 MiB and more (activations, KV caches) by mmap, which returns them
    to the OS when freed, instead of glibc's heap, whose free holes the varying shapes of each
    step cannot reuse. Same as MALLOC_MMAP_THRESHOLD_=4194304. Measured on the CPU demo, 4
    steps: peak RSS after step 4 7.25 -> 6.43 GiB, and step 4 took 81 s instead of 112 s."""
    libc = _glibc()
    if libc is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:   # the user's setting wins
        libc.mallopt(-3, 4 << 20)                     # -3 = M_MMAP_THRESHOLD


def release_memory() -> None:
    """Hand memory freed by the last phase (rollout, update, evaluation) back to the OS; glibc
    keeps freed heap blocks otherwise. Lowered the CPU demo's peak RSS from 9.7 to 7.7 GiB."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
