"""train.py: GRPO + LLDS training of a search agent, with a monitor for the LLD death spiral.

Read top to bottom: the configuration, the GRPO objective, log-probs, ONE training step, the
monitor, the loop. `python train.py` trains the embedded SmolLM2-135M-Instruct on the toy world
with an in-process BM25 on a CPU; `--preset paper` is the paper's setting on one GPU.

How it maps to the papers. Search-R1 (Jin et al., arXiv 2503.09516) is the environment (rollout.py:
<search> turns, retrieved <information> as forced tokens with loss mask 0, exact-match reward);
Deng et al. (arXiv 2512.04220) train it with GRPO and LLDS (llds.py), one veRL step numbered as in
train_step: 1. `group_size` rollouts per question (tied groups redrawn); 2. rewards, group-relative
advantages; 3. old log-probs (the rollout policy) of every row, reference ones when kl_coef > 0;
4. one AdamW step per mini-batch: clipped surrogate - entropy bonus + k3 KL + lambda LLDS
(with one update per rollout batch LLDS is 0); 5. the LLD monitor, and its warning (monitor.py).

Simplified on purpose: one process, one device, no vLLM (rollout.py samples with the training
model's own KV cache); fp32 master weights under bf16 autocast (bf16 weights would round away
updates of lr 1e-6); warm-up then a constant learning rate; log-probs are lm_head(hidden), which
fits Llama, Qwen and SmolLM. Run folders, logs, plots and speed-ups are in plumbing/.
"""
import collections
import dataclasses
import functools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import data
import monitor
import retriever
import rollout
from eval import heldout_eval
from llds import GATES, REDUCTIONS, action_ids, answer_weight, llds_loss, preserving_responses
from plumbing import checkpoints, fast_hf, memory, memory_plan, run_log, runs, token_view
from plumbing.cli import check_config, flag, parse_train_args
from plumbing.dynamic_sampling import replace_rows
from plumbing.minibatches import verl_order
from plumbing.models import (AdapterOff, frozen_in_bf16, load_policy, place_for_training,
                              reference_copy, with_lora)
from plumbing.plots import plot_runs
from plumbing.presets import PRESETS
from plumbing.sampler import PromptSampler
from plumbing.summary import final_report

# ---- Configuration -------------------------------------------------------------------------
# Every field is a flag (--llds-lambda, --no-llds, ...): its help text, then what it accepts.

@dataclass
class Config:
    # the run
    name: str = flag("", "run folder <out-dir>/<name>; '' = demo, demo-2, ... (a new one)", "any")
    out_dir: str = flag("runs", "parent folder of all runs", "text")
    seed: int = flag(0, "seeds python, numpy, torch and the prompt order", "0..4294967295")
    resume: bool = flag(False, "continue <out-dir>/<name> from its last checkpoint")
    model: str = flag("", "HF model folder or name; '' = embedded SmolLM2-135M-Instruct", "any")
    device: str = flag("auto", "auto (cuda if available), cuda or cpu", "choice")
    bf16: bool = flag(True, "bf16 autocast (fp32 weights) where the device has bf16 units")
    grad_checkpointing: bool = flag(False, "recompute activations in backward (GPU memory)")
    lora_rank: int = flag(0, "LoRA (peft) rank on every attention and MLP linear layer; 0 = full "
                          "fine-tuning. LoRA wants about 10x full fine-tuning's --lr: its "
                          "update starts at 0 and lives in a rank-R subspace", ">= 0")
    lora_alpha: float = flag(32.0, "LoRA's alpha: the adapter's update is scaled by alpha / rank",
                             "> 0")
    # data and search
    data: str = flag("toy_nq", "questions: a toy kind, a .jsonl/.parquet file or a folder", "any")
    eval_data: str = flag("", "held-out questions; '' = the test split of --data", "any")
    corpus: str = flag("", "JSONL corpus of an in-process retriever; '' = the toy world's", "file")
    retriever: str = flag("bm25", "bm25, dense or a server http://host:port/retrieve", "any")
    index: str = flag("", "retriever index folder (built there when absent); '' = cache", "any")
    retriever_timeout: float = flag(30.0, "a server's seconds per request, + 0.1 s a query", "> 0")
    # the episode (rollout.py)
    template: str = flag("fewshot", "prompt: 'fewshot' (small models) or 'search-r1'", "choice")
    max_turns: int = flag(2, "search turns per episode (one answer-only turn follows)", ">= 0")
    topk: int = flag(1, "passages per search (paper: 3)", ">= 0")
    max_turn_tokens: int = flag(32, "sampled tokens per turn (paper: 500)", ">= 1")
    max_obs_tokens: int = flag(200, "tokens per observation (paper: 500)", ">= 1")
    max_prompt_tokens: int = flag(2048, "longer prompts are dropped at load", ">= 1")
    on_long_prompt: str = flag("drop", "a prompt over the limit: 'drop' or 'error'", "choice")
    max_context: int = flag(4096, "prompt + turns + observations", ">= 2")
    temperature: float = flag(0.7, "sampling temperature, log-probs too (paper: 1.0)", "> 0")
    top_p: float = flag(1.0, "nucleus sampling of the rollouts; 1.0 = off", "> 0, <= 1")
    rollout_batch_size: int = flag(100, "episodes generated together", ">= 1")
    # GRPO
    steps: int = flag(6, "training steps (one rollout batch each)", ">= 1")
    prompts_per_step: int = flag(8, "questions per step", ">= 1")
    group_size: int = flag(8, "rollouts per question: the GRPO group G (paper: 5)", ">= 2")
    drop_tied_groups: int = flag(1, "rounds of redrawing groups whose rewards tie; 0 = off", ">= 0")
    mini_batch_size: int = flag(32, "episodes per update (one AdamW step)", ">= 1")
    micro_batch_size: int = flag(4, "episodes per forward/backward", ">= 1")
    verl_minibatches: bool = flag(False, "mini-batches in the authors' order (plumbing/"
                                  "minibatches.py), not shuffled; on in --preset paper")
    lr: float = flag(5e-5, "AdamW learning rate (paper: 1e-6)", ">= 0")
    warmup_ratio: float = flag(0.1, "linear warm-up over this fraction of the steps", "0..1")
    warmup_from_zero: bool = flag(False, "step s at lr x (s - 1) / warm-up steps, not s / warm-up "
                                  "steps, as the authors' (their first step at lr 0); on in "
                                  "--preset paper")
    weight_decay: float = flag(0.01, "AdamW weight decay", ">= 0")
    grad_clip: float = flag(1.0, "gradient-norm clip; a non-finite norm skips the update", "> 0")
    clip_eps: float = flag(0.2, "PPO ratio clip", "> 0")
    kl_coef: float = flag(0.0, "k3 KL to the initial policy; 0 = no reference model", ">= 0")
    entropy_coef: float = flag(0.0, "entropy bonus coefficient", ">= 0")
    # LLDS
    llds: bool = flag(True, "the LLDS regulariser; --no-llds = plain GRPO")
    llds_lambda: float = flag(0.2, "LLDS coefficient lambda", ">= 0")
    llds_gate: str = flag("action", "LLDS gate: action, response or token", "choice")
    llds_reduction: str = flag("token-mean", "mini-batch token-mean, or seq-mean (eq. 4)", "choice")
    answer_coef: float = flag(math.inf, "LLDS-MA: the answer span's coefficient, capped at lambda; "
                              "inf = off (the authors' script: off, its coefficient 0.2)", "any")
    answer_adaptive: bool = flag(False, "LLDS-MA: that x max(V - 1, 0), V: mean valid searches "
                                 "(with inf: 0 while V <= 1, else lambda)")
    # monitoring, evaluation, checkpoints
    displacement_every: int = flag(1, "correct responses' displacement every N steps", ">= 0")
    token_view_every: int = flag(10, "<run>/views/step_N.html every N steps and the last", ">= 0")
    samples_per_step: int = flag(4, "episodes saved per step in <run>/samples/", ">= 0")
    spiral_warning: bool = flag(True, f"warn (lld/warning) at each step where {monitor.RULE_TEXT};"
                                f" {monitor.RULE_RECORD} (monitor.py)")
    eval_every: int = flag(0, "held-out EM every N steps; 0 = before and after only", ">= 0")
    eval_size: int = flag(100, "held-out questions (greedy decoding); 0 = no evaluation", ">= 0")
    eval_samples: int = flag(0, "also N samples per held-out question (eval/em_sampled)", ">= 0")
    eval_max_turns: int = flag(2, "search turns at evaluation (paper: 4)", ">= 0")
    ckpt_every: int = flag(5, "checkpoint every N steps and at the end; 0 = at the end", ">= 0")
    keep_ckpts: int = flag(2, "checkpoints kept on disk", ">= 1")
    save_bf16: bool = flag(False, "at the end also write <run>/model-bf16 (weights in bf16)")
    report_to: str = flag("none", "metrics also go to: none, tensorboard, wandb or both", "any")


# The values of each "choice" field; check_config refuses any other before a model is loaded.
CHOICES = {"template": rollout.TEMPLATES, "on_long_prompt": rollout.ON_LONG_PROMPT,
           "llds_gate": GATES, "llds_reduction": REDUCTIONS, "device": ("auto", "cuda", "cpu")}


def rollout_config(cfg: Config, **overrides) -> rollout.RolloutConfig:
    """The episode settings rollout.py takes, from the run's."""
    return dataclasses.replace(rollout.RolloutConfig(
        max_turns=cfg.max_turns, topk=cfg.topk, max_turn_tokens=cfg.max_turn_tokens,
        max_obs_tokens=cfg.max_obs_tokens, max_prompt_tokens=cfg.max_prompt_tokens,
        max_context=cfg.max_context, temperature=cfg.temperature, top_p=cfg.top_p,
        template=cfg.template, batch_size=cfg.rollout_batch_size, bf16=cfg.bf16), **overrides)


# ---- GRPO objective ------------------------------------------------------------------------

def group_advantages(rewards, group_size: int):
    """GRPO's advantages (r - mean) / (std + 1e-6) within each group, unbiased std: rewards (N,)
    float in groups of `group_size` consecutive rows -> (N,) float. A group whose rewards all tie
    gets exactly 0: no signal, and no 1e-6-scaled noise."""
    # veRL gives a group of ONE its raw reward (std 0/0): that is how a group-id bug in Search-R1
    # silently turned GRPO into REINFORCE. Here group_size >= 2 is checked at the command line.
    r = rewards.view(-1, group_size)                                     # (P, G)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
    tie = r.amax(1, keepdim=True) == r.amin(1, keepdim=True)
    return torch.where(tie, 0.0, adv).flatten()


def masked_sum(x, mask, dim=None):
    """Sum of x where mask != 0; NaN/inf where mask == 0 reach neither value nor gradient."""
    picked = torch.where(mask.bool(), x, 0.0)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x, mask, dim=None):
    """Mean of x over mask != 0 (NaN-safe like masked_sum); 0 where nothing is selected."""
    return masked_sum(x, mask, dim) / masked_sum(torch.ones_like(x), mask, dim).clamp(min=1)


def policy_loss(logp, old_logp, advantages, loss_mask, clip=0.2, n_tokens=None):
    """PPO's clipped surrogate on token ratios exp(logp - old_logp), to be minimised, summed over
    the loss-mask tokens and divided by n_tokens (default: their number here, a token-mean).
    logp (B, T) with grad, old_logp (B, T), advantages (B,), loss_mask (B, T)
    -> (loss, {"clip_ratio": share of tokens clipped, "ppo_kl": mean of old_logp - logp})"""
    valid = loss_mask.bool()
    n_tokens = valid.sum().clamp(min=1) if n_tokens is None else n_tokens
    # 0 off the mask: no garbage reaches exp() or the gradient
    log_ratio = torch.where(valid, logp - old_logp.detach(), 0.0)      # (B, T)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages[:, None] * ratio
    clipped = -advantages[:, None] * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    loss = masked_sum(torch.maximum(unclipped, clipped), valid) / n_tokens
    with torch.no_grad():
        stats = {"clip_ratio": masked_mean((clipped > unclipped).float(), valid).item(),
                 "ppo_kl": masked_mean(-log_ratio, valid).item()}
    return loss, stats


def kl_k3(logp, ref_logp):
    """k3 ("low_var_kl") estimate of KL(pi || pi_ref) per token: exp(u) - u - 1 >= 0, (B, T)."""
    u = torch.clamp(ref_logp - logp, -20.0, 20.0)     # changes no clamped result, keeps exp finite
    return torch.clamp(torch.exp(u) - u - 1.0, -10.0, 10.0)


# ---- Log-probs -----------------------------------------------------------------------------

@fast_hf.in_checkpointed_chunks(rows=1024)     # at most 1024 x vocabulary logits live at once
def head_logprobs(lm_head, hidden, targets, temperature):
    """log pi(target) and the entropy of pi at the sampling temperature: hidden (N, H), targets
    (N,) -> two (N,) float32."""
    logp_all = torch.log_softmax(lm_head(hidden).float() / temperature, dim=-1)     # (N, V)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


@fast_hf.without_cudnn_attention   # so a call runs one attention kernel in every log-prob pass
def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature):
    """log pi(token_t | tokens_<t) and the entropy of pi before token t, at the sampling
    temperature, on model tokens only: (B, T) ids and masks -> two (B, T) float32, 0 elsewhere."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False).last_hidden_state              # (B, T, H)
    # The hidden state at t predicts token t + 1; only the model's own tokens are scored.
    scored = loss_mask[:, 1:].bool()                                             # (B, T-1)
    targets = input_ids[:, 1:][scored]                                           # (N,)
    logp, entropy = head_logprobs(model.lm_head, hidden[:, :-1][scored], targets, temperature)
    logp_full = torch.zeros(loss_mask.shape, device=hidden.device)               # (B, T)
    entropy_full = torch.zeros(loss_mask.shape, device=hidden.device)
    logp_full[:, 1:][scored], entropy_full[:, 1:][scored] = logp, entropy
    return logp_full, entropy_full


def micro_batch(batch: dict, rows, device, multiple: int | None = None) -> dict:
    """The rows `rows` of a batch of (N, T) tensors on `device`, cut to their longest real length,
    rounded up to a multiple of `multiple` columns (default: 128 on CUDA, fewer shapes for its
    attention kernels; 1 elsewhere). Every pass of a step pads alike, so the masked padding changes
    no number between passes (tested)."""
    multiple = multiple or (128 if torch.device(device).type == "cuda" else 1)
    longest = int(batch["attention_mask"][rows].sum(1).max())
    length = min(-(-longest // multiple) * multiple, batch["attention_mask"].shape[1])
    return {k: v[rows, :length].to(device) if v.dim() == 2 else v[rows].to(device)
            for k, v in batch.items()}


@torch.no_grad()
def logprob_pass(model, batch, minibatches, cfg, device):
    """Log-probs and entropy of the rows of `minibatches`, micro-batch by micro-batch, as the
    update runs them (the same rows together: the same numbers at equal weights)
    -> two (N, T) float32 on the CPU, aligned with batch["input_ids"], 0 in rows not run."""
    logp, entropy = torch.zeros(batch["loss_mask"].shape), torch.zeros(batch["loss_mask"].shape)
    with fast_hf.prefix_once(model, batch["input_ids"], batch["attention_mask"],
                             enabled=not cfg.grad_checkpointing) as policy:
        for micro in (micro for mini in minibatches for micro in mini):
            mb = micro_batch(batch, micro, device)
            with fast_hf.autocast(device, cfg.bf16):
                lp, ent = token_logprobs(policy, mb["input_ids"], mb["attention_mask"],
                                         mb["loss_mask"], cfg.temperature)
            logp[micro, :lp.shape[1]], entropy[micro, :ent.shape[1]] = lp.cpu(), ent.cpu()
    return logp, entropy


# ---- One training step ---------------------------------------------------------------------

def train_step(step: int, cfg: Config, run: runs.Run, sampler, show=None) -> dict:
    """One GRPO(+LLDS) step, steps 1-5 of the module docstring; show(text): which phase runs."""
    phases, model, G = runs.Phases(show), run.model, cfg.group_size
    # Linear warm-up, then constant. The authors' scheduler is stepped after each step's updates,
    # so their step s runs at (s - 1) / W: their first step at lr 0.
    warmup = max(1, round(cfg.warmup_ratio * cfg.steps))
    lr = cfg.lr * min(1.0, (step - 1 if cfg.warmup_from_zero else step) / warmup)
    for group in run.optimizer.param_groups:
        group["lr"] = lr

    # 1. G rollouts per prompt, each group G consecutive rows.
    roll = functools.partial(rollout.rollout, model, run.tokenizer, retriever=run.retriever,
                             cfg=rollout_config(cfg), progress=phases.note)   # roll(records)
    with phases("rollout"):
        records = [r for r in sampler.next(cfg.prompts_per_step) for _ in range(G)]
        out, redrawn = roll(records), 0
        # Dynamic sampling (DAPO): a group whose rewards all tie has advantage 0 and no GRPO
        # gradient, so its prompt is replaced by a fresh one, for up to drop_tied_groups rounds
        # (the authors never redraw). Groups that still tie stay, and LLDS guards them (A = 0).
        for _ in range(cfg.drop_tied_groups):
            rewards = torch.tensor([e["reward"] for e in out.episodes]).view(-1, G)   # (P, G)
            tied = torch.nonzero(rewards.amax(1) == rewards.amin(1)).flatten().tolist()
            if not tied:
                break
            rows = [g * G + k for g in tied for k in range(G)]
            fresh = [r for r in sampler.next(len(tied)) for _ in range(G)]
            out = replace_rows(out, rows, roll(fresh))
            for row, record in zip(rows, fresh):
                records[row] = record
            redrawn += len(tied)

    # 2. Rewards (exact match of the final answer, one number per episode) and advantages.
    rewards = torch.tensor([e["reward"] for e in out.episodes], dtype=torch.float32)   # (N,)
    batch = {"input_ids": out.input_ids, "attention_mask": out.attention_mask,          # (N, T)
             "loss_mask": out.loss_mask, "answer_mask": out.answer_mask,
             "advantages": group_advantages(rewards, G)}                                # (N,)

    # 3. The rows shuffled (or in the authors' order) into mini-batches (an optimizer step each)
    #    of micro-batches (a forward and backward each, rows of similar length together: less
    #    padding); then the old (rollout-policy) and reference log-probs of every row, micro-batch
    #    by micro-batch.
    lengths = out.attention_mask.sum(1)                                                 # (N,)
    order = (verl_order(lengths, cfg.mini_batch_size) if cfg.verl_minibatches
             else torch.randperm(len(lengths)))                                         # (N,)
    minibatches = [list(mini[lengths[mini].argsort(stable=True)].split(cfg.micro_batch_size))
                   for mini in order.split(cfg.mini_batch_size)]
    with phases("logprob", release=False):
        batch["old_logp"], old_entropy = logprob_pass(model, batch, minibatches, cfg,
                                                      run.device)                 # (N, T)
        if run.ref is not None:
            batch["ref_logp"] = logprob_pass(run.ref, batch, minibatches, cfg, run.device)[0]

    # 4. One AdamW step per mini-batch, gradients accumulated over its micro-batches. Each term is
    #    a sum over the mini-batch's model tokens over their number, n_tokens (seq-mean LLDS: over
    #    its preserving responses; the authors: per micro-batch, docs/method.md). beta: LLDS-MA's.
    valid = statistics.fmean(e["n_search"] for e in out.episodes) if cfg.answer_adaptive else None
    beta = answer_weight(cfg.llds_lambda, cfg.answer_coef, valid)
    llds_lambda = cfg.llds_lambda if cfg.llds else 0.0   # off, LLDS is still computed and logged
    sums, norms = collections.Counter(), []
    model.train()       # no dropout in these models; gradient checkpointing needs it
    run.optimizer.zero_grad(set_to_none=True)   # nothing from a step that stopped half-way
    for mini in phases.each("update", minibatches, "mini-batch"):
        rows = torch.cat(mini)
        n_tokens = batch["loss_mask"][rows].sum().clamp(min=1)
        n_llds = n_tokens if cfg.llds_reduction == "token-mean" else preserving_responses(
            batch["advantages"][rows], batch["loss_mask"][rows]).sum().clamp(min=1)
        # The prompt prefix all rows share runs once per mini-batch (plumbing/fast_hf.py); its
        # share of the gradient is added on leaving the `with`, before the clip.
        with fast_hf.prefix_once(model, batch["input_ids"], batch["attention_mask"],
                                 enabled=not cfg.grad_checkpointing) as policy:
            for micro in mini:
                mb = micro_batch(batch, micro, run.device)
                mask, adv, old_logp = mb["loss_mask"], mb["advantages"], mb["old_logp"]
                with fast_hf.autocast(run.device, cfg.bf16):
                    logp, entropy = token_logprobs(policy, mb["input_ids"], mb["attention_mask"],
                                                   mask, cfg.temperature)
                pg, pg_stats = policy_loss(logp, old_logp, adv, mask, cfg.clip_eps, n_tokens)
                llds_term, llds_stats = llds_loss(logp, old_logp, adv, mask, gate=cfg.llds_gate,
                                                  answer_mask=mb["answer_mask"], answer_weight=beta,
                                                  reduction=cfg.llds_reduction, denominator=n_llds)
                kl = (masked_sum(kl_k3(logp, mb["ref_logp"]), mask) / n_tokens
                      if run.ref is not None else torch.zeros(()))
                loss = (pg - cfg.entropy_coef * masked_sum(entropy, mask) / n_tokens
                        + cfg.kl_coef * kl + llds_lambda * llds_term)
                loss.backward()
                sums.update(runs.micro_metrics(float(mask.sum() / n_tokens), pg, pg_stats, kl,
                                               llds_term, llds_stats))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        norms.append(norm)
        if math.isfinite(norm):     # inf/NaN cannot be clipped: stepping would poison the weights
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    model.eval()

    # 5. The LLD monitor, and what the step logs.
    metrics = {"step": step, "lr": lr, "llds/answer_weight": beta,
               "entropy": masked_mean(old_entropy, out.loss_mask).item(),
               "rollout/redrawn_groups": redrawn,
               **runs.update_stats(sums, norms, len(minibatches), run.ref is not None)}
    metrics.update(monitor_step(step, cfg, run, out, records, batch, minibatches, phases))
    return metrics


# ---- LLD monitor ---------------------------------------------------------------------------

def monitor_step(step, cfg, run, out, records, batch, minibatches, phases) -> dict:
    """Step 5: the rollout's numbers, the correct responses' displacement by this step's updates,
    every N steps the token view (<run>/views/), sample episodes and the step's timing."""
    rewards = torch.tensor([e["reward"] for e in out.episodes], dtype=torch.float32)   # (N,)
    group_ids = torch.arange(len(rewards)) // cfg.group_size                           # (N,)
    metrics = {**monitor.rollout_stats(out, batch["old_logp"], rewards, group_ids),
               **monitor.control_tag_probs(run.tokenizer, out.input_ids, out.loss_mask,
                                           batch["old_logp"]),
               **dict.fromkeys(monitor.DISPLACEMENT)}
    view = cfg.token_view_every and (step % cfg.token_view_every == 0 or step == cfg.steps)
    if view or (cfg.displacement_every and step % cfg.displacement_every == 0):
        # The log-probs after the step's updates: one no-grad pass over the very micro-batches
        # that computed batch["old_logp"], so unchanged weights give exactly 0 (rows grouped
        # otherwise would sum in another order); only those holding a correct response, or all.
        micros = [mu for mini in minibatches for mu in mini if view or (rewards[mu] > 0).any()]
        with phases("logprob", release=False):
            after = (logprob_pass(run.model, batch, [micros], cfg, run.device)[0] if micros
                     else batch["old_logp"])                                               # (N, T)
        lld_metrics, change = monitor.displacement(batch, after, rewards > 0)
        metrics.update(lld_metrics)
    if view:
        with phases("view", release=False):
            token_view.write_step_view(run.dir, step, run.tokenizer, out, batch, change, group_ids,
                                       records, action_ids(batch["loss_mask"]),
                                       functools.partial(llds_loss, gate=cfg.llds_gate))
    metrics.update(phases.timing(out))     # timing/*, tokens per second, decode occupancy
    run_log.write_samples(run.dir / "samples" / f"step_{step:04d}.txt", records, out.episodes,
                          cfg.samples_per_step)
    return metrics


# ---- The loop ------------------------------------------------------------------------------

def questions(cfg: Config, tokenizer):
    """The questions, every prompt checked at load, and all their prompts' ids (a generator)."""
    train_records = data.load_questions(cfg.data, split="train")
    eval_records = data.heldout_set(cfg.eval_data or cfg.data, cfg.eval_size)
    train_records, _ = rollout.drop_long_prompts(train_records, tokenizer, rollout_config(cfg),
                                                 cfg.on_long_prompt, "training questions")
    eval_records, _ = rollout.drop_long_prompts(eval_records, tokenizer, rollout_config(cfg),
                                                cfg.on_long_prompt, "held-out questions")
    prompts = (rollout.prompt_ids(r, tokenizer, cfg.template) for r in train_records + eval_records)
    return train_records, eval_records, prompts


def setup(cfg: Config, model=None, tokenizer=None) -> runs.Run:
    """Everything a run needs; user errors (paths, flags, servers) raise ValueError/SystemExit."""
    check_config(cfg, CHOICES)
    device = runs.pick_device(cfg.device)
    memory.configure_allocator(device)        # process-wide, once, before the first allocation
    if model is None:
        model, tokenizer = load_policy(cfg.model or None)
    if cfg.lora_rank:   # LoRA: adapters on every linear layer train; the base stays frozen
        model = with_lora(model, cfg.lora_rank, cfg.lora_alpha)
    fast_hf.use_fast_attention(model)   # this model's attention (and its reference copy's) only
    train_records, eval_records, prompts = questions(cfg, tokenizer)
    memory_plan.check(cfg, device, model, prompts)   # stops here, naming the flag, if it cannot fit
    run_dir = runs.prepare_run_dir(Path(cfg.out_dir) / cfg.name, cfg.resume)
    runs.seed_everything(cfg.seed)
    memory.reuse_freed_memory()      # glibc: a long run reuses freed blocks (plumbing/memory.py)
    corpus = data.corpus_for([cfg.data], cfg.retriever, cfg.corpus)
    search_engine = retriever.open_retriever(cfg.retriever, corpus=corpus, index=cfg.index or None,
                                             timeout=cfg.retriever_timeout)
    # The frozen initial policy of the k3 KL term (none when kl_coef is 0), before a resume: a
    # copy, or with LoRA the same model with its adapter off.
    bf16_frozen = frozen_in_bf16(device, cfg.bf16)
    ref = (None if cfg.kl_coef == 0 else AdapterOff(model) if cfg.lora_rank
           else reference_copy(model, bf16_frozen).to(device))
    place_for_training(model, device, cfg.grad_checkpointing, bf16_frozen and cfg.lora_rank > 0)
    return runs.Run(device=device, dir=run_dir, ref=ref, model=model, tokenizer=tokenizer,
                    train_records=train_records, eval_records=eval_records, retriever=search_engine,
                    optimizer=runs.adamw(model.parameters(), cfg.lr, cfg.weight_decay, device))


def train(cfg: Config, model=None, tokenizer=None) -> dict:
    """Train (or resume) the run <out_dir>/<name>; model/tokenizer may be injected (tests).
    -> {"before": eval metrics at step 0, "after": at the end, "last": the last step's metrics}"""
    cfg = dataclasses.replace(cfg, name=runs.run_name(cfg.out_dir, cfg.name, cfg.resume))
    run = setup(cfg, model, tokenizer)
    state = checkpoints.start_or_resume(run.dir, run.model, run.optimizer, cfg.resume)
    start, skipped, evals = state["step"], state["skipped_steps"], state["evals"]
    sampler = PromptSampler(run.train_records, cfg.seed, **state["sampler"])
    warning = monitor.SpiralMonitor(monitor.RULE if cfg.spiral_warning else (), state["monitor"])
    log = run_log.open_run_log(run.dir, cfg, start, run.device, len(run.eval_records))
    eval_cfg = rollout_config(cfg, greedy=True, max_turns=cfg.eval_max_turns)
    held_out = functools.partial(heldout_eval, run.model, run.tokenizer, run.eval_records,
                                 run.retriever, eval_cfg, cfg.eval_samples)
    if start == 0 and run.eval_records:
        evals["before"] = held_out()
        log({"step": 0, **evals["before"]})
        print(f"held-out EM before training: {evals['before']['eval/em']:.3f}")

    metrics = {}
    bar = tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, desc=cfg.name,
               unit="step")
    for step in bar:
        metrics = train_step(step, cfg, run, sampler,
                             show=lambda text: bar.set_description_str(f"{cfg.name} {text}"))
        bar.set_description_str(cfg.name, refresh=False)
        skipped += metrics["grad_norm_nonfinite"]
        if metrics["grad_norm_nonfinite"]:         # a fact, not the warning's forecast: always said
            tqdm.write(f"step {step}: {metrics['grad_norm_nonfinite']} update(s) skipped, their "
                       "gradient norm not finite (grad_norm_nonfinite, skipped_steps)")
        metrics["skipped_steps"] = skipped
        metrics["grad_norm_z"] = warning.grad_norm_z(metrics["grad_norm"])
        metrics["lld/warning"] = warning.warn(step, metrics)       # 1 when the spiral shows
        last = step == cfg.steps
        if run.eval_records and (last or (cfg.eval_every and step % cfg.eval_every == 0)):
            metrics.update(held_out())
            evals["after" if last else f"step {step}"] = {
                k: v for k, v in metrics.items() if k.startswith("eval/")}
        metrics.update(memory.peaks(run.device))       # so far, evaluation included
        log(metrics)
        bar.set_postfix(runs.postfix(metrics))
        if last or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
            checkpoints.save_checkpoint(run.dir, step, run.model, run.tokenizer, run.optimizer,
                                        keep=cfg.keep_ckpts, state={
                                            "sampler": sampler.state(), "skipped_steps": skipped,
                                            "evals": evals, "monitor": warning.history})
    bar.close()
    log.close()
    if cfg.save_bf16:
        checkpoints.export_bf16(run.dir / "model-bf16", run.model, run.tokenizer)
    plot_runs([run.dir])
    summary = {"before": evals.get("before"), "after": evals.get("after"), "last": metrics,
               "peak_memory_gb": memory.peak_memory_gb(run.device)}
    print(final_report(run.dir, summary))
    return summary


def main(argv=None) -> None:
    cfg, plot, plot_out, plan = parse_train_args(Config, PRESETS, CHOICES, argv)
    cfg = dataclasses.replace(cfg, name=runs.run_name(cfg.out_dir, cfg.name, cfg.resume))
    with runs.user_errors_exit(Path(cfg.out_dir) / cfg.name):
        if plot:
            print(plot_runs(plot, plot_out))               # draw saved runs' curves and exit
        elif plan:
            print(memory_plan.print_plan(cfg, runs.pick_device(cfg.device), questions, plan))
        else:
            train(cfg)


if __name__ == "__main__":
    main()
