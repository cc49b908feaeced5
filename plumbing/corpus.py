"""Corpus files and index folders for retriever.py: a JSONL corpus streamed with a progress bar,
every line checked (a bad one stops with the file and line), duplicate ids warned about; a
fingerprint of the corpus; and the meta.json that marks an index folder complete and ties it to the
corpus it was built from, so an index is never searched against another corpus.
"""
import hashlib
import json
import warnings
from pathlib import Path

from tqdm import tqdm

BIG_FILE_BYTES = 32 << 20  # corpus files above this get a progress bar


def load_corpus(path) -> list[dict]:
    """Stream a JSONL corpus of {"id": str, "contents": "\\"Title\\"\\ntext"} lines.

    A bad line stops with a ValueError naming the file and line; duplicate ids only warn
    (results stay well defined, but answers citing an id become ambiguous).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"corpus file not found: {path}")
    docs, seen, dupes = [], set(), []
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(
        total=size, unit="B", unit_scale=True, desc=f"load {path.name}", disable=size < BIG_FILE_BYTES
    ) as bar:
        for lineno, raw in enumerate(f, start=1):
            bar.update(len(raw))
            if not raw.strip():
                continue
            doc = _parse_corpus_line(raw, path, lineno)
            if doc["id"] in seen:
                dupes.append(doc["id"])
            seen.add(doc["id"])
            docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: corpus is empty (expected one JSON object per line)")
    if dupes:
        warnings.warn(f"{path}: {len(dupes)} duplicate ids, e.g. {dupes[:5]}; hits stay correct "
                      "but an id no longer names one passage", stacklevel=2)
    return docs


def _parse_corpus_line(raw: bytes, path: Path, lineno: int) -> dict:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(raw.decode("utf-8-sig"))     # a BOM on the first line is fine
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                         "save the file as UTF-8") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deep") from None
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with 'id' and 'contents'")
    if not isinstance(obj.get("contents"), str):
        raise ValueError(f"{where}: 'contents' is missing or not a string")
    if not isinstance(obj.get("id"), (str, int)) or isinstance(obj.get("id"), bool):
        raise ValueError(f"{where}: 'id' is missing or not a string")
    doc = {"id": str(obj["id"]), "contents": obj["contents"]}
    if b"\\ud" in raw or b"\\uD" in raw:          # a "\\udXXX" escape may be half a surrogate pair
        try:
            (doc["id"] + doc["contents"]).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: a lone surrogate escape (\\ud800-\\udfff) is not text") from None
    return doc


def corpus_fingerprint(corpus: list[dict]) -> str:
    """Hash of ids and contents: an index is only ever loaded against the corpus it was built on."""
    h = hashlib.sha1()
    for doc in corpus:
        h.update(doc["id"].encode() + b"\0" + doc["contents"].encode() + b"\n")
    return h.hexdigest()


def write_index_meta(index_dir: Path, backend: str, corpus: list[dict], **extra) -> None:
    """meta.json, the last file of an index folder: its presence means the index is complete."""
    meta = {"backend": backend, "n_docs": len(corpus), "fingerprint": corpus_fingerprint(corpus), **extra}
    (Path(index_dir) / "meta.json").write_text(json.dumps(meta, indent=1))


def read_index_meta(index_dir: Path, backend: str, corpus: list[dict]) -> dict:
    """meta.json of a finished `backend` index built from exactly this corpus; ValueError otherwise."""
    meta_path = Path(index_dir) / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{index_dir} is not a finished index (no meta.json); "
                         f"build one with: python retriever.py index --corpus ... --index {index_dir}")
    meta = json.loads(meta_path.read_text())
    if meta["backend"] != backend:
        raise ValueError(f"{index_dir} holds a {meta['backend']} index, not {backend}")
    if meta["n_docs"] != len(corpus) or meta["fingerprint"] != corpus_fingerprint(corpus):
        raise ValueError(f"{index_dir} was built from a different corpus ({meta['n_docs']} passages, this "
                         f"one has {len(corpus)}, contents hash differs); pass another --index or delete it")
    return meta
