"""Tests for eval.py: hand-worked scores per source and per group, a scripted policy run through
the real rollout loop, the question loaders eval.py relies on, and the three modes end to end
with a tiny random model on toy-world questions."""
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import data
from plumbing.models import byte_tokenizer
import eval as ev
from retriever import open_retriever


# ----------------------------------------------------------------------------------------------
# Helpers: a scripted policy, a fixed retriever (the byte-level tokenizer is plumbing.models')
# ----------------------------------------------------------------------------------------------

class _Cache:
    """Stands in for the KV cache: remembers each row's real tokens."""

    def __init__(self, rows):
        self.rows = rows

    def batch_repeat_interleave(self, n):
        self.rows = [list(r) for r in self.rows for _ in range(n)]

    def batch_select_indices(self, index):
        self.rows = [self.rows[i] for i in index.tolist()]


class ScriptedPolicy(torch.nn.Module):
    """Writes fixed turns per question: script[question] = ["<search> q </search>", "<answer> a </answer>"].
    Turn i is written after the i-th observation (the generated text is cut at </information>)."""

    def __init__(self, tokenizer, script):
        super().__init__()
        self.tokenizer, self.script = tokenizer, script
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def _next_char(self, text: str) -> str | None:
        question, newline, generated = text.rsplit("Question: ", 1)[-1].partition("\n")
        if not newline:  # a prompt prefix shared by all rows: its logits are not used
            return None
        turns = self.script[question]
        done = generated.count("</search>")
        partial = generated.rsplit("</information>\n\n", 1)[-1] if done else generated
        return turns[done][len(partial)] if len(partial) < len(turns[done]) else None

    def forward(self, input_ids, attention_mask, past_key_values=None, **_):
        cache = past_key_values or _Cache([[] for _ in range(input_ids.shape[0])])
        real = attention_mask[:, -input_ids.shape[1]:].bool()
        for row, (ids, keep) in enumerate(zip(input_ids, real)):
            cache.rows[row] += ids[keep].tolist()
        vocab = len(self.tokenizer)
        logits = torch.zeros(input_ids.shape[0], 1, vocab)
        for row, ids in enumerate(cache.rows):
            char = self._next_char(self.tokenizer.decode(ids))
            target = (self.tokenizer.eos_token_id if char is None
                      else self.tokenizer(char, add_special_tokens=False)["input_ids"][0])
            logits[row, 0, target] = 10.0
        return type("Out", (), {"logits": logits, "past_key_values": cache})()


class FixedRetriever:
    def search(self, queries, topk):
        return [[{"document": {"id": "d1", "contents": "\"Doc\"\nSome text."}, "score": 1.0}] for _ in queries]


# ----------------------------------------------------------------------------------------------
# scores_by_source(): hand-worked per-source scores and macro averages
# ----------------------------------------------------------------------------------------------

def test_source_groups():
    assert [ev.source_group(s) for s in ("nq", "triviaqa", "popqa", "toy_nq")] == ["general"] * 4
    assert [ev.source_group(s) for s in ("hotpotqa", "2wikimultihopqa", "musique", "bamboogle",
                                         "toy_hotpot_bridge", "toy_hotpot_comparison")] == ["multihop"] * 6
    assert ev.source_group("mysource") is None


def test_scores_by_source_hand_worked():
    def ex(source, em, f1, n):       # cover-EM: 1 wherever F1 > 0 here
        return {"data_source": source, "em": em, "f1": f1, "n_search": n, "cover_em": float(f1 > 0)}
    per_example = [ex("toy_nq", 1, 1.0, 1), ex("toy_nq", 0, 0.5, 2), ex("toy_nq", 1, 1.0, 1), ex("toy_nq", 1, 1.0, 0),
                   ex("toy_hotpot_bridge", 0, 0.5, 2), ex("toy_hotpot_bridge", 1, 1.0, 2),
                   ex("toy_hotpot_comparison", 1, 1.0, 3), ex("other", 0, 0.0, 0)]
    s = ev.scores_by_source(per_example)
    assert s["sources"]["toy_nq"] == {"n": 4, "em": 0.75, "f1": 0.875, "searches": 1.0, "cover_em": 1.0}
    assert s["sources"]["toy_hotpot_bridge"] == {"n": 2, "em": 0.5, "f1": 0.75, "searches": 2.0, "cover_em": 1.0}
    assert s["general"] == {"n": 4, "em": 0.75, "f1": 0.875, "searches": 1.0, "cover_em": 1.0}
    # Macro average: every source counts once, whatever its size (the paper's "Avg.").
    assert s["multihop"] == {"n": 3, "em": 0.75, "f1": 0.875, "searches": 2.5, "cover_em": 1.0}
    assert s["all"] == pytest.approx({"n": 8, "em": 2.25 / 4, "f1": 2.625 / 4, "searches": 6 / 4, "cover_em": 3 / 4})
    table = ev.format_table(s)
    assert "avg multihop (macro)" in table and "toy_hotpot_comparison" in table


def test_scores_by_source_empty_group_is_nan(tmp_path):
    s = ev.scores_by_source([{"data_source": "nq", "em": 1.0, "f1": 1.0, "n_search": 0, "cover_em": 1.0}])
    assert s["multihop"]["n"] == 0 and math.isnan(s["multihop"]["em"])
    assert "multihop" not in ev.format_table(s)
    ev.write_outputs(tmp_path, {"direct": ({"mode": "direct"}, {**s, "examples": []})})
    assert json.loads((tmp_path / "results.json").read_text())["direct"]["multihop"]["em"] is None


# ----------------------------------------------------------------------------------------------
# evaluate(): a scripted policy through the real rollout loop gives exactly the scripted scores
# ----------------------------------------------------------------------------------------------

def test_evaluate_scripted_policy():
    tok = byte_tokenizer()
    records = [  # question, golds, source, the policy's turns -> (EM, F1, searches)
        ("Who wrote Hamlet?", ["William Shakespeare", "Shakespeare"], "nq",
         ["<search> Hamlet author </search>", "<answer> Shakespeare </answer>"]),       # 1, 1, 1
        ("What is the capital of France?", ["Paris"], "nq", ["<answer> Lyon </answer>"]),  # 0, 0, 0
        ("Who was president in 2010?", ["Barack Obama"], "hotpotqa",
         ["<search> a </search>", "<search> b </search>", "<answer> Obama </answer>"]),    # 0, 2/3, 2
        ("When did it start?", ["1990"], "bamboogle", ["<answer> The 1990. </answer>"]),   # 1, 1, 0
        ("Anything?", ["x"], "mysource", ["<answer> y </answer>"]),                        # 0, 0, 0
    ]
    policy = ScriptedPolicy(tok, {q: turns for q, _, _, turns in records})
    recs = [{"id": str(i), "question": q, "golds": g, "data_source": s} for i, (q, g, s, _) in enumerate(records)]
    cfg = ev.dataclasses.replace(ev.EVAL, max_turn_tokens=40)
    out = ev.evaluate(policy, tok, recs, FixedRetriever(), "search", cfg, batch_size=2)

    assert [e["prediction"] for e in out["examples"]] == ["Shakespeare", "Lyon", "Obama", "The 1990.", "y"]
    assert [e["n_search"] for e in out["examples"]] == [1, 0, 2, 0, 0]
    src = out["sources"]
    assert (src["nq"]["em"], src["nq"]["f1"], src["nq"]["searches"]) == (0.5, 0.5, 0.5)
    assert (src["hotpotqa"]["em"], src["hotpotqa"]["f1"]) == (0.0, pytest.approx(2 / 3))
    assert (src["bamboogle"]["em"], src["bamboogle"]["f1"]) == (1.0, 1.0)
    assert out["general"]["em"] == 0.5
    assert [e["cover_em"] for e in out["examples"]] == [1.0, 0.0, 0.0, 1.0, 0.0]   # "Obama" holds no "Barack Obama"
    assert out["multihop"] == pytest.approx({"n": 2, "em": 0.5, "f1": 5 / 6, "searches": 1.0, "cover_em": 0.5})
    assert out["all"] == pytest.approx({"n": 5, "em": 0.375, "f1": (0.5 + 2 / 3 + 1) / 4, "searches": 0.625,
                                        "cover_em": 0.375})


# ----------------------------------------------------------------------------------------------
# Loaders: FlashRAG JSONL folders and Search-R1 parquet, limit per data source
# ----------------------------------------------------------------------------------------------

def test_load_flashrag_folder_limit_per_source(tmp_path):
    for name, n in (("nq", 3), ("bamboogle", 2)):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"id": f"{name}_{i}", "question": f"q{i}?", "golden_answers": [f"a{i}"],
                             "metadata": {}}) for i in range(n)]
        (tmp_path / name / ("test.jsonl" if name == "nq" else "dev.jsonl")).write_text("\n".join(lines))
    records = data.load_question_sets([str(tmp_path)], "test", limit=2)
    assert [(r["data_source"], r["id"], r["golds"]) for r in records] == [
        ("bamboogle", "bamboogle_0", ["a0"]), ("bamboogle", "bamboogle_1", ["a1"]),
        ("nq", "nq_0", ["a0"]), ("nq", "nq_1", ["a1"])]


def test_load_searchr1_parquet_limit_per_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"data_source": src, "prompt": [{"role": "user", "content": f"Answer... Question: {src} q{i}?"}],
             "reward_model": {"ground_truth": {"target": [f"{src}-a{i}"]}}, "extra_info": {"index": i}}
            for src in ("nq", "hotpotqa") for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    records = data.load_question_sets([str(tmp_path / "test.parquet")], "test", limit=1)
    assert [(r["id"], r["question"], r["golds"]) for r in records] == [
        ("nq:0", "nq q0?", ["nq-a0"]), ("hotpotqa:0", "hotpotqa q0?", ["hotpotqa-a0"])]


def test_resolve_model_checkpoint_layouts(tmp_path):
    for step in (5, 20, 100):                         # complete checkpoints: state.json is written last
        (tmp_path / f"ckpt-{step}" / "model").mkdir(parents=True)
        (tmp_path / f"ckpt-{step}" / "model" / "config.json").write_text("{}")
        (tmp_path / f"ckpt-{step}" / "state.json").write_text("{}")
    assert ev.resolve_model(str(tmp_path)) == str(tmp_path / "ckpt-100" / "model")
    assert ev.resolve_model(str(tmp_path / "ckpt-5")) == str(tmp_path / "ckpt-5" / "model")
    assert ev.resolve_model("SomeOrg/some-model") == "SomeOrg/some-model"
    run = tmp_path / "run"                            # train.py's layout: its own config.json beside ckpt-*/
    for step in (9, 10):
        (run / f"ckpt-{step}").mkdir(parents=True)
        (run / f"ckpt-{step}" / "config.json").write_text("{}")
        (run / f"ckpt-{step}" / "state.json").write_text("{}")
    (run / "config.json").write_text('{"steps": 10}')
    assert ev.resolve_model(str(run)) == str(run / "ckpt-10")
    (run / "latest").write_text("ckpt-9")            # the checkpoint train.py would resume from wins
    assert ev.resolve_model(str(run)) == str(run / "ckpt-9")
    (run / "ckpt-11").mkdir()                         # unfinished (no state.json): never chosen
    (run / "ckpt-11" / "config.json").write_text("{}")
    (run / "latest").unlink()
    assert ev.resolve_model(str(run)) == str(run / "ckpt-10")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model here"):
        ev.resolve_model(str(tmp_path / "empty"))


# ----------------------------------------------------------------------------------------------
# The three modes with a tiny random model on toy-world questions and in-process BM25
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    tok = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(config).eval(), tok


@pytest.fixture(scope="module")
def toy_bm25():
    return open_retriever("bm25", corpus=str(data.toy_world() / "corpus.jsonl"))


@pytest.mark.parametrize("mode", ev.MODES)
def test_modes_run_on_toy_world(tiny_model, toy_bm25, mode, tmp_path):
    model, tok = tiny_model
    records = data.load_question_sets(["toy"], "test", limit=1)
    retriever = None if mode == "direct" else toy_bm25
    cfg = ev.dataclasses.replace(ev.EVAL, max_turns=1, max_turn_tokens=4, max_obs_tokens=200)
    out = ev.evaluate(model, tok, records, retriever, mode, cfg, batch_size=2)
    assert len(out["examples"]) == 3 and out["all"]["n"] == 3
    assert set(out["sources"]) == {"toy_nq", "toy_hotpot_bridge", "toy_hotpot_comparison"}
    assert [e["id"] for e in out["examples"]] == [r["id"] for r in records]
    if mode == "direct":
        assert [e["n_search"] for e in out["examples"]] == [0] * 3
    if mode == "rag":  # one retrieval with the question, its top-3 in the prompt
        assert [e["n_search"] for e in out["examples"]] == [1] * 3
        assert all(len(e["retrieved"]) == 3 for e in out["examples"])
    setting = {"model": "tiny", "mode": mode}
    ev.write_outputs(tmp_path, {mode: (setting, out)})
    saved = json.loads((tmp_path / "results.json").read_text())[mode]
    assert saved["setting"] == setting and saved["all"]["n"] == 3
    assert len((tmp_path / "predictions.jsonl").read_text().splitlines()) == 3


class PyseriniHandler(BaseHTTPRequestHandler):
    """Answers as Search-R1's BM25 server does: Pyserini hits carry title, text and contents, no id."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.posts.append(body["queries"])
        hit = {"document": {"title": "Berlin", "text": "Berlin is the capital.",
                            "contents": '"Berlin"\nBerlin is the capital.'}, "score": 9.5}
        data = json.dumps({"result": [[hit] * body["topk"] for _ in body["queries"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_rag_mode_runs_against_a_server_that_returns_no_document_id(tiny_model, tmp_path):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), PyseriniHandler)
    srv.posts = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/retrieve"
    args, cfg = ev.parse_args(["--retriever", url, "--retriever-timeout", "120", "--mode", "rag",
                               "--topk", "2", "--max-turn-tokens", "4"])
    try:
        retriever = open_retriever(args.retriever, timeout=args.retriever_timeout)
        assert retriever.timeout_for(3) == pytest.approx(120 + 0.1 * 3)
        model, tok = tiny_model
        records = data.load_question_sets(["toy"], "test", limit=1)
        out = ev.evaluate(model, tok, records, retriever, "rag", cfg, batch_size=2)
        prompt = tok.decode(ev.with_prompts(records[:1], tok, retriever, "rag", cfg)[0]["prompt_ids"])
    finally:
        srv.shutdown()
        srv.server_close()
    assert srv.posts[:2] == [[r["question"] for r in records[:2]], [records[2]["question"]]]  # a POST per chunk
    assert 'Doc 1(Title: "Berlin") Berlin is the capital.\nDoc 2(Title: "Berlin")' in prompt
    assert [e["retrieved"] for e in out["examples"]] == [[None, None]] * 3
    ev.write_outputs(tmp_path, {"rag": ({"mode": "rag"}, out)})
    lines = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [line["retrieved"] for line in lines] == [[None, None]] * 3


# ----------------------------------------------------------------------------------------------
# Questions whose prompt is over max_prompt_tokens: left out and reported, never scored silently
# ----------------------------------------------------------------------------------------------

def test_evaluate_reports_prompts_over_the_limit():
    tok = byte_tokenizer()
    questions = {"short": "Who wrote Hamlet?", "long": "Who wrote " + "the play " * 40 + "Hamlet?"}
    policy = ScriptedPolicy(tok, {q: ["<answer> Shakespeare </answer>"] for q in questions.values()})
    recs = [{"id": k, "question": q, "golds": ["Shakespeare"], "data_source": "nq"} for k, q in questions.items()]
    limit = len(ev.one_turn_prompt(questions["short"], tok)) + 10      # the direct prompt of "short" fits
    cfg = ev.dataclasses.replace(ev.EVAL, max_turn_tokens=40, max_prompt_tokens=limit)
    out = ev.evaluate(policy, tok, recs, None, "direct", cfg, batch_size=2)
    assert out["dropped"] == ["long"] and [e["id"] for e in out["examples"]] == ["short"]
    assert out["all"]["n"] == 1 and out["all"]["em"] == 1.0
    assert ev.format_table(out).endswith("not scored: 1 question with a prompt over max_prompt_tokens: long")


def test_cli_drops_long_questions_at_load_and_lists_them_in_the_results(tmp_path, monkeypatch, capsys):
    tok = byte_tokenizer()
    questions = ["Who wrote Hamlet?", "Who wrote " + "the play " * 80 + "Hamlet?", "Who painted it?"]
    policy = ScriptedPolicy(tok, {q: ["<answer> Shakespeare </answer>"] for q in questions})
    monkeypatch.setattr(ev, "load_policy", lambda path, dtype=None: (policy, tok))
    f = tmp_path / "nq.jsonl"
    f.write_text("".join(json.dumps({"id": f"q{i}", "question": q, "golden_answers": ["Shakespeare"]}) + "\n"
                         for i, q in enumerate(questions)))
    args = ["--data", str(f), "--mode", "direct", "--max-turn-tokens", "40", "--out", str(tmp_path / "out")]
    ev.main(args)
    printed = capsys.readouterr().out
    # the search prompt of q1 (few-shot examples included) is over 2048 tokens: left out of every mode
    assert "dropped 1 of 3 questions with a prompt over max_prompt_tokens=2048 tokens (fewshot template): q1" in printed
    assert "not scored: 1 question with a prompt over max_prompt_tokens: q1" in printed
    results = json.loads((tmp_path / "out" / "results.json").read_text())["direct"]
    assert results["dropped"] == ["q1"] and results["all"]["n"] == 2 and results["setting"]["questions"] == 2
    with pytest.raises(SystemExit, match=r"error: 1 of 3 questions have a prompt over max_prompt_tokens=2048 .*: q1"):
        ev.main(args + ["--on-long-prompt", "error"])
    f.write_text("\n")
    with pytest.raises(SystemExit, match=r"nq\.jsonl: no questions in this file"):
        ev.main(args)


def test_flags_are_rollout_config_fields_with_evals_defaults(capsys):
    args, cfg = ev.parse_args([])
    assert cfg == ev.EVAL and args.data == ["toy"] and args.on_long_prompt == "drop"
    args, cfg = ev.parse_args(["--max-turns", "2", "--max-turn-tokens", "64", "--batch-size", "16", "--sample",
                               "--temperature", "0.7", "--template", "search-r1", "--limit", "10"])
    assert cfg == ev.dataclasses.replace(ev.EVAL, max_turns=2, max_turn_tokens=64, batch_size=16, greedy=False,
                                         temperature=0.7, template="search-r1")
    assert args.limit == 10 and not hasattr(args, "max_turns")
    for bad in (["--batch-size", "0"], ["--template", "chat"]):
        with pytest.raises(SystemExit):
            ev.parse_args(bad)
    assert "--batch-size: must be >= 1" in capsys.readouterr().err


def test_cli_samples_reports_avg_and_pass_at_k_and_cover_em(tmp_path, monkeypatch, capsys):
    tok = byte_tokenizer()
    questions = ["Who wrote Hamlet?", "Who wrote Faust?"]
    policy = ScriptedPolicy(tok, {questions[0]: ["<answer> Shakespeare </answer>"],
                                  questions[1]: ["<answer> it was Goethe </answer>"]})
    monkeypatch.setattr(ev, "load_policy", lambda path, dtype=None: (policy, tok))
    f = tmp_path / "nq.jsonl"
    f.write_text("".join(json.dumps({"id": f"q{i}", "question": q, "golden_answers": [g]}) + "\n"
                         for i, (q, g) in enumerate(zip(questions, ["Shakespeare", "Goethe"]))))
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "d", "contents": "Hamlet"}) + "\n")
    ev.main(["--data", str(f), "--corpus", str(tmp_path / "c.jsonl"), "--samples", "3", "--max-turn-tokens", "40",
             "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "avg@3" in printed and "pass@3" in printed and "cover-EM" in printed
    results = json.loads((tmp_path / "out" / "results.json").read_text())["search"]
    assert results["all"]["em"] == 0.5 and results["all"]["cover_em"] == 1.0     # "it was Goethe" covers Goethe
    assert results["sampled"]["sources"]["nq"]["n"] == 2 and results["sampled"]["all"]["avg@k"] == 0.5
    assert results["sampled"]["all"]["pass@k"] == 0.5
