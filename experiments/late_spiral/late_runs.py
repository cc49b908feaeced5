"""Runs the late spiral (experiments/late_spiral/prereg.md) resumably: its pilot, plain GRPO at a
learning rate that learns, run long; then, once registered, its counted study.

    .venv/bin/python experiments/late_spiral/late_runs.py pilot --dry-run     # the queue
    .venv/bin/python experiments/late_spiral/late_runs.py pilot --commit      # 60 steps a run
    .venv/bin/python experiments/late_spiral/late_runs.py pilot --steps 120 --commit   # extended
    .venv/bin/python experiments/late_spiral/late_runs.py study --commit      # the counted runs

The spiral study's training code, warm-start and setting (experiments/landing.py: a worktree of
its registering commit), with a checkpoint every 5 steps. A pilot run keeps its last, so that
`--steps 120` can extend it; a counted run's are deleted once it has landed. Each finished run's
small files land in experiments/late_spiral/pilot/lr<L>/grpo-s<seed>/ or study/<arm>-s<seed>/,
committed with the pages and figures it changes.
"""
import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.landing import ROOT, git, registered_runner, train_and_land  # noqa: E402

TRAIN_COMMIT = "dd7ab09ef48fa172d248ea8198c16e8c03647cec"    # the spiral study's registering commit
PILOT_LRS, PILOT_SEEDS = ("2e-5", "4e-5"), (1000, 1001, 1002, 1003)
# The counted study's cell (lr, steps): None until the commit that registers prereg.md §5 sets it.
STUDY_CELL: tuple[str, int] | None = None
STUDY_SEEDS = range(12)
ARMS = {"grpo": ["--no-llds"], "llds": []}
ARM_NAMES = {"grpo": "plain GRPO", "llds": "GRPO + LLDS"}
LONG = ["--ckpt-every", "5", "--keep-ckpts", "1"]    # after SETTING: argparse keeps the last
RENDER = {"pilot": (["docs/readme_numbers.py"],),
          "study": (["experiments/late_spiral/late_study.py"], ["docs/readme_numbers.py"])}


def queue(stage: str = "pilot", steps: int = 60) -> list[tuple[str, str, int, int]]:
    """A stage's runs, (lr, arm, seed, steps), seed by seed so that its cells grow together: the
    pilot's plain GRPO at both learning rates, or the counted study's two arms in its cell."""
    if stage == "pilot":
        return [(lr, "grpo", seed, steps) for seed in PILOT_SEEDS for lr in PILOT_LRS]
    if STUDY_CELL is None:
        raise SystemExit("error: the counted study runs once prereg.md §5 is registered, by the "
                         "commit that also sets STUDY_CELL here")
    lr, steps = STUDY_CELL
    return [(lr, arm, seed, steps) for seed in STUDY_SEEDS for arm in ARMS]


def landed_folder(dest: Path, stage: str, lr: str, arm: str, seed: int) -> Path:
    late = dest / "experiments" / "late_spiral"
    return late / "pilot" / f"lr{lr}" / f"{arm}-s{seed}" if stage == "pilot" else (
        late / "study" / f"{arm}-s{seed}")


def train_run(reg, model: Path, dest: Path, stage: str, run: tuple[str, str, int, int],
              commit: bool, runner_commit: str) -> str:
    """One run to its `steps` (resumed from its last checkpoint), landed, committed; a pilot run
    keeps its last checkpoint, so that it can be extended."""
    lr, arm, seed, steps = run
    landed = landed_folder(dest, stage, lr, arm, seed)
    return train_and_land(
        reg, model, dest, landed, reg.ROOT / "runs" / "late_spiral" / stage / f"lr{lr}",
        [*LONG, *ARMS[arm], "--seed", str(seed), "--lr", lr], steps,
        {"train_commit": TRAIN_COMMIT, "runner_commit": runner_commit},
        f"late spiral {stage}: {landed.relative_to(dest / 'experiments' / 'late_spiral')} at "
        f"{steps} steps" if commit else None, RENDER[stage], keep_checkpoints=stage == "pilot")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["pilot", "study"])
    parser.add_argument("--steps", type=int, default=60,
                        help="the pilot's length: 60, or 120 to extend (prereg §3)")
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side, one thread each")
    parser.add_argument("--worktree", default=str(ROOT.parent / TRAIN_COMMIT[:7]),
                        help="a worktree of the training commit (made when missing)")
    parser.add_argument("--dest", default=str(ROOT), help="the checkout the results land in")
    parser.add_argument("--commit", action="store_true", help="commit each finished run folder")
    parser.add_argument("--dry-run", action="store_true", help="print the queue and stop")
    args = parser.parse_args()
    runs = queue(args.stage, args.steps)
    if args.dry_run:
        for lr, arm, seed, steps in runs:
            print(f"lr {lr}  {ARM_NAMES[arm]}  seed {seed}  {steps} steps")
        return
    reg = registered_runner(Path(args.worktree), TRAIN_COMMIT)
    model, head = reg.sft(), git(ROOT, "rev-parse", "HEAD")
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda r: train_run(reg, model, Path(args.dest), args.stage, r,
                                                 args.commit, head), runs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
