"""The death-spiral warning replayed over committed runs: does it come before the breakdown?

    make study      # runs: spiral_replay.py experiments/lld_study/compare experiments/lab/pilot
    .venv/bin/python experiments/lld_study/spiral_replay.py <study> <lab> --table   # README's table

Each run's metrics.jsonl goes, step by step, through monitor.SpiralMonitor, the class train.py
uses, with train.py's default settings; one line per run says its first warning and its
breakdown (`none` where there is none), then the counts of the design and the held-out runs.

Breakdown (breakdown_step): the first step at which the 5-step mean training reward is below half
its best earlier 5-step mean (lld_table.py's collapse rule without its entropy condition). A false
alarm is any warning in a run that never breaks down. The rule was chosen looking only at the
DESIGN runs below, and fixed before the others were replayed.

Run folders: compare-{grpo,llds}-s<seed> (the LLD study) in the first folder, and
<cell>/grpo-s<seed> (the LLD lab's pilot) in the second, named lab-<cell>-grpo-s<seed>.
"""
import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from plumbing.metrics_file import read_metrics  # noqa: E402
from monitor import SpiralMonitor  # noqa: E402

DESIGN_SEEDS = {0, 1, 2, 3, 4, 6, 8}            # the study's; 5, 7 and 9 are held out
DESIGN_CELL = re.compile(r"lab-lr1e-5-")       # the lab's lr 1e-5 cells; lr 3e-5 and 1e-4 held out
EM_LOW = 0.05                                   # the study's post-hoc rule: held-out EM <= 0.05


def breakdown_step(lines: list[dict]) -> int | None:
    """The first step whose 5-step mean reward is below half the best 5-step mean before it."""
    train = [l for l in lines if "reward" in l]
    best = 0.0
    for i in range(4, len(train)):
        mean = statistics.fmean(l["reward"] for l in train[i - 4:i + 1])
        if best > 0 and mean < best / 2:
            return train[i]["step"]
        best = max(best, mean)
    return None


def first_warning(lines: list[dict]) -> int | None:
    """The first step at which the monitor, fed the run's training steps in order, warns."""
    monitor = SpiralMonitor()
    return next((l["step"] for l in lines if "reward" in l and monitor.check(l["step"], l)), None)


def em_low_step(lines: list[dict]) -> int | None:
    """The first evaluation after step 0 with held-out EM <= 0.05."""
    evals = [l for l in lines if l["step"] > 0 and l.get("eval/em") is not None]
    return next((l["step"] for l in evals if l["eval/em"] <= EM_LOW), None)


def runs(study: Path, lab: Path) -> list[tuple[str, Path]]:
    """(name, folder) of every study run (by seed, then arm) and every lab pilot run."""
    found = [(d.name, d) for d in study.glob("compare-*-s*")]
    found.sort(key=lambda r: (int(r[0].rsplit("-s", 1)[1]), r[0]))
    found += [(f"lab-{d.parent.name}-{d.name}", d) for d in sorted(lab.glob("*/grpo-s*"))]
    if not found:
        raise SystemExit(f"error: no compare-* run folders in {study}, no */grpo-s* in {lab}")
    return found


def is_design(name: str) -> bool:
    if name.startswith("lab-"):
        return bool(DESIGN_CELL.match(name))
    return int(name.rsplit("-s", 1)[1]) in DESIGN_SEEDS


def replay(study: Path, lab: Path) -> list[dict]:
    rows = []
    for name, folder in runs(study, lab):
        lines = read_metrics(folder)
        rows.append({"run": name, "design": is_design(name), "warning": first_warning(lines),
                     "breakdown": breakdown_step(lines), "em_low": em_low_step(lines)})
    return rows


def tally(rows: list[dict]) -> dict:
    """Runs that broke down, how many of them the warning came before; runs that did not, how many
    of them it warned in (false alarms)."""
    broke = [r for r in rows if r["breakdown"] is not None]
    calm = [r for r in rows if r["breakdown"] is None]
    return {"broke": len(broke), "calm": len(calm),
            "early": sum(r["warning"] is not None and r["warning"] < r["breakdown"] for r in broke),
            "alarms": sum(r["warning"] is not None for r in calm)}


def counts(rows: list[dict]) -> str:
    t = tally(rows)
    return f"warned before breakdown {t['early']}/{t['broke']}, false alarms {t['alarms']}/{t['calm']}"


def show(step: int | None) -> str:
    return "none" if step is None else str(step)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", type=Path, help="folder of compare-{grpo,llds}-s<seed> runs")
    parser.add_argument("lab", type=Path, help="folder of the lab pilot's <cell>/grpo-s<seed> runs")
    parser.add_argument("--table", action="store_true", help="print the README's markdown table")
    args = parser.parse_args(argv)
    rows = replay(args.study, args.lab)
    if args.table:
        print("| run | set | first warning | breakdown | EM <= 0.05 (post hoc) |")
        print("|---|---|---|---|---|")
    for r in rows:
        first, broke, em = (show(r[k]) for k in ("warning", "breakdown", "em_low"))
        if args.table:
            print(f"| {r['run']} | {'design' if r['design'] else 'held-out'} | {first} | {broke} "
                  f"| {em} |")
        else:
            print(f"warning {r['run']}: first {first}, breakdown {broke}")
    for label, design in (("design", True), ("held-out", False)):
        print(f"{label}: {counts([r for r in rows if r['design'] == design])}")


if __name__ == "__main__":
    main()
