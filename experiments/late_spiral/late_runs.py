"""Runs the late spiral's pilot (experiments/late_spiral/prereg.md) resumably: plain GRPO at a
learning rate that learns, run long.

    .venv/bin/python experiments/late_spiral/late_runs.py pilot --dry-run     # the queue
    .venv/bin/python experiments/late_spiral/late_runs.py pilot --commit      # 60 steps a run
    .venv/bin/python experiments/late_spiral/late_runs.py pilot --steps 120 --commit   # extended

The spiral study's training code, warm-start and setting (experiments/landing.py: a worktree of
its registering commit), with a checkpoint every 5 steps: the last is kept, so that a run can be
extended by `--steps 120`, which resumes it. Each finished run's small files land in
experiments/late_spiral/pilot/lr<L>/grpo-s<seed>/, committed with the pages it changes.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.landing import PY, ROOT, commit_folder, git, registered_runner  # noqa: E402

TRAIN_COMMIT = "dd7ab09ef48fa172d248ea8198c16e8c03647cec"    # the spiral study's registering commit
PILOT_LRS, PILOT_SEEDS = ("2e-5", "4e-5"), (1000, 1001, 1002, 1003)
LONG = ["--ckpt-every", "5", "--keep-ckpts", "1"]    # after SETTING: argparse keeps the last
SMALL_FILES = ("metrics.jsonl", "config.json", "machine.json")
RENDER = (["docs/readme_numbers.py"],)


def queue() -> list[tuple[str, int]]:
    """The pilot's runs, (lr, seed), seed by seed so that both cells grow together."""
    return [(lr, seed) for seed in PILOT_SEEDS for lr in PILOT_LRS]


def landed_folder(dest: Path, lr: str, seed: int) -> Path:
    return dest / "experiments" / "late_spiral" / "pilot" / f"lr{lr}" / f"grpo-s{seed}"


def train_run(reg, model: Path, dest: Path, lr: str, seed: int, steps: int, commit: bool,
              runner_commit: str) -> str:
    """One run of plain GRPO to `steps` (resumed from its last checkpoint), landed, committed."""
    landed = landed_folder(dest, lr, seed)
    if reg.finished(landed, steps):
        return f"{landed}: done already"
    worktree, name = reg.ROOT, f"grpo-s{seed}"
    out_dir = worktree / "runs" / "late_spiral" / f"lr{lr}"
    cmd = [PY, "train.py", *reg.SETTING, *LONG, "--no-llds", "--model", str(model),
           "--out-dir", str(out_dir), "--name", name, "--seed", str(seed), "--lr", lr,
           "--steps", str(steps), "--resume"]
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"{name}.log"
    with open(log, "a") as f:
        code = subprocess.run(cmd, cwd=worktree, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    if code:
        return f"{lr} {name}: exit {code}, see {log}"
    landed.mkdir(parents=True, exist_ok=True)
    for f in SMALL_FILES:
        shutil.copy(out_dir / name / f, landed / f)
    (landed / "run.json").write_text(json.dumps({
        "train_commit": TRAIN_COMMIT, "runner_commit": runner_commit,
        "sft_sha256": reg.sha256(model), "log": str(log)}) + "\n")
    if commit:
        commit_folder(dest, landed, f"late spiral pilot: lr{lr}/{name} at {steps} steps", RENDER)
    return f"{landed}: {steps} steps"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["pilot"])
    parser.add_argument("--steps", type=int, default=60, help="60, or 120 to extend (prereg §3)")
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side, one thread each")
    parser.add_argument("--worktree", default=str(ROOT.parent / TRAIN_COMMIT[:7]),
                        help="a worktree of the training commit (made when missing)")
    parser.add_argument("--dest", default=str(ROOT), help="the checkout the results land in")
    parser.add_argument("--commit", action="store_true", help="commit each finished run folder")
    parser.add_argument("--dry-run", action="store_true", help="print the queue and stop")
    args = parser.parse_args()
    if args.dry_run:
        for lr, seed in queue():
            print(f"lr {lr}  plain GRPO  seed {seed}  {args.steps} steps")
        return
    reg = registered_runner(Path(args.worktree), TRAIN_COMMIT)
    model, head = reg.sft(), git(ROOT, "rev-parse", "HEAD")
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda r: train_run(reg, model, Path(args.dest), *r, args.steps,
                                                 args.commit, head), queue()):
            print(line, flush=True)


if __name__ == "__main__":
    main()
