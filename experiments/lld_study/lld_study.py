"""The LLD study: plain GRPO vs GRPO + LLDS over many seeds, every number from committed run folders.

    .venv/bin/python experiments/lld_study/lld_study.py experiments/lld_study/compare                      # the README's tables
    .venv/bin/python experiments/lld_study/lld_study.py experiments/lld_study/compare --figure experiments/lld_study/compare.png
    .venv/bin/python experiments/lld_study/lld_study.py experiments/lld_study/compare --score 200 --checkpoints runs

Run folders are named compare-grpo-s<seed> and compare-llds-s<seed> (what `make compare` writes),
each with metrics.jsonl, config.json and machine.json (CPU, and whether bf16 autocast ran).
Runs of different precision are never pooled: each precision gets its own tables.

Outcome measures (fixed before the seeds 3+ ran; the collapse rule is experiments/lld_study/lld_table.py's):
- collapses out of the runs of an arm;
- final held-out EM (30 fixed questions, greedy) per seed, and the paired difference LLDS - GRPO
  per seed with its mean and a 95% bootstrap interval over seeds (10,000 resamples, percentile);
- the same on 200 held-out questions, for the runs whose final checkpoint was scored (--score);
- training reward over the last 5 steps;
- displacement of the correct responses (`lld/correct_displacement`: d = log pi_old - log pi_theta
  summed over a response, > 0 where it lost likelihood): summed over the steps where it was
  positive, the worst (largest) step, and the number of steps where it was positive.
Added after seeds 0-8 had run, and labelled post hoc wherever it is printed: held-out EM at or
below 0.05 (1 of 30 questions) at an evaluation after step 0, a breakdown the collapse rule does
not see when entropy falls instead of rising.

--score N evaluates the final checkpoint of every finished run found under --checkpoints (the
folder train.py wrote, e.g. runs/compare-grpo-s3) on the first N questions of the run's fixed
held-out order (the training evaluation's 30 are among them), with the run's own turn settings
and greedy decoding, through eval.py; it writes heldout<N>.json beside the committed metrics.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.lld_study.lld_table import collapse_step  # noqa: E402
from plumbing.metrics_file import read_metrics  # noqa: E402

ARMS = {"grpo": "plain GRPO", "llds": "GRPO + LLDS"}
COLOURS = {"grpo": "tab:red", "llds": "tab:blue"}
NAME = re.compile(r"compare-(grpo|llds)-s(\d+)$")
EM_LOW = 0.05                                         # post hoc: "held-out EM fell to <= 0.05"


def precision(run_dir: Path) -> str:
    """"bf16" / "fp32" from machine.json ("mixed" if a resume changed it, "unknown" without it)."""
    path = run_dir / "machine.json"
    if not path.exists():
        return "unknown"
    kinds = {"bf16" if m["bf16_autocast"] else "fp32" for m in json.loads(path.read_text())}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def run_summary(run_dir: Path) -> dict:
    """One run's outcome measures, from its metrics.jsonl (and heldout*.json when scored)."""
    lines = read_metrics(run_dir)
    train = [l for l in lines if "reward" in l]
    steps = json.loads((run_dir / "config.json").read_text())["steps"]
    evals = [(l["step"], l["eval/em"]) for l in lines if l.get("eval/em") is not None]
    disp = [l["lld/correct_displacement"] for l in train
            if l.get("lld/correct_displacement") is not None]
    arm, seed = NAME.search(run_dir.name).groups()
    finished = bool(train) and train[-1]["step"] == steps
    out = {"run": run_dir.name, "arm": arm, "seed": int(seed), "precision": precision(run_dir),
           "steps": len(train), "finished": finished,
           "collapse": collapse_step(train) if train else None,
           "em_low": next((s for s, em in evals if s > 0 and em <= EM_LOW), None),
           "em_first": evals[0][1] if evals else None,
           "em_final": evals[-1][1] if finished and evals and evals[-1][0] == steps else None,
           "reward_last5": statistics.fmean(l["reward"] for l in train[-5:]) if finished else None,
           "disp_sum": sum(d for d in disp if d > 0), "disp_worst": max(disp, default=None),
           "disp_pos_steps": sum(d > 0 for d in disp), "em_heldout": {}}
    for path in run_dir.glob("heldout*.json"):
        scored = json.loads(path.read_text())
        out["em_heldout"][scored["questions"]] = scored["eval/em"]
    return out


def bootstrap_mean(values: list[float], n: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of `values` and its 95% percentile-bootstrap interval (resampling the values)."""
    x = np.asarray(values, dtype=float)
    means = np.random.default_rng(seed).choice(x, size=(n, len(x)), replace=True).mean(axis=1)
    return float(x.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def paired(runs: list[dict], key) -> list[tuple[int, float, float]]:
    """(seed, GRPO value, LLDS value) for the seeds where both arms have the value."""
    by_seed = {}
    for r in runs:
        by_seed.setdefault(r["seed"], {})[r["arm"]] = key(r)
    return [(s, v["grpo"], v["llds"]) for s, v in sorted(by_seed.items())
            if v.get("grpo") is not None and v.get("llds") is not None]


def study_tables(runs: list[dict]) -> str:
    """The README's tables for runs of one precision: per arm, paired differences, per seed."""
    out = []
    sizes = sorted({n for r in runs for n in r["em_heldout"]})
    big = sizes[-1] if sizes else None
    out.append("| arm | runs finished / started | collapses | EM fell to <= 0.05 (post hoc) | final EM, 30 q (mean) | "
               + (f"final EM, {big} q (mean, runs) | " if big else "")
               + "reward, last 5 steps (mean) | summed positive displacement (mean) | "
               "worst displacement (median) | steps with positive displacement (mean of 20) |")
    out.append("|---" * (9 + bool(big)) + "|")
    for arm, label in ARMS.items():
        mine = [r for r in runs if r["arm"] == arm]
        done = [r for r in mine if r["finished"]]
        if not mine:
            continue
        big_scores = [r["em_heldout"][big] for r in done if big in r["em_heldout"]]
        cells = [label, f"{len(done)} / {len(mine)}",
                 f"{sum(r['collapse'] is not None for r in done)} / {len(done)}",
                 f"{sum(r['em_low'] is not None for r in done)} / {len(done)}",
                 fmt(statistics.fmean(r["em_final"] for r in done) if done else None)]
        if big:
            cells.append(f"{fmt(statistics.fmean(big_scores) if big_scores else None)} ({len(big_scores)})")
        cells += [fmt(statistics.fmean(r["reward_last5"] for r in done) if done else None),
                  fmt(statistics.fmean(r["disp_sum"] for r in done) if done else None, ".1f"),
                  fmt(statistics.median(r["disp_worst"] for r in done) if done else None, ".1f"),
                  fmt(statistics.fmean(r["disp_pos_steps"] for r in done) if done else None, ".1f")]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    measures = [("final EM, 30 questions", lambda r: r["em_final"]),
                ("reward, last 5 steps", lambda r: r["reward_last5"]),
                ("summed positive displacement (nats)",
                 lambda r: r["disp_sum"] if r["finished"] else None)]
    if big:
        measures.insert(1, (f"final EM, {big} questions", lambda r: r["em_heldout"].get(big)))
    out.append("| paired difference LLDS - GRPO | seeds | mean | 95% bootstrap interval | LLDS higher / lower / tied |")
    out.append("|---|---|---|---|---|")
    for name, key in measures:
        pairs = paired(runs, key)
        if len(pairs) < 2:
            continue
        diffs = [b - a for _, a, b in pairs]
        mean, lo, hi = bootstrap_mean(diffs)
        out.append(f"| {name} | {len(pairs)} | {mean:+.3f} | [{lo:+.3f}, {hi:+.3f}] | "
                   f"{sum(d > 0 for d in diffs)} / {sum(d < 0 for d in diffs)} / {sum(d == 0 for d in diffs)} |")
    out.append("")
    out.append("| seed | final EM 30 q: GRPO / LLDS | " + (f"EM {big} q: GRPO / LLDS | " if big else "")
               + "collapse: GRPO / LLDS | EM <= 0.05 (post hoc): GRPO / LLDS | "
               "summed positive displacement: GRPO / LLDS |")
    out.append("|---" * (5 + bool(big)) + "|")
    for seed in sorted({r["seed"] for r in runs}):
        g = next((r for r in runs if r["seed"] == seed and r["arm"] == "grpo"), None)
        l = next((r for r in runs if r["seed"] == seed and r["arm"] == "llds"), None)

        def both(f):
            return " / ".join(f(r) if r else "not run" for r in (g, l))

        def em(r):
            return fmt(r["em_final"]) if r["finished"] else f"unfinished ({r['steps']} steps)"

        cells = [str(seed), both(em)]
        if big:
            cells.append(both(lambda r: fmt(r["em_heldout"].get(big))))
        cells += [both(lambda r: f"step {r['collapse']}" if r["collapse"] else "-"),
                  both(lambda r: f"step {r['em_low']}" if r["em_low"] else "-"),
                  both(lambda r: fmt(r["disp_sum"], ".1f"))]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def headline(runs: list[dict]) -> str:
    """The study's result in three lines, numbers first (the README's and experiments/lld_study/README.md's)."""
    done = [r for r in runs if r["finished"]]
    arm = {a: [r for r in done if r["arm"] == a] for a in ARMS}

    def mean(a, key):
        values = [key(r) for r in arm[a] if key(r) is not None]
        return statistics.fmean(values) if values else None

    def diff(key):                    # LLDS - GRPO: (mean, lo, hi, LLDS higher, LLDS lower, seeds)
        diffs = [b - a for _, a, b in paired(done, key)]
        if len(diffs) < 2:
            return None
        return (*bootstrap_mean(diffs), sum(d > 0 for d in diffs), sum(d < 0 for d in diffs),
                len(diffs))

    def interval(d, spec):
        return f"{d[0]:{spec}} [{d[1]:{spec}}, {d[2]:{spec}}]"

    disp, em, reward = diff(lambda r: r["disp_sum"]), diff(lambda r: r["em_final"]), diff(lambda r: r["reward_last5"])
    if not (disp and em and reward):
        return "(fewer than two seeds with both arms finished: no paired result yet)"
    sizes = sorted({n for r in done for n in r["em_heldout"]})
    untouched = sum(a == b == 0 for _, a, b in paired(done, lambda r: r["disp_sum"]))
    tied = f" (in {untouched} neither arm displaced them)" if untouched else ""
    lines = [f"**LLDS cut the displacement of correct responses in {disp[4]} of {disp[5]} seeds"
             f"{tied}:** their summed positive displacement (mean over seeds) was "
             f"{mean('grpo', lambda r: r['disp_sum']):.1f} nats under plain GRPO and "
             f"{mean('llds', lambda r: r['disp_sum']):.1f} under LLDS (paired difference "
             f"{disp[0]:+.1f}, 95% bootstrap interval [{disp[1]:+.1f}, {disp[2]:+.1f}])."]
    outcome = (f"Plain GRPO collapsed in {sum(r['collapse'] is not None for r in arm['grpo'])} of {len(arm['grpo'])} "
               f"runs, LLDS in {sum(r['collapse'] is not None for r in arm['llds'])} of {len(arm['llds'])}; final "
               f"held-out EM (30 questions) {mean('grpo', lambda r: r['em_final']):.2f} against "
               f"{mean('llds', lambda r: r['em_final']):.2f}, paired difference LLDS - GRPO {interval(em, '+.2f')}, "
               f"LLDS higher in {em[3]} of {em[5]} seeds")
    big = diff(lambda r: r["em_heldout"].get(sizes[-1])) if sizes else None
    if big:
        seeds = [s for s, _, _ in paired(done, lambda r: r["em_heldout"].get(sizes[-1]))]
        outcome += (f"; on {sizes[-1]} questions (seeds {seeds[0]}-{seeds[-1]}) "
                    f"{mean('grpo', lambda r: r['em_heldout'].get(sizes[-1])):.2f} against "
                    f"{mean('llds', lambda r: r['em_heldout'].get(sizes[-1])):.2f}, paired {interval(big, '+.2f')}")
    lines.append(f"**Outcome:** {outcome}.")
    lines.append(f"Training reward over the last 5 steps: {mean('grpo', lambda r: r['reward_last5']):.2f} plain GRPO, "
                 f"{mean('llds', lambda r: r['reward_last5']):.2f} LLDS (paired {interval(reward, '+.2f')}). "
                 f"{min(len(a) for a in arm.values())} seeds per arm.")
    return "\n".join(lines)


def draw(run_dirs: list[Path], runs: list[dict], out: Path) -> Path:
    """Four panels; one colour per arm, each seed a thin line, the per-step median bold, an X
    where a run collapsed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("training reward", "reward"), ("held-out EM (30 questions)", "eval/em"),
              ("correct responses' displacement (> 0: lost)", "lld/correct_displacement"),
              ("entropy", "entropy")]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for arm, label in ARMS.items():
        mine = [(d, r) for d, r in zip(run_dirs, runs) if r["arm"] == arm]
        for ax, (title, key) in zip(axes, panels):
            per_step = {}
            for d, r in mine:
                points = [(l["step"], l[key]) for l in read_metrics(d) if l.get(key) is not None]
                for s, v in points:
                    per_step.setdefault(s, []).append(v)
                if points:
                    ax.plot(*zip(*points), color=COLOURS[arm], linewidth=0.7, alpha=0.35)
                if key == "reward" and r["collapse"]:
                    at = dict(points)[r["collapse"]]
                    ax.plot([r["collapse"]], [at], "X", color=COLOURS[arm], markersize=8,
                            markeredgecolor="black", markeredgewidth=0.6)
            steps = sorted(per_step)
            ax.plot(steps, [statistics.median(per_step[s]) for s in steps], color=COLOURS[arm], linewidth=2.4,
                    label=f"{label}: {len(mine)} seeds (thin), median (bold)" if key == "reward" else None)
    for ax, (title, key) in zip(axes, panels):
        if key == "lld/correct_displacement":
            ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].plot([], [], "X", color="grey", markeredgecolor="black", label="collapse")
    fig.legend(loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return out


def score_final_checkpoints(run_dirs: list[Path], checkpoints: Path, n: int) -> None:
    """Write heldout<n>.json beside each committed run whose finished checkpoint is under `checkpoints`."""
    import dataclasses

    import torch

    import data
    import retriever as retrieval
    import train
    from eval import heldout_eval, resolve_model
    from plumbing import runs as run_files
    from plumbing import fast_hf
    from plumbing.models import load_policy

    for run_dir in run_dirs:
        target = run_dir / f"heldout{n}.json"
        cfg = train.Config(**json.loads((run_dir / "config.json").read_text()))
        ckpt = run_files.find_checkpoint(checkpoints / run_dir.name)
        if target.exists() or ckpt is None or int(ckpt.name.split("-")[1]) != cfg.steps:
            continue
        model, tokenizer = load_policy(resolve_model(str(ckpt)))
        fast_hf.use_fast_attention(model)                      # as train.py scored it
        records = data.heldout_set(cfg.eval_data or cfg.data, n)
        retriever = retrieval.open_retriever(cfg.retriever, corpus=data.corpus_for([cfg.data], cfg.retriever, cfg.corpus),
                                             index=cfg.index or None)
        eval_cfg = train.rollout_config(cfg, greedy=True, max_turns=cfg.eval_max_turns)
        print(f"{run_dir.name}: scoring {ckpt.name} on {len(records)} held-out questions")
        with torch.no_grad():
            scores = heldout_eval(model, tokenizer, records, retriever, eval_cfg)
        scores = {**scores, "questions": len(records), "checkpoint": ckpt.name,
                  "bf16_autocast": train.fast_hf.bf16_supported(torch.device("cpu")) and cfg.bf16,
                  "cpu": run_files.cpu_model(), "setting": dataclasses.asdict(eval_cfg)}
        target.write_text(json.dumps(scores, indent=1))
        print(f"{run_dir.name}: EM {scores['eval/em']:.3f} on {len(records)} questions -> {target}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="folder holding compare-{grpo,llds}-s<seed> run folders")
    parser.add_argument("--figure", type=Path, help="draw the study figure into this PNG")
    parser.add_argument("--score", type=int, metavar="N", help="score finished runs' final checkpoints on N questions")
    parser.add_argument("--checkpoints", type=Path, default=Path("runs"), help="where train.py wrote the runs (for --score)")
    args = parser.parse_args(argv)
    run_dirs = sorted((d for d in args.folder.iterdir() if NAME.search(d.name)),
                      key=lambda d: (int(NAME.search(d.name).group(2)), d.name))
    if not run_dirs:
        raise SystemExit(f"error: no compare-grpo-s<N> / compare-llds-s<N> folders in {args.folder}")
    if args.score:
        score_final_checkpoints(run_dirs, args.checkpoints, args.score)
    runs = [run_summary(d) for d in run_dirs]
    for kind in sorted({r["precision"] for r in runs}):
        group = [r for r in runs if r["precision"] == kind]
        print(f"### {kind}: seeds {', '.join(str(s) for s in sorted({r['seed'] for r in group}))}\n")
        print(headline(group) + "\n")
        print(study_tables(group) + "\n")
    if args.figure:                                   # the precision with the most runs; never pooled
        kind = max({r["precision"] for r in runs}, key=lambda k: sum(r["precision"] == k for r in runs))
        chosen = [(d, r) for d, r in zip(run_dirs, runs) if r["precision"] == kind]
        print(f"figure ({kind} runs): {draw(*map(list, zip(*chosen)), args.figure)}")


if __name__ == "__main__":
    main()
