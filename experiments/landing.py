"""Run bookkeeping the pre-registered studies share: the registered training code, run from a
worktree of its commit, and a finished run landed in the main checkout, committed with the pages
and figures it changes, its checkpoints deleted unless they are kept to extend it.

A landing is rendered by the committed code in a scratch worktree of HEAD, never in the checkout
itself, so that an unfinished edit there is never committed and the committed pages always match
the committed runs (tests/test_readme.py fails where they do not).
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SMALL_FILES = ("metrics.jsonl", "config.json", "machine.json")


def registered_runner(worktree: Path, commit: str):
    """The registering commit's experiments/spiral/spiral_runs.py (SETTING, sft, sha256, finished),
    loaded from its worktree, which is made here when missing."""
    if not worktree.exists():
        git(ROOT, "worktree", "add", str(worktree), commit)
    head = git(worktree, "rev-parse", "HEAD")
    if head != commit:
        raise SystemExit(f"error: {worktree} is at {head}, not {commit}")
    path = worktree / "experiments" / "spiral" / "spiral_runs.py"
    spec = importlib.util.spec_from_file_location("registered_spiral_runs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_and_land(reg, model: Path, dest: Path, landed: Path, out_dir: Path, flags: list[str],
                   steps: int, record: dict, message: str | None, render,
                   keep_checkpoints: bool = False) -> str:
    """One run of the registered train.py (its SETTING, then `flags`) to `steps`, resumed from its
    last checkpoint if it was killed, one thread, named as its landed folder. Its small files land
    in `landed` (inside the checkout `dest`) with run.json (`record` and the warm-start's hash),
    committed with `message` and the pages `render` writes when a message is given; then its
    checkpoints are deleted unless kept."""
    if reg.finished(landed, steps):
        return f"{landed}: done already"
    name = landed.name
    cmd = [PY, "train.py", *reg.SETTING, *flags, "--model", str(model), "--out-dir", str(out_dir),
           "--name", name, "--steps", str(steps), "--resume"]
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"{name}.log"
    with open(log, "a") as f:
        code = subprocess.run(cmd, cwd=reg.ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    if code:
        return f"{landed}: exit {code}, see {log}"
    landed.mkdir(parents=True, exist_ok=True)
    for f in SMALL_FILES:
        shutil.copy(out_dir / name / f, landed / f)
    (landed / "run.json").write_text(json.dumps(
        {**record, "sft_sha256": reg.sha256(model), "log": str(log)}) + "\n")
    if message:
        commit_folder(dest, landed, message, render)
    if not keep_checkpoints:
        for heavy in [*(out_dir / name).glob("ckpt-*"), out_dir / name / "model-bf16"]:
            shutil.rmtree(heavy, ignore_errors=True)
    return f"{landed}: {steps} steps"


def commit_folder(repo: Path, folder: Path, message: str, render: list[list[str]]) -> None:
    """The landed run folder and the pages and figures it changes (each of `render` a script and
    its arguments, run in the scratch worktree), committed to the checked-out branch. A page the
    checkout has not edited follows the new commit; one it has edited keeps the edit (`make docs`
    renders it again). Retried while HEAD moves under it."""
    rel = folder.relative_to(repo)
    for _ in range(30):
        old = git(repo, "rev-parse", "HEAD")
        scratch = Path(tempfile.mkdtemp(prefix="landing-"))
        try:
            git(repo, "worktree", "add", "-q", "--detach", str(scratch), old)
            shutil.copytree(folder, scratch / rel, dirs_exist_ok=True)
            for cmd in render:
                subprocess.run([PY, *cmd], cwd=scratch, capture_output=True)
            git(scratch, "add", "-A")
            git(scratch, "commit", "-q", "-m", message)
            new = git(scratch, "rev-parse", "HEAD")
            changed = git(scratch, "diff", "--name-only", old, new).split()
            branch = git(repo, "symbolic-ref", "HEAD")
            moved = subprocess.run(["git", "update-ref", branch, new, old], cwd=repo,
                                   capture_output=True).returncode
        except subprocess.CalledProcessError:
            moved = 1
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(scratch)], cwd=repo,
                           capture_output=True)
        if moved == 0:
            untouched = [p for p in changed if not git(repo, "diff", "--name-only", old, "--", p)]
            git(repo, "reset", "-q", "--", *changed)
            if untouched:
                git(repo, "checkout", "-q", "--", *untouched)
            return
        time.sleep(10)
    print(f"warning: could not commit {folder}; commit it by hand", flush=True)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()
