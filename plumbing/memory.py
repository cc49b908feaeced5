"""glibc allocator settings for long CPU runs (no-ops off glibc), and memory readings: the peak so
far, and peaks per phase (bench/gpu_check.py; on a CPU they read Linux's /proc)."""
import contextlib
import ctypes
import gc
import os
import re
import sys

import torch


def peak_memory_gb(device: torch.device, reserved: bool = False) -> float | None:
    """Peak memory so far: allocated (reserved: held by the allocator, what an OOM is about) GPU
    memory on CUDA, the process's peak RSS on Linux/macOS."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_reserved if reserved else torch.cuda.max_memory_allocated)(device) / 2**30
    try:
        import resource
    except ImportError:                               # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)


def peaks(device: torch.device) -> dict:
    """memory/peak_gb and memory/peak_reserved_gb so far (peak_memory_gb; = RSS on a CPU)."""
    return {"memory/peak_gb": peak_memory_gb(device),
            "memory/peak_reserved_gb": peak_memory_gb(device, reserved=True)}


def reset_peak(device: torch.device) -> None:
    """Start measuring a new peak (phase_peak): CUDA's peak counters, or on Linux the process's
    RSS high-water mark (written to /proc/self/clear_refs, it restarts at the current RSS)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def phase_peak(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) peak bytes since reset_peak on CUDA; on a CPU the RSS high-water mark twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return _status_bytes("VmHWM"), _status_bytes("VmHWM")


def memory_now(device: torch.device) -> int:
    """Bytes allocated now on CUDA; the process's RSS on a CPU (Linux)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (Linux), in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def _glibc():
    """The C library when it is glibc (Linux), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
    except OSError:                                   # e.g. musl
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def configure_allocator(device: torch.device) -> None:
    """Process-wide settings read when the device's allocator or oneDNN first runs, so called once,
    before the first allocation (the user's own settings win). On CUDA: expandable segments, so the
    changing shapes of KV buffers and micro-batches do not fragment the memory into an OOM. On a
    CPU: oneDNN's caches bounded (bound_onednn_caches)."""
    if device.type == "cuda":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    else:
        bound_onednn_caches()


def bound_onednn_caches(entries: int = 64) -> None:
    """A CPU's bf16 matmuls run in oneDNN, and two caches keep up to 1,024 of them each, a shape
    each (oneDNN's primitives, and PyTorch's ideep computations), with buffers: every new sequence
    length adds entries. 1,198 new row counts through one SmolLM2 weight (576 x 1536) added 737 MiB
    of RSS, and 109 MiB with 64 entries each (no more after the first 64); with no cache at all a
    64-row call took 2.3x as long. 64 entries keep the decode loop's few shapes (one row count,
    one per weight shape) cached, so its calls cost the same (373 against 404 us), and bound the
    rest: the bf16 CPU demo (seed 4) peaked at 5.50 GiB instead of 6.72, at 64 s a step instead of
    75, with the same results. Read when oneDNN first runs: call before any bf16 matmul. The user's
    settings win."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(entries))


def reuse_freed_memory() -> None:
    """Serve allocations below 1 GiB from glibc's heap, which reuses freed blocks, instead of by
    mmap, which hands each freed block back to the OS, so the next one faults in fresh zeroed
    pages. Same as MALLOC_MMAP_THRESHOLD_=1073741824. One step of the CPU demo, the same tokens,
    OMP_NUM_THREADS=1 on a shared machine (/usr/bin/time -v): against the 4 MiB threshold used
    before, minor page faults 18.2 M -> 4.6 M, system time 34 -> 13 s, step 304 -> 262 s
    (rollout 91 -> 61 s), peak RSS 5.88 -> 6.09 GB. (The 4 MiB threshold had beaten glibc's
    dynamic default: steps 114 -> 89 s.) release_memory() still trims the heap after each phase."""
    libc = _glibc()
    if libc is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:   # the user's setting wins
        libc.mallopt(-3, 1 << 30)                     # -3 = M_MMAP_THRESHOLD


@contextlib.contextmanager
def rss_follows_live_tensors(device: torch.device):
    """On a CPU, glibc maps each block over 64 KiB on its own and unmaps it when freed, so RSS
    follows the live tensors (what a memory plan counts), not the freed blocks the heap of
    reuse_freed_memory keeps (in the 4.9M-parameter smoke: an update of 0.56 against 0.77-0.81 GiB).
    The heap's setting returns after. On CUDA, allocated memory already is that: nothing to do."""
    libc = _glibc() if device.type == "cpu" else None
    if libc is None:
        yield
        return
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"    # and reuse_freed_memory leaves it so
    libc.mallopt(-3, 65536)                           # -3 = M_MMAP_THRESHOLD
    try:
        yield
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
        libc.mallopt(-3, int(saved) if saved else 1 << 30)


def release_memory() -> None:
    """Hand memory freed by the last phase (rollout, update, evaluation) back to the OS; glibc
    keeps freed heap blocks otherwise. Lowered the CPU demo's peak RSS from 9.7 to 7.7 GiB."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
