"""One breakdown rule for every study's committed runs, beside each older study's own rule.

    .venv/bin/python experiments/breakdowns.py       # every study's counts, by cell and arm

The rule is the spiral study's (experiments/spiral/prereg.md §5, `spiral_study.breakdown_onset`):
R(s) is the mean training reward over steps s-2..s and B(s) the best R of the windows that end
before s; a run breaks down at the first step s with B(s) >= 0.1 and R(s) <= 0.5 B(s), after which
R never again exceeds 0.75 B(s). Before it, the LLD study counted a *collapse* by an entropy rule
(experiments/lld_study/lld_table.py) and the LLD lab by a held-out EM rule
(experiments/lab/lab_study.py); their counts stay beside this one, not instead of it.
"""
import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.lab import lab_study  # noqa: E402
from experiments.lld_study import lld_study  # noqa: E402
from experiments.spiral.spiral_study import breakdown_onset  # noqa: E402
from plumbing.metrics_file import read_metrics  # noqa: E402

HERE = Path(__file__).resolve().parent
RUN = re.compile(r"^(?:compare-)?(.+)-s(\d+)$")       # compare-grpo-s3, grpo-kl0.001-s3, llds-s12
ARMS = {"grpo": "plain GRPO", "llds": "GRPO + LLDS", "grpo-kl0.001": "plain GRPO + KL 0.001",
        "grpo-kl0.04": "plain GRPO + KL 0.04", "llds-kl0.001": "GRPO + LLDS + KL 0.001"}
# (study, its README, the folder of its runs, its own rule's name and its onset of a run folder)
STUDIES = (
    ("the spiral study", "spiral", "spiral/study", None),
    ("the spiral study's pilot", "spiral", "spiral/pilot", None),
    ("the learning-rate map", "lr_map", "lr_map/runs", None),
    ("the late spiral's pilot", "late_spiral", "late_spiral/pilot", None),
    ("the LLD study", "lld_study", "lld_study/compare",
     ("entropy rule", lambda d: lld_study.run_summary(d)["collapse"])),
    ("the LLD lab's pilot", "lab", "lab/pilot",
     ("held-out EM rule", lambda d: lab_study.collapse_step(lab_study.read_run(d)))),
)


def study_runs(folder: Path, own=None) -> list[dict]:
    """Every run folder with a metrics.jsonl under `folder`: its cell (the folder between, '' when
    none), arm, seed, onset by the one rule, and by the study's own rule when it has one."""
    runs = []
    for d in sorted(folder.rglob("metrics.jsonl")):
        run = d.parent
        match = RUN.match(run.name)
        if not match:
            continue
        lines = [l for l in read_metrics(run) if l.get("reward") is not None]
        runs.append({"cell": "" if run.parent == folder else str(run.parent.relative_to(folder)),
                     "arm": match.group(1), "seed": int(match.group(2)),
                     "onset": breakdown_onset(lines),
                     "own": own[1](run) if own else None})
    return runs


def counts(runs: list[dict]) -> list[dict]:
    """Per cell and arm: runs, breakdowns by the one rule, and by the study's own rule."""
    groups = {}
    for r in runs:
        groups.setdefault((r["cell"], r["arm"]), []).append(r)
    return [{"cell": cell, "arm": arm, "runs": len(rs),
             "breakdowns": sum(r["onset"] is not None for r in rs),
             "onsets": sorted(r["onset"] for r in rs if r["onset"] is not None),
             "own": sum(r["own"] is not None for r in rs)}
            for (cell, arm), rs in sorted(groups.items(), key=lambda kv: cell_order(*kv[0]))]


def cell_order(cell: str, arm: str) -> tuple:
    lr = re.search(r"lr([\d.]+e-\d+)", cell)
    return (float(lr.group(1)) if lr else 0.0, cell, list(ARMS).index(arm) if arm in ARMS else 99)


def table(root: Path = HERE, only: str | None = None) -> list[str]:
    """Every study's counts, a row per cell and arm (links from docs/); `only`: one study's
    folder (e.g. "lld_study/compare"), without the study column."""
    head = ["cell", "arm", "runs", "breakdowns (the spiral rule)", "their steps",
            "the study's own rule"]
    lines = ["| " + " | ".join(head if only else ["study", *head]) + " |",
             "|---" * (len(head) + (not only)) + "|"]
    for name, readme, folder, own in STUDIES:
        if not (root / folder).is_dir() or only not in (None, folder):
            continue
        for c in counts(study_runs(root / folder, own)):
            onsets = ", ".join(map(str, c["onsets"])) or "-"
            theirs = f"{own[0]}: {c['own']} / {c['runs']}" if own else "the same rule"
            study = [] if only else [f"[{name}](../experiments/{readme}/README.md)"]
            cells = [*study, c["cell"] or "-", ARMS.get(c["arm"], c["arm"]), str(c["runs"]),
                     f"{c['breakdowns']} / {c['runs']}", onsets, theirs]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print("\n".join(table()))
