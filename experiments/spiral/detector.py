"""The warning as a detector (prereg.md §7): candidate rules over the signals a step logs, each
replayed over run folders and scored against the runs' breakdowns.

    .venv/bin/python experiments/spiral/detector.py design experiments/spiral/study --seeds 0-14
    .venv/bin/python experiments/spiral/detector.py replay experiments/spiral/study --seeds 15-29

A rule warns at a step; a breakdown is *warned* when the first warning comes at least LEAD steps
before its onset; a *false alarm* is a run that never breaks down and is warned. A candidate is a
threshold on one signal, read as its level or as its change from the mean of the run's first
BASELINE steps (monitor.py), at one step or as the mean of the last 1-3 steps; or two such
conditions at once.
The design picks, among candidates with at most MAX_ALARM_RATE false alarms per non-breaking
run, the highest recall, then the longer median lead, then the fewer conditions.
"""
import argparse
import dataclasses
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.spiral.spiral_study import breakdown_onset  # noqa: E402
from monitor import Condition  # noqa: E402
from plumbing.plots import read_metrics  # noqa: E402

LEAD, MAX_ALARM_RATE = 2, 0.1
DESIGN = Path(__file__).resolve().parent / "design.json"      # the design's record, committed
HELD_OUT_RUNS = 30                                # seeds 15-29, both arms (prereg.md §7)
SIGNALS = ("lld/correct_displacement", "frac_reward_zero_std", "valid_action_ratio", "finished",
           "entropy", "grad_norm", "grad_norm_max", "clip_ratio", "response_length", "searches",
           "reward", "ctrl/p_search", "ctrl/p_answer", "ctrl/p_close", "grad_norm_z")
THRESHOLDS = np.linspace(0.05, 0.95, 19)     # quantiles of a signal's design values


def first_warning(rule: tuple[Condition, ...], lines: list[dict]) -> int | None:
    """The first training step at which every condition of the rule fires, each fed the run's
    steps so far, as train.py's monitor is."""
    series = {c.signal: [l.get(c.signal) for l in lines] for c in rule}
    return next((l["step"] for i, l in enumerate(lines)
                 if all(c.fires(series[c.signal][:i + 1]) for c in rule)), None)


def training_lines(folder: Path) -> list[dict]:
    return [l for l in read_metrics(folder) if l.get("reward") is not None]


def score(rule, runs: list[dict], lead: int = LEAD) -> dict:
    """Recall (warned at least `lead` steps ahead), median lead and false alarms of a rule over
    runs {lines, onset}."""
    warned, leads, alarms = 0, [], 0
    for run in runs:
        first = first_warning(rule, run["lines"])
        if run["onset"] is None:
            alarms += first is not None
        elif first is not None and run["onset"] - first >= lead:
            warned, leads = warned + 1, leads + [run["onset"] - first]
    broke = sum(r["onset"] is not None for r in runs)
    calm = len(runs) - broke
    return {"rule": " and ".join(map(str, rule)), "breakdowns": broke, "warned": warned,
            "recall": warned / broke if broke else None,
            "median_lead": statistics.median(leads) if leads else None,
            "calm": calm, "false_alarms": alarms,
            "alarms_per_10": 10 * alarms / calm if calm else None}


# The readings a candidate takes: (change, trend, window). The spiral study's class (its prereg
# §7): level or change, the mean of 1-3 steps. The wider class (the late spiral's redesign):
# windows up to 5 steps, and trends over 2-5 steps.
SPIRAL_CLASS = [(change, False, w) for change in (False, True) for w in (1, 2, 3)]
WIDE_CLASS = ([(change, False, w) for change in (False, True) for w in range(1, 6)]
              + [(False, True, w) for w in range(2, 6)])


def candidates(runs: list[dict], readings=SPIRAL_CLASS) -> list[Condition]:
    """Every single condition: each signal x reading x above/below x the signal's design quantiles
    of that reading as thresholds."""
    out = []
    for signal, (change, trend, window) in itertools.product(SIGNALS, readings):
        probe = Condition(signal, change, window, True, 0.0, trend)
        values = [probe.reading([l.get(signal) for l in r["lines"][:i + 1]])
                  for r in runs for i in range(len(r["lines"]))]
        values = [v for v in values if v is not None]
        if len(set(values)) < 2:
            continue
        for t in sorted(set(np.quantile(values, THRESHOLDS).round(6))):
            out += [Condition(signal, change, window, True, float(t), trend),
                    Condition(signal, change, window, False, float(t), trend)]
    return out


def rank(scored: dict) -> tuple:
    return (scored["recall"] or 0.0, scored["median_lead"] or 0.0, -scored["rule"].count(" and "))


def design(runs: list[dict], pairs_of: int = 40, readings=SPIRAL_CLASS) -> dict:
    """The chosen rule and every single signal's best condition, on the design runs: singles
    first, then conjunctions of the `pairs_of` singles of highest recall at any alarm rate."""
    singles = [(c,) for c in candidates(runs, readings)]
    scored = {rule: score(rule, runs) for rule in singles}
    def allowed(s):
        return s["calm"] == 0 or s["false_alarms"] <= MAX_ALARM_RATE * s["calm"]
    best_of_signal = {}
    for rule, s in scored.items():
        key = rule[0].signal
        if allowed(s) and (key not in best_of_signal or rank(s) > rank(best_of_signal[key][1])):
            best_of_signal[key] = (rule, s)
    top = sorted(singles, key=lambda r: -(scored[r]["recall"] or 0.0))[:pairs_of]
    for a, b in itertools.combinations(top, 2):
        if a[0].signal != b[0].signal:
            scored[a + b] = score(a + b, runs)
    chosen = max((r for r, s in scored.items() if allowed(s)), key=lambda r: rank(scored[r]))
    return {"chosen": chosen, "score": scored[chosen], "signals": best_of_signal}


def load(folder: Path, seeds: set[int] | None) -> list[dict]:
    runs = []
    for d in sorted(folder.glob("*-s*"), key=lambda d: (d.name.split("-s")[0], seed_of(d.name))):
        seed = seed_of(d.name)
        if (d / "metrics.jsonl").exists() and (seeds is None or seed in seeds):
            lines = training_lines(d)
            runs.append({"run": d.name, "lines": lines, "onset": breakdown_onset(lines)})
    return runs


def held_out(folder: Path, record: dict) -> list[dict]:
    """The finished runs of the seeds the design (`record`) did not see."""
    design = seed_range(record["design_seeds"])
    return [r for r in load(folder, None) if seed_of(r["run"]) not in design]


def seed_of(run: str) -> int:
    return int(run.rsplit("-s", 1)[1])


def seed_range(text: str) -> set[int]:
    first, _, last = text.partition("-")
    return set(range(int(first), int(last or first) + 1))


def as_json(rule: tuple[Condition, ...]) -> list[dict]:
    return [dataclasses.asdict(c) for c in rule]


def from_json(rule: list[dict]) -> tuple[Condition, ...]:
    return tuple(Condition(**c) for c in rule)


def write_design(runs_folder: Path, seeds: str, out: Path) -> dict:
    """The design on the seeds given, written to `out` (commit it before any held-out run)."""
    record = {"design_seeds": seeds, **as_record(design(load(runs_folder, seed_range(seeds))))}
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record


def as_record(result: dict) -> dict:
    """A design's result as its record: the chosen rule, its score, each signal's best."""
    return {"chosen": as_json(result["chosen"]), "score": result["score"],
            "signals": {k: {"rule": as_json(r), "score": sc}
                        for k, (r, sc) in sorted(result["signals"].items())}}


def signal_rules(record: dict) -> list[tuple[str, tuple[Condition, ...]]]:
    """Each signal's best single condition in a design's record, where it warned a breakdown."""
    return [(signal, from_json(entry["rule"])) for signal, entry in record["signals"].items()
            if entry["score"]["warned"]]


def table_row(name: str, rule, runs: list[dict], leads: tuple[int, ...] = (LEAD,)) -> str:
    """A rule's row: breakdowns warned at least each of `leads` steps ahead, the median lead,
    false alarms, and false alarms per 10 runs without a breakdown."""
    scores = [score(rule, runs, lead) for lead in leads]
    s = scores[0]
    per_10 = "-" if s["alarms_per_10"] is None else f"{s['alarms_per_10']:.1f}"
    return (f"| {name} | {s['rule']} | "
            + "".join(f"{x['warned']} / {x['breakdowns']} | " for x in scores)
            + f"{'-' if s['median_lead'] is None else format(s['median_lead'], 'g')} | "
            f"{s['false_alarms']} / {s['calm']} | {per_10} |")


def table(record: dict, runs_folder: Path, seeds: set[int]) -> list[str]:
    """The chosen rule and each signal's best single condition, scored on the runs of `seeds`; a
    signal none of whose conditions warned a breakdown within MAX_ALARM_RATE on the design seeds
    says so. Then the chosen rule's first warning in each run that broke down or was warned."""
    runs = load(runs_folder, seeds)
    rules = [("**chosen**", from_json(record["chosen"]))] + signal_rules(record)
    lines = ["| signal | rule | breakdowns warned >= 2 steps before | median lead (steps) | "
             "false alarms / runs without a breakdown | per 10 |", "|---|---|---|---|---|---|"]
    lines += [table_row(name, rule, runs) for name, rule in rules]
    silent = sorted(set(SIGNALS) - {name for name, _ in rules})
    lines += [f"| {signal} | none warned a breakdown within {MAX_ALARM_RATE * 10:g} false alarm in "
              "10 on the design seeds | - | - | - | - |" for signal in silent]
    seen = [(r["run"], r["onset"], first_warning(rules[0][1], r["lines"])) for r in runs]
    seen = [f"{run} {onset or '-'} / {first or '-'}" for run, onset, first in seen
            if onset or first]
    return lines + ["", "The chosen rule in each run that broke down or was warned (run: onset / "
                    "first warning, steps): " + ("; ".join(seen) or "none") + "."]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["design", "replay"])
    parser.add_argument("runs", type=Path, help="experiments/spiral/study")
    parser.add_argument("--seeds", required=True, help="e.g. 0-14")
    parser.add_argument("--design", type=Path, default=DESIGN, help="the design's record")
    args = parser.parse_args(argv)
    if args.stage == "design":
        write_design(args.runs, args.seeds, args.design)
    print("\n".join(table(json.loads(args.design.read_text()), args.runs, seed_range(args.seeds))))


if __name__ == "__main__":
    main()
