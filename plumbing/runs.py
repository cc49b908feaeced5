"""Run folders: checkpoints (atomic, resumable), RNG state, the metrics log, sample
trajectories, the prompt sampler. Nothing here changes what is computed."""
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch


def json_safe(x):
    """Non-finite floats -> None, in nested dicts too, so JSON files stay strict."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    return None if isinstance(x, float) and not math.isfinite(x) else x


def find_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names; if that is missing, the highest complete ckpt-<step>."""
    run_dir = Path(run_dir)
    pointer = run_dir / "latest"
    if pointer.exists() and (run_dir / pointer.read_text().strip() / "state.json").exists():
        return run_dir / pointer.read_text().strip()
    done = [p for p in run_dir.glob("ckpt-*") if (p / "state.json").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)
