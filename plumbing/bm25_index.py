"""BM25 at corpus scale for retriever.py: a build that streams, a search that touches only postings.

Build. bm25s's own `BM25.index` keeps every document's token list as Python ints and three
nnz-long arrays plus their sort keys: ~75 GB at wiki-18's 21M passages. Here the tokenizer's output
is turned, one chunk of documents at a time, into numpy counts (the distinct terms of each document
and their frequencies, 8 bytes per (document, term) pair), and the CSC matrix bm25s saves and loads
(data, indices, indptr: one column per term, documents ascending) is filled in a second pass over
those counts with a counting sort, chunk by chunk. Peak: the counts plus the matrix, ~16 bytes per
(document, term) pair; the score of each pair is computed by the `term_score` function the caller
passes in (retriever.py writes out BM25's formula).

Search. A query's score is non-zero only on the documents in its terms' postings, so each query adds
its postings into a per-thread accumulator and, when they are few (under DENSE_FRACTION of the
corpus), ranks only those documents: O(postings), not O(N), no pass over 21M scores for a query of
rare words. A query of common words, whose postings cover much of the corpus, ranks the whole
accumulator instead, which is then cheaper. Queries of a batch run on a thread pool. Ties go to the
earlier passage; documents without any query term (score 0) fill up the top-k in corpus order.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from itertools import chain

import numpy as np

DENSE_FRACTION = 0.25  # a query whose postings reach this share of the corpus ranks all N scores


def count_terms(token_ids: list[list[int]]) -> dict:
    """One chunk of tokenised documents -> their length, distinct terms and term frequencies.

    {"doc_len": (n,) int32, "n_terms": (n,) int32 distinct terms per document,
     "terms": (nnz,) int32 and "tf": (nnz,) int32, sorted by (document, term)}
    """
    doc_len = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
    flat = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=int(doc_len.sum()))
    doc = np.repeat(np.arange(len(token_ids), dtype=np.int64), doc_len)
    pairs, tf = np.unique((doc << 32) | flat, return_counts=True)  # sorted by (document, term)
    n_terms = np.bincount(pairs >> 32, minlength=len(token_ids))
    return {"doc_len": doc_len.astype(np.int32), "n_terms": n_terms.astype(np.int32),
            "terms": (pairs & 0xFFFFFFFF).astype(np.int32), "tf": tf.astype(np.int32)}


def assemble_csc(chunks: list[dict], n_vocab: int, term_score) -> dict:
    """count_terms' chunks, in corpus order -> bm25s's score matrix {"data", "indices", "indptr", "num_docs"}.

    term_score(tf, doc_len, df, n_docs, avg_doc_len) -> float32 scores, all arrays per (document, term)
    pair. The chunks are consumed (emptied) so that their memory goes as the matrix fills.
    """
    n_docs = sum(len(c["doc_len"]) for c in chunks)
    avg_doc_len = np.float64(sum(int(c["doc_len"].sum()) for c in chunks)) / n_docs
    df = sum(np.bincount(c["terms"], minlength=n_vocab) for c in chunks)
    indptr = np.zeros(n_vocab + 1, dtype=np.int64)
    np.cumsum(df, out=indptr[1:])
    data = np.empty(indptr[-1], dtype=np.float32)
    indices = np.empty(indptr[-1], dtype=np.int32)
    fill, first_doc = indptr[:-1].copy(), 0
    while chunks:
        c = chunks.pop(0)
        docs = np.repeat(np.arange(len(c["doc_len"]), dtype=np.int32), c["n_terms"])
        scores = term_score(c["tf"], c["doc_len"][docs], df[c["terms"]], n_docs, avg_doc_len)
        # Counting sort: a stable sort by term keeps each term's documents ascending.
        order = np.argsort(c["terms"], kind="stable")
        terms = c["terms"][order]
        per_term = np.bincount(terms, minlength=n_vocab)
        rank_in_term = np.arange(len(terms)) - (np.cumsum(per_term) - per_term)[terms]
        pos = fill[terms] + rank_in_term
        data[pos], indices[pos] = scores[order], docs[order] + first_doc
        fill += per_term
        first_doc += len(c["doc_len"])
    return {"data": data, "indices": indices, "indptr": indptr, "num_docs": n_docs}


class PostingsSearch:
    """Top-k over bm25s's score matrix (arrays in memory or memory-mapped), queries on `threads` threads."""

    def __init__(self, scores: dict, threads: int = 0):
        self.data, self.indices, self.indptr = scores["data"], scores["indices"], scores["indptr"]
        self.n_docs = int(scores["num_docs"])
        self.pool = ThreadPoolExecutor(threads or os.cpu_count())
        self.local = threading.local()

    def search(self, queries_ids: list[list[int]], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Token ids of each query -> (passage indices, scores) of its min(k, N) best, best first."""
        return list(self.pool.map(lambda ids: self._one(ids, k), queries_ids))

    def _one(self, ids: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        if not hasattr(self.local, "acc"):
            self.local.acc = np.zeros(self.n_docs, dtype=np.float32)  # (N,) one per thread, kept zero
        acc, postings = self.local.acc, []
        for t in ids:  # a repeated query word counts twice, as in bm25s
            start, end = int(self.indptr[t]), int(self.indptr[t + 1])
            docs = np.asarray(self.indices[start:end])
            acc[docs] += self.data[start:end]  # a term's postings name each document once
            postings.append(docs)
        if sum(map(len, postings)) >= DENSE_FRACTION * self.n_docs:
            return _best_of_all(acc, min(k, self.n_docs))
        touched = np.concatenate(postings) if postings else np.zeros(0, dtype=np.int32)
        scores = acc[touched]
        acc[touched] = 0.0
        docs, scores = _best_distinct(touched, scores, k, max(1, len(ids)))
        if len(docs) < min(k, self.n_docs):  # too few matches: score-0 passages in corpus order
            docs, scores = _pad_with_unmatched(docs, scores, min(k, self.n_docs))
        return docs, scores


def _best_of_all(acc: np.ndarray, k: int):
    """The k best of all N scores, best first, ties to the lower index; `acc` is zeroed after."""
    kth = np.partition(acc, len(acc) - k)[len(acc) - k]
    above = np.flatnonzero(acc > kth)
    above = above[np.lexsort((above, -acc[above]))]
    docs = np.concatenate([above, np.flatnonzero(acc == kth)[:k - len(above)]])
    scores = acc[docs]
    acc.fill(0.0)
    return docs.astype(np.int64), scores


def _best_distinct(docs: np.ndarray, scores: np.ndarray, k: int, repeats: int):
    """The k best distinct documents, best first, ties to the lower index. A document appears at
    most `repeats` times in `docs`, always with the same score, so the k x repeats best entries hold
    the k best documents; all entries equal to the cut-off are kept, so the tie rule holds."""
    m = k * repeats
    if len(docs) > m:
        keep = scores >= np.partition(scores, len(scores) - m)[len(scores) - m]
        docs, scores = docs[keep], scores[keep]
    order = np.lexsort((docs, -scores))
    docs, scores = docs[order], scores[order]
    first = np.ones(len(docs), dtype=bool)
    first[1:] = docs[1:] != docs[:-1]  # a repeated document sorts next to itself
    return docs[first][:k].astype(np.int64), scores[first][:k]


def _pad_with_unmatched(docs: np.ndarray, scores: np.ndarray, k: int):
    candidates = np.arange(k, dtype=np.int64)  # the first k passages hold k - len(docs) unmatched ones
    extra = candidates[~np.isin(candidates, docs)][:k - len(docs)]
    return np.concatenate([docs, extra]), np.concatenate([scores, np.zeros(len(extra), np.float32)])
