"""Every flag of train.py, eval.py, sft.py and retriever.py, fuzzed with the values a user might type:
0, -1, a huge number, nan and inf, a word for a number; "", a missing path, a folder, an unknown
word for a string.

* A value outside the flag's declared range (plumbing/cli.py) ends at parsing: exit 2, one line
  "error: argument --flag: must be ...".
* A value inside it runs the script on a tiny model (one step, one question) and must finish, or
  exit != 0 with one line "error: ..." that names the flag or the value. A finished train.py run
  records the value in its config.json.
* Never a traceback, never a hang (an alarm per case). Huge legal values mean a long run and are
  parsed only; so is every legal value of `retriever.py serve`, which serves until stopped.
* A field of a config dataclass without a declared range fails here, when its parser is built.
"""
import argparse
import dataclasses
import json
import signal
from pathlib import Path

import pytest

import data
import eval as ev
import retriever
import sft
import train
from plumbing import cli, models, runs
from test_sft import tiny_lab_model

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

HUGE = {"int": "10000000000000", "float": "1e30"}
CORPUS = [{"id": "a", "contents": '"Everest"\nEverest is the highest mountain.'},
          {"id": "b", "contents": '"Jupiter"\nJupiter is the largest planet.'}]
TINY = ["--max-turns", "1", "--max-turn-tokens", "4", "--template", "search-r1"]
QUESTIONS = ["--data", "{s}/q.jsonl", "--corpus", str(data.toy_world() / "corpus.jsonl"), "--index", "{s}/index"]
SCRIPTS = {   # (main, parser, the tiny run every case starts from; {m} the model, {t} the case's folder, {s} shared)
    "train.py": (train.main, cli.train_parser(train.Config, train.PRESETS, train.CHOICES), [
        "--model", "{m}", "--out-dir", "{t}", *QUESTIONS, "--steps", "1", "--prompts-per-step", "2",
        "--group-size", "2", "--mini-batch-size", "4", "--micro-batch-size", "4", "--eval-size", "1",
        "--ckpt-every", "0", "--samples-per-step", "1", *TINY]),
    "eval.py": (ev.main, ev.parser(), ["--model", "{m}", *QUESTIONS, "--limit", "1",
                                      "--out", "{t}/eval", *TINY]),
    "sft.py": (sft.main, sft.parser(), ["--model", "{m}", *QUESTIONS[:4], "--out", "{t}/sft", "--questions", "2",
                                        "--episodes-per-question", "1", "--heldout-questions", "1", "--epochs", "1",
                                        "--batch-size", "2", "--eval-size", "1", "--eval-samples", "1", *TINY[:4]]),
    "retriever.py index": (retriever.main, retriever.parser(), ["index", "--corpus", "{t}/c.jsonl", "--index", "{t}/i"]),
    "retriever.py search": (retriever.main, retriever.parser(), ["search", "mountain", "--corpus", "{t}/c.jsonl",
                                                                 "--index", "{t}/i"]),
    "retriever.py serve": (retriever.main, retriever.parser(), ["serve", "--corpus", "{t}/c.jsonl", "--port", "0"]),
}


def actions(script: str) -> list[argparse.Action]:
    """The flags (and positionals) of a script or of one retriever.py subcommand, --help left out."""
    parser = SCRIPTS[script][1]
    if script.startswith("retriever.py"):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[script.split()[1]]
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def values(action: argparse.Action) -> list[str | None]:
    """What a user might type for this flag (None: the flag alone, a switch)."""
    if action.nargs == 0:
        return [None]
    if action.type is None:
        assert action.choices, f"{action.option_strings}: neither a declared range nor choices"
        return ["bogus"]
    assert hasattr(action.type, "range"), f"{action.option_strings or action.dest}: no declared range"
    kind = action.type.__name__
    if kind == "int":
        low = action.type.range.replace("..", " ").replace(">=", "").split()[0]
        return sorted({"0", "-1", HUGE["int"], "abc", low if low.lstrip("-").isdigit() else "0"})
    if kind == "float":
        return ["0", "-1", HUGE["float"], "nan", "inf"]
    return ["", "<missing>", "<folder>", "bogus"]


CASES = [(script, action.option_strings[-1] if action.option_strings else action.dest, value)
         for script in SCRIPTS for action in actions(script) for value in values(action)
         if action.dest not in ("plot", "plot_out")]     # --plot draws existing runs and exits: test_report.py


def argv_for(script: str, flag: str, value: str | None, paths: dict) -> list[str]:
    """The script's tiny run with `flag` set to `value` (a positional replaced in place)."""
    base = [a.format(**paths) for a in SCRIPTS[script][2]]
    if not flag.startswith("-"):                                   # retriever.py search's query
        return [value if a == "mountain" else a for a in base]
    names, kept, i = {flag, flag.replace("--no-", "--"), "--no-" + flag.removeprefix("--")}, [], 0
    while i < len(base):                         # drop the base's own setting of this flag
        has_value = i + 1 < len(base) and not base[i + 1].startswith("--")
        if base[i] in names:
            i += 2 if has_value else 1
            continue
        kept.append(base[i])
        i += 1
    value = {"<missing>": str(paths["t"] / "missing" / "x"), "<folder>": str(paths["t"])}.get(value, value)
    return kept + [flag] + ([] if value is None else [value])


def legal(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    try:
        parser.parse_args(argv)
        return True
    except SystemExit:
        return False


def run(main, argv: list[str], capsys, seconds: int = 120) -> tuple[int, str]:
    """main(argv) under an alarm -> (exit code, its last stderr line or SystemExit's message)."""
    def timeout(*_):
        raise TimeoutError(f"no end after {seconds} s: {argv}")
    signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        main(argv)
        code, message = 0, ""
    except SystemExit as e:
        code, message = (1, e.code) if isinstance(e.code, str) else (e.code or 0, "")
    finally:
        signal.alarm(0)
    err = capsys.readouterr().err.strip()
    return code, message or (err.splitlines()[-1] if err else "")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The tiny model, 8 questions (one file: train and held-out), the toy corpus's index."""
    folder = tmp_path_factory.mktemp("flags")
    tiny_lab_model(folder / "model")
    rows = (data.toy_world() / "train.jsonl").read_text().splitlines()
    (folder / "q.jsonl").write_text("\n".join([r for r in rows if '"toy_nq"' in r][:8]) + "\n")
    return folder


@pytest.fixture(autouse=True)
def fast(monkeypatch, tmp_path, shared):
    """What a one-step run does not need here: its plot, a full garbage collection per phase, the
    client's waits between retries; --model "" (the embedded default) loads the tiny model. Each
    case runs in its own folder: a relative path a value names lands there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "embedded_smollm2", lambda: shared / "model")
    monkeypatch.setattr(retriever.time, "sleep", lambda s: None)
    monkeypatch.setattr(train, "plot_runs", lambda *a, **k: "")
    monkeypatch.setattr(runs, "release_memory", lambda: None)
    monkeypatch.setattr(ev.memory, "release_memory", lambda: None)


@pytest.mark.parametrize("script,flag,value", CASES, ids=[f"{s}:{f}={v}" for s, f, v in CASES])
def test_every_flag_value_runs_or_ends_in_one_clear_line(script, flag, value, shared, tmp_path, capsys):
    main, parser, _ = SCRIPTS[script]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    argv = argv_for(script, flag, value, {"m": shared / "model", "t": tmp_path, "s": shared})
    if not legal(parser, argv):
        code, line = run(main, argv, capsys)
        assert code == 2 and line.startswith(f"error: argument {flag}") and "\n" not in line, line
        return
    if value in HUGE.values() or script == "retriever.py serve":
        return                                                     # legal, and a long run: parsed only
    code, line = run(main, argv, capsys)
    if code:
        assert line.startswith("error: ") and "\n" not in line, line
        assert flag.lstrip("-") in line or (value is not None and argv[-1] in line), line
    elif script == "train.py" and flag != "--plan":          # --plan prints and exits: no run
        cfg = cli.parse_train_args(train.Config, train.PRESETS, train.CHOICES, argv)[0]
        cfg = dataclasses.replace(cfg, name=cfg.name or "demo")      # the first unnamed run
        saved = json.loads((Path(cfg.out_dir) / cfg.name / "config.json").read_text())
        assert saved == json.loads(json.dumps(dataclasses.asdict(cfg)))


def test_a_field_without_a_declared_range_is_refused():
    @dataclasses.dataclass
    class Config:
        steps: int = cli.flag(1, "training steps", ">= 1")
        lr: float = cli.flag(1e-3, "learning rate, no range")   # a comment is only a comment [>= 9]

    with pytest.raises(TypeError, match="Config.lr declares no range"):
        cli.add_config_flags(argparse.ArgumentParser(), Config)
    with pytest.raises(TypeError, match="Config.lr declares no range"):
        cli.check_ranges(Config())


@pytest.mark.parametrize("spec,inside,outside", [
    (">= 1", [1, 7], [0, -1]), ("> 0, <= 1", [1e-9, 1.0], [0.0, 1.5, float("nan"), float("inf")]),
    ("0..4294967295", [0, 4294967295], [-1, 4294967296]), ("text", ["a"], ["", "  "]),
    ("any", ["", "x"], []), ("choice", ["a"], ["c"])])
def test_declared_ranges_hold_what_they_say(spec, inside, outside):
    assert all(cli.in_range(v, spec, ("a", "b")) for v in inside)
    assert not any(cli.in_range(v, spec, ("a", "b")) for v in outside)


def test_the_two_reported_tracebacks_are_one_line_now(capsys):
    for flag, line in (("--temperature", "error: argument --temperature: must be > 0, not '0'"),
                       ("--max-turn-tokens", "error: argument --max-turn-tokens: must be >= 1, not '0'")):
        with pytest.raises(SystemExit) as e:
            train.main([flag, "0"])
        assert e.value.code == 2 and capsys.readouterr().err == line + "\n"
