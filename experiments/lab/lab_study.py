"""The LLD lab's pre-registered analysis (experiments/lab/prereg.md): does LLDS stop plain GRPO's collapse?

    .venv/bin/python experiments/lab/lab_study.py pilot experiments/lab/pilot [--figure F] [--cell lr1e-05-u4]
    .venv/bin/python experiments/lab/lab_study.py study experiments/lab/study [--figure F]

A tiny model trains 300 steps with plain GRPO ("grpo") or GRPO + LLDS ("llds"). The pilot finds the
mildest setting (lr, updates per rollout batch) at which plain GRPO learns and then collapses, over seeds
1000-1007 in experiments/lab/pilot/<cell>/grpo-s<seed>/; the study runs both arms there, experiments/lab/study/<arm>-s<seed>/.
The rules, fixed before the runs and the same for both arms:

- R10(s): mean training reward over steps s-9..s (s >= 10); P(s): the largest R10(u), 10 <= u <= s.
- collapse at s*: the first s >= 30 with P(s) > 0 and R10(s) <= P(s) / 2 after which R10 never again
  exceeds 0.8 P(s*), in a run whose last sampled held-out EM is at most half its best (step 0 included);
- learned: the peak R10 is at least R10(10) + 0.10;
- a pilot cell qualifies when >= 6 of its 8 runs learned, >= 6 collapsed and their median collapse step
  is >= 100; the mildest qualifying cell is chosen (smallest lr, then fewest updates per batch); when all six
  cells are complete and none qualifies, the lab stops there: "this small model does not spiral";
- H1: collapses on paired seeds, exact McNemar test; H2: final sampled held-out EM, LLDS - GRPO per
  seed, 95% percentile bootstrap over pairs. "LLDS helps" needs fewer collapses with p < 0.05 and the H2
  interval above 0 ("hurts" is the mirror). The study is void unless LLDS displaced the correct
  responses less: their summed positive displacement (d = log pi_old - log pi_theta, > 0 where they
  lost likelihood), LLDS - GRPO, has a paired interval excluding 0 and a mean below 0;
- secondary: time to collapse, area under the sampled EM curve, and whether a collapse shows the
  paper's phases (II: correct responses displaced while reward still holds; III: entropy or gradients blow up).

A run with fewer training steps logged than its config's `steps` is unfinished: listed, never counted.
A run whose sft_model.json names another SFT model than the registered one (a machine of another CPU kind
builds other bytes) is marked, and every table is given with and without such runs (prereg §6).
"""
import argparse
import json
import math
import re
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.lab.lab import PILOT_LRS, PILOT_UPDATES, REGISTERED  # noqa: E402
from experiments.lld_study.lld_study import bootstrap_mean  # noqa: E402
from plumbing.metrics_file import read_metrics  # noqa: E402

ARMS = {"grpo": "plain GRPO", "llds": "GRPO + LLDS"}
COLOURS = {"grpo": "tab:red", "llds": "tab:blue"}
RUN = re.compile(r"^(grpo|llds)-s(\d+)$")
SERIES = {"reward": "reward", "entropy": "entropy", "grad_norm": "grad_norm", "grad_norm_max": "grad_norm_max",
          "displacement": "lld/correct_displacement"}
WITHOUT = "**The same without the runs from another SFT build** (prereg §6):"
CELL_RUNS, CELL_MIN, CELL_MEDIAN = 8, 6, 100        # pilot: 8 seeds; >= 6 learn, >= 6 collapse, median >= 100


# ---- reading run folders ----

def read_run(folder) -> dict:
    """A run folder -> {name, arm, seed, config, finished, the SERIES as arrays (index s-1 holds step s,
    NaN where not logged), evals [(step, sampled held-out EM)] from step 0}."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise SystemExit(f"error: {folder / 'config.json'} not found; is {folder} a run folder written by train.py?")
    config = json.loads((folder / "config.json").read_text())
    by_step = {}
    if (folder / "metrics.jsonl").exists():           # a run that has not logged yet is simply unfinished
        for line in read_metrics(folder):             # eval values sit in their step's line or in one of their own
            by_step.setdefault(line["step"], {}).update({k: v for k, v in line.items() if v is not None})
    trained = [s for s in by_step if s >= 1]
    last = max(trained, default=0)
    arrays = {name: np.array([by_step.get(s, {}).get(key, np.nan) for s in range(1, last + 1)], dtype=float)
              for name, key in SERIES.items()}
    evals = [(s, by_step[s]["eval/em_sampled"]) for s in sorted(by_step) if "eval/em_sampled" in by_step[s]]
    return {"name": folder.name, "arm": "llds" if config.get("llds") else "grpo", "seed": config.get("seed"),
            "config": config, "finished": len(trained) >= config["steps"], **arrays, "evals": evals,
            "other_sft": other_sft(folder)}


def other_sft(folder: Path) -> bool:
    """Did the run start from an SFT model other than the registered one? (no sft_model.json: not known, not marked)"""
    f = folder / "sft_model.json"
    return f.exists() and json.loads(f.read_text())["sha256"] != REGISTERED["sft"]


def run_folders(folder: Path) -> list[Path]:
    """The grpo-s<N> / llds-s<N> folders directly under `folder`, by arm then seed."""
    found = [d for d in folder.iterdir() if d.is_dir() and RUN.match(d.name)] if folder.is_dir() else []
    return sorted(found, key=lambda d: (RUN.match(d.name).group(1), int(RUN.match(d.name).group(2))))


def updates_per_batch(config: dict) -> int:
    return config["prompts_per_step"] * config["group_size"] // config["mini_batch_size"]


# ---- the pre-registered measures ----

def r10(reward: np.ndarray) -> np.ndarray:
    """R10: index s-1 holds the mean reward of steps s-9..s (NaN before step 10; unlogged steps skipped)."""
    out = np.full(len(reward), np.nan)
    for s in range(10, len(reward) + 1):
        window = reward[s - 10:s][~np.isnan(reward[s - 10:s])]
        if window.size:
            out[s - 1] = window.mean()
    return out


def peak(r: np.ndarray) -> np.ndarray:
    """P: index s-1 holds the largest R10(u) over 10 <= u <= s (fmax skips the NaN before step 10)."""
    return np.fmax.accumulate(r)


def collapse_step(run: dict) -> int | None:
    """s*, the step at which the run collapsed by the module docstring's rule, or None."""
    ems = [em for _, em in run["evals"]]
    if not ems or ems[-1] > 0.5 * max(ems):           # held-out EM survived: not a collapse, whatever the reward did
        return None
    r = r10(run["reward"])
    p = peak(r)
    for s in range(30, len(r) + 1):
        if p[s - 1] > 0 and r[s - 1] <= 0.5 * p[s - 1] and not np.any(r[s:] > 0.8 * p[s - 1]):
            return s
    return None


def learned(run: dict) -> bool:
    """The peak R10 is at least R10(10) + 0.10."""
    r = r10(run["reward"])
    return len(r) >= 10 and bool(np.nanmax(r) >= r[9] + 0.10)


def phases(run: dict, s_star: int) -> dict:
    """Whether a collapse at s* shows the paper's phases. II: over steps s*-40..s*-10 the correct
    responses were displaced (displacement > 0: they lost likelihood) on >= 60% of the steps that
    measured it, while R10(s*-10) >= R10(s*-40).
    III: at some step s in s*-10..s*+10, entropy >= 1.5x the run's minimum, or grad_norm_max >= 5x its
    median over steps 1..s. Windows are clipped to the run, R10's to steps 10 and later."""
    r, disp = r10(run["reward"]), run["displacement"][max(0, s_star - 41):s_star - 10]
    disp = disp[~np.isnan(disp)]
    phase2 = (bool(disp.size) and np.mean(disp > 0) >= 0.6
              and r[s_star - 11] >= r[max(10, s_star - 40) - 1])
    entropy, spikes = run["entropy"], run["grad_norm_max"]
    window = range(max(1, s_star - 10), min(len(entropy), s_star + 10) + 1)
    phase3 = any(entropy[s - 1] >= 1.5 * np.nanmin(entropy) or spikes[s - 1] >= 5 * np.nanmedian(spikes[:s])
                 for s in window)
    return {"phase2": bool(phase2), "phase3": bool(phase3)}


def em_area(evals: list[tuple]) -> float | None:
    """Area under the sampled EM curve (trapezoid over the eval steps) divided by the step span."""
    if len(evals) < 2:
        return evals[0][1] if evals else None
    steps, ems = np.array(evals, dtype=float).T
    return float(np.sum((ems[1:] + ems[:-1]) / 2 * np.diff(steps)) / (steps[-1] - steps[0]))


def run_summary(run: dict) -> dict:
    """A run's outcome measures, by name."""
    s_star = collapse_step(run)
    ems = [em for _, em in run["evals"]]
    return {"name": run["name"], "arm": run["arm"], "seed": run["seed"], "finished": run["finished"],
            "other_sft": run["other_sft"],
            "steps": len(run["reward"]), "collapse": s_star, "em_final": ems[-1] if ems else None,
            "em_best": max(ems) if ems else None, "em_area": em_area(run["evals"]),
            "disp_lost": float(np.nansum(np.maximum(run["displacement"], 0.0))),
            **(phases(run, s_star) if s_star else {"phase2": None, "phase3": None})}


# ---- the pilot: which cell ----

def pilot_cells(folder: Path, registered_only: bool = False) -> list[dict]:
    """One summary per cell folder holding grpo-s<N> runs; only finished runs are counted."""
    cells = []
    for cell in sorted(d for d in folder.iterdir() if d.is_dir()) if folder.is_dir() else []:
        runs = [r for r in map(read_run, run_folders(cell)) if not (registered_only and r["other_sft"])]
        if not runs:
            continue
        done = [r for r in runs if r["finished"]]
        collapses = [s for s in map(collapse_step, done) if s is not None]
        n_learned, median = sum(map(learned, done)), float(np.median(collapses)) if collapses else None
        complete = len(done) >= CELL_RUNS
        cells.append({"cell": cell.name, "lr": runs[0]["config"]["lr"], "updates": updates_per_batch(runs[0]["config"]),
                      "finished": len(done), "other_sft": sum(r["other_sft"] for r in done),
                      "learned": n_learned, "collapsed": len(collapses),
                      "median_collapse": median, "complete": complete,
                      "qualifies": complete and n_learned >= CELL_MIN and len(collapses) >= CELL_MIN
                      and median >= CELL_MEDIAN,
                      "unfinished": [f"{cell.name}/{r['name']} ({len(r['reward'])} steps)"
                                     for r in runs if not r["finished"]],
                      "measures": [pilot_measures(r) for r in done]})
    return sorted(cells, key=lambda c: (c["lr"], c["updates"]))       # mildest first


MEASURES = {"R10 at step 10": ".2f", "peak R10": ".2f", "sampled EM, step 0": ".2f", "sampled EM, final": ".2f",
            "summed positive displacement (nats)": ".3f", "entropy, last 10 steps": ".3f"}


def pilot_measures(run: dict) -> dict:
    """What a finished pilot run did, by the names of MEASURES (descriptive: no rule reads them)."""
    r, ems = r10(run["reward"]), [em for _, em in run["evals"]]
    lost = np.nansum(np.maximum(run["displacement"], 0.0))
    return dict(zip(MEASURES, (r[9], np.nanmax(r), ems[0], ems[-1], lost,
                               np.nanmean(run["entropy"][-10:]))))


def choose_cell(cells: list[dict]) -> dict | None:
    """The mildest qualifying cell: smallest lr, then fewest updates per rollout batch; None if none qualifies."""
    return min((c for c in cells if c["qualifies"]), key=lambda c: (c["lr"], c["updates"]), default=None)


def undecided(cells: list[dict], chosen: dict | None) -> list[str]:
    """Incomplete cells that could still change the choice: milder than the chosen cell, or any if none is chosen."""
    return [c["cell"] for c in cells if not c["complete"]
            and (chosen is None or (c["lr"], c["updates"]) < (chosen["lr"], chosen["updates"]))]


def stopped(cells: list[dict]) -> bool:
    """The pilot's stop rule: every cell of the grid complete and none qualifies ("this small model does not spiral")."""
    return sum(c["complete"] for c in cells) >= len(PILOT_LRS) * len(PILOT_UPDATES) and choose_cell(cells) is None


def harshest(cells: list[dict]) -> dict:
    """The largest lr, then the most updates per rollout batch: where plain GRPO displaces most."""
    return max(cells, key=lambda c: (c["lr"], c["updates"]))


def pilot_report(cells: list[dict]) -> str:
    """The table of cells, the choice, and what the finished runs did (ranges over each cell's runs)."""
    out = ["| cell | runs finished | learned | collapsed | median collapse step | qualifies |", "|---" * 6 + "|"]
    for c in cells:
        median = "-" if c["median_collapse"] is None else f"{c['median_collapse']:g}"
        qualifies = ("yes" if c["qualifies"] else "no") if c["complete"] else "incomplete: cannot be chosen"
        marked = f" ({c['other_sft']} from another SFT build)" if c["other_sft"] else ""
        out.append(f"| {c['cell']} | {c['finished']} of {CELL_RUNS}{marked} | {c['learned']} | {c['collapsed']} | "
                   f"{median} | {qualifies} |")
    if unfinished := [name for c in cells for name in c["unfinished"]]:
        out.append(f"\nunfinished, not counted: {', '.join(unfinished)}")
    chosen = choose_cell(cells)
    complete, grid = sum(c["complete"] for c in cells), len(PILOT_LRS) * len(PILOT_UPDATES)
    out.append(f"\nchosen cell: {chosen['cell']} (lr {chosen['lr']:g}, {chosen['updates']} updates per rollout batch)"
               if chosen else "\nno cell qualifies: this small model does not spiral" if stopped(cells)
               else f"\nno cell qualifies yet: {complete} of the {grid} cells complete")
    if milder := undecided(cells, chosen):
        out.append(f"provisional: {', '.join(milder)} incomplete (fewer than {CELL_RUNS} finished runs)")
    rows = [(c["cell"], c["measures"]) for c in cells if c["measures"]]
    if rows:
        rows.append(("all cells", [m for _, ms in rows for m in ms]))
        out += ["\nWhat the finished runs did (lowest to highest over the cell's runs):\n",
                "| cell | " + " | ".join(MEASURES) + " |", "|---" * (len(MEASURES) + 1) + "|"]
    for name, measures in rows:
        out.append(f"| {name} | " + " | ".join(f"{min(m[k] for m in measures):{f}} to {max(m[k] for m in measures):{f}}"
                                              for k, f in MEASURES.items()) + " |")
    return "\n".join(out)


# ---- the study: does LLDS help ----

def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p on b and c discordant pairs: 2 P(X <= min(b, c)), X ~ Bin(b + c, 1/2), at most 1."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n)


def pairs_of(summaries: list[dict]) -> list[tuple[dict, dict]]:
    """(GRPO, LLDS) summaries of the seeds where both arms finished, by seed."""
    done = {(s["arm"], s["seed"]): s for s in summaries if s["finished"]}
    return [(done["grpo", seed], done["llds", seed]) for arm, seed in sorted(done)
            if arm == "grpo" and ("llds", seed) in done]


def decide(pairs: list[tuple[dict, dict]]) -> dict:
    """H1, H2, the manipulation check and the verdict ("LLDS helps", "LLDS hurts", "no difference shown", "void")."""
    b = sum(g["collapse"] is not None and l["collapse"] is None for g, l in pairs)    # only GRPO collapsed
    c = sum(g["collapse"] is None and l["collapse"] is not None for g, l in pairs)    # only LLDS collapsed
    p = mcnemar_p(b, c)
    em = bootstrap_mean([l["em_final"] - g["em_final"] for g, l in pairs])
    disp = bootstrap_mean([l["disp_lost"] - g["disp_lost"] for g, l in pairs])
    check = disp[0] < 0 and not disp[1] <= 0 <= disp[2]           # LLDS lost less likelihood
    verdict = ("void" if not check else "LLDS helps" if b > c and p < 0.05 and em[1] > 0
               else "LLDS hurts" if c > b and p < 0.05 and em[2] < 0 else "no difference shown")
    return {"b": b, "c": c, "p": p, "em": em, "disp": disp, "check": check, "verdict": verdict}


def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def run_table(summaries: list[dict]) -> str:
    """One row per finished run; the unfinished ones named below it."""
    out = ["| arm | seed | collapse step | final sampled EM | best sampled EM | "
           "summed positive displacement | phase II / III |", "|---" * 7 + "|"]
    for s in (s for s in summaries if s["finished"]):
        shows = "-" if s["collapse"] is None else " / ".join("yes" if s[k] else "no" for k in ("phase2", "phase3"))
        seed = f"{s['seed']} (other SFT build)" if s["other_sft"] else s["seed"]
        out.append(f"| {ARMS[s['arm']]} | {seed} | {s['collapse'] or '-'} | {fmt(s['em_final'])} | "
                   f"{fmt(s['em_best'])} | {s['disp_lost']:.2f} | {shows} |")
    if unfinished := [f"{s['name']} ({s['steps']} steps)" for s in summaries if not s["finished"]]:
        out.append(f"\nunfinished, not counted: {', '.join(unfinished)}")
    return "\n".join(out)


def paired_report(pairs: list[tuple[dict, dict]]) -> str:
    """Time to collapse and phases per arm, the paired differences, and the three-line verdict."""
    d, n = decide(pairs), len(pairs)
    arms = {label: [pair[i] for pair in pairs] for i, label in enumerate(ARMS.values())}    # pair = (GRPO, LLDS)
    out = ["| arm | pairs | collapsed | median collapse step (collapsed runs) | median, uncollapsed counted at "
           "the last step | phase II | phase III |", "|---" * 7 + "|"]
    for label, mine in arms.items():
        hit = [s for s in mine if s["collapse"]]
        median = fmt(np.median([s["collapse"] for s in hit]) if hit else None, "g")
        censored = np.median([s["collapse"] or s["steps"] for s in mine])
        out.append(f"| {label} | {n} | {len(hit)} | {median} | {censored:g} | "
                   f"{sum(s['phase2'] for s in hit)} of {len(hit)} | {sum(s['phase3'] for s in hit)} of {len(hit)} |")
    area = bootstrap_mean([l["em_area"] - g["em_area"] for g, l in pairs])
    out += ["", "| paired difference LLDS - GRPO | pairs | mean | 95% bootstrap interval |", "|---" * 4 + "|"]
    for name, m in (("final sampled held-out EM (H2)", d["em"]),
                    ("summed positive displacement (check)", d["disp"]),
                    ("area under the sampled EM curve", area)):
        out.append(f"| {name} | {n} | {m[0]:+.3f} | [{m[1]:+.3f}, {m[2]:+.3f}] |")
    g_em, l_em = (np.mean([s["em_final"] for s in mine]) for mine in arms.values())
    g_hit, l_hit = (sum(s["collapse"] is not None for s in mine) for mine in arms.values())
    em, disp = d["em"], d["disp"]
    why = " (the manipulation check failed: H1 and H2 test nothing)" if d["verdict"] == "void" else ""
    out += ["", f"**Collapses (H1):** plain GRPO {g_hit} of {n}, GRPO + LLDS {l_hit} of {n}; discordant pairs "
                f"{d['b']} only GRPO / {d['c']} only LLDS, exact McNemar p = {d['p']:.4g}.",
            f"**Final sampled held-out EM (H2):** {g_em:.3f} plain GRPO, {l_em:.3f} LLDS; paired LLDS - GRPO "
            f"{em[0]:+.3f} [{em[1]:+.3f}, {em[2]:+.3f}] over {n} pairs.",
            f"**Manipulation check:** summed positive displacement LLDS - GRPO {disp[0]:+.2f} "
            f"[{disp[1]:+.2f}, {disp[2]:+.2f}] nats: {'passed' if d['check'] else 'failed'}. "
            f"**Verdict: {d['verdict']}**{why}."]
    return "\n".join(out)


# ---- the figure ----

def median_line(lines: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, the per-step median over the seeds that logged the step)."""
    table = np.full((len(lines), max(map(len, lines))), np.nan)
    for i, y in enumerate(lines):
        table[i, :len(y)] = y
    keep = ~np.all(np.isnan(table), axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.arange(1, table.shape[1] + 1)[keep], np.nanmedian(table[:, keep], axis=0)


def draw(runs: list[dict], out: Path, title: str) -> Path:
    """2 x 2 panels over steps; per arm each seed a thin line, the per-step median bold, an x where a seed collapsed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("training reward (10-step trailing mean)", "reward", lambda r: r10(r["reward"])),
              ("correct responses' displacement (> 0: lost likelihood)",
               "nats (before - after the step)", lambda r: r["displacement"]),
              ("entropy", "entropy (nats per token)", lambda r: r["entropy"]),
              ("grad norm (log scale; steps without gradient left out)", "grad norm",
               lambda r: np.where(r["grad_norm"] > 0, r["grad_norm"], np.nan))]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for arm, label in ARMS.items():
        mine = [r for r in runs if r["arm"] == arm]
        for k, (ax, (_, _, values)) in enumerate(zip(axes.flat, panels)):
            lines = [values(r) for r in mine if len(r["reward"])]
            if not lines:
                continue
            for y in lines:
                ax.plot(np.arange(1, len(y) + 1), y, color=COLOURS[arm], linewidth=0.7, alpha=0.35)
            ax.plot(*median_line(lines), color=COLOURS[arm], linewidth=2.4,
                    label=f"{label}: {len(lines)} seeds (thin), median (bold)" if k == 0 else None)
        for r in mine:
            if (s := collapse_step(r)) is not None:
                axes[0, 0].plot([s], [r10(r["reward"])[s - 1]], "x", color=COLOURS[arm], markersize=9, mew=2)
    axes[0, 0].plot([], [], "x", color="black", mew=2, label="collapse (pre-registered rule)")
    axes[0, 1].axhline(0.0, color="grey", linewidth=0.8)
    axes[1, 1].set_yscale("log")
    for ax, (name, unit, _) in zip(axes.flat, panels):
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=3, fontsize=9, frameon=False)   # below the panels: hides no collapse
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


# ---- the command line ----

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    for part, folder in (("pilot", "folder of <cell>/grpo-s<N> runs"), ("study", "folder of {grpo,llds}-s<N> runs")):
        p = parts.add_parser(part, help=f"the {part}'s tables and decision")
        p.add_argument("folder", type=Path, help=folder)
        p.add_argument("--figure", type=Path, help="draw the figure into this PNG")
    parts.choices["pilot"].add_argument("--cell", help="the cell to draw (default: the chosen one; the harshest one "
                                                       "when the stop rule ended the pilot)")
    args = parser.parse_args(argv)
    if args.part == "pilot":
        cells = pilot_cells(args.folder)
        if not cells:
            print(f"error: no <cell>/grpo-s<N> run folders in {args.folder}", file=sys.stderr)
            return 2
        print(pilot_report(cells))
        if any(c["other_sft"] for c in cells):
            print(f"\n{WITHOUT}\n\n{pilot_report(pilot_cells(args.folder, registered_only=True))}")
        chosen = choose_cell(cells)
        cell = args.cell or (chosen or (harshest(cells) if stopped(cells) else {})).get("cell")
        if args.figure and (cell is None or not (args.folder / cell).is_dir()):
            print(f"no figure: {'no cell chosen yet' if cell is None else f'no cell {cell}'}; pass --cell NAME")
        elif args.figure:
            runs = [r for r in map(read_run, run_folders(args.folder / cell)) if r["finished"]]
            why = "" if args.cell or chosen else ", the harshest (no cell qualifies)"
            print(f"figure: {draw(runs, args.figure, f'pilot cell {cell}{why}')}")
        return 0
    runs = [read_run(d) for d in run_folders(args.folder)]
    if not runs:
        print(f"error: no grpo-s<N> / llds-s<N> run folders in {args.folder}", file=sys.stderr)
        return 2
    summaries = [run_summary(r) for r in runs]
    print(run_table(summaries))
    for registered_only in (False, True) if any(s["other_sft"] for s in summaries) else (False,):
        pairs = pairs_of([s for s in summaries if not (registered_only and s["other_sft"])])
        print(f"\n{WITHOUT}" if registered_only else "", end="")
        print("\n" + paired_report(pairs) if pairs else "\nno seed has both arms finished: no paired result yet")
    if args.figure:
        print(f"figure: {draw([r for r in runs if r['finished']], args.figure, f'LLD lab study: {args.folder}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
