"""sft.py: supervised warm-start of a search agent on a scripted policy's episodes, before RL.

`python sft.py --model <folder> --data <questions>` writes <out>/model for `train.py --model`.

Why: GRPO learns only from groups whose rewards differ, so a policy that never answers right gets
no signal (cold-start starvation). Every large RL stack (veRL, SkyRL, TRL, prime-rl, nanochat)
ships a supervised warm-start first. Here a scripted policy (`SCRIPTS`, e.g. the noisy searcher
of tasks/searcher.py) writes each model turn and the environment appends real BM25 observations,
through the same `rollout.rollout` as RL: the prompt, token layout and loss mask are those of RL.

The loss is next-token cross-entropy on model tokens only (`loss_mask`): prompts and retrieved
passages are context, never targets, as in RL. AdamW, linear warm-up then cosine decay, a held-out
loss on the test questions' episodes, and at the end the greedy and sampled (T = 1) held-out EM.
Simplified: episodes are generated once, before training, and padded per batch.
"""
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import data
import retriever
import rollout
from eval import heldout_eval
from plumbing import checkpoints, fast_hf, runs
from plumbing.cli import OneLineParser, add_config_flags, check_ranges, flag
from plumbing.models import load_policy
from plumbing.scripted import ScriptedPolicy
from tasks.searcher import noisy_searcher

SCRIPTS = {"noisy": noisy_searcher}    # context text, rng -> the next model turn
CHOICES = {"script": tuple(SCRIPTS), "template": rollout.TEMPLATES}   # the "choice" fields' values
TENSORS = ("input_ids", "attention_mask", "loss_mask")                # (N, T) each, per episode


@dataclass
class Config:
    out: str = flag("runs/sft", "output folder: metrics.jsonl, config.json, model/", "text")
    seed: int = flag(0, "seed of the script's draws, the shuffling and torch", "0..4294967295")
    model: str = flag("", "HF model folder; '' = embedded SmolLM2-135M-Instruct", "any")
    data: str = flag("toy_nq", "questions as train.py's --data; its test split is held out", "any")
    corpus: str = flag("", "JSONL corpus of the in-process retriever; '' = the toy world's", "file")
    retriever: str = flag("bm25", "'bm25', 'dense' or a Search-R1 server URL", "any")
    script: str = flag("noisy", "the scripted policy that writes the demonstrations", "choice")
    questions: int = flag(0, "training questions used (the first N); 0 = all", ">= 0")
    episodes_per_question: int = flag(8, "scripted episodes per training question", ">= 1")
    heldout_questions: int = flag(100, "test questions that give the held-out loss", ">= 1")
    template: str = flag("search-r1", "prompt: 'search-r1' (the paper's) or 'fewshot'", "choice")
    max_turns: int = flag(2, "search turns per episode; one answer-only turn follows", ">= 0")
    topk: int = flag(3, "passages per search", ">= 0")
    max_turn_tokens: int = flag(32, "tokens per scripted turn; longer turns are cut", ">= 1")
    max_obs_tokens: int = flag(200, "tokens per observation", ">= 1")
    epochs: int = flag(2, "passes over the training episodes", ">= 1")
    batch_size: int = flag(16, "episodes per optimizer step", ">= 1")
    lr: float = flag(1e-3, "AdamW peak learning rate", ">= 0")
    warmup_steps: int = flag(50, "linear warm-up steps, then cosine decay to lr / 10", ">= 0")
    weight_decay: float = flag(0.01, "AdamW weight decay", ">= 0")
    grad_clip: float = flag(1.0, "gradient-norm clip", "> 0")
    eval_every: int = flag(100, "held-out loss every N optimizer steps (and at the end)", ">= 1")
    eval_size: int = flag(200, "held-out questions scored at the end; 0 = none", ">= 0")
    eval_samples: int = flag(4, "samples per held-out question for the sampled EM", ">= 0")
    bf16: bool = flag(False, "bf16 autocast where the CPU/GPU supports it")


def rollout_config(cfg: Config, **overrides) -> rollout.RolloutConfig:
    """The episodes' settings, greedy: the script's turns exactly (sampled EM: at T = 1)."""
    settings = dict(max_turns=cfg.max_turns, topk=cfg.topk, max_turn_tokens=cfg.max_turn_tokens,
                    max_obs_tokens=cfg.max_obs_tokens, template=cfg.template, bf16=cfg.bf16)
    return rollout.RolloutConfig(**{**settings, "greedy": True, "temperature": 1.0, **overrides})


def scripted_episodes(questions, tokenizer, retriever, cfg: Config, copies: int, seed: int) -> dict:
    """`copies` episodes of the scripted policy per question -> (N, T) input_ids, attention_mask,
    loss_mask (1 on the tokens the script wrote) and the episodes' results."""
    records = [q for q in questions for _ in range(copies)]
    policy = ScriptedPolicy(SCRIPTS[cfg.script], tokenizer, seed)
    out = rollout.rollout(policy, tokenizer, records, retriever, rollout_config(cfg, bf16=False))
    return {**{k: getattr(out, k) for k in TENSORS}, "episodes": out.episodes}


def sft_loss(model, input_ids, attention_mask, loss_mask):
    """Mean next-token cross-entropy over model tokens: (B, T) ids and masks -> scalar. lm_head
    runs only on the hidden states that predict a model token (the one at t predicts t + 1)."""
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    picked = loss_mask[:, 1:].bool()                                          # (B, T-1)
    logits = model.get_output_embeddings()(hidden[:, :-1][picked]).float()    # (N, V)
    return torch.nn.functional.cross_entropy(logits, input_ids[:, 1:][picked])


def batch_of(episodes: dict, idx: torch.Tensor, device) -> dict:
    """Rows `idx`, cut to their longest episode (episodes are right-padded)."""
    length = int(episodes["attention_mask"][idx].sum(1).max())
    return {k: episodes[k][idx, :length].to(device) for k in TENSORS}


@torch.no_grad()
def heldout_loss(model, episodes: dict, cfg: Config, device) -> float:
    losses, weights = [], []
    for idx in torch.arange(len(episodes["input_ids"])).split(cfg.batch_size):
        b = batch_of(episodes, idx, device)
        with fast_hf.autocast(device, cfg.bf16):
            losses.append(sft_loss(model, **b).item())
        weights.append(float(b["loss_mask"][:, 1:].sum()))
    return sum(l * w for l, w in zip(losses, weights)) / sum(weights)


def parser() -> OneLineParser:
    p = OneLineParser(description="Supervised warm-start on a scripted policy's episodes (loss on "
                      "model tokens only). Writes <out>/model for train.py --model.")
    add_config_flags(p, Config, choices=CHOICES)
    return p


def parse_args(argv=None) -> Config:
    return Config(**vars(parser().parse_args(argv)))


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    with runs.user_errors_exit(Path(cfg.out)):       # one line "error: ..."
        check_ranges(cfg, CHOICES)
        return warm_start(cfg)


def warm_start(cfg: Config) -> dict:
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    runs.seed_everything(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_policy(cfg.model or None)
    model.to(device)
    fast_hf.use_fast_attention(model)      # this model's attention, as train.py's (fast_hf.py)

    # 1. The data: scripted episodes of the training questions, and of held-out test questions.
    corpus = data.corpus_for([cfg.data], cfg.retriever, cfg.corpus)
    search_engine = retriever.open_retriever(cfg.retriever, corpus=corpus)
    train_q = data.load_questions(cfg.data, split="train", limit=cfg.questions or None)
    test_q = data.heldout_set(cfg.data, max(cfg.heldout_questions, cfg.eval_size))
    start = time.perf_counter()
    train = scripted_episodes(train_q, tokenizer, search_engine, cfg,
                              cfg.episodes_per_question, cfg.seed)
    held = scripted_episodes(test_q[:cfg.heldout_questions], tokenizer, search_engine, cfg,
                             1, cfg.seed + 1)
    script_em = sum(e["em"] for e in train["episodes"]) / len(train["episodes"])
    print(f"{len(train['input_ids'])} scripted episodes of {len(train_q)} questions in "
          f"{time.perf_counter() - start:.0f} s; the script's own EM {script_em:.3f}, "
          f"{int(train['loss_mask'].sum())} target tokens")

    # 2. The loop: shuffled batches, AdamW, warm-up then cosine decay, held-out loss now and then.
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    n = len(train["input_ids"])
    steps = cfg.epochs * math.ceil(n / cfg.batch_size)
    log = open(out_dir / "metrics.jsonl", "w")
    bar = tqdm(total=steps, desc="sft", unit="step")
    step = 0
    for epoch in range(cfg.epochs):
        for idx in torch.randperm(n).split(cfg.batch_size):
            step += 1
            warm = min(1.0, step / max(cfg.warmup_steps, 1))
            decay = 0.1 + 0.45 * (1 + math.cos(math.pi * min(step / steps, 1.0)))
            lr = cfg.lr * warm * decay
            for group in optimizer.param_groups:
                group["lr"] = lr
            model.train()
            with fast_hf.autocast(device, cfg.bf16):
                loss = sft_loss(model, **batch_of(train, idx, device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
            optimizer.step()
            model.eval()
            metrics = dict(step=step, epoch=epoch, lr=lr, loss=loss.item(), grad_norm=norm)
            if step % cfg.eval_every == 0 or step == steps:
                metrics["heldout_loss"] = heldout_loss(model, held, cfg, device)
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            bar.update()
            heldout = metrics.get("heldout_loss", float("nan"))
            bar.set_postfix(loss=f"{loss.item():.3f}", heldout=f"{heldout:.3f}")
    bar.close()

    # 3. Save the warm-started model, then score it as RL will start from it.
    need = checkpoints.tensor_bytes(model.parameters()) + 2**24
    with checkpoints.written_whole(out_dir / "model", need, "the SFT model", manifest=False) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    summary = {"script_em": script_em, "heldout_loss": metrics["heldout_loss"]}
    if cfg.eval_size:
        summary.update(heldout_eval(model, tokenizer, test_q[:cfg.eval_size], search_engine,
                                    rollout_config(cfg), samples=cfg.eval_samples))
    logged = {k: v for k, v in summary.items() if k != "eval/correct"}
    log.write(json.dumps({"step": step, **logged}) + "\n")
    log.close()
    scores = f"held-out EM greedy {summary['eval/em']:.3f}; " if cfg.eval_size else ""
    if "eval/em_sampled" in summary:
        scores += (f"sampled at T=1 {summary['eval/em_sampled']:.3f} "
                   f"({cfg.eval_size} questions x {cfg.eval_samples}); ")
    print(f"held-out loss {summary['heldout_loss']:.3f}; {scores}model: {out_dir / 'model'} "
          f"(train.py --model {out_dir / 'model'})")
    return summary


if __name__ == "__main__":
    main()
