"""The learning-rate x method map's tables and figure, from committed run folders alone (prereg.md).

    make lr-map    # lr_map.py --figure experiments/lr_map/map.png

The cells: experiments/lr_map/runs/lr<L>/<arm>-s<seed>/, and the spiral study's runs
(experiments/spiral/study/) as the 8e-5 cells of plain GRPO and GRPO + LLDS. Breakdown: the spiral
study's rule (spiral_study.breakdown_onset). Per cell: breakdowns with a Wilson interval, median
onset, mean final held-out EM with a bootstrap interval over seeds. Then each arm's learning-rate
sensitivity S = mean over the grid of (EM* - max(EM(lr), EM_0)), its best learning rate, the range
it trains without breaking down, the KL arms at 8e-5 against both, and the warning's replay.
"""
import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import monitor  # noqa: E402
from experiments.spiral import detector, spiral_study, survival  # noqa: E402

HERE = Path(__file__).resolve().parent
SPIRAL_STUDY = HERE.parent / "spiral" / "study"
GRID = (1e-5, 2e-5, 4e-5, 8e-5, 1.6e-4)
SPIRAL_LR = 8e-5
LINES = {"grpo": "plain GRPO", "llds": "GRPO + LLDS"}
KL = {"grpo-kl0.001": "plain GRPO + KL 0.001", "grpo-kl0.04": "plain GRPO + KL 0.04",
      "llds-kl0.001": "GRPO + LLDS + KL 0.001"}
NAMES = {**LINES, **KL}
RESAMPLES = 10_000


def map_rows(runs: Path = HERE / "runs", spiral: Path = SPIRAL_STUDY) -> list[dict]:
    """One row per run (spiral_study.run_row, with its lr and whether the map ran it)."""
    rows = [spiral_study.run_row(d) | {"lr": float(d.parent.name.removeprefix("lr")), "new": True}
            for d in sorted(runs.glob("lr*/*-s*")) if (d / "metrics.jsonl").exists()]
    rows += [spiral_study.run_row(d) | {"lr": SPIRAL_LR, "new": False}
             for d in sorted(spiral.glob("*-s*")) if (d / "metrics.jsonl").exists()]
    return sorted(rows, key=lambda r: (list(NAMES).index(r["arm"]), r["lr"], r["seed"]))


def cell(rows: list[dict], arm: str, lr: float) -> list[dict]:
    return [r for r in rows if r["arm"] == arm and math.isclose(r["lr"], lr)]


def final_em(rows: list[dict]) -> dict[int, float]:
    """{seed: final held-out EM} of the rows that have one."""
    return {r["seed"]: r["em_final"] for r in rows if r["em_final"] is not None}


def warm_start_em(rows: list[dict]) -> float:
    """EM_0: the held-out EM before training, one value per warm-start build, averaged."""
    return statistics.fmean({r["warm_start"]: r["em_before"] for r in rows
                             if r["em_before"] is not None}.values())


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k / n."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    centre, half = p + z2 / (2 * n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z2 / n)), min(1.0, (centre + half) / (1 + z2 / n))


def mean_interval(values, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Mean and its 95% percentile bootstrap interval (the paired bootstrap against zeros)."""
    return survival.paired_bootstrap([0.0] * len(values), values, resamples, seed)


def cell_stats(rows: list[dict]) -> dict:
    """What a cell's row of the table says: runs, breakdowns with their Wilson interval, median
    onset, mean final EM with its bootstrap interval."""
    onsets = [r["onset"] for r in rows if r["onset"] is not None]
    ems = list(final_em(rows).values())
    return {"runs": len(rows), "finished": sum(r["finished"] for r in rows),
            "breakdowns": len(onsets), "wilson": wilson(len(onsets), len(rows)),
            "median_onset": statistics.median(onsets) if onsets else None,
            "em": mean_interval(ems) if ems else None}


def grid_ems(rows: list[dict], arms=tuple(LINES)) -> dict[float, dict[str, dict[int, float]]]:
    """{lr: {arm: {seed: final EM}}} over the grid cells that every arm has runs in."""
    grid = {lr: {arm: final_em(cell(rows, arm, lr)) for arm in arms} for lr in GRID}
    return {lr: by_arm for lr, by_arm in grid.items() if all(by_arm.values())}


def sensitivity_of(means: np.ndarray, em0: float) -> np.ndarray:
    """S = mean over the lr grid (last axis) of EM* - max(EM(lr), EM_0), EM* the best cell or EM_0
    where none is above it."""
    floored = np.maximum(means, em0)
    return (floored.max(-1, keepdims=True) - floored).mean(-1)


def sensitivity(rows: list[dict], em0: float, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Each line's S over the grid cells both lines have, and LLDS - GRPO, with 95% bootstrap
    intervals: in each resample every lr cell's seeds are drawn once and used for both arms."""
    grid = grid_ems(rows)
    if not grid:
        return {}
    rng = np.random.default_rng(seed)
    point = {arm: [] for arm in LINES}
    boot = {arm: [] for arm in LINES}
    for lr, by_arm in grid.items():
        seeds = sorted(set.intersection(*(set(v) for v in by_arm.values())))
        draw = rng.integers(0, len(seeds), (resamples, len(seeds)))
        for arm, ems in by_arm.items():
            values = np.array([ems[s] for s in seeds])
            point[arm].append(values.mean())
            boot[arm].append(values[draw].mean(1))
    result = {"lrs": list(grid), "em0": em0}
    for arm in LINES:
        boot[arm] = sensitivity_of(np.stack(boot[arm], 1), em0)          # (resamples,)
        result[arm] = {"S": float(sensitivity_of(np.array(point[arm]), em0)),
                       "interval": tuple(np.percentile(boot[arm], [2.5, 97.5]))}
    diff = boot["llds"] - boot["grpo"]
    result["diff"] = {"S": result["llds"]["S"] - result["grpo"]["S"],
                      "interval": tuple(np.percentile(diff, [2.5, 97.5]))}
    return result


def best_lr(rows: list[dict]) -> dict:
    """Each line's learning rate of its best mean final EM, and at each such lr the difference
    LLDS - GRPO paired by seed."""
    result = {}
    for arm in LINES:
        means = {lr: statistics.fmean(ems.values()) for lr in GRID
                 if (ems := final_em(cell(rows, arm, lr)))}
        if not means:
            continue
        lr = max(means, key=means.get)
        g, l = final_em(cell(rows, "grpo", lr)), final_em(cell(rows, "llds", lr))
        shared = sorted(set(g) & set(l))
        result[arm] = {"lr": lr, "em": means[lr], "diff": survival.paired_bootstrap(
            [g[s] for s in shared], [l[s] for s in shared]) if shared else None}
    return result


def trained_range(rows: list[dict], em0: float) -> dict:
    """Each line's learning rates with no breakdown in any run, and those with mean EM > EM_0."""
    result = {}
    for arm in LINES:
        cells = {lr: cell(rows, arm, lr) for lr in GRID if cell(rows, arm, lr)}
        result[arm] = {
            "calm": [lr for lr, rs in cells.items() if all(r["onset"] is None for r in rs)],
            "above": [lr for lr, rs in cells.items()
                      if (ems := final_em(rs)) and statistics.fmean(ems.values()) > em0],
            "run": list(cells)}
    return result


def kl_comparison(rows: list[dict]) -> list[dict]:
    """Each KL arm at 8e-5 against plain GRPO and GRPO + LLDS there: breakdowns with Fisher's p
    (all runs) and final EM, KL arm - other, paired by seed over the seeds both have."""
    result = []
    for arm in KL:
        mine = cell(rows, arm, SPIRAL_LR)
        if not mine:
            continue
        for other in LINES:
            theirs = cell(rows, other, SPIRAL_LR)
            a, b = final_em(theirs), final_em(mine)
            shared = sorted(set(a) & set(b))
            k, m = (sum(r["onset"] is not None for r in rs) for rs in (mine, theirs))
            result.append({"arm": arm, "other": other, "breakdowns": (k, len(mine)),
                           "other_breakdowns": (m, len(theirs)),
                           "fisher_p": survival.fisher_exact(k, len(mine), m, len(theirs)),
                           "diff": survival.paired_bootstrap([a[s] for s in shared],
                                                             [b[s] for s in shared])
                           if shared else None})
    return result


def warning_replay(rows: list[dict], folder: Path = HERE / "runs") -> list[tuple[str, dict]]:
    """monitor.RULE, unchanged, over the map's new runs: per cell, then pooled."""
    runs = {}
    for r in rows:
        if r["new"]:
            lines = detector.training_lines(folder / f"lr{format_lr(r['lr'])}" / r["run"])
            runs.setdefault((r["arm"], r["lr"]), []).append({"run": r["run"], "lines": lines,
                                                             "onset": r["onset"]})
    scored = [(f"{NAMES[arm]}, lr {format_lr(lr)}", detector.score(monitor.RULE, rs))
              for (arm, lr), rs in runs.items()]
    pooled = [run for rs in runs.values() for run in rs]
    return scored + ([("**pooled**", detector.score(monitor.RULE, pooled))] if pooled else [])


def format_lr(lr: float) -> str:
    """8e-05 -> '8e-5', 0.00016 -> '1.6e-4': the spelling of the folders and the prereg."""
    mantissa, exponent = f"{lr:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def show(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def interval(d: dict | None, spec: str = ".2f") -> str:
    return "-" if d is None else f"{d['mean']:{spec}} [{d['low']:{spec}}, {d['high']:{spec}}]"


def cell_table(rows: list[dict]) -> list[str]:
    lines = ["| arm | lr | runs finished / started | breakdowns (95% Wilson) | median onset | "
             "final held-out EM, mean [95%] |", "|---|---|---|---|---|---|"]
    for arm, name in NAMES.items():
        for lr in GRID:
            rs = cell(rows, arm, lr)
            if not rs:
                continue
            c = cell_stats(rs)
            low, high = c["wilson"]
            lines.append(f"| {name} | {format_lr(lr)} | {c['finished']} / {c['runs']} | "
                         f"{c['breakdowns']} / {c['runs']} ({low:.2f}-{high:.2f}) | "
                         f"{show(c['median_onset'], 'g')} | {interval(c['em'])} |")
    return lines


def summary_lines(rows: list[dict]) -> list[str]:
    """Sensitivity, best learning rates, ranges and the KL comparison, as lines of text."""
    em0 = warm_start_em(rows)
    lines = [f"- EM_0 (the warm-start's held-out EM): {em0:.2f}"]
    sens = sensitivity(rows, em0)
    if sens:
        lrs = ", ".join(map(format_lr, sens["lrs"]))
        lines.append(f"- learning-rate sensitivity S over lr {lrs} (lower is less sensitive): " +
                     "; ".join(f"{NAMES[a]} {sens[a]['S']:.3f} [{sens[a]['interval'][0]:.3f}, "
                               f"{sens[a]['interval'][1]:.3f}]" for a in LINES) +
                     f"; LLDS - GRPO {sens['diff']['S']:+.3f} [{sens['diff']['interval'][0]:+.3f},"
                     f" {sens['diff']['interval'][1]:+.3f}] (95% bootstrap)")
    best = best_lr(rows)
    heads = {arm: (f"{NAMES[arm]}'s", f"{b['em']:.2f}") for arm, b in best.items()}
    if len(best) == 2 and best["grpo"]["lr"] == best["llds"]["lr"]:      # one cell: say it once
        heads = {"grpo": ("both arms'", f"{best['grpo']['em']:.2f} and {best['llds']['em']:.2f}")}
    for arm, (who, em) in heads.items():
        b = best[arm]
        lines.append(f"- {who} best lr {format_lr(b['lr'])} (mean final EM {em}); there LLDS - "
                     f"GRPO paired over {n_seeds(b['diff']['pairs'])}: "
                     f"{interval(b['diff'], '+.3f')}"
                     if b["diff"] else f"- {who} best lr {format_lr(b['lr'])}")
    for arm, r in trained_range(rows, em0).items():
        lines.append(f"- {NAMES[arm]}: no breakdown at lr {lr_list(r['calm'])}; mean final EM "
                     f"above EM_0 at lr {lr_list(r['above'])} (of {lr_list(r['run'])})")
    kl = kl_comparison(rows)
    if kl:
        lines += ["", "| at lr 8e-5 | against | breakdowns | Fisher's p | final EM difference, "
                  "paired [95%] |", "|---|---|---|---|---|"]
        for c in kl:
            (k, n), (m, t) = c["breakdowns"], c["other_breakdowns"]
            d = c["diff"]
            lines.append(f"| {NAMES[c['arm']]} | {NAMES[c['other']]} | {k} / {n} vs {m} / {t} | "
                         f"{c['fisher_p']:.3g} | {interval(d, '+.3f')}"
                         + (f" over {n_seeds(d['pairs'])}" if d else "") + " |")
    return lines


def n_seeds(n: int) -> str:
    return f"{n} seed" + "s" * (n != 1)


def lr_list(lrs: list[float]) -> str:
    return ", ".join(map(format_lr, lrs)) or "none"


def answer(rows: list[dict]) -> str:
    """The map's three answers in words, from its numbers (the README's and the project README's):
    LLDS against plain GRPO at each one's best learning rate, the range each trains without a
    breakdown, and what the KL terms did at 8e-5. A difference is named only where its interval
    excludes 0 (EM) or Fisher's p < 0.05 (breakdowns)."""
    best = best_lr(rows)
    g, l = best["grpo"], best["llds"]
    sentences = [f"Both arms were best at lr {format_lr(g['lr'])} (mean final EM {g['em']:.2f} and "
                 f"{l['em']:.2f}); there {diff_words(g['diff'])}" if g["lr"] == l["lr"] else
                 f"At plain GRPO's best learning rate, {best_words(g)}; at GRPO + LLDS's, "
                 f"{best_words(l)}"]
    sentences.append("Without a breakdown in any run: " + "; ".join(
        f"{NAMES[arm]} at lr {lr_list(r['calm'])}"
        for arm, r in trained_range(rows, warm_start_em(rows)).items()))
    kl = [c for c in kl_comparison(rows) if c["other"] == "grpo" and c["diff"]]
    if kl:
        (m, t) = kl[0]["other_breakdowns"]
        sentences.append(f"At 8e-5, against plain GRPO's {m} of {t} breakdowns: " + "; ".join(
            f"{NAMES[c['arm']]} broke down in {c['breakdowns'][0]} of {c['breakdowns'][1]} "
            f"(Fisher's p = {c['fisher_p']:.2g}), final EM {c['diff']['mean']:+.2f} "
            f"[{c['diff']['low']:+.2f}, {c['diff']['high']:+.2f}] against it" for c in kl))
    return ". ".join(sentences)


def advice(rows: list[dict]) -> str:
    """The map's answer as advice, in words (the project README's "Use LLDS" section): tune the
    learning rate first unless LLDS's registered difference at plain GRPO's best learning rate
    excludes 0. The sensitivity and the paper's KL 0.001 are named where they show a difference:
    LLDS - GRPO's sensitivity interval excludes 0, Fisher's test on plain GRPO's breakdowns at
    8e-5 with and without the KL gives p < 0.05."""
    d = best_lr(rows)["grpo"]["diff"]
    helped = d["low"] > 0
    text = ("In the learning-rate map, LLDS added final EM even at plain GRPO's best learning rate"
            if helped else "Tune the learning rate first: in the learning-rate map, at plain "
            "GRPO's best learning rate LLDS " + ("lowered final EM" if d["high"] < 0 else
                                                 f"made no difference to final EM that "
                                                 f"{n_seeds(d['pairs'])} could show"))
    sens = sensitivity(rows, warm_start_em(rows))
    low, high = sens["diff"]["interval"] if sens else (0, 0)
    if low > 0 or high < 0:
        less = high < 0
        text += (f"{', and' if helped == less else ', but'} it made final EM "
                 f"{'less' if less else 'more'} sensitive to the learning rate")
    kl = next((c for c in kl_comparison(rows)
               if (c["arm"], c["other"]) == ("grpo-kl0.001", "grpo")), None)
    if kl and kl["fisher_p"] < 0.05:
        (k, n), (m, t) = kl["breakdowns"], kl["other_breakdowns"]
        text += (f"; at 8e-5 the paper's KL 0.001 alone {'cut' if k / n < m / t else 'raised'} "
                 f"plain GRPO's breakdowns")
    return text


def best_words(b: dict) -> str:
    """An arm's best learning rate in words: '2e-5 (mean final EM 0.78), LLDS - GRPO was -0.07
    [-0.13, -0.01] over 8 seeds (LLDS lower)'."""
    return f"{format_lr(b['lr'])} (mean final EM {b['em']:.2f}), {diff_words(b['diff'])}"


def diff_words(d: dict) -> str:
    """'LLDS - GRPO was -0.07 [-0.13, -0.01] over 8 seeds (LLDS lower)'."""
    return (f"LLDS - GRPO was {d['mean']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}] over "
            f"{n_seeds(d['pairs'])} ({verdict(d)})")


def verdict(d: dict) -> str:
    return ("no difference shown" if d["low"] <= 0 <= d["high"]
            else "LLDS higher" if d["low"] > 0 else "LLDS lower")


def warning_table(rows: list[dict]) -> list[str]:
    lines = ["| cell (new runs) | breakdowns warned >= 2 steps before | median lead (steps) | "
             "false alarms / runs without a breakdown | per 10 |", "|---|---|---|---|---|"]
    for name, s in warning_replay(rows):
        lines.append(f"| {name} | {s['warned']} / {s['breakdowns']} | "
                     f"{show(s['median_lead'], 'g')} | {s['false_alarms']} / {s['calm']} | "
                     f"{show(s['alarms_per_10'], '.1f')} |")
    return lines


def draw(rows: list[dict], out: Path) -> None:
    """Mean final EM against lr (log axis) per line with 95% intervals, the KL cells at 8e-5,
    EM_0 dashed, each point labelled with its breakdowns x/N."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for colour, arm in zip(("C3", "C0"), LINES):
        points = [(lr, cell_stats(cell(rows, arm, lr))) for lr in GRID if cell(rows, arm, lr)]
        points = [(lr, c) for lr, c in points if c["em"]]
        if not points:
            continue
        x = [lr for lr, _ in points]
        y = [c["em"]["mean"] for _, c in points]
        err = [[c["em"]["mean"] - c["em"]["low"] for _, c in points],
               [c["em"]["high"] - c["em"]["mean"] for _, c in points]]
        ax.errorbar(x, y, yerr=err, color=colour, marker="o", capsize=3, label=NAMES[arm])
        for lr, c in points:
            ax.annotate(f"{c['breakdowns']}/{c['runs']}", (lr, c["em"]["mean"]), color=colour,
                        textcoords="offset points", xytext=(6, -12 if arm == "grpo" else 6),
                        fontsize=8)
    for (arm, name), marker, dx in zip(KL.items(), ("s", "D", "^"), (0.9, 1.1, 1.2)):
        c = cell_stats(cell(rows, arm, SPIRAL_LR))
        if not c["em"]:
            continue
        x = SPIRAL_LR * dx          # side by side at 8e-5, so that the intervals do not overlap
        ax.errorbar([x], [c["em"]["mean"]], yerr=[[c["em"]["mean"] - c["em"]["low"]],
                                                  [c["em"]["high"] - c["em"]["mean"]]],
                    color="C2" if arm.startswith("grpo") else "C4", marker=marker, capsize=3,
                    linestyle="none", label=f"{name} (at 8e-5)")
        ax.annotate(f"{c['breakdowns']}/{c['runs']}", (x, c["em"]["mean"]), fontsize=8,
                    textcoords="offset points", xytext=(6, 0))
    ax.axhline(warm_start_em(rows), color="grey", linestyle="--", label="warm-start")
    ax.set_xscale("log")
    ax.set_xticks(GRID, [format_lr(lr) for lr in GRID])
    ax.minorticks_off()
    ax.set_xlabel("learning rate (15 steps)")
    ax.set_ylabel("final held-out EM (mean, 95% bootstrap)")
    ax.set_ylim(-0.02, 1.0)
    ax.set_title("labels: runs that broke down / runs", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--figure", type=Path, help="write the map's figure here (PNG)")
    args = parser.parse_args(argv)
    rows = map_rows()
    print("\n".join(cell_table(rows) + [""] + summary_lines(rows) + [""] + warning_table(rows)))
    if args.figure:
        draw(rows, args.figure)
        print(f"figure: {args.figure}")
    return rows


if __name__ == "__main__":
    main()
