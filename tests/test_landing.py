"""experiments/landing.py: a landed run is committed with the pages it changes, rendered by the
committed code, and the checkout's own unfinished edits are neither committed nor lost."""
import json
import subprocess

from experiments import landing

RENDER = """from pathlib import Path
root = Path(__file__).resolve().parent
runs = len(list((root / "runs").iterdir()))
(root / "PAGE.md").write_text(f"{runs} runs\\n")
"""


def git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_landing_commits_the_run_and_its_pages_and_leaves_the_checkouts_edits(tmp_path,
                                                                                monkeypatch):
    for key, value in (("NAME", "t"), ("EMAIL", "t@t")):
        monkeypatch.setenv(f"GIT_AUTHOR_{key}", value)
        monkeypatch.setenv(f"GIT_COMMITTER_{key}", value)
    repo = tmp_path / "repo"
    (repo / "runs").mkdir(parents=True)
    (repo / "render.py").write_text(RENDER)
    (repo / "PAGE.md").write_text("0 runs\n")
    (repo / "runs" / ".keep").write_text("")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "start")
    # a run lands while the page is untouched: the commit holds both, the checkout follows it
    (repo / "runs" / "a").mkdir()
    (repo / "runs" / "a" / "metrics.jsonl").write_text("{}\n")
    landing.commit_folder(repo, repo / "runs" / "a", "a landed", [["render.py"]])
    assert git(repo, "show", "HEAD:PAGE.md") == "2 runs"
    assert git(repo, "status", "--short") == ""
    # another lands while the page and the render script hold unfinished edits
    (repo / "PAGE.md").write_text("an edit\n")
    (repo / "render.py").write_text("raise SystemExit('half-written')\n")
    (repo / "runs" / "b").mkdir()
    (repo / "runs" / "b" / "metrics.jsonl").write_text("{}\n")
    landing.commit_folder(repo, repo / "runs" / "b", "b landed", [["render.py"]])
    assert git(repo, "log", "--format=%s") == "b landed\na landed\nstart"
    assert git(repo, "show", "HEAD:PAGE.md") == "3 runs"             # the committed script's
    assert git(repo, "show", "HEAD:render.py") == RENDER.strip()
    assert (repo / "PAGE.md").read_text() == "an edit\n"
    assert git(repo, "diff", "--name-only") == "PAGE.md\nrender.py"     # edited, not staged
    assert git(repo, "diff", "--cached", "--name-only") == ""
    assert git(repo, "worktree", "list").count("\n") == 0           # the scratch one is gone


FAKE_TRAIN = """import argparse, json, sys
from pathlib import Path
p = argparse.ArgumentParser()
for flag in ("--out-dir", "--name", "--steps", "--seed", "--lr", "--model", "--x"):
    p.add_argument(flag)
p.add_argument("--resume", action="store_true")
a = p.parse_args()
run = Path(a.out_dir) / a.name
(run / "ckpt-000005").mkdir(parents=True)
for f in ("metrics.jsonl", "config.json", "machine.json"):
    (run / f).write_text(json.dumps({"argv": sys.argv[1:]}))
"""


def test_a_run_is_trained_from_the_registered_worktree_landed_and_its_checkpoints_deleted(
        tmp_path):
    from types import SimpleNamespace
    worktree, dest = tmp_path / "worktree", tmp_path / "checkout"
    worktree.mkdir()
    (worktree / "train.py").write_text(FAKE_TRAIN)
    reg = SimpleNamespace(ROOT=worktree, SETTING=["--x", "1", "--lr", "0"], sha256=lambda p: "h",
                          finished=lambda landed, steps: (landed / "run.json").exists())
    landed, out = dest / "runs" / "grpo-s3", worktree / "runs"
    line = landing.train_and_land(reg, tmp_path / "m", dest, landed, out,
                                  ["--seed", "3", "--lr", "2e-5"], 15, {"train_commit": "c"},
                                  None, [])
    assert line == f"{landed}: 15 steps"
    argv = json.loads((landed / "config.json").read_text())["argv"]
    # the registered setting first, then the run's own flags, which win where both name one
    assert argv[:4] == ["--x", "1", "--lr", "0"] and argv[4:8] == ["--seed", "3", "--lr", "2e-5"]
    assert argv[argv.index("--name") + 1] == "grpo-s3" and "--resume" in argv
    assert json.loads((landed / "run.json").read_text())["train_commit"] == "c"
    assert json.loads((landed / "run.json").read_text())["sft_sha256"] == "h"
    assert not (out / "grpo-s3" / "ckpt-000005").exists()
    assert landing.train_and_land(reg, tmp_path / "m", dest, landed, out, [], 15, {}, None,
                                  []) == f"{landed}: done already"
    kept = dest / "runs" / "grpo-s4"
    landing.train_and_land(reg, tmp_path / "m", dest, kept, out, [], 60, {}, None, [],
                           keep_checkpoints=True)
    assert (out / "grpo-s4" / "ckpt-000005").is_dir()
