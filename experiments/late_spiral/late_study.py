"""The late spiral's pilot table, from committed run folders alone (prereg.md §3).

    .venv/bin/python experiments/late_spiral/late_study.py

A run *breaks down* by the spiral study's rule (`spiral_study.breakdown_onset`). It *learned first*
when, before the onset, a 3-step mean training reward R(s) rose above R(3), the mean of its first
3 steps (the warm-start's reward, before learning). A cell qualifies when 2 or more of its 4 runs
broke down having learned first.

The phases figure (`draw_phases`) aligns plain GRPO's late breakdowns at their onsets and sets
beside them, aligned at the median of those onsets, plain GRPO's runs that did not break down and
every GRPO + LLDS run: the likelihood of correct and incorrect responses, the correct responses'
displacement and the gradient norm, median and interquartile band over each group's runs.
`phases` reads the paper's three phases in each late breakdown against those control runs:
stagnation (early), steady decay (middle) and accelerated collapse (end), in WINDOWS.
"""
import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.late_spiral import warning  # noqa: E402
from experiments.spiral import detector, spiral_study  # noqa: E402
from plumbing.plots import read_metrics  # noqa: E402

HERE = Path(__file__).resolve().parent
QUALIFY = 2                     # breakdowns after learning, of a cell's 4 runs
PILOT_RUNS, LONGEST = 8, 120    # 2 cells x 4 seeds; 60 steps, extended once to 120
PHASES = {"lld/logp_correct": "log-likelihood, correct responses",
          "lld/logp_incorrect": "log-likelihood, incorrect responses",
          "lld/correct_displacement": "correct responses' displacement (nats)",
          "grad_norm": "gradient norm"}
BEFORE, AFTER = 12, 3           # steps drawn before and after the alignment step
# The paper's phases are read in three windows of steps from the onset (prereg.md §5).
WINDOWS = {"early": (-12, -8), "middle": (-7, -3), "end": (-2, 1)}
CORRECT, INCORRECT, GRAD = "lld/logp_correct", "lld/logp_incorrect", "grad_norm"
Group = list[tuple[list[dict], int]]     # runs' training lines, each with its alignment step


def learned_first(lines: list[dict], onset: int | None) -> bool:
    """A window before the onset above the first: R(s) > R(3) for some 3 < s < onset."""
    windows = spiral_study.reward_windows(lines)
    return onset is not None and any(mean > windows[0][1] for step, mean in windows[1:]
                                     if step < onset)


def pilot_rows(folder: Path) -> list[dict]:
    """One row per pilot run: lr, seed, steps run, onset, learned first, held-out EM."""
    rows = []
    for run in sorted(folder.glob("lr*/grpo-s*")):
        lines = detector.training_lines(run)
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
    if not rows:
        lines.append("| - | no pilot run has landed yet | - | - |")
    return lines + ["", decision(rows)]


def decision(rows: list[dict]) -> str:
    """The pilot's decision by prereg.md §3, once all its runs have reached the same length."""
    lengths = {r["steps"] for r in rows}
    if len(rows) < PILOT_RUNS or len(lengths) > 1:
        return (f"Not decided yet: {len(rows)} of {PILOT_RUNS} runs have landed"
                + (f", at {'/'.join(map(str, sorted(lengths)))} steps." if rows else "."))
    steps = lengths.pop()
    qualified = [lr for lr in {r["lr"] for r in rows}
                 if sum(r["learned_first"] for r in rows if r["lr"] == lr) >= QUALIFY]
    if qualified:
        return (f"Decided (prereg §3): lr {min(qualified, key=float)} at {steps} steps"
                + (" (both cells qualify: the lower learning rate)." if len(qualified) > 1 else "."))
    if steps < LONGEST:
        return (f"No cell qualifies at {steps} steps: the same runs are extended once, to "
                f"{LONGEST} (`late_runs.py pilot --steps {LONGEST} --commit`).")
    return (f"No cell qualifies at {steps} steps: at a learning rate that learns, plain GRPO did "
            f"not break down within {steps} steps here, and the study ends.")


def study_runs(folder: Path) -> list[dict]:
    """Every run folder <arm>-s<seed> of a study: its arm, training lines, onset, learned first."""
    return [{**r, "arm": r["run"].split("-s")[0],
             "learned_first": learned_first(r["lines"], r["onset"])}
            for r in detector.load(folder, None)]


def phase_groups(runs: list[dict]) -> dict[str, Group]:
    """Each group's runs as (lines, the step they are aligned at); empty when no run of plain
    GRPO broke down having learned first."""
    late = [r for r in runs if r["arm"] == "grpo" and r["learned_first"]]
    if not late:
        return {}
    anchor = round(statistics.median(r["onset"] for r in late))
    return {"plain GRPO, late breakdowns (at their onsets)": [(r["lines"], r["onset"])
                                                             for r in late],
            f"plain GRPO, no breakdown (at step {anchor})": [
                (r["lines"], anchor) for r in runs if r["arm"] == "grpo" and r["onset"] is None],
            f"GRPO + LLDS, every run (at step {anchor})": [
                (r["lines"], anchor) for r in runs if r["arm"] == "llds"]}


def aligned(group: Group, signal: str) -> list[tuple[int, float, float, float]]:
    """(step - alignment step, median, lower quartile, upper quartile) of `signal` over the
    group's runs, for each offset from -BEFORE to AFTER that two of its runs have (or its one)."""
    by_offset: dict[int, list[float]] = {}
    for lines, at in group:
        for l in lines:
            if -BEFORE <= l["step"] - at <= AFTER and l.get(signal) is not None:
                by_offset.setdefault(l["step"] - at, []).append(l[signal])
    out = []
    for offset, values in sorted(by_offset.items()):
        if len(values) < min(2, len(group)):
            continue
        q1, q2, q3 = (statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1
                      else values * 3)
        out.append((offset, q2, q1, q3))
    return out


def draw_phases(runs: list[dict], out: Path) -> None:
    """One panel per PHASES signal, one line (median, interquartile band) per group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = phase_groups(runs)
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, (signal, title) in zip(axes.flat, PHASES.items()):
        for colour, (name, group) in zip(("C3", "C7", "C0"), groups.items()):
            points = aligned(group, signal)
            if points:
                x, mid, low, high = zip(*points)
                ax.plot(x, mid, color=colour, label=f"{name}: {len(group)} runs")
                ax.fill_between(x, low, high, color=colour, alpha=0.15)
        ax.axvline(0, color="k", lw=0.8, ls=":")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("steps from the onset (or the alignment step)")
    axes.flat[0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def window(run: tuple[list[dict], int], signal: str, phase: str) -> list[tuple[int, float]]:
    """(step - alignment step, value) of `signal` in a phase's window of a run (lines, at)."""
    lines, at = run
    low, high = WINDOWS[phase]
    return [(l["step"] - at, l[signal]) for l in lines
            if low <= l["step"] - at <= high and l.get(signal) is not None]


def slope(points: list[tuple[int, float]]) -> float | None:
    """The least-squares change per step; None under 3 points."""
    return float(np.polyfit(*zip(*points), 1)[0]) if len(points) >= 3 else None


def level(points: list[tuple[int, float]]) -> float | None:
    return statistics.fmean(v for _, v in points) if len(points) >= 3 else None


def phase_readings(run: tuple[list[dict], int]) -> dict[str, float | None]:
    """The readings the phases take: each likelihood's slope in each window, the gradient norm's
    level at the end."""
    return {**{(signal, phase): slope(window(run, signal, phase))
               for signal in (CORRECT, INCORRECT) for phase in WINDOWS},
            (GRAD, "end"): level(window(run, GRAD, "end"))}


def phases(runs: list[dict]) -> dict[str, tuple[int, int]]:
    """The paper's three phases in plain GRPO's late breakdowns (prereg.md §5): for each, (runs
    that show it, runs in which it can be read). The yardstick is the control runs (plain GRPO's
    without a breakdown and every GRPO + LLDS run, at the median onset), in the same windows:
    stagnation, both likelihoods' early slopes within the controls' range; steady decay, both
    middle slopes below the controls' lowest; accelerated collapse, the correct responses' slope
    at the end below its middle slope and the controls' lowest, and the gradient norm's level at
    the end above the controls' highest."""
    groups = list(phase_groups(runs).values())
    if not groups:
        return {}
    late = [phase_readings(run) for run in groups[0]]
    controls = [phase_readings(run) for run in groups[1] + groups[2]]
    def low(key):
        return min((c[key] for c in controls if c[key] is not None), default=None)
    def high(key):
        return max((c[key] for c in controls if c[key] is not None), default=None)
    early, middle, end = ([(signal, phase) for signal in (CORRECT, INCORRECT)]
                          for phase in WINDOWS)
    tests = {"stagnation": lambda r: all(low(k) <= r[k] <= high(k) for k in early),
             "steady decay": lambda r: all(r[k] < low(k) for k in middle),
             "accelerated collapse": lambda r: (r[end[0]] < min(r[middle[0]], low(end[0]))
                                                and r[GRAD, "end"] > high((GRAD, "end")))}
    result = {}
    for phase, test in tests.items():
        verdicts = [verdict for r in late if (verdict := read(test, r)) is not None]
        result[phase] = (sum(verdicts), len(verdicts))
    return result


def read(test, readings: dict) -> bool | None:
    """A phase's test on one run's readings; None where a reading it needs is missing (a window
    the run does not reach, or no control to compare with)."""
    try:
        return bool(test(readings))
    except TypeError:                      # a comparison with None
        return None


def phases_table(runs: list[dict]) -> list[str]:
    lines = ["| the paper's phase | window (steps from the onset) | late breakdowns that show it "
             "| appears (in more than half) |", "|---|---|---|---|"]
    for (phase, (k, n)), span in zip(phases(runs).items(), WINDOWS.values()):
        lines.append(f"| {phase} | {span[0]} to {span[1]} | {k} of {n} | "
                     f"{'-' if not n else 'yes' if 2 * k > n else 'no'} |")
    return lines if len(lines) > 2 else lines + ["| - | - | no late breakdown | - |"]


def main(argv=None) -> None:
    """The pilot table; once counted runs have landed in study/, the spiral study's tables and
    survival figure for them, the phases figure and the redesigned warning's replay."""
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    print("\n".join(pilot_table(HERE / "pilot")))
    study = HERE / "study"
    if not study.is_dir():
        print(f"no {study}: no counted run has landed")
        return
    rows = spiral_study.study_rows(study)
    result = spiral_study.outcome(rows)
    print("\n".join(spiral_study.tables(rows, result)))
    spiral_study.draw(rows, result, HERE / "survival.png")
    runs = study_runs(study)
    draw_phases(runs, HERE / "phases.png")
    print("\n".join(["", *phases_table(runs), ""]))
    print(f"figures: {HERE / 'survival.png'}, {HERE / 'phases.png'}")
    if warning.DESIGN.exists():
        print("\n".join(warning.replay(runs)))


if __name__ == "__main__":
    main()
