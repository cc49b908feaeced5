"""eval.py — exact-match evaluation per data source, as in the Search-R1 / LLDS results tables.

The paper reports EM on NQ, TriviaQA, PopQA (general QA) and HotpotQA, 2WikiMultiHopQA, Musique,
Bamboogle (multi-hop QA), each dataset scored on its own and then averaged (macro average) per
group and over all seven. Reproduction threads on Search-R1 disagree mostly because the
retriever, corpus, top-k or decoding differed, so every table printed here repeats its setting.

Three rows of the paper's table, three modes:
- `search`  the trained agent: `rollout.rollout()` with up to `max_turns` searches (4 at
            evaluation, one more than in training), top-3 passages, greedy decoding;
- `rag`     retrieve top-3 once with the question itself, put the passages in the prompt, and
            answer in one turn (no search tags offered);
- `direct`  no retrieval at all: the question alone, answered in one turn.
`rag` and `direct` are rollouts with `max_turns=0` whose prompt (text in plumbing/fewshot.py) is built
here: the few-shot search prompt would teach the model to emit `<search>` it is not allowed to use.

Used two ways: `python eval.py ...` prints the table and writes `results.json` +
`predictions.jsonl` (plumbing/reports.py); `evaluate(...)` returns the same numbers in memory, and
`heldout_eval(...)` hands them to train.py's periodic held-out evaluation as eval/* metrics. The
flags are RolloutConfig's fields (defaults: EVAL), made by the same code as train.py's. A question
whose prompt is over `max_prompt_tokens` is left out (at load, or after retrieval for a rag prompt)
and listed under "dropped" in the results, never scored silently. Simplified: scores are EM and
token F1 on the last `<answer>` (as the reward), and cover-EM (a gold inside the answer, for papers
that report it); no LLM judge. `--samples k`: avg@k, pass@k with bootstrap intervals (plumbing/
scores.py). The toy world's sources are its question kinds (single-hop toy_nq, multi-hop toy_hotpot_*).
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
from plumbing.fewshot import CHAT_DIRECT, CHAT_RAG, FEWSHOT_DIRECT, FEWSHOT_RAG   # the rag / direct prompts' text
from plumbing.memory import release_memory
from plumbing.scores import cover_em, format_sampled, sampled_scores
from plumbing.search_health import answer_in_passages
from plumbing.models import load_policy
from plumbing.reports import format_header, format_table, write_outputs
from plumbing.runs import resolve_model   # a train.py run, checkpoint or model folder -> the model folder
from retriever import open_retriever

MODES = ("search", "rag", "direct")
EVAL = rollout.RolloutConfig(max_turns=4, topk=3, greedy=True)  # as in the paper: greedy, 4 searches, top-3

# The paper's two column groups. Names are matched after dropping a "toy_" prefix, so the toy
# world's toy_nq counts as general and toy_hotpot_* as multi-hop; unknown sources only enter "all".
GENERAL = ("nq", "triviaqa", "popqa")
MULTIHOP = ("hotpot", "2wiki", "musique", "bamboogle")


# ---- Scores: per example -> per source -> group averages -------------------------------------

def source_group(source: str) -> str | None:
    """The paper column group of a data_source: "general", "multihop", or None ("all" only)."""
    name = source.lower().removeprefix("toy_")
    return "general" if name.startswith(GENERAL) else "multihop" if name.startswith(MULTIHOP) else None


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def scores_by_source(per_example: list[dict]) -> dict:
    """Per-source and group scores from per-example results ({"data_source", "em", "f1", "n_search"}).

    Returns {"sources": {source: {"n", "em", "f1", "searches"}}, "general": {...}, "multihop": {...},
    "all": {...}}. Group rows are macro averages over their sources (every dataset counts once,
    as in the paper's "Avg." column); their "n" is the total number of questions. A group without
    sources has n=0 and NaN scores.
    """
    by_source = collections.defaultdict(list)
    for ex in per_example:
        by_source[ex["data_source"]].append(ex)
    sources = {src: {"n": len(exs), "em": _mean(e["em"] for e in exs), "f1": _mean(e["f1"] for e in exs),
                     "searches": _mean(e["n_search"] for e in exs), "cover_em": _mean(e["cover_em"] for e in exs)}
               for src, exs in sorted(by_source.items())}
    out = {"sources": sources}
    for group in ("general", "multihop", "all"):
        rows = [row for src, row in sources.items() if group == "all" or source_group(src) == group]
        out[group] = {"n": sum(r["n"] for r in rows),
                      **{k: _mean(r[k] for r in rows) for k in ("em", "f1", "searches", "cover_em")}}
    return out


# ---- Prompts of the no-search modes, in the style of each rollout template -------------------

def one_turn_prompt(question: str, tokenizer, template: str = "fewshot", passages: str | None = None) -> list[int]:
    """Prompt ids for answering in one turn: direct (passages=None) or rag (format_passages text).
    template "fewshot" -> plain-text 2-shot prompt; "search-r1" -> one chat message (plumbing/fewshot.py)."""
    question = rollout.as_question(question)
    if template == "fewshot":
        text = (FEWSHOT_DIRECT if passages is None else FEWSHOT_RAG).format(question=question, passages=passages)
        return tokenizer(text)["input_ids"]
    text = (CHAT_DIRECT if passages is None else CHAT_RAG).format(question=question, passages=passages)
    return rollout.chat_prompt_ids(tokenizer, text) if tokenizer.chat_template else tokenizer(text + "\n")["input_ids"]


def _cut(text: str, tokenizer, max_tokens: int) -> str:
    """`text` cut to at most max_tokens tokens (the observation cap of the search mode)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def with_prompts(records: list[dict], tokenizer, retriever, mode: str, cfg) -> list[dict]:
    """Copies of `records` with "prompt_ids" for rag / direct (rag: one batched retrieval call,
    the question as query; retrieved ids kept under "retrieved")."""
    if mode == "direct":
        return [{**r, "prompt_ids": one_turn_prompt(r["question"], tokenizer, cfg.template)} for r in records]
    hits = retriever.search([r["question"] for r in records], cfg.topk)
    return [{**r, "retrieved": [h["document"].get("id") for h in hs],   # Search-R1's Pyserini server sends none
             "prompt_ids": one_turn_prompt(r["question"], tokenizer, cfg.template,
                                           _cut(rollout.format_passages(hs), tokenizer, cfg.max_obs_tokens))}
            for r, hs in zip(records, hits)]


# ---- Evaluation loop ---------------------------------------------------------------------------

def mode_config(cfg, mode: str):
    """The rollout config a mode runs with: rag and direct get no search turns."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    return cfg if mode == "search" else dataclasses.replace(cfg, max_turns=0)


def evaluate(model, tokenizer, records: list[dict], retriever, mode: str = "search", cfg=None,
             batch_size: int | None = None, progress: bool = False) -> dict:
    """Score `model` on `records` in one mode; nothing is written to disk.

    cfg: RolloutConfig (default EVAL: greedy, max_turns 4, top-3); rag/direct force max_turns=0.
    retriever: anything with .search(queries, topk); unused (may be None) in direct mode.
    Returns scores_by_source(examples) plus "examples" (one dict per scored record, input order),
    "dropped" (ids of the records left out because their prompt in this mode is over
    cfg.max_prompt_tokens: a rag prompt holds passages, so it is known only after retrieval),
    "seconds" and "questions_per_min". The model is put in eval mode and restored afterwards.
    """
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
                chunk, too_long = rollout.split_long_prompts(chunk, tokenizer, cfg)   # reported, not scored
                dropped += [r["id"] for r in too_long]
                if chunk:
                    episodes = rollout.rollout(model, tokenizer, chunk, retriever, cfg, progress=bar.set_postfix_str).episodes
                    examples += [_example(r, ep, mode) for r, ep in zip(chunk, episodes)]
                bar.update(len(chunk) + len(too_long))
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    return {**scores_by_source(examples), "examples": examples, "dropped": dropped, "seconds": seconds,
            "questions_per_min": 60 * len(examples) / seconds if seconds else float("nan")}


def heldout_eval(model, tokenizer, records, retriever, rollout_cfg, samples: int = 0) -> dict:
    """train.py's held-out evaluation: evaluate() in mode "search", as eval/* metrics; eval/em is
    the macro average over data sources, as in the paper's tables. samples > 0 adds eval/em_sampled:
    the same questions `samples` times each, sampled at rollout_cfg.temperature (the policy RL
    samples from). The torch RNG stream is left as it was, so evaluating does not change the run."""
    rng = torch.get_rng_state()
    scores = evaluate(model, tokenizer, records, retriever, "search", rollout_cfg, progress=True)
    metrics = {"eval/em": scores["all"]["em"], "eval/f1": scores["all"]["f1"],
               "eval/em_micro": statistics.fmean(e["em"] for e in scores["examples"]),
               "eval/correct": [int(e["em"]) for e in scores["examples"]],   # per question, in order
               "eval/searches": scores["all"]["searches"], "timing/eval": scores["seconds"],
               "eval/answer_in_passages": answer_in_passages(scores["examples"], rollout.normalize_answer)}
    if samples:
        sampled = evaluate(model, tokenizer, [r for r in records for _ in range(samples)], retriever, "search",
                           dataclasses.replace(rollout_cfg, greedy=False), progress=True)
        metrics.update({"eval/em_sampled": sampled["all"]["em"], "timing/eval": scores["seconds"] + sampled["seconds"],
                        f"eval/pass@{samples}": sampled_scores(sampled["examples"], samples, resamples=0)["all"]["pass@k"]})
    torch.set_rng_state(rng)
    release_memory()
    return metrics


def _example(record: dict, episode: dict, mode: str) -> dict:
    """One line of predictions.jsonl. n_search counts retriever calls (rag: always 1)."""
    out = {"id": record["id"], "data_source": record["data_source"], "question": record["question"],
           "golds": episode["golds"], "prediction": episode["answer"], "em": episode["em"],
           "f1": episode["f1"], "cover_em": cover_em(episode["answer"], episode["golds"], rollout.normalize_answer),
           "n_search": 1 if mode == "rag" else episode["n_search"],
           "finished": episode["finished"], "text": episode["text"]}
    if "retrieved" in record:
        out["retrieved"] = record["retrieved"]
    return out


# ---- CLI -----------------------------------------------------------------------------------------

def setting_of(args, mode: str, cfg, n: int) -> dict:
    """Everything that changes a score, printed above every table and stored in results.json."""
    retrieval = {"search": f"{args.retriever} over {args.corpus or 'server corpus'}",
                 "rag": f"{args.retriever} over {args.corpus or 'server corpus'} (query = question)",
                 "direct": "none"}[mode]
    return {"model": resolve_model(args.model) or "SmolLM2-135M-Instruct (embedded default)",
            "mode": mode, "data": f"{', '.join(args.data)} [{args.split}]"
            + (f", first {args.limit} per source" if args.limit else ""), "questions": n,
            "retriever": retrieval, "topk": cfg.topk if mode != "direct" else "-",
            "max_turns": cfg.max_turns, "max_turn_tokens": cfg.max_turn_tokens,
            "max_prompt_tokens": cfg.max_prompt_tokens,
            "decoding": "greedy" if cfg.greedy else f"sampling T={cfg.temperature} top_p={cfg.top_p}",
            "prompt": cfg.template if mode == "search" else f"{cfg.template}-{mode} (eval.py)",
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def parser() -> OneLineParser:
    """eval.py's flags. Every RolloutConfig field is a flag (its comment the help), with EVAL's
    value as default: the same mechanism as train.py's Config."""
    p = OneLineParser(description="Exact-match evaluation per data source (Search-R1 / LLDS tables). "
                                "No arguments: the embedded SmolLM2 on the toy world's test split, search mode.")
    p.add_argument("--model", type=ranged("any", str), help="HF model folder or name in the local cache, or a train.py checkpoint "
                   "(run dir, ckpt-<step> dir or its model/); default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--data", nargs="+", default=["toy"], type=ranged("text", str),
                   help="'toy' (or one kind: toy_nq, toy_hotpot_bridge, toy_hotpot_comparison), FlashRAG "
                        ".jsonl files, Search-R1 .parquet files, or folders laid out <root>/<dataset>/<split>.jsonl")
    p.add_argument("--split", default="test", type=ranged("text", str), help="split for 'toy' and dataset folders (test falls back to dev)")
    p.add_argument("--limit", type=ranged(">= 1"), help="first N questions of every data source")
    p.add_argument("--mode", nargs="+", default=["search"], choices=MODES,
                   help="search: the agent; rag: retrieve with the question, answer once; direct: no retrieval")
    p.add_argument("--retriever", default="bm25", type=ranged("text", str), help="bm25 | dense | http://host:port/retrieve")
    p.add_argument("--retriever-timeout", type=ranged("> 0", float), default=30.0, help="server: seconds a request, + 0.1 s a query")
    p.add_argument("--corpus", type=ranged("file", str), help="JSONL corpus for bm25/dense (default with --data toy: the toy corpus)")
    p.add_argument("--index", type=ranged("any", str), help="index folder (loaded, or built and saved there; default: cached)")
    p.add_argument("--on-long-prompt", default="drop", choices=rollout.ON_LONG_PROMPT,
                   help="a prompt over --max-prompt-tokens: drop the question (reported) or stop with an error")
    p.add_argument("--sample", dest="greedy", action="store_false", default=argparse.SUPPRESS,
                   help="sample at --temperature and --top-p instead of greedy decoding (= --no-greedy)")
    p.add_argument("--seed", type=ranged("0..4294967295"), default=0, help="torch seed (matters with --sample, --samples)")
    p.add_argument("--samples", type=ranged(">= 0"), default=0, help="also sample each question K times at "
                   "--temperature: avg@K and pass@K with bootstrap 95%% intervals (search mode)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", type=ranged("text", str), help="output folder (default runs/eval/<date>)")
    add_config_flags(p, rollout.RolloutConfig, defaults=EVAL, choices={"template": rollout.TEMPLATES})
    return p


def parse_args(argv=None):
    """eval.py's flags -> (args, cfg)."""
    args = vars(parser().parse_args(argv))
    fields = shared_fields(rollout.RolloutConfig, args)
    return argparse.Namespace(**{k: v for k, v in args.items() if k not in fields}), dataclasses.replace(EVAL, **fields)


def main(argv=None) -> None:
    args, cfg = parse_args(argv)
    torch.manual_seed(args.seed)
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but torch sees no GPU; use --device cpu")
        records = data.load_question_sets(args.data, args.split, args.limit)
        if not records:
            raise ValueError(f"no questions found in {args.data}")
        retriever = open_retriever(args.retriever, corpus=data.corpus_for(args.data, args.retriever, args.corpus),
                                   index=args.index or None, timeout=args.retriever_timeout) if set(args.mode) - {"direct"} else None
        model, tokenizer = load_policy(resolve_model(args.model), dtype=torch.bfloat16 if args.device == "cuda" else None)
        model.to(args.device)
        # Checked at load, with the search prompt, so that every mode scores the same questions.
        records, too_long = rollout.drop_long_prompts(records, tokenizer, cfg, args.on_long_prompt, "questions")
        runs = {}
        for mode in args.mode:
            result = evaluate(model, tokenizer, records, retriever, mode, cfg, progress=True)
            result["dropped"] = [r["id"] for r in too_long] + result["dropped"]
            setting = setting_of(args, mode, mode_config(cfg, mode), len(records))
            print(f"\n{format_header(setting)}\n\n{format_table(result)}")
            print(f"{result['questions_per_min']:.1f} questions/min ({result['seconds']:.0f} s)")
            if args.samples and mode == "search":
                sampled = evaluate(model, tokenizer, [r for r in records for _ in range(args.samples)], retriever, mode,
                                   dataclasses.replace(cfg, greedy=False), progress=True)
                result["sampled"] = sampled_scores(sampled["examples"], args.samples)
                print(f"\n{args.samples} samples per question at T={cfg.temperature}:\n{format_sampled(result['sampled'])}")
            runs[mode] = (setting, result)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    out_dir = Path(args.out or f"runs/eval/{datetime.datetime.now():%Y%m%d-%H%M%S}")
    write_outputs(out_dir, runs)
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'predictions.jsonl'}")


if __name__ == "__main__":
    main()
