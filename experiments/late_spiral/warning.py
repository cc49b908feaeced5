"""The warning, designed again for the late spiral (prereg.md §5): on every committed run so far,
with the wider class, before the first counted late run; then replayed on the late runs.

    .venv/bin/python experiments/late_spiral/warning.py design     # writes design.json (commit it)
    .venv/bin/python experiments/late_spiral/warning.py replay     # scores it on the late runs

The design runs are every run folder of the spiral study (its counted runs and its pilot), the
learning-rate map and this study's pilot: plain GRPO and GRPO + LLDS, 15 to 120 steps, all in the
spiral study's setting. The procedure is the spiral study's (experiments/spiral/detector.py): the
highest recall at >= 2 steps ahead within 1 false alarm in 10 runs without a breakdown, then the
longer lead, then fewer conditions; the class is detector.WIDE_CLASS (levels and changes over the
mean of 1-5 steps, trends over 2-5 steps) and conjunctions of two. On the late runs the replay
reports recall at >= 2 and >= 5 steps ahead, the median lead and false alarms per 10 runs, for
the redesigned rule, the current default (monitor.RULE) and each signal's best single condition.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.spiral import detector  # noqa: E402
from monitor import RULE  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DESIGN_FOLDERS = ("experiments/spiral/study", "experiments/spiral/pilot/*",
                  "experiments/lr_map/runs/*", "experiments/late_spiral/pilot/*")
LATE_RUNS = Path(__file__).resolve().parent / "study"
DESIGN = Path(__file__).resolve().parent / "design.json"


def runs_in(patterns: tuple[str, ...], root: Path = ROOT) -> list[dict]:
    """Every run folder under the patterns' folders, named by its path from `root`."""
    runs = []
    for pattern in patterns:
        for folder in sorted(root.glob(pattern)):
            runs += [{**r, "run": f"{folder.relative_to(root)}/{r['run']}"}
                     for r in detector.load(folder, None)]
    return runs


def write_design(runs: list[dict], out: Path = DESIGN) -> dict:
    """The redesign on `runs`, with its design scores and the runs it saw, written to `out`."""
    record = {"design_runs": [r["run"] for r in runs],
              **detector.as_record(detector.design(runs, readings=detector.WIDE_CLASS))}
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record


def replay_table(record: dict, runs: list[dict]) -> list[str]:
    """The redesigned rule, the default and each signal's best single condition on `runs`."""
    rules = [("**redesigned**", detector.from_json(record["chosen"])), ("the default", RULE)]
    lines = ["| rule | condition | recall >= 2 steps ahead | recall >= 5 | median lead (steps) | "
             "false alarms / runs without a breakdown | per 10 |", "|---|---|---|---|---|---|---|"]
    return lines + [detector.table_row(name, rule, runs, leads=(detector.LEAD, 5))
                    for name, rule in rules + detector.signal_rules(record)]


def replay(runs: list[dict]) -> list[str]:
    """The committed design (design.json) replayed on `runs`, the counted late runs."""
    return replay_table(json.loads(DESIGN.read_text()), runs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["design", "replay"])
    args = parser.parse_args(argv)
    if args.stage == "design":
        record = write_design(runs_in(DESIGN_FOLDERS))
        print(f"designed on {len(record['design_runs'])} runs, written to {DESIGN}")
        print("\n".join(replay_table(record, runs_in(DESIGN_FOLDERS))))
    else:
        print("\n".join(replay(detector.load(LATE_RUNS, None))))


if __name__ == "__main__":
    main()
