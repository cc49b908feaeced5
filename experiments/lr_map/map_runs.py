"""Runs the learning-rate x method map (experiments/lr_map/prereg.md) resumably, in its
registered order.

    .venv/bin/python experiments/lr_map/map_runs.py --dry-run     # the queue, nothing run
    .venv/bin/python experiments/lr_map/map_runs.py --commit      # every run not landed yet

The training code is the spiral study's registered commit (TRAIN_COMMIT), run from a worktree of
it (`git worktree add ../dd7ab09 dd7ab09`, made here when missing), so the map's runs and the
spiral study's share one training path: its warm-start (built once a machine by that commit's
`spiral_runs.py sft`), its RL setting (that commit's SETTING) and its 15 steps. Each run is
`train.py <SETTING> <arm's flags> --model <warm-start> --lr L --steps 15 --seed N --resume`, one
thread each, two side by side; the next run starts as soon as one ends. A finished run's small
files (metrics.jsonl, config.json, machine.json, and run.json: both commits and the warm-start's
hash) land in experiments/lr_map/runs/lr<L>/<arm>-s<seed>/; `--commit` commits that folder with the
pages and figure it changes (rendered by the committed code, never the checkout's unfinished
edits), and the run's checkpoints and export are deleted then (about 1.5 GiB a run). A killed run
continues from its last checkpoint; a landed one is skipped.
"""
import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.landing import ROOT, git, registered_runner, train_and_land  # noqa: E402

TRAIN_COMMIT = "dd7ab09ef48fa172d248ea8198c16e8c03647cec"    # the spiral study's registering commit
STEPS = 15
# Each arm's flags after SETTING (whose --kl-coef 0 comes first; argparse keeps the last).
ARMS = {"grpo": ["--no-llds"], "llds": [],
        "grpo-kl0.001": ["--no-llds", "--kl-coef", "0.001"],
        "grpo-kl0.04": ["--no-llds", "--kl-coef", "0.04"],
        "llds-kl0.001": ["--kl-coef", "0.001"]}
LR_CELLS = ("2e-5", "4e-5", "1.6e-4", "1e-5")        # plain GRPO and GRPO + LLDS, seeds 0-7
KL_LR, KL_ARMS = "8e-5", ("grpo-kl0.001", "grpo-kl0.04", "llds-kl0.001")    # seeds 0-9
# Four rounds, each a balanced map (prereg.md §4): the lr cells' seeds, then the KL cells' seeds.
ROUNDS = (((0, 1), (0, 1)), ((2, 3), (2, 3, 4)), ((4, 5), (5, 6, 7)), ((6, 7), (8, 9)))
# What a landed run changes, rendered again before its commit: the map's figure, then every page.
RENDER = (["experiments/lr_map/lr_map.py", "--figure", "experiments/lr_map/map.png"],
          ["docs/readme_numbers.py"])


def queue() -> list[tuple[str, str, int]]:
    """Every counted run, (lr, arm, seed), in the order they start (94 runs)."""
    runs = []
    for lr_seeds, kl_seeds in ROUNDS:
        runs += [(lr, arm, s) for s in lr_seeds for lr in LR_CELLS for arm in ("grpo", "llds")]
        runs += [(KL_LR, arm, s) for s in kl_seeds for arm in KL_ARMS]
    return runs


def landed_folder(dest: Path, lr: str, arm: str, seed: int) -> Path:
    return dest / "experiments" / "lr_map" / "runs" / f"lr{lr}" / f"{arm}-s{seed}"


def train_run(reg, model: Path, dest: Path, lr: str, arm: str, seed: int, commit: bool,
              runner_commit: str) -> str:
    """One run to its end (resumed if it was killed), landed, committed, its checkpoints deleted."""
    landed = landed_folder(dest, lr, arm, seed)
    return train_and_land(
        reg, model, dest, landed, reg.ROOT / "runs" / "lr_map" / f"lr{lr}",
        [*ARMS[arm], "--seed", str(seed), "--lr", lr], STEPS,
        {"train_commit": TRAIN_COMMIT, "runner_commit": runner_commit},
        f"lr map: lr{lr}/{landed.name} finished" if commit else None, RENDER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side, one thread each")
    parser.add_argument("--worktree", default=str(ROOT.parent / TRAIN_COMMIT[:7]),
                        help="a worktree of the training commit (made when missing)")
    parser.add_argument("--dest", default=str(ROOT), help="the checkout the results land in")
    parser.add_argument("--commit", action="store_true", help="commit each finished run folder")
    parser.add_argument("--dry-run", action="store_true", help="print the queue and stop")
    args = parser.parse_args()
    runs, dest = queue(), Path(args.dest)
    if args.dry_run:
        for lr, arm, seed in runs:
            done = (landed_folder(dest, lr, arm, seed) / "run.json").exists()
            print(f"lr {lr:>6}  {arm:<13} seed {seed}{'  (landed)' if done else ''}")
        return
    reg = registered_runner(Path(args.worktree), TRAIN_COMMIT)
    head = git(ROOT, "rev-parse", "HEAD")
    model = reg.sft()
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda r: train_run(reg, model, dest, *r, args.commit, head), runs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
