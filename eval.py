"""eval.py: exact-match evaluation per data source, as in the Search-R1 / LLDS results tables.

Each dataset is scored on its own, then averaged per group, general QA (NQ, TriviaQA, PopQA) and
multi-hop QA (HotpotQA, 2WikiMultiHopQA, Musique, Bamboogle), and over all seven. Reproductions
of Search-R1 differ mostly in retriever, corpus, top-k or decoding, so each table states them.

Three modes, three rows of the paper's table:
- `search`  the agent: `rollout.rollout()` with up to `max_turns` searches, top-3, greedy.
- `rag`     one top-3 retrieval with the question, passages in the prompt, one answer turn.
- `direct`  the question alone, one answer turn.
rag and direct are rollouts with `max_turns=0` and a prompt of their own (plumbing/fewshot.py):
the few-shot search prompt would teach the model a `<search>` it may not use.

`python eval.py` prints the tables and writes results.json and predictions.jsonl. `evaluate()`
returns the scores in memory, and `heldout_eval()` gives them to train.py as eval/* metrics.
A question whose prompt is over `max_prompt_tokens` is listed under "dropped", never scored.
Simplified: EM, token F1 and cover-EM on the last `<answer>` (as the reward); no LLM judge.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import data
import rollout
from plumbing.cli import OneLineParser, add_config_flags, ranged, shared_fields
from plumbing.fewshot import CHAT_DIRECT, CHAT_RAG, FEWSHOT_DIRECT, FEWSHOT_RAG
from plumbing import fast_hf, memory
from plumbing.scores import cover_em, format_sampled, sampled_scores
from plumbing.search_health import answer_in_passages
from plumbing.models import load_policy
from plumbing.eval_tables import format_header, format_table, write_outputs
from plumbing.checkpoints import resolve_model
from plumbing.runs import user_errors_exit
from retriever import open_retriever

MODES = ("search", "rag", "direct")
# The paper's evaluation setting: greedy, 4 searches (one more than in training), top-3.
EVAL = rollout.RolloutConfig(max_turns=4, topk=3, greedy=True)

# The paper's two column groups. Names are matched after dropping a "toy_" prefix, so the toy
# world's toy_nq counts as general and toy_hotpot_* as multi-hop; unknown sources only enter "all".
GENERAL = ("nq", "triviaqa", "popqa")
MULTIHOP = ("hotpot", "2wiki", "musique", "bamboogle")
SCORES = {"em": "em", "f1": "f1", "searches": "n_search", "cover_em": "cover_em"}  # score: its key


# ---- Scores: per example -> per source -> group averages -------------------------------------

def source_group(source: str) -> str | None:
    """The paper column group of a data_source: "general", "multihop", or None ("all" only)."""
    name = source.lower().removeprefix("toy_")
    return ("general" if name.startswith(GENERAL) else
            "multihop" if name.startswith(MULTIHOP) else None)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def scores_by_source(per_example: list[dict]) -> dict:
    """Per-source and group scores of per-example results: {"sources": {source: {"n", "em", "f1",
    "searches", "cover_em"}}, "general", "multihop", "all"}. Group rows macro-average their sources
    (the paper's "Avg." column); "n" counts questions (0, with NaN scores, for an empty group)."""
    by_source = collections.defaultdict(list)
    for ex in per_example:
        by_source[ex["data_source"]].append(ex)
    sources = {src: {"n": len(exs), **{k: _mean(e[key] for e in exs) for k, key in SCORES.items()}}
               for src, exs in sorted(by_source.items())}
    out = {"sources": sources}
    for group in ("general", "multihop", "all"):
        rows = [row for src, row in sources.items() if group == "all" or source_group(src) == group]
        n = sum(r["n"] for r in rows)
        out[group] = {"n": n, **{k: _mean(r[k] for r in rows) for k in SCORES}}
    return out


# ---- Prompts of the no-search modes, in the style of each rollout template -------------------

def one_turn_prompt(question: str, tokenizer, template="fewshot", passages=None) -> list[int]:
    """Prompt ids for answering in one turn: direct (passages None) or rag (format_passages text).
    "fewshot": a plain-text 2-shot prompt; "search-r1": one chat message (plumbing/fewshot.py)."""
    texts = (FEWSHOT_DIRECT, FEWSHOT_RAG) if template == "fewshot" else (CHAT_DIRECT, CHAT_RAG)
    text = texts[passages is not None].format(question=rollout.as_question(question),
                                              passages=passages)
    if template != "fewshot" and tokenizer.chat_template:
        return rollout.chat_prompt_ids(tokenizer, text)
    return tokenizer(text if template == "fewshot" else text + "\n")["input_ids"]


def _cut(text: str, tokenizer, max_tokens: int) -> str:
    """`text` cut to at most max_tokens tokens (the observation cap of the search mode)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def with_prompts(records: list[dict], tokenizer, retriever, mode: str, cfg) -> list[dict]:
    """Copies of `records` with "prompt_ids" for rag / direct (rag: one batched retrieval call,
    the question as query; retrieved ids kept under "retrieved")."""
    if mode == "direct":
        return [{**r, "prompt_ids": one_turn_prompt(r["question"], tokenizer, cfg.template)}
                for r in records]
    hits = retriever.search([r["question"] for r in records], cfg.topk)
    passages = [_cut(rollout.format_passages(hs), tokenizer, cfg.max_obs_tokens) for hs in hits]
    # .get("id"): Search-R1's Pyserini server sends no passage ids.
    return [{**r, "retrieved": [h["document"].get("id") for h in hs],
             "prompt_ids": one_turn_prompt(r["question"], tokenizer, cfg.template, text)}
            for r, hs, text in zip(records, hits, passages)]


# ---- Evaluation loop ---------------------------------------------------------------------------

def mode_config(cfg, mode: str):
    """The rollout config a mode runs with: rag and direct get no search turns."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    return cfg if mode == "search" else dataclasses.replace(cfg, max_turns=0)


def evaluate(model, tokenizer, records: list[dict], retriever, mode: str = "search", cfg=None,
             batch_size: int | None = None, progress: bool = False) -> dict:
    """Score `model` on `records` in one mode, in memory. cfg: a RolloutConfig (default EVAL).
    retriever: anything with .search(queries, topk); None in direct mode. Returns
    scores_by_source(examples) plus "examples" (one per scored record, in order), "dropped" (ids
    of the records whose prompt is over cfg.max_prompt_tokens: a rag prompt is known only after
    retrieval), "seconds" and "questions_per_min". The model's train/eval mode is restored."""
    cfg = mode_config(cfg or EVAL, mode)
    if mode != "direct" and retriever is None:
        raise ValueError(f"mode {mode!r} needs a retriever (only 'direct' runs without one)")
    cfg = dataclasses.replace(cfg, batch_size=batch_size or cfg.batch_size)
    was_training = model.training
    model.eval()
    examples, dropped, start = [], [], time.perf_counter()
    try:
        with tqdm(total=len(records), desc=f"eval {mode}", unit="q", disable=not progress) as bar:
            for first in range(0, len(records), cfg.batch_size):
                chunk = records[first:first + cfg.batch_size]
                if mode != "search":
                    chunk = with_prompts(chunk, tokenizer, retriever, mode, cfg)
                chunk, too_long = rollout.split_long_prompts(chunk, tokenizer, cfg)
                dropped += [r["id"] for r in too_long]
                if chunk:
                    out = rollout.rollout(model, tokenizer, chunk, retriever, cfg,
                                          progress=bar.set_postfix_str)
                    examples += [_example(r, ep, mode) for r, ep in zip(chunk, out.episodes)]
                bar.update(len(chunk) + len(too_long))
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    return {**scores_by_source(examples), "examples": examples, "dropped": dropped,
            "seconds": seconds,
            "questions_per_min": 60 * len(examples) / seconds if seconds else float("nan")}


def heldout_eval(model, tokenizer, records, retriever, rollout_cfg, samples: int = 0) -> dict:
    """train.py's held-out evaluation: evaluate() in search mode, as eval/* metrics (eval/em: the
    macro average over sources). samples > 0 adds eval/em_sampled and pass@samples, sampling at
    rollout_cfg.temperature. The torch RNG is restored, so evaluating does not change the run."""
    rng = torch.get_rng_state()
    scores = evaluate(model, tokenizer, records, retriever, "search", rollout_cfg, progress=True)
    examples = scores["examples"]
    metrics = {"eval/em": scores["all"]["em"], "eval/f1": scores["all"]["f1"],
               "eval/em_micro": statistics.fmean(e["em"] for e in examples),
               "eval/correct": [int(e["em"]) for e in examples],   # per question, in order
               "eval/searches": scores["all"]["searches"], "timing/eval": scores["seconds"],
               "eval/answer_in_passages": answer_in_passages(examples, rollout.normalize_answer)}
    if samples:
        sampled = evaluate(model, tokenizer, [r for r in records for _ in range(samples)],
                           retriever, "search", dataclasses.replace(rollout_cfg, greedy=False),
                           progress=True)
        pass_k = sampled_scores(sampled["examples"], samples, resamples=0)["all"]["pass@k"]
        metrics.update({"eval/em_sampled": sampled["all"]["em"], f"eval/pass@{samples}": pass_k,
                        "timing/eval": scores["seconds"] + sampled["seconds"]})
    torch.set_rng_state(rng)
    memory.release_memory()
    return metrics


def _example(record: dict, episode: dict, mode: str) -> dict:
    """One line of predictions.jsonl. n_search counts retriever calls (rag: always 1)."""
    out = {"id": record["id"], "data_source": record["data_source"], "question": record["question"],
           "golds": episode["golds"], "prediction": episode["answer"], "em": episode["em"],
           "f1": episode["f1"],
           "cover_em": cover_em(episode["answer"], episode["golds"], rollout.normalize_answer),
           "n_search": 1 if mode == "rag" else episode["n_search"],
           "finished": episode["finished"], "text": episode["text"]}
    if "retrieved" in record:
        out["retrieved"] = record["retrieved"]
    return out


# ---- CLI -----------------------------------------------------------------------------------------

def setting_of(args, mode: str, cfg, n: int) -> dict:
    """Everything that changes a score, printed above every table and stored in results.json."""
    corpus = f"{args.retriever} over {args.corpus or 'server corpus'}"
    retrieval = {"search": corpus, "rag": f"{corpus} (query = question)", "direct": "none"}[mode]
    limit = f", first {args.limit} per source" if args.limit else ""
    decoding = "greedy" if cfg.greedy else f"sampling T={cfg.temperature} top_p={cfg.top_p}"
    return {"model": resolve_model(args.model) or "SmolLM2-135M-Instruct (embedded default)",
            "mode": mode, "data": f"{', '.join(args.data)} [{args.split}]{limit}", "questions": n,
            "retriever": retrieval, "topk": cfg.topk if mode != "direct" else "-",
            "max_turns": cfg.max_turns, "max_turn_tokens": cfg.max_turn_tokens,
            "max_prompt_tokens": cfg.max_prompt_tokens, "decoding": decoding,
            "prompt": cfg.template if mode == "search" else f"{cfg.template}-{mode} (eval.py)",
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def parser() -> OneLineParser:
    """eval.py's flags: these, and every RolloutConfig field with EVAL's value as default."""
    p = OneLineParser(description="Exact-match evaluation per data source. No arguments: the "
                      "embedded SmolLM2 on the toy world's test split, search mode.")
    text, anything, path = ranged("text", str), ranged("any", str), ranged("file", str)
    p.add_argument("--model", type=anything, help="HF model folder or cached name, or a train.py "
                   "run or checkpoint (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", nargs="+", default=["toy"], type=text, help="'toy' or a toy kind, "
                   "FlashRAG .jsonl, Search-R1 .parquet, or <root>/<dataset>/<split>.jsonl folders")
    p.add_argument("--split", default="test", type=text,
                   help="split of 'toy' and of folders (test falls back to dev)")
    p.add_argument("--limit", type=ranged(">= 1"), help="first N questions of every data source")
    p.add_argument("--mode", nargs="+", default=["search"], choices=MODES,
                   help="search: the agent; rag: retrieve once, answer once; direct: no retrieval")
    p.add_argument("--retriever", default="bm25", type=text, help="bm25, dense or a server URL")
    p.add_argument("--retriever-timeout", type=ranged("> 0", float), default=30.0,
                   help="server: seconds a request, + 0.1 s a query")
    p.add_argument("--corpus", type=path, help="JSONL corpus for bm25/dense; toy data: the toy's")
    p.add_argument("--index", type=anything, help="index folder (default: a cached one)")
    p.add_argument("--on-long-prompt", default="drop", choices=rollout.ON_LONG_PROMPT,
                   help="a prompt over --max-prompt-tokens: drop the question or stop")
    p.add_argument("--sample", dest="greedy", action="store_false", default=argparse.SUPPRESS,
                   help="sample at --temperature and --top-p (= --no-greedy)")
    p.add_argument("--seed", type=ranged("0..4294967295"), default=0, help="torch seed")
    p.add_argument("--samples", type=ranged(">= 0"), default=0,
                   help="search mode: also sample each question K times, avg@K and pass@K")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"))
    p.add_argument("--out", type=text, help="output folder (default runs/eval/<date>)")
    add_config_flags(p, rollout.RolloutConfig, defaults=EVAL,
                     choices={"template": rollout.TEMPLATES})
    return p


def parse_args(argv=None):
    """eval.py's flags -> (args, cfg)."""
    args = vars(parser().parse_args(argv))
    fields = shared_fields(rollout.RolloutConfig, args)
    rest = {k: v for k, v in args.items() if k not in fields}
    return argparse.Namespace(**rest), dataclasses.replace(EVAL, **fields)


def main(argv=None) -> None:
    args, cfg = parse_args(argv)
    torch.manual_seed(args.seed)
    out_dir = Path(args.out or f"runs/eval/{datetime.datetime.now():%Y%m%d-%H%M%S}")
    with user_errors_exit(out_dir):      # a user's error, Ctrl-C or a full disk: one line
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but torch sees no GPU; use --device cpu")
        records = data.load_question_sets(args.data, args.split, args.limit)
        if not records:
            raise ValueError(f"no questions found in {args.data}")
        retriever = None if set(args.mode) <= {"direct"} else open_retriever(
            args.retriever, corpus=data.corpus_for(args.data, args.retriever, args.corpus),
            index=args.index or None, timeout=args.retriever_timeout)
        dtype = torch.bfloat16 if args.device == "cuda" else None
        model, tokenizer = load_policy(resolve_model(args.model), dtype=dtype)
        fast_hf.use_fast_attention(model.to(args.device))   # this model's attention only
        # Checked at load, with the search prompt, so that every mode scores the same questions.
        records, too_long = rollout.drop_long_prompts(records, tokenizer, cfg, args.on_long_prompt,
                                                      "questions")
        runs = {}
        for mode in args.mode:
            result = evaluate(model, tokenizer, records, retriever, mode, cfg, progress=True)
            result["dropped"] = [r["id"] for r in too_long] + result["dropped"]
            setting = setting_of(args, mode, mode_config(cfg, mode), len(records))
            print(f"\n{format_header(setting)}\n\n{format_table(result)}")
            print(f"{result['questions_per_min']:.1f} questions/min ({result['seconds']:.0f} s)")
            if args.samples and mode == "search":
                repeated = [r for r in records for _ in range(args.samples)]
                sampled = evaluate(model, tokenizer, repeated, retriever, mode,
                                   dataclasses.replace(cfg, greedy=False), progress=True)
                result["sampled"] = sampled_scores(sampled["examples"], args.samples)
                print(f"\n{args.samples} samples per question at T={cfg.temperature}:\n"
                      f"{format_sampled(result['sampled'])}")
            runs[mode] = (setting, result)
        write_outputs(out_dir, runs)
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'predictions.jsonl'}")


if __name__ == "__main__":
    main()
