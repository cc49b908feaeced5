"""bench/lora_vs_full.py: the CPU demo with full fine-tuning against LoRA, seed by seed, alternating.

    git worktree add /tmp/base <commit>; ln -s $PWD/.venv /tmp/base/.venv     # optional: --base
    .venv/bin/python bench/lora_vs_full.py --seeds 0 1 2 --lora-lr 5e-4 --out runs/lora-vs-full \
        [--base /tmp/base --base-seeds 0 1]

For each seed: with --base, `train.py --seed S` at the older commit checked out there (the same
demo, to compare this commit's step time with it); `train.py --seed S` (the demo, full
fine-tuning; seed 0 named `demo`, as `make train` names it); `train.py --seed S --lora-rank 32 --lr
<lora-lr>`. One run at a time, each under `/usr/bin/time -v` (peak RSS), from its checkout's
folder (`--out-dir runs`). Every finished run appends one JSON line to <out>/runs.jsonl (a run
already there is skipped on a rerun) and keeps its output in <out>/<name>.log: its step time and
split (rollout / logprob / update, the run's own timing), peak RSS, held-out EM before and after
with the sign test, the CPU and the load. The table over all lines is printed.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from plumbing.run_log import cpu_model  # noqa: E402

EM_LINE = re.compile(r"held-out EM: before ([\d.]+) -> after ([\d.]+) \((\d+) questions: (\d+) turned "
                     r"right, (\d+) turned wrong; sign test p = ([\d.e+-]+)\)")


def one_run(arm: str, seed: int, lora_lr: float, out: Path, root: Path) -> dict:
    name = "demo" if (arm, seed) == ("full", 0) else f"{arm}-s{seed}"
    args = ["--seed", str(seed), "--name", name, "--out-dir", "runs"]
    if arm == "lora":
        args += ["--lora-rank", "32", "--lr", str(lora_lr)]
    load_before, start = os.getloadavg()[0], time.time()
    done = subprocess.run(["/usr/bin/time", "-v", str(root / ".venv/bin/python"), "train.py", *args],
                          cwd=root, capture_output=True, text=True)
    (out / f"{name}.log").write_text(done.stdout + done.stderr[-20000:])
    if done.returncode:
        raise SystemExit(f"{name} failed: {done.stderr[-2000:]}")
    lines = [json.loads(l) for l in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if "reward" in l]
    em = EM_LINE.search(done.stdout)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    split = {k: round(statistics.fmean(l[f"timing/{k}"] for l in steps), 1)
             for k in ("step", "rollout", "logprob", "update")}
    return {"arm": arm, "seed": seed, "args": " ".join(args[4:]), "wall_s": round(time.time() - start),
            "s_per_step": split, "peak_rss_gib": round(int(rss.group(1)) / 2**20, 2),
            "before": float(em.group(1)), "after": float(em.group(2)), "right": int(em.group(4)),
            "wrong": int(em.group(5)), "p": float(em.group(6)), "questions": int(em.group(3)),
            "cpu": cpu_model(),
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(start)),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                                     capture_output=True, text=True).stdout.strip()}


def table(rows: list[dict]) -> str:
    lines = ["| arm | seed | s/step (rollout / logprob / update) | peak RSS GiB | EM before -> after | "
             "right / wrong | sign test p |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["s_per_step"]
        lines.append(f"| {r['arm']} | {r['seed']} | {t['step']} ({t['rollout']} / {t['logprob']} / "
                     f"{t['update']}) | {r['peak_rss_gib']} | {r['before']:.2f} -> {r['after']:.2f} | "
                     f"{r['right']} / {r['wrong']} | {r['p']:.2g} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lora-lr", type=float, default=5e-4)
    parser.add_argument("--out", type=Path, default=Path("runs/lora-vs-full"))
    parser.add_argument("--base", type=Path, help="a checkout of an older commit (its own .venv)")
    parser.add_argument("--base-seeds", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--arms", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    done = [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []
    for seed in args.seeds:
        arms = ["base"] if args.base and seed in args.base_seeds else []
        for arm in arms + args.arms:
            if any(r["arm"] == arm and r["seed"] == seed for r in done):
                continue
            row = one_run(arm, seed, args.lora_lr, args.out.resolve(),
                          args.base.resolve() if arm == "base" else ROOT)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            done.append(row)
            print(table(done[-1:]).splitlines()[-1], flush=True)
    print(table(sorted(done, key=lambda r: (r["seed"], r["arm"]))))


if __name__ == "__main__":
    main()
