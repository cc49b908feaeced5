"""Runs the spiral study (experiments/spiral/prereg.md) resumably: the warm-start, the pilot, the
counted seeds.

    .venv/bin/python experiments/spiral/spiral_runs.py sft                  # the warm-start, once a machine
    .venv/bin/python experiments/spiral/spiral_runs.py pilot --cell lr5e-5-s30 --seeds 1000-1003
    .venv/bin/python experiments/spiral/spiral_runs.py study --seeds 0-14 [--commit]

Each run is `train.py <SETTING> --model <sft> --lr L --steps S --seed N [--no-llds] --resume`, one
thread each, two side by side (the study's arms of a seed start together; the next run starts as
soon as one ends). Checkpoints stay in runs/spiral/; a finished run's small files (metrics.jsonl,
config.json, machine.json, and run.json: the commit, the CPU and the warm-start's hash) are copied
into experiments/spiral/<stage>/<arm>-s<seed>/ and the run is skipped from then on; `--commit`
commits each such folder as it lands. A killed run continues from its last checkpoint. The counted
runs run from a worktree of the registered commit (prereg.md) and land in the main checkout:
`--dest <main checkout>`.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
SFT_DIR = ROOT / "runs" / "spiral" / "sft"
# The warm-start (prereg.md §2): the noisy scripted searcher's episodes in the search-r1 prompt.
SFT_ARGS = ["--questions", "480", "--episodes-per-question", "1", "--epochs", "1",
            "--batch-size", "16", "--lr", "3e-5", "--warmup-steps", "3", "--topk", "1",
            "--max-turn-tokens", "24", "--heldout-questions", "48", "--eval-every", "10",
            "--eval-size", "100", "--eval-samples", "4"]
# The RL setting (prereg.md §3) without the pilot's levers (--lr, --steps) and the arm.
SETTING = ["--template", "search-r1", "--max-turns", "2", "--topk", "1", "--max-turn-tokens", "24",
           "--max-obs-tokens", "200", "--temperature", "1.0", "--prompts-per-step", "8",
           "--group-size", "5", "--drop-tied-groups", "0", "--mini-batch-size", "4",
           "--micro-batch-size", "4", "--warmup-ratio", "0.1", "--kl-coef", "0",
           "--entropy-coef", "0.001", "--no-bf16", "--eval-every", "0", "--eval-size", "100",
           "--eval-max-turns", "2", "--token-view-every", "0", "--samples-per-step", "2",
           "--ckpt-every", "2", "--keep-ckpts", "1"]
SMALL_FILES = ("metrics.jsonl", "config.json", "machine.json")
PAGES = ("README.md", "experiments/spiral/README.md", "experiments/spiral/survival.png")


def parse_cell(cell: str) -> tuple[str, str]:
    """'lr5e-5-s30' -> ('5e-5', '30'): the learning rate and the run's steps."""
    lr, steps = cell.removeprefix("lr").split("-s")
    return lr, steps


def sha256(folder: Path) -> str:
    """One hash of a model folder: its weights and tokenizer files, by name, in order."""
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.suffix in (".safetensors", ".json"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def sft() -> Path:
    """The warm-started model: built once a machine (float32, two threads), reused after."""
    model = SFT_DIR / "model"
    if not (model / "config.json").exists():
        subprocess.run([PY, "sft.py", "--out", str(SFT_DIR), *SFT_ARGS], cwd=ROOT, check=True)
    print(f"SFT model {model}: sha256 {sha256(model)}", flush=True)
    return model


def finished(folder: Path, steps: int) -> bool:
    metrics = folder / "metrics.jsonl"
    last = [json.loads(l) for l in metrics.read_text().splitlines()[-3:]] if metrics.exists() else []
    return any(l.get("step") == steps and "reward" in l for l in last)


def train_run(model: Path, stage: str, dest: Path, name: str, seed: int, lr: str, steps: str,
              llds: bool, commit: bool) -> str:
    """One run to its end (resumed if it was killed), its small files copied to dest/stage/name."""
    landed = dest / "experiments" / "spiral" / stage / name
    if finished(landed, int(steps)):
        return f"{landed}: done already"
    out_dir = ROOT / "runs" / "spiral" / stage
    cmd = [PY, "train.py", *SETTING, "--model", str(model), "--out-dir", str(out_dir),
           "--name", name, "--seed", str(seed), "--lr", lr, "--steps", steps, "--resume",
           *([] if llds else ["--no-llds"])]
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"{name}.log"
    with open(log, "a") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    if code:
        return f"{name}: exit {code}, see {log}"
    landed.mkdir(parents=True, exist_ok=True)
    for f in SMALL_FILES:
        shutil.copy(out_dir / name / f, landed / f)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    (landed / "run.json").write_text(json.dumps({
        "commit": head.stdout.strip(), "sft_sha256": sha256(model), "log": str(log)}) + "\n")
    if commit:
        commit_landed(dest, landed, f"spiral study: {stage}/{name} finished")
    return f"{landed}: finished"


def commit_landed(repo: Path, folder: Path, message: str) -> None:
    """The landed run folder, and the pages and figure it changes (`make spiral docs` in the
    checkout it landed in), committed alone; retried while another git command holds the index.
    The pages are committed as the working tree has them: leave no half-done edit there."""
    subprocess.run(["make", "-s", "spiral", "docs"], cwd=repo, capture_output=True)
    paths = [str(folder), *(page for page in PAGES if (repo / page).exists())]
    for _ in range(30):
        add = subprocess.run(["git", "add", *paths], cwd=repo, capture_output=True)
        done = add.returncode == 0 and subprocess.run(
            ["git", "commit", "-q", "-m", message, "--", *paths], cwd=repo,
            capture_output=True).returncode == 0
        if done:
            return
        time.sleep(10)
    print(f"warning: could not commit {folder}; commit it by hand", flush=True)


def seeds_of(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["sft", "pilot", "study"])
    parser.add_argument("--cell", help="lr and steps, e.g. lr5e-5-s30 (the study: prereg.md's)")
    parser.add_argument("--seeds", help="e.g. 0-14", required=False)
    parser.add_argument("--arms", default="grpo,llds", help="the pilot runs plain GRPO only")
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side, one thread each")
    parser.add_argument("--dest", default=str(ROOT), help="the checkout the results land in")
    parser.add_argument("--commit", action="store_true", help="commit each finished run folder")
    args = parser.parse_args()
    model = sft()
    if args.stage == "sft":
        return
    lr, steps = parse_cell(args.cell or STUDY_CELL)
    stage = args.stage if args.stage == "study" else f"pilot/{args.cell}"
    runs = [(stage, Path(args.dest), f"{arm}-s{s}", s, lr, steps, arm == "llds", args.commit)
            for s in seeds_of(args.seeds) for arm in args.arms.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda r: train_run(model, *r), runs):
            print(line, flush=True)


STUDY_CELL = "lr8e-5-s15"      # the pilot's choice (prereg.md §4)

if __name__ == "__main__":
    main()
