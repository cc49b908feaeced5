"""integrations/trl_search_r1.py: Search-R1 trained with GRPO + LLDS inside TRL's GRPOTrainer, on CPU.

    python integrations/trl_search_r1.py                          # embedded SmolLM2-135M, toy world, BM25
    python integrations/trl_search_r1.py --steps 6 --answer-coef 0.05 --answer-adaptive --out-dir /tmp/trl-run

Everything a TRL user writes to train a search agent with LLDS, and nothing else: chat prompts with
their gold answers, Search-R1's exact-match reward, our BM25 over the toy world's corpus as a TRL tool, and
`LLDSGRPOTrainer` (integrations/trl_llds.py) where GRPOTrainer would be. Each optimiser step prints
its reward, tool calls and llds/* metrics; they also go to TRL's log history (saved as
<out-dir>/<name>/log_history.jsonl) and to every `--report-to` backend.

How it differs from train.py, this project's own Search-R1 loop:
- Tool calls are TRL's, not Search-R1's tags. TRL runs a tool when the model writes
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in a chat template TRL knows how to parse
  (Qwen2.5/3, Llama 3, ...); `<search> query </search>` triggers nothing. SmolLM2 shares Qwen2.5's
  <|im_start|>/<|im_end|> tokens, so it gets TRL's copy of the Qwen2.5 template, and train.py's three
  worked examples are replayed as chat turns so that a 135M model writes tool calls at all.
- Results come back as a `<tool_response>` user turn (tool_mask 0: never trained on, never penalised),
  not an <information> block; TRL generates whole turns up to <|im_end|>.
- Steps count optimiser steps; each generation batch (questions x group) feeds updates_per_generation
  of them, which is what gives LLDS something to do (with one, it is exactly 0).
- The reward is Search-R1's `qa_em` with its `format_score` knob on (0.1 for a well-formed wrong
  answer; the paper trains with 0): on a handful of questions a 135M model is rarely right, and a
  group of equal rewards has zero advantage, so the policy would not move and LLDS would stay 0.
- TRL's generate has no fast CPU path: the default run (16 completions, 2 updates) took 12 min on
  the 2-core CPU shared with two training runs (bench/bench_vs_trl.py measured TRL's step at 6x
  train.py's on a few-shot prompt); pass --threads 1 when other jobs share the cores.
"""
import json
import math
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402
from trl.chat_template_utils import qwen2_5_chat_template  # noqa: E402

import data  # noqa: E402
import retriever as retrieval  # noqa: E402
import rollout as ro  # noqa: E402
from integrations.trl_llds import LLDSGRPOTrainer  # noqa: E402
from llds import GATES  # noqa: E402
from plumbing import cli, fast_hf, models  # noqa: E402
from plumbing.cli import flag  # noqa: E402
from plumbing.fewshot import FEWSHOT_EXAMPLES  # noqa: E402

SYSTEM = ("Answer the question. Call the search tool to look things up, then give the final answer as "
          "<answer> answer </answer>.")
SHOWN = ("reward", "tools/call_frequency", "llds/loss", "llds/active_token_frac", "llds/n_preserving",
         "llds/answer_weight")


@dataclass
class Config:
    name: str = flag("trl-search-r1", "run name: the output goes to <out-dir>/<name>", "text")
    out_dir: str = flag("runs", "parent folder of the run's output; '' = a temporary one", "any")
    model: str = flag("", "HF model folder; '' = embedded SmolLM2-135M-Instruct", "any")
    data: str = flag("toy_nq", "training questions (see data.load_questions)", "any")
    corpus: str = flag("", "JSONL corpus for BM25; '' = the toy world's", "file")
    topk: int = flag(3, "passages per search", ">= 0")
    steps: int = flag(2, "optimiser steps", ">= 1")
    questions: int = flag(4, "questions per generation batch", ">= 1")
    group_size: int = flag(4, "completions per question (GRPO group)", ">= 2")
    updates_per_generation: int = flag(2,
        "optimiser steps per generation batch; LLDS needs two or more", ">= 2")
    micro_batch_size: int = flag(2, "completions per forward/backward", ">= 1")
    max_completion_tokens: int = flag(256, "model and tool tokens per completion", ">= 1")
    max_tool_calls: int = flag(2, "tool-calling turns per completion", ">= 0")
    temperature: float = flag(0.7, "sampling temperature", "> 0")
    format_score: float = flag(0.1, "reward of a well-formed wrong <answer>; 0 = EM only", "0..1")
    lr: float = flag(2e-5, "AdamW learning rate", ">= 0")
    llds_lambda: float = flag(0.2, "LLDS coefficient; 0 = plain GRPO", ">= 0")
    llds_gate: str = flag("action", "LLDS gate: action, response or token", "choice")
    answer_coef: float = flag(math.inf, "LLDS-MA: the answer's coefficient, capped at lambda", "any")
    answer_adaptive: bool = flag(False, "LLDS-MA: --answer-coef x max(V - 1, 0), V = valid searches")
    report_to: str = flag("none", "TRL logging backends (tensorboard, wandb, ...)", "any")
    seed: int = flag(0, "sampling and shuffling seed", "0..4294967295")
    threads: int = flag(0, "torch CPU threads; 0 = torch's default", ">= 0")


def search_tool(corpus: str, topk: int):
    """Our BM25 as a TRL tool: a typed function whose docstring TRL turns into the tool's JSON schema."""
    index = retrieval.open_retriever("bm25", corpus=corpus)

    def search(query: str) -> str:
        """Search the encyclopedia.

        Args:
            query: the words to look up
        """
        return ro.format_passages(index.search([query], topk)[0])

    return search


def worked_examples() -> list[dict]:
    """train.py's few-shot examples (plumbing/fewshot.py) as chat turns with TRL-style tool calls."""
    messages = []
    for question, steps in FEWSHOT_EXAMPLES:
        messages.append({"role": "user", "content": question})
        note = ""                                   # the sentence written before the next action
        for kind, argument, passages in steps:
            if kind == "note":
                note = argument
            elif kind == "search":
                call = {"type": "function", "function": {"name": "search", "arguments": {"query": argument}}}
                hits = [{"document": {"contents": p}} for p in passages]
                messages += [{"role": "assistant", "content": note, "tool_calls": [call]},
                             {"role": "tool", "name": "search", "content": ro.format_passages(hits)}]
                note = ""
            else:
                messages.append({"role": "assistant", "content": f"{note} <answer> {argument} </answer>".strip()})
    return messages


def dataset(records: list[dict]) -> Dataset:
    """TRL's conversational format: a `prompt` list of messages per row; `golds` reaches the reward."""
    shown = [{"role": "system", "content": SYSTEM}] + worked_examples()
    return Dataset.from_dict({"prompt": [shown + [{"role": "user", "content": r["question"]}] for r in records],
                              "golds": [r["golds"] for r in records]})


def em_reward(format_score: float):
    """Search-R1's qa_em reward on a completion's final assistant turn: 1 for an exact match,
    format_score for a wrong <answer>, 0 without one."""

    def exact_match(completions, golds, **kwargs) -> list[float]:
        answers = [ro.extract_answer(turns[-1]["content"]) for turns in completions]
        return [0.0 if a is None else 1.0 if ro.exact_match(a, g) else format_score for a, g in zip(answers, golds)]

    return exact_match


class PrintSteps(TrainerCallback):
    """One line per optimiser step with the metrics that show LLDS at work."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            shown = "  ".join(f"{k} {logs[k]:.4g}" for k in SHOWN if k in logs)
            print(f"step {state.global_step}/{state.max_steps}  {shown}", flush=True)


def build_trainer(cfg: Config, model, tokenizer, out: Path) -> LLDSGRPOTrainer:
    """The TRL setup: the whole integration a user copies."""
    tokenizer.chat_template = qwen2_5_chat_template     # a template TRL parses tool calls of
    records = data.load_questions(cfg.data, split="train")
    n_questions = cfg.steps // cfg.updates_per_generation * cfg.questions
    accumulation = cfg.questions * cfg.group_size // cfg.updates_per_generation // cfg.micro_batch_size
    args = GRPOConfig(
        output_dir=str(out), max_steps=cfg.steps, per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation * cfg.updates_per_generation,    # several updates: LLDS acts
        num_generations=cfg.group_size, max_completion_length=cfg.max_completion_tokens,
        max_tool_calling_iterations=cfg.max_tool_calls, temperature=cfg.temperature, learning_rate=cfg.lr,
        lr_scheduler_type="constant", beta=0.0, loss_type="dapo",
        gradient_checkpointing=True,       # without it, micro-batches of 4 x ~1k tokens went past 10 GB on CPU
        logging_steps=1, save_strategy="no",
        report_to=cfg.report_to, use_cpu=not torch.cuda.is_available(),
        bf16=fast_hf.bf16_supported(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        disable_tqdm=True, seed=cfg.seed)
    trainer = LLDSGRPOTrainer(
        model=model, reward_funcs=em_reward(cfg.format_score), args=args, processing_class=tokenizer,
        train_dataset=dataset(records[:n_questions]),
        tools=[search_tool(cfg.corpus or str(data.toy_world() / "corpus.jsonl"), cfg.topk)],
        llds_lambda=cfg.llds_lambda, llds_gate=cfg.llds_gate, llds_answer_coef=cfg.answer_coef,
        llds_answer_adaptive=cfg.answer_adaptive)
    trainer.remove_callback(PrinterCallback)            # PrintSteps shows the lines that matter here
    trainer.add_callback(PrintSteps())
    return trainer


def main(argv=None) -> None:
    parser = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    cli.add_config_flags(parser, Config, choices={"llds_gate": GATES})
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.questions * cfg.group_size % (cfg.updates_per_generation * cfg.micro_batch_size):
        raise SystemExit("questions x group-size must be a multiple of updates-per-generation x micro-batch-size")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir or tempfile.mkdtemp(prefix="trl-search-r1-")) / cfg.name
    model, tokenizer = models.load_policy(cfg.model or None)
    trainer = build_trainer(cfg, model, tokenizer, out)
    trainer.train()

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    with open(out / "log_history.jsonl", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in trainer.state.log_history)
    llds = sorted({k for line in trainer.state.log_history for k in line if k.startswith("llds/")})
    print(f"llds metrics ({', '.join(llds)}): one value per optimiser step in trainer.state.log_history, "
          f"saved to {out / 'log_history.jsonl'}; report_to={cfg.report_to!r} got them too")
    if not any(line.get("llds/loss") for line in trainer.state.log_history):
        print("llds/loss stayed 0: every group had equal rewards, so the policy never moved away from the "
              "rollout policy; more --questions or --steps give GRPO (and then LLDS) something to act on")


if __name__ == "__main__":
    main()
