"""The hardened HTTP server behind `python retriever.py serve`: Search-R1's `POST /retrieve` (and
`GET /health`) over any retriever.py backend, standard library only. It takes everything the
original Search-R1 trainer sends (an empty batch, empty queries, a whole turn in one POST, topk
missing, null or 0), rejects anything else with a JSON 4xx that says what is wrong, caps the body
size by the largest valid request, drops clients that stall mid-request, answers backend failures
with a 500 instead of dying, and serves many clients on threads.

Searches are batched: one worker thread runs them all, and the requests that arrive while it is
busy (or within --batch-window-ms of the first) share one search call, so one encoder pass and one
index search serve 8 concurrent one-query clients instead of 8 passes queued behind a lock. A
merged call that fails is retried request by request, so only the request that breaks the backend
gets its 500. The backend itself needs no thread safety; BM25 spreads a batch over its own threads.
The query rules (`check_queries`, MAX_QUERY_CHARS) live here and retriever.py's in-process
backends apply the same ones, so a rollout that works in-process works over HTTP.
"""
import json
import os
import queue
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from plumbing.cli import ranged

# Limits: generous for a rollout batch, small enough that one request can't hog the box.
MAX_QUERY_CHARS = 2000  # the longest query: the server answers longer ones with a 400, rollout.py cuts to it
MAX_QUERIES = 4096  # default --max-queries; Search-R1 posts a whole turn: 512 prompts x 5 = 2,560
MAX_TOPK = 100
DEFAULT_TOPK = 3  # default --topk, used when a request has no topk (Search-R1's retrieval_topk)
READ_TIMEOUT_S = 10.0  # a client that stalls mid-request is dropped after this long
BATCH_WINDOW_MS = 2.0  # default --batch-window-ms: how long the first request of a batch waits for others


def check_queries(queries, topk) -> None:
    """The request rules of every backend, in-process or served; ValueError saying what is wrong.

    An empty list and empty strings are valid (see retriever.py's docstring).
    """
    if not isinstance(queries, (list, tuple)):
        raise ValueError(f"queries must be a list of strings, got {type(queries).__name__}")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise ValueError(f"queries[{i}] must be a string, got {type(q).__name__}")
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def max_body_bytes(max_queries: int) -> int:
    """The largest body a request within the other limits can need, so this cap never rejects one.

    JSON spends at most 12 bytes on one character (a non-BMP character escaped as a surrogate
    pair, "\\ud83d\\ude00"); 16 bytes per query cover quotes, comma and indentation, 4 KiB the rest.
    """
    return max_queries * (12 * MAX_QUERY_CHARS + 16) + 4096


def parse_retrieve_request(body: bytes, max_queries: int = MAX_QUERIES,
                           default_topk: int = DEFAULT_TOPK) -> tuple[list[str], int, bool]:
    """Validate a Search-R1 request body -> (queries, topk, return_scores); BadRequest if wrong.

    Accepts everything the original Search-R1 trainer sends: an empty `queries` list (a turn in
    which no row searched), empty query strings (`<search></search>`), a whole turn in one POST
    (up to `max_queries`), and `topk` missing, null or 0, which all mean `default_topk` as in the
    original server. Rejected: bodies that are not a JSON object, wrong types, negative topk or
    topk > MAX_TOPK, queries longer than MAX_QUERY_CHARS, more than `max_queries` queries.
    """
    try:
        req = json.loads(body)
    except ValueError as e:  # includes UnicodeDecodeError
        raise BadRequest(400, f"body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise BadRequest(400, 'body must be a JSON object like {"queries": ["..."], "topk": 3}')
    if "queries" not in req:
        raise BadRequest(400, "missing 'queries' (a list of strings)")
    queries, topk, return_scores = req["queries"], req.get("topk"), req.get("return_scores", True)
    if topk is None or (type(topk) is int and topk == 0):  # the original's `if not request.topk`
        topk = default_topk
    try:
        check_queries(queries, topk)
    except ValueError as e:
        raise BadRequest(400, str(e)) from None
    if len(queries) > max_queries:
        raise BadRequest(400, f"too many queries: {len(queries)} > {max_queries}; split the batch "
                              "or start the server with a larger --max-queries")
    for i, q in enumerate(queries):
        if len(q) > MAX_QUERY_CHARS:
            raise BadRequest(400, f"queries[{i}] is {len(q)} characters, over the {MAX_QUERY_CHARS} limit")
    if topk > MAX_TOPK:
        raise BadRequest(400, f"topk must be between 1 and {MAX_TOPK}, got {topk}")
    if not isinstance(return_scores, bool):
        raise BadRequest(400, "return_scores must be true or false")
    return queries, topk, return_scores


class _Handler(BaseHTTPRequestHandler):
    """POST /retrieve in Search-R1's format, GET /health.

    Request:  {"queries": [str, ...], "topk": int (optional), "return_scores": bool (default true)}
    Response: {"result": [hits of queries[0], hits of queries[1], ...]}, one list per query, with
      return_scores true:  hits = [{"document": {"id": str, "contents": str}, "score": float}, ...]
      return_scores false: hits = [{"document": {"id": str, "contents": str}}, ...]
    Search-R1's own server breaks on return_scores false (its trainer always sends true); ours
    keeps the one hit shape, less the score.
    Errors:   4xx/5xx with {"error": "what is wrong"}.
    """

    server_version = "llds-retriever/1"

    def setup(self):
        self.timeout = self.server.read_timeout  # socket timeout: a stalled client can't hold a thread
        super().setup()

    def do_GET(self):
        if self.path == "/health":
            r = self.server.retriever
            self._send(200, {"status": "ok", "backend": getattr(r, "backend", "?"), "n_docs": len(r.corpus)})
        else:
            self._send(404 if self.path != "/retrieve" else 405,
                       {"error": f"GET {self.path} not served; use POST /retrieve or GET /health"})

    def do_POST(self):
        try:
            if self.path != "/retrieve":
                raise BadRequest(404, f"unknown path {self.path}; use POST /retrieve")
            queries, topk, return_scores = parse_retrieve_request(
                self._read_body(), self.server.max_queries, self.server.default_topk)
        except BadRequest as e:
            self.close_connection = True
            self._send(e.status, {"error": str(e)})
            return
        try:
            result = self.server.batcher.search(queries, topk)
        except Exception as e:  # a backend bug must not kill the server; the client retries 5xx
            self._send(500, {"error": f"search failed: {type(e).__name__}: {e}"})
            return
        if not return_scores:
            result = [[{"document": h["document"]} for h in hits] for hits in result]
        self._send(200, {"result": result})

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            raise BadRequest(411, "Content-Length header required")
        try:
            length = int(length)
        except ValueError:
            raise BadRequest(400, f"bad Content-Length {length!r}") from None
        limit = self.server.max_body_bytes
        if length < 0 or length > limit:
            raise BadRequest(413, f"body of {length} bytes is over the {limit} byte limit "
                                  f"(set by --max-queries {self.server.max_queries})")
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            raise BadRequest(408, f"body not received within {self.server.read_timeout} s") from None
        if len(body) < length:
            raise BadRequest(400, f"body ended after {len(body)} of {length} bytes")
        return body

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away; nothing left to tell it
            self.close_connection = True

    def log_request(self, code="-", size="-"):
        if isinstance(code, int) and code >= 400:  # successful requests stay quiet
            super().log_request(code, size)


def check_server_flags(max_queries: int, topk: int) -> None:
    """Raise ValueError for a server --max-queries or --topk it cannot honour."""
    if max_queries < 1:
        raise ValueError(f"--max-queries must be at least 1, got {max_queries}")
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"--topk must be between 1 and {MAX_TOPK}, got {topk}")


def make_server(retriever, host: str = "127.0.0.1", port: int = 8000, read_timeout: float = READ_TIMEOUT_S,
                max_queries: int = MAX_QUERIES, topk: int = DEFAULT_TOPK,
                batch_window_ms: float = BATCH_WINDOW_MS) -> ThreadingHTTPServer:
    """A threaded server over `retriever`; port 0 picks a free one (see .server_address).

    max_queries caps the queries per request (and so the body size, and the queries merged into
    one search); topk is used for requests that send none.
    """
    check_server_flags(max_queries, topk)
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    server.retriever = retriever
    server.read_timeout = read_timeout
    server.max_queries, server.default_topk = max_queries, topk
    server.max_body_bytes = max_body_bytes(max_queries)
    server.batcher = Batcher(retriever, batch_window_ms / 1000, max_queries)
    return server


class Batcher:
    """Runs every search on one thread; requests waiting together (same topk) share one search call."""

    def __init__(self, retriever, window_s: float = BATCH_WINDOW_MS / 1000, max_queries: int = MAX_QUERIES):
        self.retriever, self.window_s, self.max_queries = retriever, window_s, max_queries
        self.waiting = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="search-batcher").start()

    def search(self, queries: list[str], topk: int) -> list:
        """What retriever.search(queries, topk) returns, run on the batcher's thread (blocks)."""
        request = (queries, topk, Future())
        self.waiting.put(request)
        return request[2].result()

    def _run(self) -> None:
        while True:
            batch = [self.waiting.get()]
            deadline, n = time.monotonic() + self.window_s, len(batch[0][0])
            while n < self.max_queries:  # take what waits now, and what comes within the window
                try:
                    request = self.waiting.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                batch.append(request)
                n += len(request[0])
            for topk in dict.fromkeys(r[1] for r in batch):  # one search per topk, in arrival order
                self._search_together([r for r in batch if r[1] == topk], topk)

    def _search_together(self, requests: list, topk: int) -> None:
        try:
            results = self.retriever.search([q for r in requests for q in r[0]], topk)
        except Exception as e:  # the handler answers it with a 500
            if len(requests) == 1:
                requests[0][2].set_exception(e)
                return
            for r in requests:  # find the request that breaks the backend: the others still get answers
                self._search_together([r], topk)
            return
        for queries, _, future in requests:
            future.set_result(results[:len(queries)])
            results = results[len(queries):]


def serve(open_backend, host: str, port: int, max_queries: int, topk: int,
          batch_window_ms: float = BATCH_WINDOW_MS) -> None:
    """Check the flags, then open the backend (`open_backend()`, maybe a long index build) and
    serve it until Ctrl-C."""
    check_server_flags(max_queries, topk)
    # Before the backend loads torch and faiss: their OpenMP threads then sleep between parallel
    # regions instead of spinning. On a busy CPU a spinning thread holds the core its peer needs;
    # measured with MiniLM on 2 busy cores, one query: p50 1120 ms spinning, 11 ms sleeping.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    retriever = open_backend()
    server = make_server(retriever, host, port, max_queries=max_queries, topk=topk, batch_window_ms=batch_window_ms)
    host, port = server.server_address[:2]
    print(f"serving {retriever.backend} over {len(retriever.corpus)} passages on "
          f"http://{host}:{port}/retrieve (GET /health); Ctrl-C stops; {retriever.settings}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def add_serve_command(subparsers, local_args, open_local) -> None:
    """`retriever.py serve`: its flags, and `serve` run on `open_local(args)`. local_args(parser)
    adds the backend flags the other subcommands share (--corpus, --index, --backend, --encoder)."""
    sp = subparsers.add_parser(
        "serve", help="serve POST /retrieve (Search-R1 format) and GET /health",
        description='Serve POST /retrieve: {"queries": [str, ...], "topk": int, "return_scores": bool} -> '
                    '{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}, one list per '
                    'query ("score" left out when return_scores is false). Takes all the original '
                    'Search-R1 trainer sends: an empty queries list, empty queries, a whole turn in '
                    'one POST; topk missing, null or 0 means --topk. Bad input gets a JSON 4xx.')
    local_args(sp)
    sp.add_argument("--host", default="127.0.0.1", type=ranged("text", str), help="bind address (0.0.0.0 exposes it to the network)")
    sp.add_argument("--port", type=ranged("0..65535"), default=8000, help="port (0 picks a free one)")
    sp.add_argument("--topk", type=ranged(f"1..{MAX_TOPK}"), default=DEFAULT_TOPK,
                    help=f"hits per query when a request sends no topk, null or 0 (1..{MAX_TOPK})")
    sp.add_argument("--max-queries", type=ranged(">= 1"), default=MAX_QUERIES,
                    help=f"most queries in one request (Search-R1 sends 512 prompts x 5 = 2,560); "
                         f"also sets the body limit ({max_body_bytes(MAX_QUERIES) / 2**20:.0f} MiB at "
                         f"{MAX_QUERIES})")
    sp.add_argument("--batch-window-ms", type=ranged(">= 0", float), default=BATCH_WINDOW_MS,
                    help="how long a request waits for others to share its search (concurrent requests "
                         "that arrive while a search runs are merged anyway)")

    def run(args):
        serve(lambda: open_local(args), args.host, args.port, args.max_queries, args.topk, args.batch_window_ms)
    sp.set_defaults(fn=run)
