"""data.py — question sets: the embedded "toy world" and loaders for the formats users have.

Search-R1 trains on NQ + HotpotQA and evaluates on seven QA sets over a 21M-passage Wikipedia
dump. None of that fits an offline CPU demo, so this file also offers a synthetic stand-in:

* **Toy world** (`toy_world(seed)`): invented, pronounceable people, cities, countries and
  companies with facts (birthplace, birth year, employer, founding year, founder, HQ city,
  country, capital, independence year), one or two passages each in wiki-18 format
  (`{"id", "contents": "\"Title\"\ntext"}`), with near-identical distractors. Questions come in
  three `data_source`s mirroring the paper's training mix: `toy_nq` (single hop: one BM25
  search with the question's words finds the passage), `toy_hotpot_bridge` (two hops: the
  second entity is only named in the first passage) and `toy_hotpot_comparison` ("Who was
  born first, A or B?"). Train and test are split by *country*, so test questions are about
  entities that no training question mentions. The names are invented, so a model that does
  not search can only guess; `python data.py --check` measures that, and checks that an oracle
  reading the gold passages (`support` ids in each record) answers every question. The
  generator and these checks live in tasks/toy_world.py; here the world is only cached.
  Simplified: facts are few and templated; real Wikipedia questions are far more varied.

* **Loaders** (`load_questions`): FlashRAG JSONL, Search-R1 parquet (needs pyarrow), our own
  JSONL, or a `<root>/<dataset>/<split>.jsonl` folder. All give the same Record:
  `{"id", "question", "golds", "data_source"}` (+ optional keys such as `support`).
  `load_question_sets` reads several sources and keeps the first N of every data_source.
  Everything is checked here, at load: a line that is not UTF-8, not JSON or not a record, and
  a file without questions, stop with a ValueError naming the file and line (a BOM, CRLF line
  ends and blank lines are fine). Prompt lengths are checked by rollout.drop_long_prompts.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import plumbing
from tasks.toy_world import TOY_VERSION, build_toy_world, check_bm25, check_oracle, check_priors

Record = dict  # {"id": str, "question": str, "golds": list[str], "data_source": str, ...optional}

# ----------------------------------------------------------------------------------------------
# The toy world, built once per seed and cached
# ----------------------------------------------------------------------------------------------

TOY_SOURCES = ("toy_nq", "toy_hotpot_bridge", "toy_hotpot_comparison")


def is_toy(source: str) -> bool:
    """"toy" (the whole toy world) or one of its question kinds, e.g. "toy_nq" (single-hop only)."""
    return source == "toy" or source in TOY_SOURCES


def _toy_world_dir(seed: int) -> Path:
    return plumbing.cache_dir() / "toy_world" / f"v{TOY_VERSION}-seed{seed}"


def toy_world(seed: int = 0) -> Path:
    """Directory holding the toy world for this seed; generated on first use (~1 s)."""
    target = _toy_world_dir(seed)
    if (target / "meta.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    build_toy_world(seed, tmp)
    try:  # atomic: another process may be building the same world at the same time
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def corpus_for(sources: list[str], retriever: str, corpus: str | None = None) -> str | None:
    """The corpus an in-process retriever searches: `corpus` when given, none for a server URL
    (it has its own), the toy world's for toy questions; else a clear error."""
    if corpus or retriever.startswith(("http://", "https://")):
        return corpus or None
    if any(is_toy(s) for s in sources):
        return str(toy_world() / "corpus.jsonl")
    raise ValueError(f"the {retriever} retriever needs --corpus (a JSONL of passages) for your own "
                     "questions, or a server URL as --retriever")


# ----------------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------------

def _read_jsonl(path: Path):
    """Yields (line number, parsed object) of every non-blank line; any line that cannot be read
    (bytes that are not UTF-8, bad JSON, nesting too deep) is a ValueError naming file and line.
    Lines end at b"\\n" only, as an editor counts them; a UTF-8 BOM and CRLF line ends are fine."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {n}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                                 f"{e.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except RecursionError:
                raise ValueError(f"{path}: line {n}: JSON nested too deep") from None
            except ValueError as e:                   # bad JSON, or an integer of 4,300+ digits
                raise ValueError(f"{path}: line {n}: not valid JSON ({getattr(e, 'msg', e)})") from None
            yield n, obj


def _as_golds(value) -> list | None:
    if hasattr(value, "tolist"):  # numpy arrays, as pandas hands back list columns
        value = value.tolist()
    if isinstance(value, (str, int, float)):
        return [str(value)]
    if isinstance(value, (list, tuple)):
        return [str(v) if isinstance(v, (int, float)) else v for v in value]
    return None


def _is_text(value) -> bool:
    """A non-blank string that can be written as UTF-8 (JSON's "\\ud800" escape gives one that cannot)."""
    if not isinstance(value, str) or not value.strip():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _record(raw, where: str, default_source: str, default_id: str) -> Record:
    """Validate one FlashRAG / own-format record into a Record; errors say where it came from."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    question = raw.get("question")
    if not _is_text(question):
        raise ValueError(f"{where}: 'question' is missing, empty or not valid text")
    golds = _as_golds(raw["golds"] if "golds" in raw else raw.get("golden_answers"))
    if not golds or not all(_is_text(g) for g in golds):
        raise ValueError(f"{where}: needs a non-empty list of answer strings in 'golds' or 'golden_answers'")
    if raw.get("id") is not None and (not isinstance(raw["id"], (str, int)) or isinstance(raw["id"], bool)):
        raise ValueError(f"{where}: 'id' must be a string or an integer, got {type(raw['id']).__name__}")
    if raw.get("data_source") and not _is_text(raw["data_source"]):
        raise ValueError(f"{where}: 'data_source' must be a non-empty string, got {raw['data_source']!r:.40}")
    source = raw.get("data_source") or default_source
    record = {k: v for k, v in raw.items() if k != "golden_answers"}
    record.update(id=str(raw["id"]) if raw.get("id") is not None else default_id.format(source=source),
                  question=question.strip(), golds=golds, data_source=str(source))
    return record


def _load_jsonl(path: Path, limit: int | None, default_source: str) -> list[Record]:
    records = []
    for n, raw in _read_jsonl(path):
        if limit is not None and len(records) >= limit:
            break
        records.append(_record(raw, f"{path}: line {n}", default_source, "{source}:%d" % len(records)))
    return records


def question_from_prompt(prompt) -> str:
    """The question inside a Search-R1 prompt: the last user message, after "Question: "."""
    if isinstance(prompt, str):
        text = prompt
    else:
        messages = list(prompt) if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist") else []
        users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        text = users[-1] if users and isinstance(users[-1], str) else ""
    return text.rsplit("Question:", 1)[-1].strip()


def _field(row, *keys):
    """row[k1][k2]..., None where a level is missing or not a dict."""
    for key in keys:
        row = row.get(key) if isinstance(row, dict) else None
    return row


def searchr1_record(row: dict, where: str, default_source: str, row_index: int) -> Record:
    """One Search-R1 parquet row ({data_source, prompt, reward_model, extra_info}) as a Record."""
    source = _field(row, "data_source") or default_source
    index = _field(row, "extra_info", "index")
    # Search-R1's merged files number rows per source, hence data_source:index as the id.
    raw = {"id": f"{source}:{row_index if index is None else index}",
           "question": question_from_prompt(_field(row, "prompt")),
           "golds": _as_golds(_field(row, "reward_model", "ground_truth", "target")), "data_source": source}
    return _record(raw, where, default_source, "")


def _load_parquet(path: Path, limit: int | None, default_source: str) -> list[Record]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        rows = pq.read_table(path).to_pylist()[:limit]
    except (pyarrow.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    return [searchr1_record(row, f"{path}: row {n}", default_source, n - 1) for n, row in enumerate(rows, 1)]


def _load_file(path: Path, limit: int | None, default_source: str) -> list[Record]:
    """The records of one .jsonl or .parquet file; a file with none is an error."""
    if path.suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"{path}: unknown question file type (expected .jsonl or .parquet)")
    load = _load_parquet if path.suffix == ".parquet" else _load_jsonl
    records = load(path, limit, default_source)
    if not records and limit != 0:
        raise ValueError(f"{path}: no questions in this file")
    return records


def _split_file(folder: Path, split: str) -> Path | None:
    for name in [split] + (["dev"] if split == "test" else []):  # FlashRAG has no test for some sets
        for ext in (".jsonl", ".parquet"):
            if (folder / f"{name}{ext}").exists():
                return folder / f"{name}{ext}"
    return None


def load_questions(source: str, limit: int | None = None, split: str = "train") -> list[Record]:
    """Records from "toy" or one toy kind such as "toy_nq" (its `split`), a FlashRAG/own .jsonl,
    a Search-R1 .parquet, a dataset folder holding <split>.jsonl (test falls back to dev), or a
    root of such folders (all datasets, `limit` each). data_source defaults to the dataset folder
    or file name."""
    if is_toy(source):
        if split not in ("train", "test"):
            raise ValueError(f"the toy world has splits 'train' and 'test', not {split!r}")
        records = _load_jsonl(toy_world() / f"{split}.jsonl", None, "toy")
        return [r for r in records if source in ("toy", r["data_source"])][:limit]
    path = Path(source).expanduser()
    if path.is_file():
        return _load_file(path, limit, path.stem)
    if path.is_dir():
        own = _split_file(path, split)
        if own:
            return _load_file(own, limit, path.name)
        datasets = [d for d in sorted(path.iterdir()) if d.is_dir() and _split_file(d, split)]
        if datasets:
            return [r for d in datasets for r in _load_file(_split_file(d, split), limit, d.name)]
        raise ValueError(f"{path}: no {split}.jsonl here nor in <dataset>/{split}.jsonl subfolders")
    raise ValueError(f"{source}: no such file or folder (expected 'toy' or {', '.join(TOY_SOURCES)}, "
                     "a .jsonl or .parquet file, or a folder laid out <root>/<dataset>/<split>.jsonl)")


def load_question_sets(sources: list[str], split: str, limit: int | None) -> list[Record]:
    """Records of every source (as load_questions reads them), the first `limit` of every
    data_source: one file may mix sources, and each still counts on its own."""
    records = [r for source in sources for r in load_questions(source, split=split)]
    seen, kept = collections.Counter(), []
    for r in records:
        if limit is None or seen[r["data_source"]] < limit:
            seen[r["data_source"]] += 1
            kept.append(r)
    return kept


def heldout_set(source: str, size: int) -> list[Record]:
    """A fixed held-out subset: `size` test questions of `source` drawn with seed 0, the same for
    every run (train.py evaluates on it before, during and after training)."""
    records = load_questions(source, split="test")
    random.Random(0).shuffle(records)
    return records[:size]


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def _fmt(scores: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.3f}" for k, v in scores.items())


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the toy world and print its statistics, "
                                     "or inspect any question file.")
    parser.add_argument("--seed", type=int, default=0, help="toy world seed")
    parser.add_argument("--check", action="store_true",
                        help="also run the checks: oracle EM, no-search baselines, BM25 top-3 recall")
    parser.add_argument("--show", type=int, default=2, help="example questions to print per data source")
    parser.add_argument("--source",
                        help="instead of the toy world, load this question file/folder and summarise it")
    parser.add_argument("--split", default="test", help="split for --source folders")
    parser.add_argument("--limit", type=int, help="records to load per file with --source")
    args = parser.parse_args()
    try:
        if args.source:
            records = load_questions(args.source, args.limit, args.split)
            print(f"{len(records)} records:", dict(collections.Counter(r["data_source"] for r in records)))
            for r in records[: args.show]:
                print(" ", json.dumps(r)[:300])
            return
        start = time.perf_counter()
        built = not (_toy_world_dir(args.seed) / "meta.json").exists()
        world_dir = toy_world(args.seed)
        took = time.perf_counter() - start
        print(f"toy world seed {args.seed}: {world_dir} ({'built' if built else 'cached'}, {took:.2f}s)")
        meta = json.loads((world_dir / "meta.json").read_text())
        print(f"passages: {meta['passages']}   entities (train/test): "
              + ", ".join(f"{k} {v['train']}/{v['test']}" for k, v in meta["entities"].items()))
        for split, counts in meta["questions"].items():
            print(f"{split} questions: {sum(counts.values())}  {counts}")
        test = load_questions(str(world_dir / "test.jsonl"))
        for source in meta["questions"]["test"]:
            for r in [r for r in test if r["data_source"] == source][: args.show]:
                print(f"  [{source}] {r['question']} -> {r['golds']}")
        if args.check:
            for split in ("train", "test"):
                print(f"oracle EM from support passages ({split}): {_fmt(check_oracle(world_dir, split))}")
            for name, scores in check_priors(world_dir).items():
                print(f"no-search baseline {name} (test EM): {_fmt(scores)}")
            print("chance for comparison questions: 0.500")
            bm25 = check_bm25(world_dir, "test")
            if bm25 is None:
                print("BM25 top-3 recall: skipped (retriever.py not importable)")
            else:
                for name, scores in bm25.items():
                    print(f"BM25 top-3 with the raw question, {name} support found (test): {_fmt(scores)}")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
