"""The late spiral's pilot table, from committed run folders alone (prereg.md §3).

    .venv/bin/python experiments/late_spiral/late_study.py

A run *breaks down* by the spiral study's rule (`spiral_study.breakdown_onset`). It *learned first*
when, before the onset, a 3-step mean training reward R(s) rose above R(3), the mean of its first
3 steps (the warm-start's reward, before learning). A cell qualifies when 2 or more of its 4 runs
broke down having learned first.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.spiral import spiral_study  # noqa: E402
from plumbing.plots import read_metrics  # noqa: E402

HERE = Path(__file__).resolve().parent
QUALIFY = 2                     # breakdowns after learning, of a cell's 4 runs


def learned_first(lines: list[dict], onset: int | None) -> bool:
    """A window before the onset above the first: R(s) > R(3) for some 3 < s < onset."""
    windows = spiral_study.reward_windows(lines)
    return onset is not None and any(mean > windows[0][1] for step, mean in windows[1:]
                                     if step < onset)


def pilot_rows(folder: Path) -> list[dict]:
    """One row per pilot run: lr, seed, steps run, onset, learned first, held-out EM."""
    rows = []
    for run in sorted(folder.glob("lr*/grpo-s*")):
        lines = [l for l in read_metrics(run) if l.get("reward") is not None]
        evals = [(l["step"], l["eval/em"]) for l in read_metrics(run) if "eval/em" in l]
        onset = spiral_study.breakdown_onset(lines)
        rows.append({"lr": run.parent.name.removeprefix("lr"), "seed": int(run.name[6:]),
                     "steps": lines[-1]["step"] if lines else 0, "onset": onset,
                     "learned_first": learned_first(lines, onset), "evals": evals})
    return rows


def onset(row: dict) -> str:
    if row["onset"] is None:
        return "-"
    return f"{row['onset']} ({'learned first' if row['learned_first'] else 'no learning first'})"


def pilot_table(folder: Path = HERE / "pilot") -> list[str]:
    lines = ["| lr | run: steps, onset (learned first?), held-out EM over the evaluations | "
             "broke down after learning | qualifies |", "|---|---|---|---|"]
    rows = pilot_rows(folder) if folder.is_dir() else []
    for lr in dict.fromkeys(r["lr"] for r in rows):
        cell = [r for r in rows if r["lr"] == lr]
        runs = "; ".join(f"{r['seed']}: {r['steps']}, {onset(r)}, EM "
                         + " -> ".join(f"{em:.2f}" for _, em in r["evals"]) for r in cell)
        late = sum(r["learned_first"] for r in cell)
        lines.append(f"| {lr} | {runs} | {late} of {len(cell)} | "
                     f"{'yes' if late >= QUALIFY else 'no'} |")
    return lines if rows else lines + ["| - | no pilot run has landed yet | - | - |"]


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print("\n".join(pilot_table()))
