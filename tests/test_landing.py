"""experiments/landing.py: a landed run is committed with the pages it changes, rendered by the
committed code, and the checkout's own unfinished edits are neither committed nor lost."""
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
