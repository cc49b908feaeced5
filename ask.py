"""ask.py: ask the agent a question and watch it search.

    python ask.py "Where was Drardrin Kritruard born?"               # the embedded model
    python ask.py "Where was Drardrin Kritruard born?" --model runs/demo   # a train.py run

One episode of rollout.py, greedy, printed turn by turn: what the model wrote, each search, the
passages it got back (shortened to a line each), and its answer. Coloured on a terminal, plain
text in a pipe. The episode settings are the run's own (its config.json) when --model names a
train.py run, else train.py's defaults; any of them can be given as a flag (--topk 3, ...).
"""
import dataclasses
import json
import re
import sys
from pathlib import Path

import data
import retriever
import rollout
import train
from plumbing import checkpoints, fast_hf, runs
from plumbing.cli import OneLineParser, add_config_flags, ranged
from plumbing.models import load_policy

INFORMATION = re.compile(r"(<information>.*?</information>)", re.DOTALL)
TAG = re.compile(r"(<(?:search|answer)>.*?</(?:search|answer)>)", re.DOTALL)
COLOURS = {"model": "", "tag": "\033[1;34m", "passages": "\033[2m", "answer": "\033[1;32m"}


def show(episode: dict, colour: bool) -> str:
    """The episode's text after the prompt, turn by turn: model text, its <search>/<answer> tags
    highlighted, each observation's passages one shortened line each; then the answer."""
    def paint(text, kind):
        return f"{COLOURS[kind]}{text}\033[0m" if colour and COLOURS[kind] else text

    lines = []
    for part in INFORMATION.split(episode["text"]):
        if INFORMATION.fullmatch(part):
            docs = part.removeprefix("<information>").removesuffix("</information>").strip()
            lines += [paint(f"    {doc[:96]}", "passages") for doc in docs.splitlines() if doc]
        elif part.strip():
            lines.append("".join(paint(p, "tag") if TAG.fullmatch(p) else p
                                 for p in TAG.split(part.strip())))
    answer = episode["answer"]
    lines.append(paint(f"answer: {answer}", "answer") if answer is not None else "no answer")
    return "\n".join(lines)


def settings(model: str | None) -> train.Config:
    """train.py's settings of the run `model` names (its config.json), else its defaults."""
    run = Path(model) if model else None
    if run is None or not (run / "metrics.jsonl").exists():
        return train.Config()
    saved = run / "config.json"
    names = {f.name for f in dataclasses.fields(train.Config)}
    return train.Config(**{k: v for k, v in json.loads(saved.read_text()).items() if k in names})


def parser() -> OneLineParser:
    p = OneLineParser(description="Ask the agent a question and print its episode turn by turn.")
    p.add_argument("question", type=ranged("text", str), help="the question to ask")
    p.add_argument("--model", type=ranged("any", str), help="a train.py run or checkpoint, or an "
                   "HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", type=ranged("file", str), help="JSONL corpus (default: the run's, "
                   "or the toy world's)")
    p.add_argument("--retriever", type=ranged("text", str), help="bm25, dense or a server URL "
                   "(default: the run's, or bm25)")
    add_config_flags(p, rollout.RolloutConfig, choices={"template": rollout.TEMPLATES},
                     defaults=train.rollout_config(train.Config(), greedy=True))
    return p


def main(argv=None) -> None:
    args = vars(parser().parse_args(argv))
    cfg = settings(args["model"])
    search = args.pop("retriever") or cfg.retriever
    corpus = args.pop("corpus") or cfg.corpus
    question, model_path = args.pop("question"), args.pop("model")
    episode_cfg = dataclasses.replace(train.rollout_config(cfg, greedy=True), **args)
    with runs.user_errors_exit(Path(".")):
        corpus = data.corpus_for([cfg.data], search, corpus)
        engine = retriever.open_retriever(search, corpus=corpus, index=cfg.index or None)
        model, tokenizer = load_policy(checkpoints.resolve_model(model_path))
        fast_hf.use_fast_attention(model)
        record = {"id": "asked", "question": question, "golds": [], "data_source": "asked"}
        out = rollout.rollout(model, tokenizer, [record], engine, episode_cfg)
    print(show(out.episodes[0], colour=sys.stdout.isatty()))


if __name__ == "__main__":
    main()
