"""The command line of retriever.py: `index` (build and save), `search` (one query's top hits, from
an index or a server) and `serve` (plumbing/server.py). retriever.py passes in what the commands
run (open_retriever, the backends' classes, the HTTP client), so this file imports no script."""
import time
from pathlib import Path

from plumbing import server
from plumbing.cli import OneLineParser, ranged
from plumbing.corpus import load_corpus

BACKEND_FLAGS = {"bm25": ("k1", "b", "stemmer", "threads"),
                 "dense": ("encoder", "pooling", "query_prefix", "passage_prefix", "faiss_type", "faiss_params",
                           "device", "index_device", "batch_size")}


def parser(open_retriever, backends: dict, client) -> OneLineParser:
    """open_retriever(backend, corpus, index, **options); backends: {"bm25": class, "dense": class}, each
    with .build(docs, **options) and .save(index); client(url, timeout=...): a retriever over HTTP."""
    def options(args) -> dict:
        return {name: getattr(args, name) for name in BACKEND_FLAGS[args.backend]}

    def local_retriever(args):
        return open_retriever(args.backend, args.corpus, args.index, **options(args))

    def index_command(args):
        index = Path(args.index)
        if (index / "meta.json").is_file() and not args.force:
            raise SystemExit(f"error: --index {index} already holds an index; pass --force to rebuild it")
        t = time.perf_counter()
        docs = load_corpus(args.corpus)
        retriever = backends[args.backend].build(docs, **options(args))
        retriever.save(index)
        print(f"{args.backend} index of {len(docs)} passages saved to {index} in {time.perf_counter() - t:.1f} s "
              f"({retriever.settings})")

    def search_command(args):
        retriever = client(args.url, timeout=args.timeout) if args.url else local_retriever(args)
        print(f"query: {args.query}")
        for rank, hit in enumerate(retriever.search([args.query], args.topk)[0], start=1):
            text = " ".join(hit["document"]["contents"].split())
            print(f"{rank:>3}. [{hit['score']:.3f}] id={hit['document'].get('id')}  {text[:150]}")

    p = OneLineParser(description="BM25 / dense retrieval over a JSONL corpus, "
                                "with a Search-R1-compatible HTTP server.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def local_args(sp, index_required=False, corpus_required=True):
        sp.add_argument("--corpus", required=corpus_required, type=ranged("file", str),
                        help='JSONL, one {"id", "contents"} per line (Search-R1\'s wiki-18.jsonl as it is)')
        sp.add_argument("--index", required=index_required, type=ranged("text", str),
                        help="index directory (built there when absent; default: cached under $LLDS_CACHE); "
                             "dense: also a faiss file whose row i is passage i, e.g. Search-R1's e5_Flat.index")
        sp.add_argument("--backend", choices=["bm25", "dense"], default="bm25", help="retrieval method")
        bm25 = sp.add_argument_group("bm25 (set when the index is built; checked against it when loaded)")
        bm25.add_argument("--k1", type=ranged("> 0", float), default=None, help="BM25 k1 (default 1.5; Search-R1's Pyserini: 0.9)")
        bm25.add_argument("--b", type=ranged("0..1", float), default=None, help="BM25 b (default 0.75; Search-R1's Pyserini: 0.4)")
        bm25.add_argument("--stemmer", choices=["none", "porter"], default=None,
                          help="stem words (default none; Search-R1's Pyserini: porter)")
        bm25.add_argument("--threads", type=ranged(">= 0"), default=0, help="threads searching a batch of queries (0: all cores)")
        dense = sp.add_argument_group("dense (encoder settings: from the encoder's sentence-transformers files unless given)")
        dense.add_argument("--encoder", default=None, type=ranged("text", str),
                           help="local Hugging Face encoder folder (default: bundled MiniLM)")
        dense.add_argument("--pooling", choices=["mean", "cls"], default=None, help="how token vectors become one (default: mean)")
        dense.add_argument("--query-prefix", default=None, type=ranged("any", str),
                           help='text put before each query; e5: "query: "')
        dense.add_argument("--passage-prefix", default=None, type=ranged("any", str),
                           help='text put before each passage; e5: "passage: "')
        dense.add_argument("--faiss-type", default=None, type=ranged("text", str),
                           help="faiss index_factory string: Flat (default), SQfp16, HNSW32, IVF4096,PQ64, ...")
        dense.add_argument("--faiss-params", default=None, type=ranged("text", str),
                           help="faiss search parameters, e.g. efSearch=128 (HNSW) or nprobe=32 (IVF)")
        dense.add_argument("--device", default=None, type=ranged("text", str),
                           help="encoder device: cpu, cuda, cuda:1 (default: cuda when there is one)")
        dense.add_argument("--index-device", default="cpu", type=ranged("text", str),
                           help="faiss index device: cpu or cuda[:N] (needs faiss-gpu)")
        dense.add_argument("--batch-size", type=ranged(">= 1"), default=64, help="texts per encoder batch")

    sp = sub.add_parser("index", help="build and save an index")
    local_args(sp, index_required=True)
    sp.add_argument("--force", action="store_true", help="rebuild even if the index exists")
    sp.set_defaults(fn=index_command)

    sp = sub.add_parser("search", help="print the top hits for one query")
    sp.add_argument("query", type=ranged("any", str))
    local_args(sp, corpus_required=False)
    sp.add_argument("--url", default=None, type=ranged("text", str), help="ask this server instead, e.g. http://127.0.0.1:8000")
    sp.add_argument("--topk", type=ranged(">= 1"), default=3, help="hits to print")
    sp.add_argument("--timeout", type=ranged("> 0", float), default=30.0,
                    help="with --url: seconds a request may take, plus 0.1 s per query")
    sp.set_defaults(fn=search_command)

    server.add_serve_command(sub, local_args, local_retriever)
    return p


def main(p: OneLineParser, argv=None):
    args = p.parse_args(argv)
    if args.cmd == "search" and not args.url and not args.corpus:
        p.error("search needs --corpus (or --url of a running server)")
    try:
        args.fn(args)
    except (ValueError, ConnectionError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
