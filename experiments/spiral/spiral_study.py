"""The spiral study's tables and figure, from committed run folders alone (prereg.md).

    make spiral     # = .venv/bin/python experiments/spiral/spiral_study.py experiments/spiral --figure experiments/spiral/survival.png

Breakdown (prereg.md §5, `breakdown_onset`): R(s), the mean training reward over steps s-2..s;
B(s), the best R of the windows that end before s. A run breaks down at the first step s with
B(s) >= 0.1 and R(s) <= 0.5 B(s), after which R never again exceeds 0.75 B(s). A run that never
does is censored at its last step. Outcomes: breakdowns x / N per arm with Fisher's exact p,
Kaplan-Meier curves with 95% bands and the log-rank test, final held-out EM paired by seed with a
bootstrap interval.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.spiral import survival  # noqa: E402
from plumbing.plots import read_metrics  # noqa: E402

WINDOW, FLOOR, FALL, RECOVER = 3, 0.1, 0.5, 0.75
ARMS = {"grpo": "plain GRPO", "llds": "GRPO + LLDS"}


def reward_windows(lines: list[dict]) -> list[tuple[int, float]]:
    """(s, R(s)): each training step from the WINDOW-th on, with its window's mean reward."""
    steps = [(l["step"], l["reward"]) for l in lines if l.get("reward") is not None]
    return [(steps[i][0], statistics.fmean(r for _, r in steps[i - WINDOW + 1:i + 1]))
            for i in range(WINDOW - 1, len(steps))]


def breakdown_onset(lines: list[dict]) -> int | None:
    """The step at which the run broke down by the rule above, or None."""
    windows = reward_windows(lines)
    for i, (step, mean) in enumerate(windows):
        best = max((m for _, m in windows[:i]), default=0.0)
        recovered = any(m > RECOVER * best for _, m in windows[i + 1:])
        if best >= FLOOR and mean <= FALL * best and not recovered:
            return step
    return None


def run_row(folder: Path) -> dict:
    """What the tables need of one run folder <arm>-s<seed>."""
    lines = read_metrics(folder)
    arm, seed = folder.name.rsplit("-s", 1)
    train = [l for l in lines if l.get("reward") is not None]
    evals = [l for l in lines if l.get("eval/em") is not None]
    onset = breakdown_onset(lines)
    config = json.loads((folder / "config.json").read_text())
    machines = json.loads((folder / "machine.json").read_text())     # one entry a (re)start
    landed = json.loads((folder / "run.json").read_text()) if (folder / "run.json").exists() else {}
    return {"run": folder.name, "arm": arm, "seed": int(seed), "onset": onset,
            "time": onset if onset is not None else (train[-1]["step"] if train else 0),
            "finished": bool(train) and train[-1]["step"] == config["steps"],
            "em_before": evals[0]["eval/em"] if evals and evals[0]["step"] == 0 else None,
            "em_final": evals[-1]["eval/em"] if evals and evals[-1]["step"] > 0 else None,
            "reward_last": statistics.fmean(l["reward"] for l in train[-WINDOW:])
            if train else None,
            "minutes": sum(l.get("timing/step", 0) + l.get("timing/eval", 0) for l in lines) / 60,
            "s_step": statistics.fmean(l["timing/step"] for l in train) if train else None,
            "cpu": [m["cpu"] for m in machines],
            "bf16": any(m["bf16_autocast"] for m in machines),
            "warm_start": landed.get("sft_sha256")}


def study_rows(folder: Path) -> list[dict]:
    rows = [run_row(d) for d in sorted(folder.glob("*-s*")) if (d / "metrics.jsonl").exists()]
    if not rows:
        raise SystemExit(f"error: no <arm>-s<seed> run folders with a metrics.jsonl in {folder}")
    return sorted(rows, key=lambda r: (r["seed"], r["arm"]))


def outcome(rows: list[dict]) -> dict:
    """Breakdowns per arm, Fisher's p, the log-rank test, the paired final EM difference."""
    by_arm = {arm: [r for r in rows if r["arm"] == arm] for arm in ARMS}
    result = {arm: {"runs": len(rs), "finished": sum(r["finished"] for r in rs),
                    "breakdowns": sum(r["onset"] is not None for r in rs),
                    "curve": survival.kaplan_meier([r["time"] for r in rs],
                                                   [r["onset"] is not None for r in rs])}
              for arm, rs in by_arm.items() if rs}
    if len(result) == 2:
        g, l = by_arm["grpo"], by_arm["llds"]
        result["fisher_p"] = survival.fisher_exact(result["grpo"]["breakdowns"], len(g),
                                                   result["llds"]["breakdowns"], len(l))
        result["log_rank"] = survival.log_rank(
            [r["time"] for r in g], [r["onset"] is not None for r in g],
            [r["time"] for r in l], [r["onset"] is not None for r in l])
        pairs = [(a["em_final"], b["em_final"]) for a in g for b in l
                 if a["seed"] == b["seed"] and None not in (a["em_final"], b["em_final"])]
        if pairs:
            result["em_paired"] = survival.paired_bootstrap(*zip(*pairs))
    return result


def draw(rows: list[dict], result: dict, out: Path) -> None:
    """The survival figure: the fraction of runs not yet broken down after each step, per arm,
    with its 95% band; crosses mark censored runs (ended without a breakdown)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = max(r["time"] for r in rows)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for colour, (arm, label) in zip(("C3", "C0"), ARMS.items()):
        if arm not in result:
            continue
        curve = result[arm]["curve"]
        x = [0] + [p["time"] for p in curve] + [steps]
        y, low, high = ([1.0] + [p[k] for p in curve] + [curve[-1][k] if curve else 1.0]
                        for k in ("survival", "low", "high"))
        n, k = result[arm]["runs"], result[arm]["breakdowns"]
        ax.step(x, y, where="post", color=colour, label=f"{label}: {k} of {n} broke down")
        ax.fill_between(x, low, high, step="post", color=colour, alpha=0.15)
        censored = [r["time"] for r in rows if r["arm"] == arm and r["onset"] is None]
        ax.plot(censored, [y[-1]] * len(censored), "+", color=colour, markersize=8)
    ax.set_xlabel("training step")
    ax.set_ylabel("fraction of runs not broken down")
    ax.set_ylim(-0.02, 1.02)
    title = "Kaplan-Meier, 95% bands"
    if "log_rank" in result:
        title += f"; log-rank p = {result['log_rank']['p']:.2g}"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def show(x) -> str:
    return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)


def tables(rows: list[dict], result: dict) -> list[str]:
    lines = ["| arm | runs finished / started | breakdowns | final held-out EM (mean) |",
             "|---|---|---|---|"]
    for arm, label in ARMS.items():
        if arm in result:
            rs = [r["em_final"] for r in rows if r["arm"] == arm and r["em_final"] is not None]
            lines.append(f"| {label} | {result[arm]['finished']} / {result[arm]['runs']} | "
                         f"{result[arm]['breakdowns']} / {result[arm]['runs']} | "
                         f"{show(statistics.fmean(rs) if rs else None)} |")
    if "fisher_p" in result:
        lr, em = result["log_rank"], result.get("em_paired")
        lines += ["", f"Fisher's exact p (breakdowns) = {result['fisher_p']:.3g}; log-rank "
                  f"chi2 = {lr['chi2']:.2f}, p = {lr['p']:.3g} (plain GRPO {lr['observed_a']:.0f} "
                  f"breakdowns, {lr['expected_a']:.1f} expected under equal rates)"]
        if em:
            lines.append(f"final held-out EM, LLDS - GRPO paired over {em['pairs']} seeds: "
                         f"{em['mean']:+.3f} [{em['low']:+.3f}, {em['high']:+.3f}] (95% bootstrap)")
    lines += ["", "| seed | breakdown onset: GRPO / LLDS | final EM: GRPO / LLDS |", "|---|---|---|"]
    for seed in sorted({r["seed"] for r in rows}):
        pair = {r["arm"]: r for r in rows if r["seed"] == seed}
        cell = [" / ".join(show(pair[a][k]) if a in pair else "" for a in ARMS)
                for k in ("onset", "em_final")]
        lines.append(f"| {seed} | {cell[0]} | {cell[1]} |")
    return lines + ["", cost(rows), "", warm_starts(rows)]


def cost(rows: list[dict]) -> str:
    """What the finished runs cost, from their own timings: minutes (steps and both evaluations)
    and seconds a step, and the CPUs they ran on."""
    done = [r for r in rows if r["finished"]]
    if not done:
        return "No run has finished yet."
    span = lambda k, f: f"{min(r[k] for r in done):{f}}-{max(r[k] for r in done):{f}}"  # noqa: E731
    cpus = sorted({c for r in done for c in r["cpu"]})
    precision = "bf16 autocast" if any(r["bf16"] for r in done) else "float32"
    resumed = sum(len(r["cpu"]) > 1 for r in done)
    return (f"Cost: a finished run took {span('minutes', '.0f')} minutes ({span('s_step', '.0f')} "
            f"s a step), two runs side by side, one thread each, on {'; '.join(cpus)} in "
            f"{precision}; {resumed} of {len(done)} resumed after an interruption.")


def warm_starts(rows: list[dict]) -> str:
    """Which build of the warm-start (prereg.md §2: one a machine) each seed's runs started from."""
    seeds = {}
    for r in rows:
        seeds.setdefault(r["warm_start"], set()).add(r["seed"])
    builds = [f"{sha[:8] if sha else 'unrecorded'} (seeds {spans(sorted(s))})"
              for sha, s in sorted(seeds.items(), key=lambda kv: min(kv[1]))]
    return f"Warm-start builds, by sha256: {'; '.join(builds)}."


def spans(seeds: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs = []
    for s in seeds:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# Pilot runs started and lost with their machine, not rerun (prereg.md §9): no folder holds them.
LOST = {"lr8e-5-s15": [1002, 1003]}


def pilot_table(pilot: Path) -> list[str]:
    """One row per pilot cell (plain GRPO only): its runs, those lost (LOST), and their breakdowns'
    onsets."""
    lines = ["| learning rate | steps | runs finished / started | broke down | onsets (seed: step) |",
             "|---|---|---|---|---|"]
    cells = sorted((d for d in pilot.iterdir() if d.is_dir()),
                   key=lambda d: float(d.name.removeprefix("lr").split("-s")[0])) \
        if pilot.is_dir() else []
    for cell in cells:
        rows = study_rows(cell)
        done = [r for r in rows if r["finished"]]
        lr, steps = cell.name.removeprefix("lr").split("-s")
        lost = LOST.get(cell.name, [])
        onsets = ", ".join([f"{r['seed']}: {show(r['onset'])}" for r in rows]
                           + [f"{seed}: lost" for seed in lost])
        lines.append(f"| {lr} | {steps} | {len(done)} / {len(rows) + len(lost)} | "
                     f"{sum(r['onset'] is not None for r in done)} of {len(done)} | {onsets} |")
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="experiments/spiral: its pilot/ and study/ folders")
    parser.add_argument("--figure", type=Path, help="write the survival figure here (PNG)")
    args = parser.parse_args(argv)
    print("\n".join(pilot_table(args.root / "pilot")))
    if not (args.root / "study").is_dir():
        print(f"no {args.root / 'study'}: no counted seed has finished")
        return {}
    rows = study_rows(args.root / "study")
    result = outcome(rows)
    print("\n".join(tables(rows, result)))
    if args.figure:
        draw(rows, result, args.figure)
        print(f"figure: {args.figure}")
    return result


if __name__ == "__main__":
    main()
