"""Benchmark retriever.py on a synthetic corpus: build, load, batched throughput, server latency.

Targets (issue 3, 2-core CPU): BM25 >= 300 queries/s in batches of 64; loading a saved index
>= 5x faster than building it; server p99 < 100 ms for one-query requests from 8 concurrent
clients; BM25 server peak RSS < 1 GB. Dense (MiniLM) is measured the same way, optionally on
fewer passages (--dense-passages) because embedding 100k passages on 2 cores takes long.

Passages are ~100 Zipf-distributed pseudo-words under a two-word title (wiki-18-like length);
each query is the title plus 3 words of one passage, so hit@1 is a sanity check of quality.

    python bench/bench_retriever.py [--passages 100000] [--dense-passages 5000] [--skip-dense]
"""

import argparse
import json
import os
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

REPO = Path(__file__).resolve().parents[1]


def make_corpus(path: Path, n: int, seed: int = 0, vocab_size: int = 30_000, words: int = 100):
    """Write n synthetic passages in wiki-18 format (skipped if already there)."""
    if path.is_file() and sum(1 for _ in open(path)) == n:
        return
    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "vo", "de", "an", "pir", "gu", "el", "zo", "ny", "bar", "fi"]
    vocab = sorted({"".join(rng.choice(syllables, rng.integers(2, 5))) for _ in range(vocab_size * 2)})[:vocab_size]
    vocab = np.array(vocab)
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1
    p /= p.sum()
    path.parent.mkdir(parents=True, exist_ok=True)
    titles = rng.integers(len(vocab) // 10, len(vocab), (n, 2))  # rarer words: titles identify passages
    texts = rng.choice(len(vocab), (n, words), p=p)
    with open(path, "w") as f:
        for i in range(n):
            title = " ".join(vocab[titles[i]]).title()
            text = " ".join(vocab[texts[i]])
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) + "\n")


def make_queries(corpus: list[dict], n: int, seed: int = 1):
    """(queries, source passage index): title + 3 random words of a random passage."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, len(corpus), n)
    queries = []
    for i in src:
        title, text = corpus[i]["contents"].split("\n", 1)
        queries.append(title.strip('"') + " " + " ".join(rng.choice(text.split(), 3, replace=False)))
    return queries, src


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def throughput(retriever, queries, src, batch=64):
    """Queries/s for batches of `batch`, and hit@1 of the source passage."""
    hits, t = 0, time.perf_counter()
    for start in range(0, len(queries), batch):
        results = retriever.search(queries[start:start + batch], 3)
        hits += sum(r[0]["document"]["id"] == str(s) for r, s in zip(results, src[start:start + batch]))
    return len(queries) / (time.perf_counter() - t), hits / len(queries)


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


def bench_backend(name, cls, corpus, corpus_path, index_dir, queries, src, args, **build_kw):
    print(f"\n== {name}: {len(corpus)} passages ==", flush=True)
    built, t_build = timed(lambda: cls.build(corpus, **build_kw))
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=100_000, help="BM25 corpus size")
    p.add_argument("--dense-passages", type=int, default=100_000, help="dense corpus size (first N passages)")
    p.add_argument("--queries", type=int, default=1024, help="queries for the throughput test")
    p.add_argument("--requests-per-client", type=int, default=50, help="server test: requests per client")
    p.add_argument("--skip-dense", action="store_true", help="BM25 only")
    p.add_argument("--out", default=str(plumbing.cache_dir() / "bench_retriever"), help="work directory")
    args = p.parse_args()
    out = Path(args.out)
    print(f"cpu cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} (other processes share the cores)")

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
            dense_path.write_text("".join(json.dumps(d) + "\n" for d in corpus[:n]))
            print(f"\nNOTE: dense uses a {n}-passage corpus (--dense-passages), not {len(corpus)}")
        dense_corpus = corpus[:n]
        dq, dsrc = make_queries(dense_corpus, args.queries)
        report["dense"] = bench_backend("dense", R.DenseRetriever, dense_corpus, dense_path,
                                        out / f"idx-dense-{n}", dq, dsrc, args)

    b = report["bm25"]
    print("\n== targets ==")
    print(f"BM25 batched >= 300 q/s: {b['qps']:.0f} -> {'met' if b['qps'] >= 300 else 'NOT met'}")
    for name, r in report.items():
        ratio = r["build_s"] / r["load_s"]
        print(f"{name} load >= 5x faster than build: {ratio:.1f}x -> {'met' if ratio >= 5 else 'NOT met'}")
        print(f"{name} server p99 < 100 ms: {r['p99_ms']:.1f} ms -> {'met' if r['p99_ms'] < 100 else 'NOT met'}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print(f"BM25 server peak RSS < 1 GB: {b['peak_rss_mb']:.0f} MB -> {'met' if b['peak_rss_mb'] < 1024 else 'NOT met'}")
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
