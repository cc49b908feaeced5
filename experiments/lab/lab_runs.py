"""Runs the LLD lab (experiments/lab/prereg.md) end to end, resumably: build, SFT, pilot, study, demo.

    .venv/bin/python experiments/lab/lab_runs.py sft                        # the warm-start (once; its hash is registered)
    .venv/bin/python experiments/lab/lab_runs.py check                      # its sampled EM and shared first searches
    .venv/bin/python experiments/lab/lab_runs.py pilot [--jobs 2]           # plain GRPO, seeds 1000-1007, mildest cell first
    .venv/bin/python experiments/lab/lab_runs.py study [--cell lr3e-05-u10] # 32 pairs, seeds 0-31, at the pilot's cell
    .venv/bin/python experiments/lab/lab_runs.py demo [--cell lr3e-05-u10]  # seed 0, both arms: the quick look

Each run is `train.py --preset lab --data <lab>/rl --corpus <lab>/corpus.jsonl --model <sft> --lr L --mini-batch-size M --seed N [--no-llds]
--resume`, one thread each, `--jobs` side by side. Checkpoints stay in runs/lab/; a finished run's
small files (metrics.jsonl, config.json, machine.json, and the SFT model's hash) are copied into
experiments/lab/ and the run is skipped from then on. Killed runs continue from their last checkpoint.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from experiments.lab.lab import (PILOT_LRS, PILOT_UPDATES, REGISTERED, build_lab,  # noqa: E402
                                 lab_dir)
from experiments.lab.lab_study import (choose_cell, harshest, pilot_cells, stopped,  # noqa: E402
                                       undecided)

PY = sys.executable
SFT_DIR = ROOT / "runs" / "lab" / "sft"
# The warm-start recipe (experiments/lab/prereg.md): the lab's SFT questions and four other worlds' (experiments/lab/lab.py).
SFT_ARGS = ["--epochs", "2", "--lr", "2e-3", "--episodes-per-question", "2"]
PILOT_SEEDS = range(1000, 1008)
STUDY_SEEDS = range(32)
BATCH = 8 * 5                                          # prompts x group size of the lab preset
SMALL_FILES = ("metrics.jsonl", "config.json", "machine.json")


def cell_name(lr: float, updates: int) -> str:
    return f"lr{lr:.0e}-u{updates}".replace("e-0", "e-")


def parse_cell(cell: str) -> tuple[float, int]:
    lr, updates = cell.removeprefix("lr").split("-u")
    return float(lr), int(updates)


def lab_cell(pilot: Path, stage: str) -> str | None:
    """The cell the pilot chose; None for the study when the stop rule ended the lab, whose demo then runs the
    pilot's harshest cell (the most displacement, the likeliest spiral). Exits while the pilot can still choose."""
    cells = pilot_cells(pilot)
    if (chosen := choose_cell(cells)) and not undecided(cells, chosen):
        return chosen["cell"]
    if cells and stopped(cells):
        return harshest(cells)["cell"] if stage == "demo" else None
    raise SystemExit(f"error: the pilot has chosen no cell yet (`experiments/lab/lab_study.py pilot {pilot}` says where it "
                     "stands; `make lab` continues it); or pass --cell")


def sha256(folder: Path) -> str:
    """One hash of a model folder: its weights and tokenizer files, by name, in order."""
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.suffix in (".safetensors", ".json"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def sft(other_build: bool = False) -> Path:
    """The warm-started model, trained once with the registered recipe, on one thread (pretraining too),
    and checked against the registered hashes: a run from any other model would not be the registered lab.
    Another CPU kind (AVX2 only) builds other bytes from the same recipe; `other_build` goes on with them, and
    the analysis marks those runs (prereg §6)."""
    import torch

    torch.set_num_threads(1)
    lab = build_lab()
    check_registered("base", lab / "base", other_build)
    model = SFT_DIR / "model"
    if not (model / "config.json").exists():
        subprocess.run([PY, "sft.py", "--model", str(lab / "base"), "--data", str(lab / "sft"),
                        "--corpus", str(lab / "sft" / "corpus.jsonl"), "--out", str(SFT_DIR), *SFT_ARGS],
                       cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    check_registered("sft", model, other_build)
    print(f"SFT model {model}: sha256 {sha256(model)}")
    return model


def check_registered(name: str, folder: Path, other_build: bool) -> None:
    if sha256(folder) != REGISTERED[name]:
        problem = f"{folder} has sha256 {sha256(folder)}, not the registered {REGISTERED[name]}"
        if not other_build:
            raise SystemExit(f"error: {problem}: delete it and rebuild on one thread (float32) with the registered "
                             "code, or pass --other-build on a CPU kind that cannot build the registered bytes")
        print(f"warning: {problem}; going on with it (--other-build, or the demo), its runs are marked")


def check(model: Path, questions: int = 200) -> dict:
    """What the pre-registration reports of the warm-start: its sampled (T = 1) EM on held-out
    questions in groups of G = 5, and how often an incorrect sample shares a correct one's first search."""
    import torch

    import data
    import monitor
    import retriever
    import rollout
    import train
    from plumbing import fast_hf
    from plumbing.models import load_policy
    from plumbing.search_health import shared_first_search

    torch.manual_seed(0)
    lab = build_lab()
    policy, tokenizer = load_policy(str(model))
    fast_hf.use_fast_attention(policy)                         # as train.py runs it
    cfg = train.rollout_config(train.Config(**train.PRESETS["lab"]))
    records = data.heldout_set(str(lab / "rl"), questions)
    out = rollout.rollout(policy, tokenizer, [r for r in records for _ in range(5)],
                          retriever.open_retriever("bm25", corpus=str(lab / "corpus.jsonl")), cfg)
    correct = torch.tensor([e["em"] > 0 for e in out.episodes])
    groups = torch.arange(len(records)).repeat_interleave(5)
    result = {"em_sampled": correct.float().mean().item(), "questions": questions, "samples": 5,
              "shared_first_search": shared_first_search(out.episodes, correct, groups),
              "groups_tied": monitor.rollout_stats(out, out.logp, correct.float(),
                                                   groups)["frac_reward_zero_std"],
              "model_tokens": out.loss_mask.sum(1).mean().item()}
    print(json.dumps(result))
    return result


def finished(docs_run: Path, steps: int = 300) -> bool:
    metrics = docs_run / "metrics.jsonl"
    last = [json.loads(line) for line in metrics.read_text().splitlines()[-3:]] if metrics.exists() else []
    return any(line.get("step") == steps and "reward" in line for line in last)


def train_run(model: Path, out_dir: Path, docs_dir: Path, name: str, seed: int, lr: float, updates: int,
              llds: bool) -> str:
    """One lab run to its end (resumed if it was killed), its small files copied to docs_dir/name."""
    if finished(docs_dir / name):
        return f"{docs_dir / name}: done already"
    lab = lab_dir()
    cmd = [PY, "train.py", "--preset", "lab", "--data", str(lab / "rl"), "--corpus", str(lab / "corpus.jsonl"),
           "--model", str(model), "--out-dir", str(out_dir), "--name", name,
           "--seed", str(seed), "--lr", str(lr), "--mini-batch-size", str(BATCH // updates), "--resume"]
    cmd += [] if llds else ["--no-llds"]
    log = out_dir / f"{name}.log"
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    if code:
        return f"{name}: exit {code}, see {log}"
    (docs_dir / name).mkdir(parents=True, exist_ok=True)
    for f in SMALL_FILES:
        shutil.copy(out_dir / name / f, docs_dir / name / f)
    (docs_dir / name / "sft_model.json").write_text(json.dumps({"path": str(model), "sha256": sha256(model)}) + "\n")
    return f"{docs_dir / name}: finished"


def run_all(jobs: int, runs: list[tuple], other_build: bool) -> None:
    model = sft(other_build)
    with ThreadPoolExecutor(jobs) as pool:
        for line in pool.map(lambda r: train_run(model, *r), runs):
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["sft", "check", "pilot", "study", "demo"])
    parser.add_argument("--cell", help="the study's cell, e.g. lr3e-05-u10 (default: the one the pilot chose)")
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side, one thread each")
    parser.add_argument("--seeds", help="a subset of the stage's seeds, e.g. 0-3 (default: all)")
    parser.add_argument("--other-build", action="store_true",
                        help="go on with this machine's SFT build when its hash is not the registered one (a CPU "
                             "without AVX-512 builds other bytes); the analysis marks its runs")
    args = parser.parse_args()
    if args.stage in ("sft", "check"):
        model = sft(args.other_build)
        if args.stage == "check":
            check(model)
        return
    wanted = None
    if args.seeds:
        first, _, last = args.seeds.partition("-")
        wanted = set(range(int(first), int(last or first) + 1))
    runs_root, docs_root = ROOT / "runs" / "lab", ROOT / "experiments" / "lab"
    if args.stage == "pilot":     # mildest cell first; the first cell that qualifies ends the pilot
        for lr in PILOT_LRS:
            for u in PILOT_UPDATES:
                cell = cell_name(lr, u)
                run_all(args.jobs, [(runs_root / "pilot" / cell, docs_root / "pilot" / cell, f"grpo-s{s}", s, lr, u,
                                     False) for s in PILOT_SEEDS if wanted is None or s in wanted], args.other_build)
                chosen = choose_cell(pilot_cells(docs_root / "pilot"))
                if chosen:
                    print(f"pilot: {chosen['cell']} qualifies; the harsher cells are not run")
                    return
        return
    else:
        cell = args.cell or lab_cell(docs_root / "pilot", args.stage)
        if cell is None:
            print("no study: no pilot cell qualifies, so the pre-registered stop rule ended the lab (this small "
                  "model does not spiral)")
            return
        lr, u = parse_cell(cell)
        where = "study" if args.stage == "study" else "demo"
        seeds = STUDY_SEEDS if args.stage == "study" else [0]
        runs = [(runs_root / where, docs_root / where, f"{arm}-s{s}", s, lr, u, arm == "llds")
                for s in seeds for arm in ("grpo", "llds")]
    # the demo is a quick look, not the registered lab: it goes on with whatever SFT build this CPU makes
    run_all(args.jobs, [r for r in runs if wanted is None or r[3] in wanted], args.other_build or args.stage == "demo")


if __name__ == "__main__":
    main()
