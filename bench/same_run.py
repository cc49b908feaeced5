"""bench/same_run.py: are two train.py runs the same run? Compares their metrics.jsonl value by
value, every step (timing/*, memory/* and rollout_tokens_per_s excepted: they measure the
machine, not the run). Used to show that a refactor changed no number:

    git checkout OLD && .venv/bin/python train.py --name before
    git checkout NEW && .venv/bin/python train.py --name after
    .venv/bin/python bench/same_run.py runs/before runs/after

Exit status 0 when every compared value is identical, 1 otherwise.
"""
import argparse
import json
import sys
from pathlib import Path

MACHINE = ("timing/", "memory/", "rollout_tokens_per_s")


def lines(run: Path) -> dict[int, dict]:
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l]
    merged = {}
    for row in rows:                                  # step 0 (eval before) and steps 1..N
        merged.setdefault(row["step"], {}).update(row)
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args(argv)
    a, b = lines(args.run_a), lines(args.run_b)
    differ, same = [], 0
    for step in sorted(set(a) | set(b)):
        keys = sorted((set(a.get(step, {})) | set(b.get(step, {}))) - {"step"})
        for key in keys:
            if key.startswith(MACHINE):
                continue
            va, vb = a.get(step, {}).get(key, "<missing>"), b.get(step, {}).get(key, "<missing>")
            if va == vb:
                same += 1
            else:
                differ.append(f"step {step} {key}: {va} != {vb}")
    for step in sorted(set(a) & set(b)):
        shown = {k: a[step][k] for k in ("reward", "pg_loss", "llds/loss", "lld/logp_correct",
                                         "lld/correct_displacement", "eval/em") if k in a[step]}
        print(f"step {step}: " + ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in shown.items()))
    print(f"{same} values identical, {len(differ)} differ" + (":" if differ else ""))
    for line in differ:
        print("  " + line)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
