"""train.py: GRPO + LLDS training of a search agent, with a monitor for the LLD death spiral.

One file, read top to bottom (CleanRL style): the GRPO objective, the configuration, helpers,
then the loop. `python train.py` trains the embedded SmolLM2-135M-Instruct on the toy world with
an in-process BM25 on a CPU in minutes; `python train.py --preset paper --model <Qwen2.5-3B
folder> --data <nq_hotpotqa train.parquet> --retriever http://host:8000/retrieve` is the paper's
setting on one GPU. `python train.py --plot runs/<name>` redraws a saved run's curves.

How it maps to the papers. Search-R1 (Jin et al., arXiv 2503.09516) gives the environment
(rollout.py: multi-turn generation with <search>, retrieved <information> as forced tokens with
loss mask 0, exact-match reward). Deng et al. (arXiv 2512.04220) train it with GRPO and add LLDS
(llds.py). One training step here is their veRL step:
  1. sample `prompts_per_step` questions, `group_size` rollouts each, one group id per prompt;
  2. reward = exact match of the last <answer>; group-relative advantages;
  3. old log-probs (the rollout policy, no grad) and, when kl_coef > 0, reference log-probs;
  4. shuffle the trajectories into mini-batches; one AdamW step per mini-batch, micro-batches
     with gradient accumulation; loss = clipped surrogate - entropy bonus + k3 KL + lambda LLDS.
     Several mini-batches per step are what make LLDS do anything: with one update per rollout
     batch the policy still equals the rollout policy and the LLDS penalty is exactly zero.
The LLD monitor logs what the paper shows before a collapse: the likelihood of correct and
incorrect responses, how much one step moved the correct ones (displacement), entropy and the
gradient norm, and warns when correct-response likelihood keeps falling or the norm spikes.

Simplified on purpose: one process, one device (no FSDP, no vLLM: rollout.py samples with the
training model's own KV cache); fp32 master weights with bf16 autocast (bf16 weights would round
away updates of lr 1e-6); old log-probs are recomputed in a separate pass, as veRL does; the
learning-rate schedule is warm-up then constant, stepped once per training step; log-probs are
computed as lm_head(hidden) on model tokens only (fine for Llama / Qwen / SmolLM; models with
logit soft-capping or scaling would need that added in `token_logprobs`).
"""
import argparse
import copy
import ctypes
import dataclasses
import gc
import inspect
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import data
import eval as evaluation
import retriever as retrieval
import rollout as ro
from llds import action_ids, llds_loss


# ---- GRPO objective ------------------------------------------------------------------------

def group_advantages(rewards, group_ids):
    """GRPO advantages: (r - mean_group) / (std_group + 1e-6), unbiased std.

    rewards (N,) float; group_ids (N,) long tensor or a list of hashable ids (e.g. "nq:12"),
    in any order (samples of one group need not be adjacent) -> (N,) float.

    A group whose rewards are all equal gets exactly 0 (no learning signal, and no 1e-6-scaled
    rounding noise). A group of ONE sample also gets 0: its unbiased std is 0/0 (undefined)
    and there is nothing to compare the sample with, so it should neither be reinforced nor
    punished. (veRL instead returns the raw reward for such a group; that is how a group-id bug
    in Search-R1 silently turned GRPO into plain REINFORCE. Make group ids unique per prompt.)
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if not torch.is_tensor(group_ids):
        index = {}
        group_ids = torch.tensor([index.setdefault(g, len(index)) for g in group_ids])
    if group_ids.shape != rewards.shape or rewards.dim() != 1:
        raise ValueError("group_advantages: rewards and group_ids must both be (N,); got "
                         f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    _, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()

    def per_group(reduce, values):                                # (N,) -> (G,)
        out = rewards.new_zeros(n_groups)
        return out.scatter_reduce(0, group, values, reduce=reduce, include_self=False)

    mean = per_group("sum", rewards) / counts
    centred = rewards - mean[group]
    var = per_group("sum", centred ** 2) / (counts - 1).clamp(min=1)
    tie = per_group("amax", rewards) == per_group("amin", rewards)   # includes groups of one
    adv = centred / (var.sqrt()[group] + 1e-6)
    return torch.where(tie[group], 0.0, adv)


def masked_sum(x, mask, dim=None):
    """Sum of x where mask != 0; NaN/inf where mask == 0 reach neither the value nor the grad.

    x, mask: same shape (mask bool or 0/1 float) -> scalar, or reduced over `dim`.
    """
    picked = torch.where(mask.bool(), x, 0.0)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x, mask, dim=None):
    """Mean of x over mask != 0 (NaN-safe like masked_sum); 0 where nothing is selected."""
    return masked_sum(x, mask, dim) / masked_sum(torch.ones_like(x), mask, dim).clamp(min=1)


def policy_loss(logp, old_logp, advantages, loss_mask, clip=0.2, agg="token-mean"):
    """PPO clipped surrogate on token ratios exp(logp - old_logp) (to be minimised).

    logp (B, T) with grad; old_logp (B, T) rollout-time log-probs; advantages (B,) or (B, T);
    loss_mask (B, T). agg: "token-mean" (mean over all loss-mask tokens of the batch) or
    "seq-mean-token-mean" (mean per response, then over responses that have model tokens).
    -> (loss, {"clip_ratio": fraction of tokens where the clipped term was active,
               "approx_kl": mean of old_logp - logp over loss-mask tokens})
    """
    if agg not in ("token-mean", "seq-mean-token-mean"):
        raise ValueError(f"policy_loss: agg must be 'token-mean' or 'seq-mean-token-mean', got {agg!r}")
    valid = loss_mask.bool()
    # Zero the log-ratio outside the mask before exp, so garbage there stays out of the grad.
    log_ratio = torch.where(valid, logp - old_logp.detach(), 0.0)   # (B, T)
    ratio = torch.exp(log_ratio)
    if advantages.dim() == 1:
        adv = advantages[:, None]
    else:
        adv = torch.where(valid, advantages, 0.0)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    per_token = torch.maximum(unclipped, clipped)                    # (B, T)
    if agg == "token-mean":
        loss = masked_mean(per_token, valid)
    else:
        has_tokens = valid.any(dim=1)
        loss = masked_mean(masked_mean(per_token, valid, dim=1), has_tokens)
    with torch.no_grad():
        stats = {"clip_ratio": masked_mean((clipped > unclipped).float(), valid).item(),
                 "approx_kl": masked_mean(-log_ratio, valid).item()}
    return loss, stats


def kl_k3(logp, ref_logp):
    """k3 ("low_var_kl") estimate of KL(pi || pi_ref) per token, clamped to [-10, 10].

    u = ref_logp - logp; kl = exp(u) - u - 1 (>= 0, unbiased, low variance). (B, T) -> (B, T).
    u is first clamped to [-20, 20]: the result there is clamped to 10 anyway, and this keeps
    exp() and inf - inf from producing inf/NaN.
    """
    u = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(u) - u - 1.0, -10.0, 10.0)


def entropy_from_logits(logits):
    """Token entropy H = -sum_v p_v log p_v from logits (B, T, V) -> (B, T).

    log_softmax (a logsumexp under the hood) keeps this stable for large logits; the result has
    the dtype of `logits` (pass float32 logits for an exact value).
    """
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# ---- Configuration -------------------------------------------------------------------------
# Every field becomes a flag (--llds-lambda, --no-llds, ...); its comment is the --help text.

@dataclass
class Config:
    name: str = "demo"                 # run folder is <out_dir>/<name>
    out_dir: str = "runs"              # parent folder of all runs
    seed: int = 0                      # seeds python, numpy, torch and the prompt order
    resume: bool = False               # continue <out_dir>/<name> from its last checkpoint
    model: str = ""                    # HF model folder or name; "" = embedded SmolLM2-135M-Instruct
    data: str = "toy_nq"               # training questions: "toy", a toy kind (toy_nq = single-hop), a .jsonl/.parquet file or a dataset folder
    eval_data: str = ""                # held-out questions; "" = the test split of --data
    corpus: str = ""                   # JSONL corpus of an in-process retriever; "" = the toy world's
    retriever: str = "bm25"            # "bm25", "dense" or a Search-R1 server URL http://host:port/retrieve
    index: str = ""                    # retriever index folder (built there when absent); "" = cache
    template: str = "fewshot"          # prompt: "fewshot" (small models) or "search-r1" (the paper's)
    max_turns: int = 2                 # search turns per episode in training (one answer-only turn follows)
    topk: int = 3                      # passages per search
    max_turn_tokens: int = 32          # sampled tokens per turn (paper: 500)
    max_obs_tokens: int = 200          # tokens per observation (paper: 500)
    max_prompt_tokens: int = 2048      # longer prompts are an error
    max_context: int = 4096            # prompt + turns + observations
    temperature: float = 0.7           # sampling temperature of the rollouts (log-probs use the same; paper: 1.0)
    top_p: float = 1.0                 # nucleus sampling of the rollouts; 1.0 = off
    steps: int = 6                     # training steps (one rollout batch each)
    prompts_per_step: int = 8          # questions per step
    group_size: int = 4                # rollouts per question (GRPO group, G)
    mini_batch_size: int = 16          # trajectories per optimizer step; < prompts x G gives several updates per step
    micro_batch_size: int = 4          # trajectories per forward/backward (gradient accumulation; 8 peaks near 8 GB on CPU)
    lr: float = 2e-5                   # AdamW learning rate (paper: 1e-6 for 3B over 1005 steps)
    warmup_ratio: float = 0.1          # linear warm-up over this fraction of the steps, then constant
    weight_decay: float = 0.01         # AdamW weight decay
    grad_clip: float = 1.0             # gradient-norm clip; a step with a non-finite norm is skipped
    clip_eps: float = 0.2              # PPO ratio clip
    kl_coef: float = 0.0               # k3 KL to the initial policy; 0 = no reference model is loaded
    entropy_coef: float = 0.0          # entropy bonus coefficient
    llds: bool = True                  # LLDS regulariser on; --no-llds = plain GRPO
    llds_lambda: float = 0.2           # LLDS coefficient (0 = plain GRPO)
    llds_gate: str = "action"          # LLDS gate: action, response or token
    llds_reduction: str = "token-mean"  # LLDS normaliser: token-mean (authors' code) or seq-mean (paper eq. 4)
    answer_weight: str = "1.0"         # LLDS-MA weight of the final answer span: a number, or "adaptive" = min(V/2, 1)
    displacement_every: int = 1        # measure correct-response displacement every N steps (one extra forward); 0 = never
    samples_per_step: int = 4          # trajectories saved as text per step in <run>/samples/
    spiral_window: int = 5             # warn when correct-response log-lik falls this many steps in a row
    spiral_grad_factor: float = 10.0   # warn when the grad norm exceeds this times its running median
    eval_every: int = 0                # held-out evaluation every N steps; 0 = only before and after training
    eval_size: int = 100               # held-out questions (fixed subset, greedy decoding); 0 = no evaluation
    eval_max_turns: int = 2            # search turns at evaluation (paper: 4)
    ckpt_every: int = 5                # checkpoint every N steps (and always at the end); 0 = only at the end
    keep_ckpts: int = 2                # checkpoints kept on disk (older ones are deleted)
    rollout_batch_size: int = 64       # episodes generated together
    device: str = "auto"               # auto (cuda if available), cuda or cpu
    bf16: bool = True                  # bf16 autocast (fp32 weights) where the device supports it
    grad_checkpointing: bool = False   # recompute activations in backward (GPU memory for long contexts)


# The paper's settings (Qwen2.5-3B, NQ+HotpotQA, E5 retriever server; section 4 of the LLDS paper).
PRESETS = {
    "paper": dict(
        model="Qwen/Qwen2.5-3B-Instruct", data="data/nq_hotpotqa_train/train.parquet",
        eval_data="data/nq_hotpotqa_train/test.parquet", retriever="http://127.0.0.1:8000/retrieve",
        template="search-r1", max_turns=3, topk=3, max_turn_tokens=500, max_obs_tokens=500,
        max_prompt_tokens=2048, max_context=4096, temperature=1.0, steps=1005,
        prompts_per_step=512, group_size=5, mini_batch_size=256, micro_batch_size=4, lr=1e-6,
        warmup_ratio=0.285, clip_eps=0.2, kl_coef=0.001, entropy_coef=0.001, llds_lambda=0.2,
        llds_gate="action", eval_every=50, eval_size=1000, eval_max_turns=4, ckpt_every=50,
        rollout_batch_size=128, grad_checkpointing=True),
}


def _field_help() -> dict[str, str]:
    """Config's one-line field comments, read from the source, as --help texts."""
    return dict(re.findall(r"^\s+(\w+): [^#\n]*#\s*(.+)$", inspect.getsource(Config), re.M))


def parse_args(argv=None) -> tuple[Config, str | None]:
    """Flags -> (Config, folder to plot or None). Explicit flags override the preset."""
    parser = argparse.ArgumentParser(
        description="GRPO + LLDS training of a Search-R1 agent. Defaults: the CPU demo "
                    "(SmolLM2-135M, toy world, BM25). --preset paper: the paper's settings.")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="start from a named preset")
    parser.add_argument("--plot", metavar="RUN_DIR", help="redraw RUN_DIR/curves.png from its metrics.jsonl and exit")
    helps = _field_help()
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        text = f"{helps[f.name]} (default: {f.default})"
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(flag, type=f.type, default=argparse.SUPPRESS, metavar=f.type.__name__.upper(), help=text)
    args = vars(parser.parse_args(argv))
    preset, plot = args.pop("preset", None), args.pop("plot", None)
    return Config(**{**PRESETS.get(preset, {}), **args}), plot


def check_config(cfg: Config) -> None:
    """Catch inconsistent settings before any model is loaded (ValueError with what to change)."""
    batch = cfg.prompts_per_step * cfg.group_size
    if min(cfg.steps, cfg.prompts_per_step, cfg.group_size, cfg.mini_batch_size, cfg.micro_batch_size) < 1:
        raise ValueError("steps, prompts-per-step, group-size, mini-batch-size and micro-batch-size must be >= 1")
    if cfg.group_size < 2:
        raise ValueError("group-size must be >= 2: GRPO compares the rollouts of one question")
    if batch % cfg.mini_batch_size:
        raise ValueError(f"mini-batch-size {cfg.mini_batch_size} must divide prompts-per-step x group-size = {batch}")
    if cfg.max_prompt_tokens >= cfg.max_context:
        raise ValueError(f"max-prompt-tokens {cfg.max_prompt_tokens} must be below max-context {cfg.max_context}")
    if cfg.llds_gate not in ("action", "response", "token"):
        raise ValueError(f"llds-gate must be action, response or token, not {cfg.llds_gate!r}")
    if cfg.llds_reduction not in ("token-mean", "seq-mean"):
        raise ValueError(f"llds-reduction must be token-mean or seq-mean, not {cfg.llds_reduction!r}")
    if cfg.answer_weight != "adaptive":
        try:
            float(cfg.answer_weight)
        except ValueError:
            raise ValueError(f"answer-weight must be a number or 'adaptive', not {cfg.answer_weight!r}") from None
    if cfg.device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, not {cfg.device!r}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no GPU; use --device cpu")


# ---- Helpers: data, log-probs, mini-batches ------------------------------------------------

class PromptSampler:
    """Endless prompts, reshuffled every epoch from the seed; (epoch, pos) is its whole state."""

    def __init__(self, records: list[dict], seed: int, epoch: int = 0, pos: int = 0):
        self.records, self.seed, self.epoch, self.pos = records, seed, epoch, pos

    def _order(self) -> list[int]:
        order = list(range(len(self.records)))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            order = self._order()
            take = order[self.pos:self.pos + n - len(out)]
            out += [self.records[i] for i in take]
            self.pos += len(take)
            if self.pos == len(order):
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on CUDA, and on CPUs with native bf16 (AVX512-BF16 / AMX); else a no-op."""
    ok = enabled and (torch.cuda.is_bf16_supported() if device.type == "cuda"
                      else torch.cpu._is_avx512_bf16_supported())
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=ok)


def _head_stats(lm_head, hidden, targets, temperature):
    # hidden (N, H), targets (N,) -> log p(target) (N,) and entropy (N,), float32.
    logits = lm_head(hidden).float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return logp, entropy_from_logits(logits)


def shared_prefix_len(input_ids, attention_mask) -> int:
    """Length of the leading columns every row has identical and attended (the few-shot prompt)."""
    same = ((input_ids == input_ids[:1]) & (attention_mask == 1)).all(0)            # (T,)
    return int(same.long().cumprod(0).sum())


def hidden_states(model, input_ids, attention_mask, share_prefix=True):
    """The last hidden states (B, T, H), running the prompt prefix all rows share only once.

    The few-shot prompt is ~60% of every CPU-demo trajectory. Its keys/values are computed for
    one row, expanded to all rows as a KV cache, and the rest runs on top: the same numbers as
    one plain forward (rows see the same keys/values) and the same gradients (the expansion sums
    them over rows). Measured on SmolLM2, 4 rows x 764 tokens, bf16 autocast, fwd+bwd: 6.9 s and
    3.5 GB peak RSS instead of 13.0 s and 4.7 GB. Gradient checkpointing disables HF's cache in
    training, so with it (GPU runs) every pass runs `share_prefix=False`: a plain forward. The
    caller picks the path from the config, never from grad mode: in bf16 the two paths differ
    by up to 0.36 nats/token, and old, reference and update log-probs must come from one path.
    """
    n, length = input_ids.shape
    p = min(shared_prefix_len(input_ids, attention_mask), length - 1)
    if not share_prefix or n == 1 or p < 16:
        return model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                use_cache=False).last_hidden_state
    first = model.base_model(input_ids=input_ids[:1, :p], attention_mask=attention_mask[:1, :p], use_cache=True)
    cache = first.past_key_values
    cache.batch_repeat_interleave(n)                  # (1, heads, p, d) -> (n, heads, p, d), differentiable
    positions = torch.arange(p, length, device=input_ids.device).expand(n, -1)
    rest = model.base_model(input_ids=input_ids[:, p:], attention_mask=attention_mask, past_key_values=cache,
                            position_ids=positions, use_cache=True).last_hidden_state  # (n, T - p, H)
    return torch.cat([first.last_hidden_state.expand(n, -1, -1), rest], dim=1)


def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature=1.0, share_prefix=True, chunk=1024):
    """log p(token_t | tokens_<t) and the entropy there, on loss-mask positions only.

    input_ids, attention_mask, loss_mask: (B, T) -> (logp, entropy): (B, T) float32, 0 elsewhere.
    The LM head runs on model tokens only (prompt and observations never need logits) and in
    chunks; with grad each chunk is checkpointed, so at most `chunk` x vocab logits are alive.
    """
    hidden = hidden_states(model, input_ids, attention_mask, share_prefix)  # (B, T, H)
    picked = loss_mask[:, 1:].bool()                  # (B, T-1): the next token is a model token
    h, targets = hidden[:, :-1][picked], input_ids[:, 1:][picked]          # (N, H), (N,)
    lm_head = model.get_output_embeddings()
    logps, entropies = [], []
    for start in range(0, len(targets), chunk):
        args = (lm_head, h[start:start + chunk], targets[start:start + chunk], temperature)
        lp, ent = (checkpoint(_head_stats, *args, use_reentrant=False) if torch.is_grad_enabled()
                   else _head_stats(*args))
        logps.append(lp)
        entropies.append(ent)

    def place(values):                                # (N,) -> (B, T), position t scores token t
        full = torch.zeros(picked.shape, dtype=torch.float32, device=h.device)
        return torch.nn.functional.pad(full.masked_scatter(picked, torch.cat(values)), (1, 0))

    if not logps:
        zeros = torch.zeros(input_ids.shape, device=input_ids.device)
        return zeros, zeros
    return place(logps), place(entropies)


def rows(batch: dict, idx: torch.Tensor, device) -> dict:
    """The trajectories `idx` of a batch of (N, T) tensors, cut to their longest real length."""
    length = int(batch["attention_mask"][idx].sum(1).max())
    return {k: v[idx, :length].to(device) if v.dim() == 2 else v[idx].to(device) for k, v in batch.items()}


def update_plan(n: int, cfg: Config) -> list[list[torch.Tensor]]:
    """Shuffle n trajectories into mini-batches, each a list of micro-batch index tensors.

    Drawn from the torch RNG before the old log-probs are computed, and reused for them: every
    forward of the first mini-batch then sees exactly the rows and shapes the old pass saw, so
    ratio == 1 and the LLDS displacement == 0 there bit for bit, not up to rounding noise.
    """
    perm = torch.randperm(n)
    return [list(mb.split(cfg.micro_batch_size)) for mb in perm.split(cfg.mini_batch_size)]


@torch.no_grad()
def plan_logprobs(model, batch, plan, cfg, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of all trajectories, micro-batch by micro-batch as in `plan`.

    -> (logp, entropy): (N, T) float32 on the CPU, aligned with batch["input_ids"].
    """
    n, t = batch["input_ids"].shape
    logp, ent = torch.zeros(n, t), torch.zeros(n, t)
    for micro in (mu for mb in plan for mu in mb):
        r = rows(batch, micro, device)
        with autocast(device, cfg.bf16):
            lp, e = token_logprobs(model, r["input_ids"], r["attention_mask"], r["loss_mask"], cfg.temperature,
                                   share_prefix=not cfg.grad_checkpointing)
        logp[micro, :lp.shape[1]], ent[micro, :e.shape[1]] = lp.cpu(), e.cpu()
    return logp, ent


def preserving(adv: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(N,) bool: responses LLDS protects (advantage >= 0 and at least one model token)."""
    return (adv >= 0) & (loss_mask.sum(1) > 0)


def answer_weight(cfg: Config, episodes: list[dict]) -> float:
    """LLDS-MA beta: fixed, or the paper's min(V/2, 1) with V = mean valid searches per episode."""
    if cfg.answer_weight != "adaptive":
        return float(cfg.answer_weight)
    return min(statistics.fmean(e["n_search"] for e in episodes) / 2, 1.0)


# ---- The update: mini-batches, micro-batches, one AdamW step each --------------------------

def update(model, optimizer, batch, plan, cfg, beta, device, counters) -> dict:
    """All optimizer steps of one training step. batch: (N, T) tensors incl. old_logp,
    ref_logp (or None), advantages (N,). -> mean stats over micro-batches (token-weighted)."""
    use_llds = cfg.llds and cfg.llds_lambda > 0
    totals, weights, norms = {}, {}, []

    def add(name, value, w):                          # token-weighted running means for the log
        totals[name] = totals.get(name, 0.0) + value * w
        weights[name] = weights.get(name, 0.0) + w

    model.train()  # no dropout in these models; needed for gradient checkpointing to engage
    for mini in plan:
        optimizer.zero_grad(set_to_none=True)
        idx = torch.cat(mini)
        # The mini-batch loss is a token-mean over the whole mini-batch, so each micro-batch's
        # mean is weighted by its share of tokens (of preserving responses for LLDS seq-mean).
        mini_tokens = batch["loss_mask"][idx].sum().clamp(min=1)
        mini_preserving = preserving(batch["advantages"][idx], batch["loss_mask"][idx]).sum().clamp(min=1)
        for micro in mini:
            r = rows(batch, micro, device)
            mask, adv = r["loss_mask"], r["advantages"]
            w_tok = float(mask.sum() / mini_tokens)
            with autocast(device, cfg.bf16):
                logp, entropy = token_logprobs(model, r["input_ids"], r["attention_mask"], mask, cfg.temperature,
                                               share_prefix=not cfg.grad_checkpointing)
            pg, pg_stats = policy_loss(logp, r["old_logp"], adv, mask, clip=cfg.clip_eps)
            ent = masked_mean(entropy, mask)
            loss = (pg - cfg.entropy_coef * ent) * w_tok
            if r.get("ref_logp") is not None:
                kl = masked_mean(kl_k3(logp, r["ref_logp"]), mask)
                loss = loss + cfg.kl_coef * kl * w_tok
                add("kl", kl.item(), w_tok)
            ll, ll_stats = llds_loss(logp, r["old_logp"], adv, mask, gate=cfg.llds_gate,
                                     answer_mask=r["answer_mask"], answer_weight=beta,
                                     reduction=cfg.llds_reduction)
            w_llds = w_tok if cfg.llds_reduction == "token-mean" else float(
                preserving(adv, mask).sum() / mini_preserving)
            if use_llds:
                loss = loss + cfg.llds_lambda * ll * w_llds
            loss.backward()
            add("pg_loss", pg.item(), w_tok)
            add("clip_ratio", pg_stats["clip_ratio"], w_tok)
            add("ppo_kl", pg_stats["approx_kl"], w_tok)
            add("llds/loss", ll.item(), w_llds)        # logged even when off: what it would be
            for k in ("llds/active_token_frac", "llds/active_action_frac"):
                add(k, ll_stats[k], w_tok)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        norms.append(norm)
        if math.isfinite(norm):
            optimizer.step()
        else:  # clip_grad_norm_ cannot repair inf/NaN; stepping would poison the weights
            counters["skipped_steps"] += 1
    optimizer.zero_grad(set_to_none=True)            # free the gradients' memory for the rollout
    model.eval()
    stats = {k: totals[k] / weights[k] for k in totals if weights[k] > 0}
    finite = [x for x in norms if math.isfinite(x)]
    stats["grad_norm"] = statistics.fmean(finite) if finite else float("nan")
    # A non-finite norm must win the max (max([1.0, nan]) is 1.0): the monitor checks it.
    stats["grad_norm_max"] = max(norms, key=lambda x: x if math.isfinite(x) else math.inf)
    stats["grad_norm_nonfinite"] = len(norms) - len(finite)
    return stats


# ---- LLD monitor ---------------------------------------------------------------------------

def shared_first_search(episodes: list[dict], correct: torch.Tensor, group_ids: torch.Tensor) -> float | None:
    """Fraction of (correct, incorrect) response pairs of one group whose first search query is
    the same (lower-cased, whitespace collapsed); None when no group has both kinds.

    The paper's mechanism: an incorrect response that shares its first search, and so the
    retrieved documents, with a correct one shares a prefix of its context, and pushing the
    incorrect one down drags the correct one's likelihood with it.
    """
    first = [" ".join(e["queries"][0].lower().split()) if e["queries"] else None for e in episodes]
    pairs = [(i, j) for i in range(len(first)) for j in range(len(first))
             if group_ids[i] == group_ids[j] and correct[i] and not correct[j]]
    if not pairs:
        return None
    return sum(first[i] is not None and first[i] == first[j] for i, j in pairs) / len(pairs)


def rollout_stats(ro_out, old_logp, rewards, group_ids) -> dict:
    """Per-step rollout numbers: reward, searches, valid actions, correct/incorrect likelihood.

    lld/logp_correct (incorrect): mean over correct (incorrect) responses of the mean token
    log-likelihood of the response's model tokens under the rollout policy.
    """
    eps, mask = ro_out.episodes, ro_out.loss_mask
    n_actions = action_ids(mask).amax(dim=1)                        # (N,) model turns
    per_response = masked_mean(old_logp, mask, dim=1)               # (N,)
    correct = rewards > 0
    has_tokens = mask.sum(1) > 0

    def mean_or_none(x, sel):
        return x[sel].mean().item() if sel.any() else None

    return {
        "reward": rewards.mean().item(),
        "em": statistics.fmean(e["em"] for e in eps),
        "f1": statistics.fmean(e["f1"] for e in eps),
        "response_length": mask.sum(1).mean().item(),
        "searches": statistics.fmean(e["n_search"] for e in eps),
        "valid_action_ratio": sum(e["n_valid"] for e in eps) / max(int(n_actions.sum()), 1),
        "finished": statistics.fmean(float(e["finished"]) for e in eps),
        "lld/logp_correct": mean_or_none(per_response, correct & has_tokens),
        "lld/logp_incorrect": mean_or_none(per_response, ~correct & has_tokens),
        "lld/shared_first_search": shared_first_search(eps, correct, group_ids),
        # sampling-time vs recomputed log-probs (KV-cache decode vs full forward, bf16 rounding)
        "rollout/logp_diff": masked_mean((ro_out.logp - old_logp).abs(), mask).item(),
    }


@torch.no_grad()
def displacement(model, batch, plan, correct, old_logp, cfg, device) -> dict:
    """Likelihood displacement of the correct responses caused by this step's updates: summed
    log-prob after minus before (the rollout policy), one extra no-grad forward.

    "After" is recomputed in the very micro-batches of `plan` that computed `old_logp` (same
    rows, same padding, same path), so with unchanged weights every sum is exactly 0; regrouping
    the rows changes prefix and padding, which in bf16 alone moved sums by up to 0.32 nats.
    correct (N,) bool.
    """
    micros = [mu for mb in plan for mu in mb if correct[mu].any()]
    if not micros:
        return {"lld/displacement_correct": None, "lld/frac_correct_fell": None}
    after, _ = plan_logprobs(model, batch, [micros], cfg, device)
    idx = torch.nonzero(correct).flatten()
    delta = masked_sum(after[idx] - old_logp[idx], batch["loss_mask"][idx], dim=1)    # (C,)
    return {"lld/displacement_correct": delta.mean().item(),
            "lld/frac_correct_fell": (delta < 0).float().mean().item()}


class SpiralMonitor:
    """Warns when the death-spiral pattern shows: the log-likelihood of correct responses falls
    `window` steps in a row (phase II of the paper's figure 2), or the gradient norm jumps above
    `factor` x its running median (phase III)."""

    def __init__(self, window: int, factor: float, history: dict | None = None):
        self.window, self.factor = window, factor
        self.history = history or {"logp_correct": [], "grad_norm": []}

    def check(self, step: int, metrics: dict) -> list[str]:
        warnings, logp, norms = [], self.history["logp_correct"], self.history["grad_norm"]
        if metrics.get("lld/logp_correct") is not None:
            logp.append(metrics["lld/logp_correct"])
            recent = logp[-(self.window + 1):]
            if len(recent) == self.window + 1 and all(b < a for a, b in zip(recent, recent[1:])):
                warnings.append(
                    f"step {step}: mean log-likelihood of correct responses fell {self.window} steps "
                    f"in a row ({recent[0]:.3f} -> {recent[-1]:.3f}); lazy likelihood displacement, "
                    "the first sign of a GRPO collapse (keep LLDS on, or raise --llds-lambda)")
        norm = metrics.get("grad_norm_max")
        if norm is not None:
            if not math.isfinite(norm):
                warnings.append(f"step {step}: gradient norm {norm}; the update was skipped (skipped_steps)")
            elif len(norms) >= 5 and norm > self.factor * statistics.median(norms[-50:]):
                warnings.append(
                    f"step {step}: gradient norm {norm:.3g} is above {self.factor:g} x its running median "
                    f"{statistics.median(norms[-50:]):.3g}; with rising entropy this is the collapse phase")
            if math.isfinite(norm):
                norms.append(norm)
        return warnings


def write_samples(path: Path, records: list[dict], episodes: list[dict], n: int) -> None:
    """A few full trajectories as readable text: half correct (when there are), half not."""
    correct = [i for i, e in enumerate(episodes) if e["reward"] > 0]
    wrong = [i for i, e in enumerate(episodes) if e["reward"] <= 0]
    chosen = correct[:n // 2]
    chosen += wrong[:n - len(chosen)]
    chosen += correct[len(correct[:n // 2]):][:n - len(chosen)]
    blocks = []
    for i in sorted(chosen):
        e = episodes[i]
        blocks.append(f"=== trajectory {i}  reward {e['reward']:.0f}  searches {e['n_search']}  "
                      f"answer {e['answer']!r}  golds {e['golds']}\nQuestion: {records[i]['question']}\n"
                      f"{e['text']}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(blocks))


def _clean(metrics: dict) -> dict:
    """JSON-safe: non-finite floats become null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


def log_metrics(run_dir: Path, metrics: dict) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(_clean(metrics)) + "\n")


# ---- Evaluation ----------------------------------------------------------------------------

def heldout_set(cfg: Config) -> list[dict]:
    """The fixed held-out subset: eval_size questions drawn with seed 0 (the same for every run)."""
    source = cfg.eval_data or cfg.data
    records = data.load_questions(source, split="test")
    random.Random(0).shuffle(records)
    return records[:cfg.eval_size]


def run_eval(model, tokenizer, records, retriever, cfg: Config) -> dict:
    """Greedy held-out scores through eval.py (the numbers of `python eval.py`, mode "search").
    eval/em is the macro average over data sources, as in the paper's tables."""
    rcfg = rollout_config(cfg, greedy=True, max_turns=cfg.eval_max_turns)
    rng = torch.get_rng_state()                   # greedy needs no randomness; keep the stream intact
    scores = evaluation.evaluate(model, tokenizer, records, retriever, "search", rcfg, progress=True)
    torch.set_rng_state(rng)
    release_memory()
    return {"eval/em": scores["all"]["em"], "eval/f1": scores["all"]["f1"],
            "eval/em_micro": statistics.fmean(e["em"] for e in scores["examples"]),
            "eval/searches": scores["all"]["searches"], "timing/eval": scores["seconds"]}


def rollout_config(cfg: Config, **overrides) -> ro.RolloutConfig:
    fields = {f.name for f in dataclasses.fields(ro.RolloutConfig)}
    values = {k: v for k, v in dataclasses.asdict(cfg).items() if k in fields}
    values["batch_size"] = cfg.rollout_batch_size
    return ro.RolloutConfig(**{**values, **overrides})


# ---- Checkpoints: atomic, resumable --------------------------------------------------------

def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, state: dict, keep: int) -> Path:
    """<run>/ckpt-<step>/: HF model + tokenizer, optimizer, RNG states, state.json (step, data
    position, counters, monitor history). Written into a temp folder and renamed, then the
    `latest` pointer is replaced: a kill at any moment leaves the previous checkpoint intact."""
    final = run_dir / f"ckpt-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-ckpt-", dir=run_dir))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}))
        if final.exists():                            # the same step saved again after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_atomic(run_dir / "latest", final.name)
    for old in sorted(run_dir.glob("ckpt-*"), key=lambda p: int(p.name.split("-")[1]))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names; if that is missing, the highest complete ckpt-<step>."""
    pointer = run_dir / "latest"
    if pointer.exists() and (run_dir / pointer.read_text().strip() / "state.json").exists():
        return run_dir / pointer.read_text().strip()
    done = [p for p in run_dir.glob("ckpt-*") if (p / "state.json").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore weights, optimizer and RNG states in place; returns state.json."""
    saved = type(model).from_pretrained(path, dtype=torch.float32)
    model.load_state_dict(saved.state_dict())
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / "state.json").read_text())


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop log lines of steps after `step` (written by a run killed after its checkpoint)."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        lines = [l for l in path.read_text().splitlines() if l and json.loads(l)["step"] <= step]
        _write_atomic(path, "".join(l + "\n" for l in lines))


# ---- The training loop ---------------------------------------------------------------------

def make_reference(model, device, cfg: Config):
    """The frozen initial policy of the k3 KL term; None when kl_coef == 0 (as in the CPU demo,
    where a second copy of the model would cost memory and a forward pass for nothing).

    It runs as the policy does (same autocast, same log-prob path), so on CPU, where it is an
    exact fp32 copy, KL is exactly 0 until the first update. On CUDA its weights are stored in
    bf16 (3B in fp32 would be 12 GB more), which leaves a small KL at step 1 from the bf16
    embeddings and norm weights; the buffers stay fp32 (RoPE's inv_freq in bf16 is 0.37% off).
    """
    if cfg.kl_coef <= 0:
        return None
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    if device.type == "cuda" and cfg.bf16:
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16)
    return ref.to(device)


def setup(cfg: Config, model=None, tokenizer=None):
    """Everything a run needs; user errors (paths, flags, servers) raise ValueError / SystemExit."""
    check_config(cfg)
    limit_heap_fragmentation()
    device = torch.device("cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    run_dir = Path(cfg.out_dir) / cfg.name
    if run_dir.exists() and not cfg.resume and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} already exists: pass --resume to continue it, or --name for a new run")
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob(".tmp-ckpt-*"):        # left by a run killed while checkpointing
        shutil.rmtree(stale, ignore_errors=True)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    corpus = cfg.corpus or None
    if corpus is None and not cfg.retriever.startswith(("http://", "https://")):
        if not data.is_toy(cfg.data):
            raise ValueError(f"the {cfg.retriever} retriever needs --corpus (a JSONL of passages) "
                             "for your own data, or a server URL as --retriever")
        corpus = str(data.toy_world() / "corpus.jsonl")
    train_records = data.load_questions(cfg.data, split="train")
    eval_records = heldout_set(cfg)
    retriever = retrieval.open_retriever(cfg.retriever, corpus=corpus, index=cfg.index or None)

    if model is None:
        model, tokenizer = ro.load_policy(cfg.model or None)
    ref = make_reference(model, device, cfg)          # before a resume loads newer weights
    model.to(device)
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return device, run_dir, train_records, eval_records, retriever, model, tokenizer, ref, optimizer


def peak_memory_gb(device: torch.device) -> float | None:
    """Peak memory so far: allocated GPU memory on CUDA, the process's peak RSS on Linux/macOS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
    except ImportError:                               # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)


def _glibc():
    """The C library when it is glibc (Linux), else None: the two memory helpers below."""
    try:
        libc = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
    except OSError:                                   # e.g. musl
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def limit_heap_fragmentation() -> None:
    """Serve allocations of 4 MiB and more (activations, KV caches) by mmap, which returns them
    to the OS when freed, instead of glibc's heap, whose free holes the varying shapes of each
    step cannot reuse. Same as MALLOC_MMAP_THRESHOLD_=4194304. Measured on the CPU demo, 4
    steps: peak RSS after step 4 7.25 -> 6.43 GiB, and step 4 took 81 s instead of 112 s."""
    libc = _glibc()
    if libc is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:   # the user's setting wins
        libc.mallopt(-3, 4 << 20)                     # -3 = M_MMAP_THRESHOLD


def release_memory() -> None:
    """Hand memory freed by the last phase (rollout, update, evaluation) back to the OS; glibc
    keeps freed heap blocks otherwise. Lowered the CPU demo's peak RSS from 9.7 to 7.7 GiB."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def train_step(step, cfg, model, tokenizer, ref, optimizer, sampler, retriever, device, counters, run_dir):
    """One GRPO(+LLDS) step: rollouts, advantages, old/ref log-probs, mini-batch updates."""
    t_step = time.perf_counter()
    warmup = max(1, round(cfg.warmup_ratio * cfg.steps))
    lr = cfg.lr * min(1.0, step / warmup)
    for group in optimizer.param_groups:
        group["lr"] = lr

    # 1. G rollouts per prompt; the group id is the prompt's slot in this step, so it is unique
    #    per prompt even if one question is drawn twice (epoch boundary).
    prompts = sampler.next(cfg.prompts_per_step)
    records = [r for r in prompts for _ in range(cfg.group_size)]
    group_ids = torch.arange(len(prompts)).repeat_interleave(cfg.group_size)
    t = time.perf_counter()
    out = ro.rollout(model, tokenizer, records, retriever, rollout_config(cfg))
    t_rollout = time.perf_counter() - t
    release_memory()

    # 2. Rewards (exact match, on the last model token in the paper; one number per episode here).
    rewards = torch.tensor([e["reward"] for e in out.episodes], dtype=torch.float32)   # (N,)
    batch = {"input_ids": out.input_ids, "attention_mask": out.attention_mask,
             "loss_mask": out.loss_mask, "answer_mask": out.answer_mask,
             "advantages": group_advantages(rewards, group_ids)}

    # 3. Old (rollout-policy) and reference log-probs, in the micro-batches the update will use.
    t = time.perf_counter()
    plan = update_plan(len(records), cfg)
    batch["old_logp"], old_entropy = plan_logprobs(model, batch, plan, cfg, device)
    if ref is not None:
        batch["ref_logp"] = plan_logprobs(ref, batch, plan, cfg, device)[0]
    t_logprob = time.perf_counter() - t

    # 4. len(plan) optimizer steps (mini-batches); LLDS is identically 0 if there is only one.
    t = time.perf_counter()
    beta = answer_weight(cfg, out.episodes)
    stats = update(model, optimizer, batch, plan, cfg, beta, device, counters)
    t_update = time.perf_counter() - t
    release_memory()

    metrics = {"step": step, "lr": lr, **rollout_stats(out, batch["old_logp"], rewards, group_ids), "kl": None,
               **stats, "entropy": masked_mean(old_entropy, out.loss_mask).item(),
               "skipped_steps": counters["skipped_steps"], "llds/answer_weight": beta,
               "lld/displacement_correct": None, "lld/frac_correct_fell": None}
    if cfg.displacement_every and step % cfg.displacement_every == 0:
        t = time.perf_counter()
        metrics.update(displacement(model, batch, plan, rewards > 0, batch["old_logp"], cfg, device))
        t_logprob += time.perf_counter() - t
    metrics.update({"timing/rollout": t_rollout, "timing/retrieval": out.timing["retrieval"],
                    "timing/logprob": t_logprob, "timing/update": t_update,
                    "timing/step": time.perf_counter() - t_step,
                    "rollout_tokens_per_s": out.n_generated / max(out.timing["generate"], 1e-9)})
    if cfg.samples_per_step:
        write_samples(run_dir / "samples" / f"step_{step:04d}.txt", records, out.episodes, cfg.samples_per_step)
    return metrics


def train(cfg: Config, model=None, tokenizer=None) -> dict:
    """Train (or resume) the run <out_dir>/<name>; model/tokenizer may be injected (tests).

    -> {"before": eval metrics at step 0, "after": at the end, "last": the last step's metrics}
    """
    device, run_dir, train_records, eval_records, retriever, model, tokenizer, ref, optimizer = \
        setup(cfg, model, tokenizer)
    sampler = PromptSampler(train_records, cfg.seed)
    counters, evals, start = {"skipped_steps": 0}, {}, 0
    monitor = SpiralMonitor(cfg.spiral_window, cfg.spiral_grad_factor)
    ckpt = find_checkpoint(run_dir) if cfg.resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, optimizer)
        start, counters, evals = state["step"], state["counters"], state["evals"]
        sampler = PromptSampler(train_records, cfg.seed, **state["sampler"])
        monitor.history = state["monitor"]
        truncate_metrics(run_dir, start)
        print(f"resumed from {ckpt} (step {start})")
    elif cfg.resume:
        print(f"--resume: no checkpoint in {run_dir}, starting from step 0")
        truncate_metrics(run_dir, -1)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))

    print(f"device {device}, bf16 autocast {bool(autocast(device, cfg.bf16)._enabled)}; "
          f"{cfg.prompts_per_step} prompts x {cfg.group_size} rollouts, "
          f"{cfg.prompts_per_step * cfg.group_size // cfg.mini_batch_size} optimizer steps per step; "
          f"LLDS {'lambda %g, %s gate' % (cfg.llds_lambda, cfg.llds_gate) if cfg.llds and cfg.llds_lambda else 'off'}; "
          f"eval: {len(eval_records)} held-out questions, greedy, {cfg.eval_max_turns} search turns, "
          f"retriever {cfg.retriever} top-{cfg.topk}")
    if start == 0 and eval_records:
        evals["before"] = run_eval(model, tokenizer, eval_records, retriever, cfg)
        log_metrics(run_dir, {"step": 0, **evals["before"]})
        print(f"held-out EM before training: {evals['before']['eval/em']:.3f}")

    metrics = {}
    bar = tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, desc="train", unit="step")
    for step in bar:
        metrics = train_step(step, cfg, model, tokenizer, ref, optimizer, sampler, retriever,
                             device, counters, run_dir)
        warnings = monitor.check(step, metrics)
        for text in warnings:
            tqdm.write("LLD WARNING " + text)
        metrics["lld/warning"] = int(bool(warnings))
        if eval_records and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            metrics.update(run_eval(model, tokenizer, eval_records, retriever, cfg))
            evals["after" if step == cfg.steps else f"step {step}"] = {k: v for k, v in metrics.items()
                                                                      if k.startswith("eval/")}
        metrics["memory/peak_gb"] = peak_memory_gb(device)   # so far, evaluation included
        log_metrics(run_dir, metrics)
        bar.set_postfix(_postfix(metrics))
        if step == cfg.steps or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
            save_checkpoint(run_dir, step, model, tokenizer, optimizer, keep=cfg.keep_ckpts, state={
                "sampler": sampler.state(), "counters": counters, "evals": evals,
                "monitor": monitor.history})
    bar.close()
    plot_run(run_dir)
    summary = {"before": evals.get("before"), "after": evals.get("after"), "last": metrics,
               "peak_memory_gb": peak_memory_gb(device)}
    print(summarize(run_dir, summary))
    return summary


def _postfix(m: dict) -> dict:
    def fmt(v):
        return "-" if v is None else f"{v:.3g}"
    return {"reward": fmt(m["reward"]), "logp_c": fmt(m["lld/logp_correct"]),
            "disp_c": fmt(m["lld/displacement_correct"]), "gnorm": fmt(m["grad_norm"]),
            "llds": fmt(m["llds/loss"]), "ent": fmt(m["entropy"]), "search": fmt(m["searches"])}


def summarize(run_dir: Path, summary: dict) -> str:
    """Final report: EM before/after, where the time went, peak memory."""
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l]
    steps = [l for l in lines if "reward" in l]
    parts = ["rollout", "logprob", "update"]
    total = {p: sum(l[f"timing/{p}"] for l in steps) for p in parts + ["step"]}
    text = [f"run {run_dir}: {len(steps)} steps logged, curves in {run_dir / 'curves.png'}"]
    if summary["before"] and summary["after"]:
        text.append(f"held-out EM: before {summary['before']['eval/em']:.3f} -> after "
                    f"{summary['after']['eval/em']:.3f}")
    if total["step"] > 0:
        text.append("step time: " + ", ".join(f"{p} {total[p] / total['step']:.0%}" for p in parts)
                    + f" of {total['step'] / len(steps):.1f} s/step")
    if summary.get("peak_memory_gb"):
        text.append(f"peak memory {summary['peak_memory_gb']:.2f} GB (allocated on a GPU, process RSS on a CPU)")
    return "\n".join(text)


# ---- Curves --------------------------------------------------------------------------------

PANELS = [("reward (eval/em: held-out EM)", ["reward", "eval/em"]),
          ("mean token log-lik under rollout policy", ["lld/logp_correct", "lld/logp_incorrect"]),
          ("displacement of correct responses", ["lld/displacement_correct"]),
          ("grad norm", ["grad_norm"]),
          ("entropy", ["entropy"]),
          ("searches per episode", ["searches"])]


def plot_run(run_dir) -> Path:
    """Draw <run>/curves.png from <run>/metrics.jsonl (also works on a finished or killed run)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} not found; pass the folder of a run (e.g. runs/demo)")
    lines = [json.loads(l) for l in path.read_text().splitlines() if l]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            points = [(l["step"], l[key]) for l in lines if l.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=key)
        if title == "grad norm":
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{run_dir.name}: GRPO + LLDS training curves")
    fig.tight_layout()
    fig.savefig(run_dir / "curves.png", dpi=100)
    plt.close(fig)
    return run_dir / "curves.png"


def main(argv=None) -> None:
    cfg, plot = parse_args(argv)
    if plot:
        print(plot_run(plot))
        return
    try:
        train(cfg)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
