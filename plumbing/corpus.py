"""Corpus files and index folders for retriever.py.

A JSONL corpus ({"id": str, "contents": "\\"Title\\"\\ntext"} per line, Search-R1's wiki-18.jsonl
as it is) becomes a `Corpus`: every passage's UTF-8 bytes in one buffer plus an offsets array, a
passage decoded only when it is read. Nothing is ever a Python object per passage (~1.3 KB each: 27 GB
for wiki-18's 21M passages); the buffer is the size of the text.

- Files under SMALL_FILE_BYTES are parsed at every start into an in-memory buffer (< 0.5 s).
- Larger files are parsed once into $LLDS_CACHE/corpus/<key>/ (passages.bin + offsets.npy, the
  size of the JSONL again on disk) and memory-mapped from there at every later start: no re-read, no
  re-hash; the OS pages in what is read. The key is the file's size, modification time and 64 sampled
  64 KiB blocks, so an edited file is parsed again.

Every line is checked on the way in (a bad one stops with the file and line) and duplicate ids are
warned about. The corpus fingerprint (sha1 of every id and contents) is computed while parsing and
kept; meta.json, the last file of an index folder, records it, so an index is never searched
against another corpus.
"""
import hashlib
import io
from array import array
import json
import mmap
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

SMALL_FILE_BYTES = 64 << 20  # below this a corpus is parsed in memory at each start, above it stored once
BIG_FILE_BYTES = 32 << 20  # corpus files above this get a progress bar
SAMPLED_BLOCKS, BLOCK_BYTES = 64, 64 << 10  # what the store key reads of a big file


class Corpus(Sequence):
    """Passages by position: corpus[i] -> {"id", "contents"} (a new dict each time), len(corpus).

    Record i of `blob` is id + b"\\0" + contents + b"\\n" (UTF-8) and starts at offsets[2i]; its
    contents start at offsets[2i + 1]. The fingerprint is the sha1 of the whole blob.
    """

    def __init__(self, blob, offsets: np.ndarray, fingerprint: str, source: str = "(in memory)"):
        self.blob, self.offsets, self.fingerprint, self.source = blob, offsets, fingerprint, source

    @classmethod
    def from_docs(cls, docs) -> "Corpus":
        """An in-memory corpus from {"id", "contents"} dicts (tests, generated corpora)."""
        sink, offsets, sha = io.BytesIO(), array("q", [0]), hashlib.sha1()
        for d in docs:
            _append(sink, offsets, sha, str(d["id"]), d["contents"])
        return cls(sink.getvalue(), np.frombuffer(offsets, dtype=np.int64), sha.hexdigest())

    def __len__(self) -> int:
        return (len(self.offsets) - 1) // 2

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices, IndexError past the end
        start, mid, end = (int(x) for x in self.offsets[2 * i:2 * i + 3])
        return {"id": self.blob[start:mid - 1].decode(), "contents": self.blob[mid:end - 1].decode()}

    def contents(self, start: int, stop: int) -> list[str]:
        """The contents of passages start..stop-1: what an indexer streams through, a chunk at a time."""
        o = self.offsets[2 * start:2 * stop + 1].tolist()
        return [self.blob[o[j + 1]:o[j + 2] - 1].decode() for j in range(0, len(o) - 1, 2)]

    def __eq__(self, other):
        if isinstance(other, Corpus):
            return len(self) == len(other) and self.fingerprint == other.fingerprint
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None


def _append(sink, offsets: array, sha, doc_id: str, contents: str) -> None:
    id_bytes = doc_id.encode()
    record = id_bytes + b"\0" + contents.encode() + b"\n"
    sink.write(record)
    sha.update(record)
    offsets.extend((offsets[-1] + len(id_bytes) + 1, offsets[-1] + len(record)))


def load_corpus(path) -> Corpus:
    """Open a JSONL corpus of {"id": str, "contents": "\\"Title\\"\\ntext"} lines (see the module doc).

    A bad line stops with a ValueError naming the file and line; duplicate ids only warn
    (results stay well defined, but answers citing an id become ambiguous).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"corpus file not found: {path}")
    size = path.stat().st_size
    if size < SMALL_FILE_BYTES:
        sink = io.BytesIO()
        offsets, sha, id_hashes = _parse(path, sink)
        corpus = Corpus(sink.getvalue(), np.frombuffer(offsets, dtype=np.int64), sha, str(path))
        dupes = _duplicates(corpus, id_hashes)
    else:
        corpus, dupes = _stored(path)
    if dupes:
        warnings.warn(f"{path}: {dupes[0]} duplicate ids, e.g. {dupes[1]}; hits stay correct "
                      "but an id no longer names one passage", stacklevel=2)
    return corpus


def _parse(path: Path, sink) -> tuple[array, str, np.ndarray]:
    """Check every line of `path`, write its records to `sink` -> (offsets, fingerprint, id hashes)."""
    offsets, sha, id_hashes = array("q", [0]), hashlib.sha1(), array("q")
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"load {path.name}",
                                     disable=size < BIG_FILE_BYTES) as bar:
        for lineno, raw in enumerate(f, start=1):
            bar.update(len(raw))
            if not raw.strip():
                continue
            doc = _parse_corpus_line(raw, path, lineno)
            id_hashes.append(hash(doc["id"]))
            _append(sink, offsets, sha, doc["id"], doc["contents"])
    if len(offsets) == 1:
        raise ValueError(f"{path}: corpus is empty (expected one JSON object per line)")
    return offsets, sha.hexdigest(), np.frombuffer(id_hashes, dtype=np.int64)


def _duplicates(corpus: Corpus, id_hashes: np.ndarray) -> list:
    """[] or [number of repeated ids, the first five]. Ids are compared by 64-bit hash (8 bytes a
    passage, not a Python set of 21M strings); only passages whose hash repeats are read again."""
    sorted_hashes = np.sort(id_hashes)
    repeated = np.unique(sorted_hashes[1:][sorted_hashes[1:] == sorted_hashes[:-1]])
    seen, dupes = set(), []
    for doc_id in (corpus[int(i)]["id"] for i in np.flatnonzero(np.isin(id_hashes, repeated))):
        if doc_id in seen:
            dupes.append(doc_id)
        seen.add(doc_id)
    return [len(dupes), dupes[:5]] if dupes else []


def _stored(path: Path) -> tuple[Corpus, list]:
    """A big corpus from its store under $LLDS_CACHE/corpus/, parsed into it first if absent."""
    from plumbing import cache_dir

    store = cache_dir() / "corpus" / f"{path.stem}-{_file_key(path)}"
    if not (store / "meta.json").is_file():
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=store.parent, prefix=".tmp-"))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        try:
            with open(tmp / "passages.bin", "wb") as sink:
                offsets, sha, id_hashes = _parse(path, sink)
            np.save(tmp / "offsets.npy", np.frombuffer(offsets, dtype=np.int64))
            dupes = _duplicates(_mapped(tmp, sha, path), id_hashes)
            (tmp / "meta.json").write_text(json.dumps({"source": str(path), "n_docs": (len(offsets) - 1) // 2,
                                                       "fingerprint": sha, "duplicates": dupes}))
            os.replace(tmp, store)  # atomic: a concurrent start sees no store or a whole one
        except OSError:
            if not (store / "meta.json").is_file():  # not another process finishing first: a real failure
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads((store / "meta.json").read_text())
    return _mapped(store, meta["fingerprint"], path), meta["duplicates"]


def _mapped(store: Path, fingerprint: str, source: Path) -> Corpus:
    with open(store / "passages.bin", "rb") as f:
        blob = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return Corpus(blob, np.load(store / "offsets.npy", mmap_mode="r"), fingerprint, str(source))


def _file_key(path: Path) -> str:
    """Size, modification time and SAMPLED_BLOCKS evenly spaced blocks: ~4 MiB read, not the file."""
    st = path.stat()
    h = hashlib.sha1(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        for k in range(SAMPLED_BLOCKS):
            f.seek(k * max(0, st.st_size - BLOCK_BYTES) // (SAMPLED_BLOCKS - 1))
            h.update(f.read(BLOCK_BYTES))
    return h.hexdigest()[:16]


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


def write_index_meta(index_dir: Path, backend: str, corpus: Corpus, **extra) -> None:
    """meta.json, the last file of an index folder: its presence means the index is complete."""
    meta = {"backend": backend, "n_docs": len(corpus), "fingerprint": corpus.fingerprint, **extra}
    (Path(index_dir) / "meta.json").write_text(json.dumps(meta, indent=1))


def read_index_meta(index_dir: Path, backend: str, corpus: Corpus, **given) -> dict:
    """meta.json of a finished `backend` index built from exactly this corpus and with the settings
    `given` (those not None, e.g. k1=0.9 from --k1); ValueError otherwise."""
    meta_path = Path(index_dir) / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{index_dir} is not a finished index (no meta.json); "
                         f"build one with: python retriever.py index --corpus ... --index {index_dir}")
    meta = json.loads(meta_path.read_text())
    if meta["backend"] != backend:
        raise ValueError(f"{index_dir} holds a {meta['backend']} index, not {backend}")
    if meta["n_docs"] != len(corpus) or meta["fingerprint"] != corpus.fingerprint:
        raise ValueError(f"{index_dir} was built from a different corpus ({meta['n_docs']} passages, this "
                         f"one has {len(corpus)}, contents hash differs); pass another --index or delete it")
    for name, value in given.items():
        if value is not None and meta.get(name) != value:
            raise ValueError(f"{index_dir} was built with --{name.replace('_', '-')} {meta.get(name)!r}, not "
                             f"{value!r}; pass the same, or build another --index")
    return meta
