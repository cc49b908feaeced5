"""Benchmark retriever.py on synthetic corpora: build, load, batched throughput, server latency, scale.

Passages are ~100 Zipf-distributed pseudo-words under a two-word title (wiki-18's length: DPR's
100-word split); each query is the title plus 3 words of one passage, so hit@1 is a sanity check.

    python bench/bench_retriever.py [--passages 100000] [--dense-passages 2000] [--skip-dense]

Targets (2-core CPU): BM25 >= 300 queries/s in batches of 64; loading a saved index >= 5x faster
than building it; server p99 <= 100 ms for one-query requests from 8 concurrent clients (the server
merges waiting requests into one search); BM25 server peak RSS < 1 GB.

    python bench/bench_retriever.py --scale 100000 1000000 [--scale-backends bm25 encoder flat hnsw]

The scale series: for each size, every phase in its own process (so its peak RSS is its own):
- bm25: build (time, peak RSS, index size), then load (time, RSS) and queries/s at batch 1 and
  128 over the memory-mapped index, against bm25s's own `retrieve(n_threads=...)` on the same index;
- encoder: MiniLM passages/s and queries/s at batch 1 and 128 on a sample (encoding 1M passages on
  2 shared cores takes hours, so the faiss tiers below hold synthetic vectors);
- flat / hnsw: faiss IndexFlatIP / HNSW32 filled with synthetic 384-dimensional unit vectors (MiniLM's
  size) in 100k blocks: build, load (memory-mapped) and queries/s at batch 1 and 128; queries are
  indexed vectors plus noise, and HNSW's recall@3 is measured against the flat index's exact top-3.
Results are merged into <out>/scale.json, so tiers can run one at a time (--skip-build measures
the indexes an earlier run built). Each phase records its load average, before and after, and
beside each wall time the CPU seconds of its threads: what the work costs on a box shared with
other jobs, where the wall time is what it took beside them.
"""

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plumbing  # noqa: E402
import retriever as R  # noqa: E402
from plumbing.corpus import Corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DIM = 384  # MiniLM's vectors
VECTOR_BLOCK = 100_000


def make_corpus(path: Path, n: int, seed: int = 0, vocab_size: int = 30_000, words: int = 100, chunk: int = 100_000):
    """Write n synthetic passages in wiki-18's layout, a chunk at a time (skipped if already there)."""
    done = path.with_suffix(".done")
    if done.is_file():
        return
    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "vo", "de", "an", "pir", "gu", "el", "zo", "ny", "bar", "fi"]
    vocab = sorted({"".join(rng.choice(syllables, rng.integers(2, 5))) for _ in range(vocab_size * 2)})[:vocab_size]
    vocab = np.array(vocab)
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1
    p /= p.sum()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            titles = rng.integers(len(vocab) // 10, len(vocab), (m, 2))  # rarer words: titles identify passages
            texts = rng.choice(len(vocab), (m, words), p=p)
            f.writelines(json.dumps({"id": str(start + i), "contents": f'"{" ".join(vocab[titles[i]]).title()}"\n'
                                                                      f'{" ".join(vocab[texts[i]])}'}) + "\n"
                         for i in range(m))
    done.touch()


def make_queries(corpus, n: int, seed: int = 1):
    """(queries, source passage index): title + 3 random words of a random passage."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, len(corpus), n)
    queries = []
    for i in src:
        title, text = corpus[int(i)]["contents"].split("\n", 1)
        queries.append(title.strip('"') + " " + " ".join(rng.choice(text.split(), 3, replace=False)))
    return queries, src


def read_into_page_cache(*paths: Path) -> None:
    """Read files once, so that queries are timed as on a server that has been up a while (a
    mapped index the OS had evicted is otherwise read from disk page by page)."""
    for path in paths:
        for f in (path.iterdir() if path.is_dir() else [path]):
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def clocked(fn):
    """(fn(), wall seconds, CPU seconds of this process's threads): on a shared box the CPU time is
    what the work costs, the wall time what it took beside the other jobs."""
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


def throughput(retriever, queries, src, batch=64):
    """Queries/s for batches of `batch`, and hit@1 of the source passage."""
    hits, t = 0, time.perf_counter()
    for start in range(0, len(queries), batch):
        results = retriever.search(queries[start:start + batch], 3)
        hits += sum(r[0]["document"]["id"] == str(s) for r, s in zip(results, src[start:start + batch]))
    return len(queries) / (time.perf_counter() - t), hits / len(queries)


# ---------------------------------------------------------------------------------- memory

def memory_mb() -> dict:
    """This process's resident memory now (MB): total, anonymous (heap) and file-backed (mapped files)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


class PeakAnon:
    """Samples RssAnon every 0.2 s: the peak heap of a phase, apart from mapped-file pages (which the
    OS can drop) that VmHWM also counts."""

    def __init__(self):
        self.peak, self.stop = 0.0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self.stop.wait(0.2):
            self.peak = max(self.peak, memory_mb()["RssAnon"])

    def done(self) -> float:
        self.stop.set()
        return max(self.peak, memory_mb()["RssAnon"])


# ---------------------------------------------------------------------------------- the default run

def load_test(url, queries, clients, per_client):
    """`clients` threads each send `per_client` one-query requests -> latency percentiles, req/s."""
    latencies, lock = [], threading.Lock()

    def client(w):
        for n in range(per_client):
            q = queries[(w * per_client + n) % len(queries)]
            t = time.perf_counter()
            r = requests.post(url, json={"queries": [q], "topk": 3, "return_scores": True}, timeout=60)
            dt = time.perf_counter() - t
            assert r.status_code == 200, r.text
            with lock:
                latencies.append(dt)

    threads = [threading.Thread(target=client, args=(w,)) for w in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ms = np.array(latencies) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "rps": len(ms) / (time.perf_counter() - t0)}


def server_latency(corpus_path, index_dir, backend, queries, per_client=50):
    """Start `retriever.py serve` as a subprocess; measure 1 client, then 8 concurrent clients."""
    proc = subprocess.Popen([sys.executable, str(REPO / "retriever.py"), "serve", "--corpus", str(corpus_path),
                             "--index", str(index_dir), "--backend", backend, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=open(Path(index_dir) / "server.log", "w"), text=True)
    try:
        line = proc.stdout.readline()
        if "serving" not in line:
            raise SystemExit(f"server did not start, see {Path(index_dir) / 'server.log'}")
        url = line.split(" on ")[1].split()[0]
        load_test(url, queries, 1, 5)  # warm-up
        one = load_test(url, queries, 1, per_client)
        eight = load_test(url, queries, 8, per_client)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        peak_kb = int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM")).split()[1])
    finally:
        proc.terminate()
        proc.wait(30)
    return {**eight, "p50_1client_ms": one["p50_ms"], "p99_1client_ms": one["p99_ms"], "peak_rss_mb": peak_kb / 1024}


def bench_backend(name, cls, corpus, corpus_path, index_dir, queries, src, args):
    print(f"\n== {name}: {len(corpus)} passages ==", flush=True)
    built, t_build = timed(lambda: cls.build(corpus))
    built.save(index_dir)
    loaded, t_load = timed(lambda: cls.load(index_dir, corpus))
    same = loaded.search(queries[:64], 5) == built.search(queries[:64], 5)
    del built
    qps, hit1 = throughput(loaded, queries, src)
    del loaded
    srv = server_latency(corpus_path, index_dir, name, queries, per_client=args.requests_per_client)
    print(f"build {t_build:.2f} s | load {t_load:.2f} s (build/load = {t_build / t_load:.1f}x) | "
          f"save/load identical: {same}")
    print(f"batched search: {qps:.0f} queries/s (batches of 64, {len(queries)} queries), hit@1 {hit1:.3f}")
    print(f"server, 1 client: p50 {srv['p50_1client_ms']:.1f} ms, p99 {srv['p99_1client_ms']:.1f} ms")
    print(f"server, 8 clients x {args.requests_per_client} one-query requests: p50 {srv['p50_ms']:.1f} ms, "
          f"p99 {srv['p99_ms']:.1f} ms, {srv['rps']:.0f} req/s, server peak RSS {srv['peak_rss_mb']:.0f} MB")
    return {"build_s": t_build, "load_s": t_load, "qps": qps, "hit1": hit1, **srv}


def default_run(args, out: Path):
    corpus_path = out / f"corpus-{args.passages}.jsonl"
    _, t_gen = timed(lambda: make_corpus(corpus_path, args.passages))
    corpus, t_corpus = timed(lambda: R.load_corpus(corpus_path))
    queries, src = make_queries(corpus, args.queries)
    print(f"corpus: {len(corpus)} passages ({corpus_path.stat().st_size / 1e6:.0f} MB, made or reused in {t_gen:.1f} s), "
          f"load_corpus {t_corpus:.2f} s (needed by build and load alike, not counted below)")
    report = {"bm25": bench_backend("bm25", R.BM25Retriever, corpus, corpus_path, out / "idx-bm25", queries, src, args)}

    if not args.skip_dense:
        n = min(args.dense_passages, len(corpus))
        dense_path = out / f"corpus-{n}.jsonl"
        if n < len(corpus):
            dense_path.write_text("".join(json.dumps(corpus[i]) + "\n" for i in range(n)))
            print(f"\nNOTE: dense uses a {n}-passage corpus (--dense-passages), not {len(corpus)}")
        dense_corpus = Corpus.from_docs(corpus[:n])
        dq, dsrc = make_queries(dense_corpus, args.queries)
        report["dense"] = bench_backend("dense", R.DenseRetriever, dense_corpus, dense_path,
                                        out / f"idx-dense-{n}", dq, dsrc, args)

    b = report["bm25"]
    print("\n== targets ==")
    print(f"BM25 batched >= 300 q/s: {b['qps']:.0f} -> {'met' if b['qps'] >= 300 else 'NOT met'}")
    for name, r in report.items():
        ratio = r["build_s"] / r["load_s"]
        print(f"{name} load >= 5x faster than build: {ratio:.1f}x -> {'met' if ratio >= 5 else 'NOT met'}")
        print(f"{name} server p99 <= 100 ms: {r['p99_ms']:.1f} ms -> {'met' if r['p99_ms'] <= 100 else 'NOT met'}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print(f"BM25 server peak RSS < 1 GB: {b['peak_rss_mb']:.0f} MB -> {'met' if b['peak_rss_mb'] < 1024 else 'NOT met'}")
    (out / "report.json").write_text(json.dumps(report, indent=1))


# ---------------------------------------------------------------------------------- the scale series
# Each phase runs in a child process (`--phase NAME --n N`) and prints one JSON line.

def phase_bm25_build(n, out: Path, args) -> dict:
    corpus = R.load_corpus(out / f"corpus-{n}.jsonl")  # the store exists: made by the parent
    peak = PeakAnon()
    retriever, t_build, cpu_build = clocked(lambda: R.BM25Retriever.build(corpus))
    _, t_save = timed(lambda: retriever.save(out / f"bm25-{n}"))
    size = sum(f.stat().st_size for f in (out / f"bm25-{n}").iterdir())
    return {"build_s": t_build, "build_cpu_s": cpu_build, "save_s": t_save, "peak_anon_mb": peak.done(), "peak_rss_mb": memory_mb()["VmHWM"],
            "index_mb": size / 1e6, "nnz": int(retriever.scores["indptr"][-1])}


def phase_bm25_query(n, out: Path, args) -> dict:
    import bm25s

    start = time.perf_counter()
    corpus = R.load_corpus(out / f"corpus-{n}.jsonl")
    retriever = R.BM25Retriever.load(out / f"bm25-{n}", corpus, threads=args.threads)
    t_load, at_load = time.perf_counter() - start, memory_mb()
    queries, src = make_queries(corpus, 1024 + 200)
    read_into_page_cache(out / f"bm25-{n}")
    retriever.search(make_queries(corpus, 128, seed=3)[0], 3)  # warm-up
    _, t_one, cpu_one = clocked(lambda: [retriever.search([q], 3) for q in queries[:200]])
    (qps, hit1), _, cpu_batch = clocked(lambda: throughput(retriever, queries[200:], src[200:], batch=128))
    after = memory_mb()
    # bm25s's own multi-threaded retrieve on the same files and token ids, 256 queries in one call
    ref = bm25s.BM25.load(str(out / f"bm25-{n}"), mmap=True, show_progress=False)
    ids = retriever.tokenizer.tokenize(queries[200:456], update_vocab=False, show_progress=False)
    (docs, _), t_ref, cpu_ref = clocked(lambda: ref.retrieve(ids, k=3, n_threads=args.threads or os.cpu_count(),
                                                  show_progress=False))
    ours = [[int(h["document"]["id"]) for h in hits] for hits in retriever.search(queries[200:456], 3)]
    return {"load_s": t_load, "rss_load_mb": at_load["VmRSS"], "anon_load_mb": at_load["RssAnon"],
            "qps_batch1": 200 / t_one, "qps_batch128": qps, "hit1": hit1, "rss_after_mb": after["VmRSS"],
            "cpu_ms_per_query_batch1": 1000 * cpu_one / 200, "cpu_ms_per_query_batch128": 1000 * cpu_batch / 1024,
            "anon_after_mb": after["RssAnon"], "bm25s_retrieve_qps": 256 / t_ref,
            "bm25s_retrieve_cpu_ms_per_query": 1000 * cpu_ref / 256,
            "bm25s_same_top1": float(np.mean([o[0] == d[0] for o, d in zip(ours, docs.tolist())]))}


def phase_encoder(n, out: Path, args) -> dict:
    corpus = R.load_corpus(out / f"corpus-{n}.jsonl")
    enc = R.Encoder(device="cpu")
    texts = corpus.contents(0, args.encode_sample)
    enc.encode(texts[:64], "passage")  # warm-up
    _, t_pass, cpu_pass = clocked(lambda: enc.encode(texts, "passage"))
    queries, _ = make_queries(corpus, 64 + 512)
    _, t_one, cpu_one = clocked(lambda: [enc.encode([q], "query") for q in queries[:64]])
    enc.batch_size = 128
    _, t_batch, cpu_batch = clocked(lambda: [enc.encode(queries[s:s + 128], "query") for s in range(64, 64 + 512, 128)])
    return {"passages_per_s": len(texts) / t_pass, "passages_per_cpu_s": len(texts) / cpu_pass,
            "sample": len(texts), "bf16": enc.bf16,
            "queries_per_s_batch1": 64 / t_one, "queries_per_s_batch128": 512 / t_batch,
            "cpu_ms_per_query_batch1": 1000 * cpu_one / 64, "cpu_ms_per_query_batch128": 1000 * cpu_batch / 512}


def vector_block(n: int, block: int, seed: int = 0) -> np.ndarray:
    """Block `block` (VECTOR_BLOCK rows) of n synthetic unit vectors: the same rows wherever it is asked for."""
    rows = min(VECTOR_BLOCK, n - block * VECTOR_BLOCK)
    x = np.random.default_rng([seed, block]).standard_normal((rows, DIM), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def vector_queries(n: int, count: int, seed: int = 2, blocks: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Indexed vectors plus noise (a relevant passage is much closer than the rest), and their
    sources: rows of `blocks` blocks drawn across the index (each block to make is 38M numbers)."""
    rng = np.random.default_rng(seed)
    chosen = rng.choice((n + VECTOR_BLOCK - 1) // VECTOR_BLOCK, min(blocks, (n + VECTOR_BLOCK - 1) // VECTOR_BLOCK),
                        replace=False)
    block = rng.choice(chosen, count)
    rows = np.minimum(VECTOR_BLOCK, n - block * VECTOR_BLOCK)  # the last block may be short
    src = np.sort(block * VECTOR_BLOCK + (rng.random(count) * rows).astype(np.int64))
    q = np.empty((count, DIM), dtype=np.float32)
    for block in np.unique(src // VECTOR_BLOCK):  # each block made once (one is 150 MB), its rows copied
        rows = src // VECTOR_BLOCK == block
        q[rows] = vector_block(n, int(block))[src[rows] % VECTOR_BLOCK]
    q += rng.standard_normal(q.shape, dtype=np.float32) * 0.6 / np.sqrt(DIM)
    return q / np.linalg.norm(q, axis=1, keepdims=True), src


FAISS_TYPES = {"flat": "Flat", "hnsw": "HNSW32"}


def phase_faiss_build(n, out: Path, args, kind: str) -> dict:
    import faiss
    from plumbing import dense_index

    peak = PeakAnon()
    index = dense_index.new_index(DIM, FAISS_TYPES[kind])
    blocks = (vector_block(n, b) for b in range((n + VECTOR_BLOCK - 1) // VECTOR_BLOCK))
    _, t_build, cpu_build = clocked(lambda: dense_index.add_streamed(index, blocks, n))
    path = out / f"{kind}-{n}.faiss"
    _, t_save = timed(lambda: faiss.write_index(index, str(path)))
    return {"build_s": t_build, "build_cpu_s": cpu_build, "save_s": t_save, "peak_anon_mb": peak.done(), "peak_rss_mb": memory_mb()["VmHWM"],
            "index_mb": path.stat().st_size / 1e6}


def phase_faiss_query(n, out: Path, args, kind: str) -> dict:
    from plumbing import dense_index

    index, t_load = timed(lambda: dense_index.read_index(out / f"{kind}-{n}.faiss"))
    at_load = memory_mb()
    if kind == "hnsw":
        dense_index.set_search_params(index, f"efSearch={args.ef_search}")
    q, src = vector_queries(n, 128 * args.batches + args.singles)
    read_into_page_cache(out / f"{kind}-{n}.faiss")
    index.search(q[args.singles:args.singles + 128], 3)  # warm-up
    _, t_one, cpu_one = clocked(lambda: [index.search(q[i:i + 1], 3) for i in range(args.singles)])
    (_, ids), t_batch, cpu_batch = clocked(lambda: index.search(q[args.singles:], 3))
    result = {"load_s": t_load, "rss_load_mb": at_load["VmRSS"], "anon_load_mb": at_load["RssAnon"],
              "queries": [args.singles, len(q[args.singles:])],
              "qps_batch1": args.singles / t_one, "qps_batch128": len(q[args.singles:]) / t_batch,
              "cpu_ms_per_query_batch1": 1000 * cpu_one / args.singles,
              "cpu_ms_per_query_batch128": 1000 * cpu_batch / len(q[args.singles:]),
              "hit1": float(np.mean(ids[:, 0] == src[args.singles:])), "rss_after_mb": memory_mb()["VmRSS"]}
    flat = out / f"flat-{n}.faiss"
    if kind == "hnsw" and flat.is_file():  # recall@3 against the exact top-3 of the same vectors
        _, exact = dense_index.read_index(flat).search(q[args.singles:], 3)
        result["recall_at_3"] = float(np.mean([len(set(a) & set(b)) / 3 for a, b in zip(ids, exact)]))
    return result


PHASES = {"bm25-build": phase_bm25_build, "bm25-query": phase_bm25_query, "encoder": phase_encoder,
          **{f"{k}-build": functools.partial(phase_faiss_build, kind=k) for k in FAISS_TYPES},
          **{f"{k}-query": functools.partial(phase_faiss_query, kind=k) for k in FAISS_TYPES}}
SERIES = {"bm25": ["bm25-build", "bm25-query"], "encoder": ["encoder"],
          "flat": ["flat-build", "flat-query"], "hnsw": ["hnsw-build", "hnsw-query"]}


def scale_run(args, out: Path):
    report_path = out / "scale.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    for n in args.scale:
        corpus_path = out / f"corpus-{n}.jsonl"
        if ("bm25" in args.scale_backends or "encoder" in args.scale_backends) and "corpus" not in report.get(str(n), {}):
            make_corpus(corpus_path, n)
            load_before = os.getloadavg()[0]
            _, t_parse = timed(lambda: R.load_corpus(corpus_path))  # parsed into its store (once)
            _, t_open = timed(lambda: R.load_corpus(corpus_path))   # then memory-mapped
            report.setdefault(str(n), {})["corpus"] = {"jsonl_mb": corpus_path.stat().st_size / 1e6,
                                                       "first_load_s": t_parse, "load_s": t_open,
                                                       "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)]}
            print(f"{n} passages: corpus {corpus_path.stat().st_size / 1e6:.0f} MB, first load {t_parse:.1f} s "
                  f"(parsed into the store), then {t_open:.3f} s", flush=True)
        for backend in args.scale_backends:
            for phase in (p for p in SERIES[backend] if not (args.skip_build and p.endswith("-build"))):
                load_before = os.getloadavg()[0]
                cmd = [sys.executable, __file__, "--phase", phase, "--n", str(n), "--out", str(out),
                       "--threads", str(args.threads), "--encode-sample", str(args.encode_sample),
                       "--ef-search", str(args.ef_search), "--batches", str(args.batches),
                       "--singles", str(args.singles)]
                done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=lambda: resource.setrlimit(
                    resource.RLIMIT_DATA, (args.max_heap_gb << 30, args.max_heap_gb << 30)))  # the box is shared
                if done.returncode:
                    raise SystemExit(f"{phase} at {n} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
                result = {**json.loads(done.stdout.strip().splitlines()[-1]),
                          "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)]}
                report.setdefault(str(n), {})[phase] = result
                print(f"{n} {phase}: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})}",
                      flush=True)
                report_path.write_text(json.dumps(report, indent=1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=100_000, help="BM25 corpus size")
    p.add_argument("--dense-passages", type=int, default=2000, help="dense corpus size (first N passages)")
    p.add_argument("--queries", type=int, default=1024, help="queries for the throughput test")
    p.add_argument("--requests-per-client", type=int, default=50, help="server test: requests per client")
    p.add_argument("--skip-dense", action="store_true", help="BM25 only")
    p.add_argument("--scale", type=int, nargs="*", default=None, help="the scale series at these corpus sizes")
    p.add_argument("--scale-backends", nargs="+", default=list(SERIES), choices=list(SERIES),
                   help="which tiers of the scale series")
    p.add_argument("--skip-build", action="store_true", help="scale series: measure the indexes built before")
    p.add_argument("--threads", type=int, default=0, help="BM25 search threads (0: all cores)")
    p.add_argument("--encode-sample", type=int, default=2048, help="passages the encoder tier encodes")
    p.add_argument("--ef-search", type=int, default=64, help="HNSW efSearch of the scale series")
    p.add_argument("--batches", type=int, default=4, help="faiss tiers: batches of 128 queries")
    p.add_argument("--singles", type=int, default=50, help="faiss tiers: one-query searches")
    p.add_argument("--max-heap-gb", type=int, default=14, help="scale series: heap limit of each phase")
    p.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(plumbing.cache_dir() / "bench_retriever"), help="work directory")
    args = p.parse_args()
    out = Path(args.out)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `retriever.py serve` sets it (plumbing/server.py)
    if args.phase:
        print(json.dumps(PHASES[args.phase](args.n, out, args)))
        return
    print(f"cpu cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} (other processes share the cores)")
    scale_run(args, out) if args.scale else default_run(args, out)


if __name__ == "__main__":
    main()
