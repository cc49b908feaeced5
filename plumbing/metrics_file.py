"""A run's metrics.jsonl read back, one dict a line, with the names and signs older runs logged
mapped to today's, so the committed runs of experiments/ and a run of today read alike."""
import json
from pathlib import Path

# old name -> (name now, sign). The correct responses' displacement was logged as after - before
# (< 0: lost); it is d = before - after now (> 0: lost), llds.py's sign.
RENAMED = {"lld/displacement_correct": ("lld/correct_displacement", -1),
           "lld/displacement_correct_search": ("lld/correct_displacement_search", -1),
           "lld/displacement_correct_answer": ("lld/correct_displacement_answer", -1),
           "lld/frac_correct_fell": ("lld/correct_frac_lost", 1)}


def read_metrics(run_dir: Path) -> list[dict]:
    """<run_dir>/metrics.jsonl as a list of dicts, every old name and sign mapped to today's."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} not found; pass the folder of a run (e.g. runs/demo)")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line]
    for line in lines:
        for old, (new, sign) in RENAMED.items():
            if old in line:
                value = line.pop(old)
                line[new] = None if value is None else sign * value
    return lines
