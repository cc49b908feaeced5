"""plumbing: the engineering the teaching scripts call in one line, and a reader may skip.

The top-level scripts (llds.py, train.py, rollout.py, retriever.py, eval.py, data.py) hold the
method. Everything here is there to make them fast, robust or convenient, not to explain
anything: each module says what it speeds up or takes care of.

    fast_hf.py    CPU/GPU speed-ups of Hugging Face internals: a KV cache that grows in place,
                  SDPA sharing K/V heads, the shared-prefix forward, the one bf16 autocast check
    models.py     loading a policy; converting the embedded SmolLM2 GGUF once into an HF folder
    memory.py     glibc allocator settings and peak-memory readings
    runs.py       run folders: checkpoints and RNG state, metrics log, samples, prompt sampler
    plots.py      training curves of one run, or several overlaid
    cli.py        a config dataclass -> argparse flags whose --help is the field comments
    server.py     the hardened HTTP server behind `retriever.py serve`
    toy_world.py  the generator of data.py's synthetic "toy world" and its checks
"""
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models, toy worlds and indexes go ($LLDS_CACHE or ~/.cache/llds)."""
    return Path(os.environ.get("LLDS_CACHE", "~/.cache/llds")).expanduser()
