"""Tests for data.py and its generator plumbing/toy_world.py: the toy world (determinism, disjoint
splits, answers in the passages, oracle EM 1.0, no-search baselines at chance) and the question loaders."""
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import data
from plumbing import toy_world

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
    code = f"from plumbing.toy_world import build_toy_world; build_toy_world(0, {str(tmp_path)!r})"
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
