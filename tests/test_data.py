"""Tests for data.py and its generator tasks/toy_world.py: the toy world (determinism, disjoint
splits, answers in the passages, oracle EM 1.0, no-search baselines at chance) and the question loaders."""
import collections
import contextlib
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import data
from tasks import toy_world

ROOT = Path(__file__).resolve().parent.parent
FILES = ("corpus.jsonl", "train.jsonl", "test.jsonl", "meta.json")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    toy_world.build_toy_world(0, out)
    return out


@pytest.fixture(scope="module")
def build_seconds(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy_timed")
    start = time.perf_counter()
    toy_world.build_toy_world(0, out)
    return time.perf_counter() - start


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _corpus(world):
    return {d["id"]: d["contents"] for d in _jsonl(world / "corpus.jsonl")}


# ---------------------------------------------------------------------------- toy world

def test_generation_is_fast_and_sized(world, build_seconds):
    assert build_seconds < 5.0
    meta = json.loads((world / "meta.json").read_text())
    assert 2000 <= meta["passages"] <= 6000
    assert meta["questions"]["train"] == {"toy_nq": 2000, "toy_hotpot_bridge": 1200, "toy_hotpot_comparison": 800}
    assert sum(meta["questions"]["test"].values()) == 600
    assert len(_corpus(world)) == meta["passages"]
    first = _jsonl(world / "corpus.jsonl")[0]
    assert re.fullmatch(r'"[A-Z][a-z]+"\n.+', first["contents"], re.S)  # wiki-18: "Title"\ntext


def test_same_seed_gives_byte_identical_files_in_another_process(world, tmp_path):
    # A different hash seed in a fresh interpreter catches any dependence on set/dict ordering.
    code = f"from tasks.toy_world import build_toy_world; build_toy_world(0, {str(tmp_path)!r})"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (world / name).read_bytes(), name


def test_other_seed_gives_other_world(world, tmp_path):
    toy_world.build_toy_world(1, tmp_path)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    assert digest(tmp_path / "corpus.jsonl") != digest(world / "corpus.jsonl")


def test_splits_are_disjoint_by_entity(world):
    corpus = _corpus(world)

    def entities(split):
        names = set()
        for r in _jsonl(world / f"{split}.jsonl"):
            names |= {corpus[i].split("\n")[0].strip('"') for i in r["support"]}  # every hop's entity
            for pattern, _, _ in toy_world._QUESTION_REGEXES:
                m = pattern.fullmatch(r["question"])
                if m:
                    names |= {v for v in m.groupdict().values() if v}
                    break
            else:
                pytest.fail(f"question matches no template: {r['question']}")
            names |= {g for g in r["golds"][:1] if not g.isdigit()}  # years may repeat, names may not
        return names

    train, test = entities("train"), entities("test")
    assert len(train) > 1000 and len(test) > 200
    assert not train & test


def test_every_gold_is_in_its_support_passages(world):
    corpus = _corpus(world)
    for split in ("train", "test"):
        for r in _jsonl(world / f"{split}.jsonl"):
            assert set(r) == {"id", "question", "golds", "data_source", "support"}
            text = " ".join(corpus[i] for i in r["support"])
            assert all(g in text for g in r["golds"]), r
            if r["data_source"] == "toy_hotpot_bridge":
                assert len(r["support"]) == 2 and r["golds"][0] in corpus[r["support"][1]]


def test_aliases_years_and_surnames(world):
    records = _jsonl(world / "train.jsonl")
    years = [r for r in records if r["question"].startswith("In what year was")]
    assert years and all(re.fullmatch(r"\d{4}", r["golds"][0]) for r in years)
    founders = [r for r in records if r["question"].startswith("Who founded ")]
    assert founders and all(r["golds"][1] == r["golds"][0].split()[-1] for r in founders)


def test_oracle_answers_everything_from_support_passages(world):
    for split in ("train", "test"):
        scores = toy_world.check_oracle(world, split)
        assert scores == {k: 1.0 for k in scores}, (split, scores)


def test_oracle_reader_by_hand():
    passages = ['"Orlan Vesterby"\nOrlan Vesterby (born 1962) is a pilot from Kelford. '
                'Her sister Orlen Vesterby is a chef. She works for Dravex Mining.',
                '"Dravex Mining"\nFounded in 1990 by Tama Kell, Dravex Mining is a mining business. '
                'It opened an office in Velmora in 1995. Its headquarters are in Brusmere.']
    facts = toy_world.read_facts(passages)
    assert facts["Orlan Vesterby"] == {"birth_year": "1962", "birth_city": "Kelford", "employer": "Dravex Mining"}
    assert facts["Dravex Mining"] == {"founded": "1990", "founder": "Tama Kell", "hq": "Brusmere"}
    assert "Orlen Vesterby" not in facts  # the sibling sentence is about someone else
    question = "In what year was the company that Orlan Vesterby works for founded?"
    assert toy_world.oracle_answer(question, passages) == "1990"
    assert toy_world.oracle_answer("Where was Orlan Vesterby born?", passages) == "Kelford"
    assert toy_world.oracle_answer("Where was Orlan Vesterby born?", passages[1:]) is None  # needs its passage
    assert toy_world.oracle_answer("In which country was Orlan Vesterby born?", passages) is None  # 2nd hop missing


def test_no_search_baselines_stay_at_chance(world):
    priors = toy_world.check_priors(world)
    assert priors["train_prior"]["all"] < 0.02  # test entities never occur in train answers
    assert priors["best_fixed"]["toy_nq"] < 0.2  # even a per-template guess fitted on test itself
    assert 0.35 < priors["first_mentioned"]["toy_hotpot_comparison"] < 0.65  # A/B order is balanced


def test_toy_world_is_cached_per_seed(tmp_path, monkeypatch):
    monkeypatch.setenv("LLDS_CACHE", str(tmp_path))
    path = data.toy_world(3)
    assert path.parent == tmp_path / "toy_world" and (path / "meta.json").exists()
    stamp = (path / "corpus.jsonl").stat().st_mtime_ns
    assert data.toy_world(3) == path and (path / "corpus.jsonl").stat().st_mtime_ns == stamp
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".building")]


def test_load_toy(tmp_path, monkeypatch):
    monkeypatch.setenv("LLDS_CACHE", str(tmp_path))
    records = data.load_questions("toy", limit=5, split="test")
    assert len(records) == 5 and records[0]["id"] == "toy-test-0"
    with pytest.raises(ValueError, match="'train' and 'test'"):
        data.load_questions("toy", split="dev")
    everything = data.load_questions("toy", split="test")
    for kind in data.TOY_SOURCES:  # one kind = exactly the records of that data_source, in order
        assert data.load_questions(kind, split="test") == [r for r in everything if r["data_source"] == kind]
    assert [r["data_source"] for r in data.load_questions("toy_nq", limit=3)] == ["toy_nq"] * 3


# ---------------------------------------------------------------------------- loaders

def _write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return path


def test_flashrag_jsonl(tmp_path):
    f = _write(tmp_path / "nq.jsonl", [
        {"id": "test_0", "question": " who wrote hamlet? ", "golden_answers": ["Shakespeare", "W. Shakespeare"],
         "metadata": {"x": 1}},
        {"question": "capital of france", "golden_answers": "Paris"},
        {"id": 7, "question": "year?", "golden_answers": [1066]},
    ])
    records = data.load_questions(str(f))
    assert records[0] == {"id": "test_0", "question": "who wrote hamlet?", "golds": ["Shakespeare", "W. Shakespeare"],
                          "data_source": "nq", "metadata": {"x": 1}}
    assert records[1] == {"id": "nq:1", "question": "capital of france", "golds": ["Paris"], "data_source": "nq"}
    assert records[2]["id"] == "7" and records[2]["golds"] == ["1066"]
    assert len(data.load_questions(str(f), limit=2)) == 2


def test_own_jsonl_keeps_optional_keys(tmp_path):
    rec = {"id": "a", "question": "q?", "golds": ["x"], "data_source": "mine", "support": ["3"]}
    f = _write(tmp_path / "own.jsonl", [rec, "", {"question": "q2?", "golds": ["y"]}])
    records = data.load_questions(str(f))
    assert records[0] == rec
    assert records[1] == {"id": "own:1", "question": "q2?", "golds": ["y"], "data_source": "own"}


def test_directory_layouts(tmp_path):
    _write(tmp_path / "nq" / "test.jsonl", [{"question": "a?", "golden_answers": ["1"]}] * 3)
    _write(tmp_path / "hotpotqa" / "dev.jsonl", [{"question": "b?", "golden_answers": ["2"]}] * 3)
    _write(tmp_path / "hotpotqa" / "train.jsonl", [{"question": "c?", "golden_answers": ["3"]}])
    both = data.load_questions(str(tmp_path), limit=2, split="test")  # test, else dev
    assert [(r["data_source"], r["question"]) for r in both] == [("hotpotqa", "b?")] * 2 + [("nq", "a?")] * 2
    one = data.load_questions(str(tmp_path / "hotpotqa"), split="train")
    assert [(r["data_source"], r["question"]) for r in one] == [("hotpotqa", "c?")]
    with pytest.raises(ValueError, match="no validation.jsonl"):
        data.load_questions(str(tmp_path), split="validation")


@pytest.mark.parametrize("line, problem", [
    ('{"question": "ok?", "golden_answers": ["a"]', "not valid JSON"),
    ('{"question": "ok?"}', "golds"),
    ('{"question": "", "golds": ["a"]}', "question"),
    ('{"question": "ok?", "golds": []}', "golds"),
    ('["not", "an", "object"]', "JSON object"),
])
def test_bad_record_names_file_and_line(tmp_path, line, problem):
    f = _write(tmp_path / "bad.jsonl", [{"question": "fine?", "golden_answers": ["x"]}, line])
    with pytest.raises(ValueError, match=rf"bad\.jsonl: line 2: .*{problem}"):
        data.load_questions(str(f))


def test_unknown_sources(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        data.load_questions(str(tmp_path / "missing.jsonl"))
    (tmp_path / "q.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="expected .jsonl or .parquet"):
        data.load_questions(str(tmp_path / "q.csv"))


SEARCH_R1_PROMPT = ("Answer the given question. ... For example, <answer> Beijing </answer>. "
                    "Question: who sang the song in the middle of the street?\n")


def test_searchr1_row_conversion():
    row = {"data_source": "nq", "prompt": [{"role": "user", "content": SEARCH_R1_PROMPT}],
           "reward_model": {"ground_truth": {"target": np.array(["Jimmy", "Jimmy Cliff"])}, "style": "rule"},
           "extra_info": {"index": 5, "split": "train"}}
    assert data.searchr1_record(row, "f: row 1", "x", 0) == {
        "id": "nq:5", "question": "who sang the song in the middle of the street?",
        "golds": ["Jimmy", "Jimmy Cliff"], "data_source": "nq"}
    row["reward_model"]["ground_truth"]["target"] = "Jimmy"
    assert data.searchr1_record(row, "f: row 1", "x", 0)["golds"] == ["Jimmy"]
    with pytest.raises(ValueError, match="f: row 1"):
        data.searchr1_record({**row, "reward_model": {}}, "f: row 1", "x", 0)


def test_searchr1_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [{"data_source": src, "prompt": [{"role": "user", "content": SEARCH_R1_PROMPT}],
             "reward_model": {"ground_truth": {"target": ["Jimmy"]}}, "extra_info": {"index": i}}
            for i, src in enumerate(["nq", "hotpotqa"])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    records = data.load_questions(str(tmp_path / "train.parquet"))
    assert [r["id"] for r in records] == ["nq:0", "hotpotqa:1"]
    assert records[1]["question"] == "who sang the song in the middle of the street?"


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    # A None entry in sys.modules makes `import pyarrow` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "train.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="pip install pyarrow"):
        data.load_questions(str(tmp_path / "train.parquet"))


def test_cli_check(tmp_path):
    env = {**os.environ, "LLDS_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "data.py", "--check", "--show", "1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "oracle EM from support passages (test): all=1.000" in out
    bad = subprocess.run([sys.executable, "data.py", "--source", str(tmp_path / "nope.jsonl")], cwd=ROOT,
                         env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr


def test_encoding_errors_name_file_and_line(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_bytes(b'{"question": "a?", "golds": ["x"]}\n{"question": "b\xff?", "golds": ["y"]}\n')
    with pytest.raises(ValueError, match=r"q\.jsonl: line 2: not UTF-8 \(byte 0xff at column 16\)"):
        data.load_questions(str(f))
    # a BOM, CRLF line ends and blank lines load as the plain file does
    plain = data.load_questions(str(_write(tmp_path / "q.jsonl", [{"question": "a?", "golds": ["x"]}] * 2)))
    f.write_bytes(b'\xef\xbb\xbf{"question": "a?", "golds": ["x"]}\r\n\r\n  \n{"question": "a?", "golds": ["x"]}\r\n')
    assert data.load_questions(str(f)) == plain
    f.write_bytes(b'{"question": "a?", "golds": ["x"]}\n' + b"[" * 100_000 + b"\n")
    with pytest.raises(ValueError, match=r"q\.jsonl: line 2: JSON nested too deep"):
        data.load_questions(str(f))
    f.write_bytes(b'{"question": "a\\ud800?", "golds": ["x"]}\n')    # half a surrogate pair is not text
    with pytest.raises(ValueError, match=r"q\.jsonl: line 1: 'question' is missing, empty or not valid text"):
        data.load_questions(str(f))


def test_empty_question_file_is_an_error_at_load(tmp_path):
    for text in ("", "\n\n  \n"):
        (tmp_path / "empty.jsonl").write_text(text)
        with pytest.raises(ValueError, match=r"empty\.jsonl: no questions in this file"):
            data.load_questions(str(tmp_path / "empty.jsonl"))


# ---------------------------------------------------------------------------- corrupted files
# Random corruptions of valid files: every case must either load into well-formed records or
# stop with a ValueError naming the file and a line that was corrupted; never hang, never raise
# anything else. A seeded loop (no hypothesis): the same cases on every run, a few seconds.

QUESTIONS = [{"id": "q1", "question": "Where was Talia Wrenn born?", "golds": ["Orvale"], "data_source": "toy_nq"},
             {"question": "Who founded Brisco Mining?", "golden_answers": ["Ada Pell", "Pell"]},
             {"id": 3, "question": "In what year was Ada Pell born?", "golds": [1890], "support": ["7"]},
             {"id": "q4", "question": "Which company does Doran Vesk work for?", "golds": ["Trimble Motors"]}]
PASSAGES = [{"id": "0", "contents": '"Talia Wrenn"\nTalia Wrenn was born in Orvale.'},
            {"id": 1, "contents": '"Ada Pell"\nAda Pell was born in Kessan in 1890.'},
            {"id": "2", "contents": '"Brisco Mining"\nBrisco Mining was founded by Ada Pell in 1921.'}]
WRONG_VALUES = [None, True, 7, 2.5, float("nan"), [], {}, ["a", 3], [None], {"x": "y"}, "", "  "]
# Values json.dumps cannot write, put in the file in place of these markers.
UNWRITABLE = {"<half a surrogate pair>": '"a\\ud800"', "<an integer of 5,000 digits>": "1" * 5000}


def _corrupt(rng, rows: list[dict]) -> tuple[list[tuple[bytes, bool]], bytes]:
    """A JSONL file of `rows` with 1-3 random corruptions -> ([(line, corrupted?)], line end)."""
    lines, end = [(json.dumps(r).encode(), False) for r in rows], b"\n"
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["truncate", "wrong_type", "missing_field", "surrogate", "huge_field", "big_int",
                           "non_utf8", "flip", "huge_garbage", "deep", "not_object", "bom", "crlf", "blank"])
        i = rng.randrange(len(lines))
        line = lines[i][0]
        if len(line) < 2 and kind in ("truncate", "flip"):
            continue
        if kind in ("wrong_type", "missing_field", "surrogate", "huge_field", "big_int"):
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if not isinstance(obj, dict) or not obj:
                continue
            key = rng.choice(sorted(obj))
            if kind == "missing_field":
                del obj[key]
            else:
                markers = list(UNWRITABLE)
                obj[key] = {"wrong_type": lambda: rng.choice(WRONG_VALUES), "surrogate": lambda: markers[0],
                            "huge_field": lambda: "word " * rng.randint(20_000, 200_000),
                            "big_int": lambda: rng.choice([10 ** 20, markers[1]])}[kind]()
            text = json.dumps(obj)
            for marker, written in UNWRITABLE.items():
                text = text.replace(json.dumps(marker), written)
            lines[i] = (text.encode(), True)
        elif kind == "truncate":
            lines[i] = (line[:rng.randrange(1, len(line))], True)
        elif kind == "non_utf8":
            at = rng.randrange(len(line) + 1)
            lines[i] = (line[:at] + bytes([rng.choice([0x80, 0xbf, 0xc0, 0xc3, 0xe2, 0xf8, 0xff])]) + line[at:], True)
        elif kind == "flip":
            at = rng.randrange(len(line))
            lines[i] = (line[:at] + bytes([rng.randrange(256)]) + line[at + 1:], True)
        elif kind == "huge_garbage":
            lines.insert(i, (bytes(rng.randrange(32, 127) for _ in range(1000)) * 500, True))
        elif kind == "deep":
            lines.insert(i, (b'{"question": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", True))
        elif kind == "not_object":
            lines.insert(i, (rng.choice([b"[1, 2]", b'"text"', b"3", b"null", b"true"]), True))
        elif kind == "bom" and not lines[0][0].startswith(b"\xef\xbb\xbf"):
            lines[0] = (b"\xef\xbb\xbf" + lines[0][0], lines[0][1])
        elif kind == "crlf":
            end = b"\r\n"
        elif kind == "blank":
            lines.insert(i, (rng.choice([b"", b"  ", b"\t", b"\r"]), False))
    return lines, end


def _is_text(value, blank_ok=False) -> bool:
    try:
        value.encode("utf-8")
    except (AttributeError, UnicodeEncodeError):
        return False
    return isinstance(value, str) and (blank_ok or bool(value.strip()))


@contextlib.contextmanager
def _time_limit(seconds: float):
    def stop(*_):
        raise TimeoutError(f"no answer in {seconds} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _check_corruptions(tmp_path, seed: int, rows: list[dict], load, valid) -> collections.Counter:
    """300 corrupted files through `load`; each one either loads (every item `valid`, and exactly
    the clean file's items when only a BOM, CRLF or blank lines were added) or raises a ValueError
    that names the file and one of the corrupted lines (or says the file holds nothing)."""
    clean = load(_write(tmp_path / "clean.jsonl", rows))
    rng, outcomes = random.Random(seed), collections.Counter()
    for case in range(300):
        lines, end = _corrupt(rng, rows)
        path = tmp_path / "clean.jsonl"           # the same name: data_source and ids stay comparable
        path.write_bytes(b"".join(line + end for line, _ in lines))
        corrupted = [n for n, (_, bad) in enumerate(lines, 1) if bad]
        try:
            with _time_limit(5.0), warnings.catch_warnings():
                warnings.simplefilter("ignore")   # a corrupted corpus id may repeat another one
                items = load(path)
        except ValueError as e:
            message = str(e)
            line = re.match(rf"{re.escape(str(path))}(?:: line |:)(\d+): ", message)
            assert line or re.match(rf"{re.escape(str(path))}: (no questions in this file|corpus is empty)", message), \
                message[:300]
            assert not line or int(line.group(1)) in corrupted, (message[:300], corrupted)
            outcomes["error"] += 1
            continue
        assert all(valid(item) for item in items), items
        assert corrupted or items == clean
        outcomes["loaded" if not corrupted else "loaded despite a corruption"] += 1
    return outcomes


def test_question_loader_survives_random_corruptions(tmp_path):
    def valid(r):
        return (isinstance(r["id"], str) and _is_text(r["question"]) and _is_text(r["data_source"])
                and bool(r["golds"]) and all(_is_text(g) for g in r["golds"]))

    start = time.perf_counter()
    outcomes = _check_corruptions(tmp_path, 0, QUESTIONS, lambda p: data.load_questions(str(p)), valid)
    assert outcomes["error"] > 100 and outcomes["loaded"] > 10 and outcomes["loaded despite a corruption"] > 10
    assert time.perf_counter() - start < 30


def test_corpus_reader_survives_random_corruptions(tmp_path):
    from plumbing.corpus import load_corpus

    def valid(d):
        return _is_text(d["id"], blank_ok=True) and _is_text(d["contents"], blank_ok=True)

    outcomes = _check_corruptions(tmp_path, 1, PASSAGES, load_corpus, valid)
    assert outcomes["error"] > 100 and outcomes["loaded"] > 10 and outcomes["loaded despite a corruption"] > 10


def test_parquet_loader_names_the_file_or_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    good = {"data_source": "nq", "prompt": [{"role": "user", "content": SEARCH_R1_PROMPT}],
            "reward_model": {"ground_truth": {"target": ["Jimmy"]}}, "extra_info": {"index": 0}}
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([good] * 3), path)
    whole = path.read_bytes()
    for cut in random.Random(2).sample(range(len(whole)), 30):          # truncated files
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: not a readable parquet file"):
            data.load_questions(str(path))
    wrong = [{"prompt": 5}, {"prompt": "no question mark here"}, {"reward_model": "Jimmy"},
             {"reward_model": {"ground_truth": ["Jimmy"]}}, {"data_source": 3}, {"extra_info": "x"}]
    for change in wrong:               # wrong types (a parquet column has one type: one row per file)
        pq.write_table(pa.Table.from_pylist([{**good, **change}]), path)
        try:
            records = data.load_questions(str(path))
        except ValueError as e:
            assert str(e).startswith(f"{path}: row 1: "), str(e)
        else:
            assert len(records) == 1 and records[0]["golds"] == ["Jimmy"], change
