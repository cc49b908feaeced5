"""The README and docs/ say only what works on a fresh clone: every linked file and path they name
exists; every command they give runs as written, at a tiny size where the real one is long, or
parses against its script's own flags (COMMANDS says which and why); every measured number of the
README is what its record gives (docs/readme_numbers.py); and the README's reading guide is the
path the code takes from a sampled token to `loss.backward()`."""
import ast
import difflib
import functools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from test_retriever import tiny_encoder_dir, write_corpus  # noqa: F401  (a tiny BERT: a fixture)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "experiments").glob("**/README.md"))]
DIRS = ("bench", "docs", "experiments", "integrations", "plumbing", "tasks", "tests")
# in backticks: a path under one of the repository's folders, or a Python file at its top
PATH = re.compile(r"(?<![\w/.$<-])((?:(?:%s)/[\w/.*-]+)|[\w-]+\.py)(?![\w/])" % "|".join(DIRS))
EXTERNAL = {"ray_trainer.py"}                          # other projects' files named in the docs


def named_paths(text: str) -> set[str]:
    """Repository paths written in backticks."""
    code = " ".join(re.findall(r"`([^`]+)`", text))
    return {p.split(":")[0].rstrip(".") for p in PATH.findall(code)}


def links(text: str) -> set[str]:
    """Relative links `](x)`: a reader's browser resolves them from the page alone."""
    return {l for l in re.findall(r"\]\(([^)#\s]+)\)", text) if not l.startswith("http")}


def missing_paths(paths, base: Path) -> list[str]:
    return sorted(path for path in set(paths) - EXTERNAL if "<" not in path and "*" not in path
                  and not any(b.exists() for b in (base / path, ROOT / path))
                  and not any((ROOT / d / path).exists() for d in DIRS))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_file_exists(page):
    missing = missing_paths(named_paths(page.read_text()), page.parent)
    assert not missing, f"{page.name} names files that do not exist: {missing}"
    broken = sorted(l for l in links(page.read_text()) if not (page.parent / l).exists())
    assert not broken, f"{page.name} links to files that are not there from it: {broken}"


@pytest.mark.parametrize("name", ["Makefile", "requirements.txt", "requirements-test.txt",
                                  "requirements-models.txt", "requirements-verl.txt"])
def test_the_files_named_in_the_makefile_and_requirements_comments_exist(name):
    # comments name files without backticks (the Makefile's recipes also name outputs)
    comments = [l for l in (ROOT / name).read_text().splitlines() if l.startswith("#")]
    missing = missing_paths(PATH.findall("\n".join(comments)), ROOT)
    assert not missing, f"{name} names files that do not exist: {missing}"


def test_readme_is_short_and_gives_the_two_commands():
    text = (ROOT / "README.md").read_text()
    # a rendered block's marker lines (<!-- ... -->) are not shown
    assert len([l for l in text.splitlines() if not l.startswith("<!--")]) <= 180
    # prose at 100 columns; tables, images, link targets and code blocks may run longer
    wide = [l for l in text.splitlines()
            if len(l) > 100 and not l.startswith(("|", "![", "[", "    "))]
    assert not wide, wide
    first_screen = [l[4:].split("#")[0].strip() for l in text.splitlines()[:40]
                    if l.startswith("    ")]
    assert [c for c in first_screen if COMMAND.match(c)] == ["make train", "make test"]


SCRIPTS = ["train.py", "eval.py", "retriever.py", "data.py", "ask.py", "sft.py",
           "experiments/lld_study/lld_study.py", "experiments/lld_study/lld_table.py",
           "experiments/lab/lab_runs.py",
           "experiments/lab/lab_study.py", "experiments/demo_seeds/demo_seeds.py",
           "experiments/lr_map/lr_map.py", "experiments/lr_map/map_runs.py",
           "experiments/breakdowns.py", "experiments/late_spiral/late_runs.py",
           "experiments/late_spiral/late_study.py",
           "bench/same_run.py", "bench/bench_llds.py", "bench/bench_rollout.py",
           "bench/bench_retriever.py", "bench/bench_decode.py", "docs/readme_numbers.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs(script):
    assert any(script in page.read_text() for page in PAGES), f"{script} is not named in the docs"
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stderr[-2000:]


def test_nothing_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.md", "Makefile", ".ci/*"], cwd=ROOT,
                             capture_output=True, text=True).stdout.split()
    sibling = "../" + "shared"                        # the developers' folder beside a checkout
    outside = [f for f in tracked if sibling in (ROOT / f).read_text(errors="replace")]
    assert not outside, f"these files point outside the repository: {outside}"


# ---- Every measured number of the README comes from its record ---------------------------------

def test_the_readme_numbers_are_what_their_records_give():
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "docs/readme_numbers.py")
    numbers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(numbers)
    for page in numbers.PAGES:
        text = (ROOT / page).read_text()
        rendered = numbers.render(text, page)
        assert rendered == text, f"{page} differs from its records; run `make docs`:\n" + "\n".join(
            difflib.unified_diff(text.splitlines(), rendered.splitlines(), page, "rendered",
                                 lineterm=""))


# ---- The reading guide is the code's path from a sampled token to loss.backward() --------------

ROOTS = ["rollout.py:rollout", "train.py:train_step"]
# Definitions on that path the guide passes over, and why.
PASSED_OVER = {
    "rollout.py:RolloutConfig": "the episode's settings",
    "rollout.py:prompt_ids": "the prompt's text, few-shot or Search-R1's, as token ids",
    "plumbing/long_prompts.py:refuse_long": "a prompt over the limit is a user's error",
    "plumbing/tokens.py:encode_in_text": "forced text tokenised as inside running text",
    "plumbing/fast_hf.py:autocast": "a fast path (the README's list)",
    "plumbing/fast_hf.py:KVBatch": "a fast path (the README's list)",
    "plumbing/fast_hf.py:StopChecker": "a fast path (the README's list)",
    "plumbing/fast_hf.py:prefix_once": "a fast path; the README says where its gradient arrives",
    "plumbing/fast_hf.py:without_cudnn_attention": "a fast path (the README's list)",
    "plumbing/fast_hf.py:in_checkpointed_chunks": "a fast path (the README's list)",
    "rollout.py:_observations": "the turn's searches in one call: observations are never trained",
    "rollout.py:_as_list": "the gold answers as a list",
    "rollout.py:normalize_answer": "SQuAD's normalisation, read with exact_match",
    "rollout.py:f1_score": "logged, never a reward",
    "rollout.py:_pad": "right-padding",
    "plumbing/runs.py:Phases": "bookkeeping: each phase's time and the progress bar",
    "train.py:rollout_config": "bookkeeping: the run's settings as rollout.py's",
    "plumbing/dynamic_sampling.py:replace_rows": "bookkeeping: a redrawn group's rows swapped in",
    "plumbing/minibatches.py:verl_order": "the authors' mini-batch order (--verl-minibatches)",
    "train.py:masked_mean": "the logged statistics' means",
    "llds.py:_response_advantage": "advantages given per token (veRL's layout), not train.py's",
}


def definitions(path: str) -> tuple[dict, dict]:
    """A file's top-level functions and classes by name, and what each imported name points to:
    ("module", file) or ("def", file, name), for the repository's own files only."""
    return _definitions(ROOT, path)


@functools.lru_cache(maxsize=None)
def _definitions(root: Path, path: str) -> tuple[dict, dict]:
    tree = ast.parse((root / path).read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    names = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (root / f"{alias.name}.py").exists():
                    names[alias.asname or alias.name] = ("module", f"{alias.name}.py")
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module.replace(".", "/")
            for alias in node.names:
                if (root / base / f"{alias.name}.py").exists():
                    names[alias.asname or alias.name] = ("module", f"{base}/{alias.name}.py")
                elif (root / f"{base}.py").exists():
                    names[alias.asname or alias.name] = ("def", f"{base}.py", alias.name)
    return defs, names


def resolve(path: str, expr) -> str | None:
    """'file:name' of the repository definition a Name or module.attribute refers to, or None."""
    defs, names = definitions(path)
    if isinstance(expr, ast.Name):
        if expr.id in defs:
            return f"{path}:{expr.id}"
        target = names.get(expr.id)
        if target and target[0] == "def" and target[2] in definitions(target[1])[0]:
            return f"{target[1]}:{target[2]}"
    elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        target = names.get(expr.value.id)
        if target and target[0] == "module" and expr.attr in definitions(target[1])[0]:
            return f"{target[1]}:{expr.attr}"
    return None


def references(node) -> list:
    """The names and attributes in a definition's decorators and body, in reading order
    (annotations left out: a type named in a signature is not a call on the path)."""
    found = []

    def visit(n):
        if isinstance(n, (ast.Name, ast.Attribute)):
            found.append(n)
        for field, value in ast.iter_fields(n):
            if field not in ("annotation", "returns"):
                for child in value if isinstance(value, list) else [value]:
                    if isinstance(child, ast.AST):
                        visit(child)

    for n in node.decorator_list + node.body:
        visit(n)
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def path_to_backward() -> list[str]:
    """Every repository definition met from ROOTS in reading order, depth first, up to the first
    `.backward(`; a definition passed over is met but not entered."""
    met, done = [], []

    def enter(key: str) -> None:
        met.append(key)
        if key in PASSED_OVER:
            return
        path, name = key.split(":")
        for ref in references(definitions(path)[0][name]):
            if done:
                return
            if isinstance(ref, ast.Attribute) and ref.attr == "backward":
                done.append(key)
                return
            target = resolve(path, ref)
            if target and target not in met:
                enter(target)

    for root in ROOTS:
        if root not in met:
            enter(root)
    return met


def test_the_reading_guide_is_the_path_from_a_sampled_token_to_loss_backward():
    text = (ROOT / "README.md").read_text()
    stops = re.findall(r"^- ([a-z])\. `([\w/]+\.py):([\w.]+)`", text, re.M)
    assert [letter for letter, _, _ in stops] == [chr(ord("a") + i) for i in range(len(stops))]
    claim = re.search(r"these (\d+) definitions in (\d+) files", text)
    assert claim and (len(stops), len({f for _, f, _ in stops})) == tuple(map(int, claim.groups()))
    met = path_to_backward()
    assert set(PASSED_OVER) <= set(met), f"passed over, not met: {set(PASSED_OVER) - set(met)}"
    path = [key for key in met if key not in PASSED_OVER]
    guide = [f"{f}:{name}" for _, f, name in stops]
    assert guide == path, "README.md's reading guide (-) against the code's path (+):\n" + \
        "\n".join(difflib.unified_diff(guide, path, "guide", "code", lineterm="", n=1))


def test_the_walk_follows_calls_in_reading_order_and_stops_at_backward(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "lib.py").write_text("def helper():\n    pass\n\n\ndef unused():\n    pass\n")
    (tmp_path / "a.py").write_text(
        "import lib\nfrom lib import helper\n\n\ndef root(x: int):\n    second(first())\n"
        "    lib.helper()\n    x.backward()\n    after()\n\n\ndef first():\n    helper()\n\n\n"
        "def second(y):\n    pass\n\n\ndef after():\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOTS", ["a.py:root"])
    monkeypatch.setattr(sys.modules[__name__], "PASSED_OVER", {})
    # second(first()): second is read first; after() comes after the backward
    assert path_to_backward() == ["a.py:root", "a.py:second", "a.py:first", "lib.py:helper"]


# ---- Every command the README and docs/ give works as written ---------------------------------

# a path into the repository's folders, inside a command (also after another path: /x/plumbing/y)
REPO_PATH = re.compile(r"(?<![\w.-])((?:\.ci|%s)/[\w/.-]*\w)" % "|".join(DIRS))
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:nice -n \d+ )?(?:make|python3?|"
                     r"\.venv(?:-bare)?/bin/\w+|pip|hf|git|cd|export)\b|d=\$\(")
# How each command is checked, the first rule that matches it; any other python or make command is
# parsed: a script's argparse flags take its arguments (files it names present), a make target's
# recipe parses the same way (`make -n`).
COMMANDS = [
    (r"retriever\.py (index|search|serve)", "run", "seconds on a tiny corpus and encoder; serve "
     "stops once its retriever is open; --device cuda:1 runs on the CPU (the suite has no GPU)"),
    (r"\bpip install", "install", "needs the network: its pins must be requirements.txt's"),
    (r"^hf download", "skip", "downloads from the Hugging Face Hub"),
    (r"bash \.ci/run", "skip", "the whole suite on a clean clone, in minutes; .ci/run must exist"),
    (r"^cd verl|^export PYTHONPATH|verl\.trainer\.main_ppo", "skip",
     "veRL's trainer on a GPU cluster; tests/test_verl_llds.py applies the patch"),
    (r'ARGS="\.\.\."', "skip", "a placeholder for any flags"),
]


def commands(page: Path) -> list[str]:
    """The shell commands of a page: every line of its code blocks that starts like one (joined
    with its `\\` continuation lines), and in the README also those in backticks in its text."""
    text, found = page.read_text(), []
    lines = text.replace("\\\n", " ").splitlines()
    fenced = False
    for line in lines:
        fenced ^= line.startswith("```")
        code = line[4:] if line.startswith("    ") and not fenced else line if fenced else None
        if code and COMMAND.match(code.strip()):
            found.append(" ".join(code.split()))
    if page.name == "README.md":
        spans = (" ".join(s.split()) for s in re.findall(r"`([^`]+)`", text))
        found += [s for s in spans if COMMAND.match(s) and " " in s]
    return list(dict.fromkeys(found))


CHECKED = [(page, c) for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
           for c in commands(page)]


def rule(command: str) -> tuple[str, str]:
    return next(((mode, why) for pattern, mode, why in COMMANDS if re.search(pattern, command)),
                ("parse", ""))


def argv(command: str, keep_optional: bool) -> list[str]:
    """The command's words: <placeholders> as one word, [optional parts] kept or dropped, the
    environment and `nice` in front and shell comments left out."""
    command = re.sub(r"<[^>]+>", "PLACEHOLDER", command)
    command = re.sub(r"\[([^\]]*)\]", r"\1" if keep_optional else "", command)
    words = shlex.split(command, comments=True)
    while words and (re.match(r"[A-Z_]+=", words[0]) or words[0] == "nice"):
        words = words[3:] if words[0] == "nice" else words[1:]
    return words


def present(words: list[str], folder: Path) -> None:
    """Create in `folder` the relative files and folders a command names that are not there: a
    user's inputs (a run, a corpus) as empty files, or folders where they end in / or have no
    suffix. Nothing is created inside the repository's own folders: those must exist."""
    for word in words[1:]:
        part = word.split("=", 1)[-1]
        if "://" in part or part.startswith(("-", "/")) or not re.search(r"/|\.\w+$", part):
            continue
        target = folder / part
        if target.exists() or (folder / Path(part).parts[0]).is_symlink():
            continue
        if part.endswith("/") or not Path(part).suffix:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()


def sandbox(tmp: Path) -> Path:
    """A folder that looks like the checkout (its entries linked), for the files commands create."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "runs"):
            (tmp / entry.name).symlink_to(entry)
    return tmp


# Runs each script of a list up to its command line's parse, then stops it: nothing trains.
PARSE_ONLY = """
import argparse, contextlib, io, json, os, runpy, sys
class Parsed(Exception):
    pass
real = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_args
results = {}
for key, folder, argv in json.loads(sys.argv[1]):
    os.chdir(folder)
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))   # as `python script.py` does
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(argv[0], run_name="__main__")
        results[key] = "the script ended without parsing its command line"
    except Parsed:
        results[key] = "ok"
    except SystemExit as e:
        results[key] = "ok" if e.code in (0, None) else f"exit {e.code}: {said.getvalue()[-500:]}"
    except Exception as e:
        results[key] = f"{type(e).__name__}: {e}"
print("PARSED " + json.dumps(results))
"""


def scripts_to_parse(command: str, folder: Path) -> list[list[str]] | str:
    """The python argv(s) a command runs: its own, or a make target's recipe lines; a string
    when make refuses the target."""
    words = argv(command, keep_optional=True)
    if words[0] == "make":
        made = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True)
        if made.returncode:
            return made.stderr.strip()
        lines = [shlex.split(l) for l in made.stdout.splitlines()
                 if re.match(r"\.venv(-bare)?/bin/python \w", l)]
    else:
        lines = [words]
    for line in lines:
        present(line, folder)
    return [line[1:] for line in lines if line[1].endswith(".py")]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """Every parsed command's result, from one process (one import of torch for all)."""
    folder = sandbox(tmp_path_factory.mktemp("checkout"))
    jobs, refused = [], {}
    for page, command in CHECKED:
        if rule(command)[0] == "parse":
            found = scripts_to_parse(command, folder)
            if isinstance(found, str):
                refused[command] = found
            jobs += [[f"{command} | {' '.join(a)}", str(folder), a] for a in found]
    done = subprocess.run([sys.executable, "-c", PARSE_ONLY, json.dumps(jobs)], cwd=folder,
                          capture_output=True, text=True, timeout=600)
    line = next((l for l in done.stdout.splitlines() if l.startswith("PARSED ")), None)
    assert line, done.stderr[-3000:]
    results = json.loads(line[len("PARSED "):])
    return {command: refused.get(command) or [v for k, v in results.items()
                                              if k.startswith(command + " | ")]
            for _, command in CHECKED}


def run_retriever(command: str, folder: Path, monkeypatch) -> None:
    """retriever.py in this process, in `folder`; `serve` opens its retriever and returns."""
    import retriever
    from plumbing import server

    monkeypatch.chdir(folder)
    monkeypatch.setenv("LLDS_CACHE", str(folder / "cache"))
    monkeypatch.setattr(server, "serve", lambda open_retriever, *args: open_retriever())
    words = [w.replace("cuda:1", "cpu") for w in argv(command, keep_optional=False)]
    retriever.main(words[2:])


@pytest.fixture
def retrieval_files(tmp_path, tiny_encoder_dir):
    """The files the retriever commands name, tiny: a corpus under both names, and an e5-style
    encoder folder with Search-R1's faiss file of its passages."""
    import shutil

    import faiss
    import retriever

    write_corpus(tmp_path / "corpus.jsonl")
    write_corpus(tmp_path / "wiki-18.jsonl")
    shutil.copytree(tiny_encoder_dir / "tiny-bert", tmp_path / "e5-base-v2")
    encoder = retriever.Encoder(str(tmp_path / "e5-base-v2"), bf16=False,
                                passage_prefix="passage: ")
    texts = [json.loads(l)["contents"] for l in (tmp_path / "corpus.jsonl").open()]
    index = faiss.IndexFlatIP(encoder.dim)
    index.add(encoder.encode(texts, "passage"))
    faiss.write_index(index, str(tmp_path / "e5_Flat.index"))
    return tmp_path


@pytest.mark.parametrize("page, command", CHECKED, ids=[f"{p.name}:{c[:50]}" for p, c in CHECKED])
def test_every_command_works_as_written(page, command, parsed, request, monkeypatch):
    mode, why = rule(command)
    named = [p for p in REPO_PATH.findall(command) + re.findall(r"-r (\S+)", command)
             if "PLACEHOLDER" not in p and "<" not in p]
    missing = [p for p in named if not (ROOT / p).exists()]
    assert not missing, f"{page.name}: `{command}` names files that do not exist: {missing}"
    if mode == "skip":
        return
    if mode == "install":
        pins = dict(re.findall(r"^([\w-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))
        for name, version in re.findall(r"\b([\w-]+)==(\S+)", command):
            assert pins.get(name) == version, f"{page.name}: `{command}` pins {name} {version}, " \
                                              f"requirements.txt {pins.get(name)}"
        return
    if mode == "run":
        run_retriever(command, request.getfixturevalue("retrieval_files"), monkeypatch)
        return
    results = parsed[command]
    assert isinstance(results, list) and results and all(r == "ok" for r in results), \
        f"{page.name}: `{command}` does not parse as written: {results}"
