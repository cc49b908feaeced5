"""The README and docs/ say only what works on a fresh clone: every linked file and every path
they name exists, and the cheap commands they give run (each script's --help)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "experiments").glob("**/README.md"))]
DIRS = ("bench", "docs", "experiments", "integrations", "plumbing", "tasks", "tests")
# in backticks: a path under one of the repository's folders, or a Python file at its top
PATH = re.compile(r"(?<![\w/.$<-])((?:(?:%s)/[\w/.*-]+)|[\w-]+\.py)(?![\w/])" % "|".join(DIRS))
EXTERNAL = {"ray_trainer.py"}                          # other projects' files named in the docs


def named_paths(text: str) -> set[str]:
    """Links `](x)` and repository paths written in backticks."""
    links = {l for l in re.findall(r"\]\(([^)#\s]+)\)", text) if not l.startswith("http")}
    code = " ".join(re.findall(r"`([^`]+)`", text))
    return links | {p.split(":")[0].rstrip(".") for p in PATH.findall(code)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_file_exists(page):
    missing = [path for path in named_paths(page.read_text()) - EXTERNAL if "<" not in path and "*" not in path
               and not any(base.exists() for base in (page.parent / path, ROOT / path))
               and not any((ROOT / d / path).exists() for d in DIRS)]
    assert not missing, f"{page.name} names files that do not exist: {sorted(missing)}"


def test_readme_is_short_and_gives_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 180
    # prose at 100 columns; tables, images, link targets and code blocks may run longer
    wide = [l for l in text.splitlines()
            if len(l) > 100 and not l.startswith(("|", "![", "[", "    "))]
    assert not wide, wide
    first_screen = "\n".join(text.splitlines()[:40])
    assert "    make train" in first_screen and "    make test" in first_screen


SCRIPTS = ["train.py", "eval.py", "retriever.py", "data.py", "ask.py", "experiments/lld_study/lld_study.py", "experiments/lld_study/lld_table.py",
           "experiments/lld_study/spiral_replay.py",
           "bench/same_run.py", "bench/bench_llds.py", "bench/bench_rollout.py", "bench/bench_retriever.py",
           "bench/bench_decode.py", "sft.py", "experiments/lab/lab_runs.py", "experiments/lab/lab_study.py", "experiments/demo_seeds/demo_seeds.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs(script):
    assert any(script in page.read_text() for page in PAGES), f"{script} is not named in the docs"
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stderr[-2000:]


def test_nothing_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.md", "Makefile", ".ci/*"], cwd=ROOT,
                             capture_output=True, text=True).stdout.split()
    sibling = "../" + "shared"                        # the developers' folder beside a checkout
    outside = [f for f in tracked if sibling in (ROOT / f).read_text(errors="replace")]
    assert not outside, f"these files point outside the repository: {outside}"


def test_the_reading_guide_lists_definitions_that_exist_and_counts_them():
    import ast
    text = (ROOT / "README.md").read_text()
    stops = re.findall(r"^\d+\. `([\w/]+\.py):([\w.]+)`", text, re.M)
    claim = re.search(r"these (\d+) definitions in (\d+) files", text)
    assert claim and (len(stops), len({f for f, _ in stops})) == tuple(map(int, claim.groups()))
    for path, name in stops:
        tree = ast.parse((ROOT / path).read_text())
        scope = tree.body
        for part in name.split("."):
            found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part]
            assert found, f"README's guide names {path}:{name}, which is not defined there"
            scope = found[0].body
