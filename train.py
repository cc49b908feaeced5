"""train.py: GRPO + LLDS training of a search agent, with a monitor for the LLD death spiral.

Read top to bottom: configuration, the GRPO objective, log-probs, ONE training step, the loop.
`python train.py` trains the embedded SmolLM2-135M-Instruct on the toy world with an in-process BM25
on a CPU in minutes; `python train.py --preset paper --model <Qwen2.5-3B folder> --data <nq_hotpotqa
train.parquet> --retriever http://host:8000/retrieve` is the paper's setting on one GPU;
`python train.py --plot RUN [RUN ...]` draws saved runs' curves, overlaid.

How it maps to the papers. Search-R1 (Jin et al., arXiv 2503.09516) gives the environment (rollout.py:
multi-turn generation with <search>, retrieved <information> as forced tokens with loss mask 0,
exact-match reward). Deng et al. (arXiv 2512.04220) train it with GRPO and add LLDS (llds.py). One
training step is their veRL step, numbered as in train_step: 1. `group_size` rollouts per question,
one group id per prompt; 2. exact-match rewards, group-relative advantages; 3. old log-probs (the
rollout policy) and, when kl_coef > 0, reference log-probs; 4. one AdamW step per shuffled mini-batch,
loss = clipped surrogate - entropy bonus + k3 KL + lambda LLDS (several mini-batches per step are
what make LLDS do anything: with one update per rollout batch the policy is the rollout policy and
LLDS is 0); 5. the LLD monitor: likelihood of correct and incorrect responses, how much the updates
moved the correct ones (displacement), entropy, gradient norm, and a warning when the spiral shows.

Simplified on purpose: one process, one device (no FSDP, no vLLM: rollout.py samples with the
training model's own KV cache); fp32 master weights with bf16 autocast (bf16 weights would round
away updates of lr 1e-6); old log-probs get their own pass, as in veRL, but for the first mini-batch,
whose update pass (the policy has not moved yet) gives them; warm-up then a constant learning rate;
log-probs are lm_head(hidden) on model tokens only (fine for Llama / Qwen / SmolLM; logit soft-capping
or scaling would need adding). Run bookkeeping, logs, plots, memory and HF speed-ups are in plumbing/.
"""
import dataclasses
import functools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import data
import retriever as retrieval
import rollout
from eval import heldout_eval
from llds import GATES, REDUCTIONS, action_ids, llds_loss, preserving_responses
from plumbing import dynamic_sampling, fast_hf, memory_plan, presets, report, runs, token_view
from plumbing.cli import check_config, parse_train_args, shared_fields
from plumbing.models import load_policy, place_for_training, reference_copy, reference_in_bf16
from plumbing.memory import peak_memory_gb
from plumbing.plots import plot_runs
from plumbing.runs import micro_batch, shuffle_into_minibatches
from plumbing.search_health import search_health
from tasks.lab import lab_dir

# ---- Configuration -------------------------------------------------------------------------
# Every field becomes a flag (--llds-lambda, --no-llds, ...); its comment is the --help text.

@dataclass
class Config:
    name: str = "demo"                 # run folder is <out_dir>/<name> [text]
    out_dir: str = "runs"              # parent folder of all runs [text]
    seed: int = 0                      # seeds python, numpy, torch and the prompt order [0..4294967295]
    resume: bool = False               # continue <out_dir>/<name> from its last checkpoint
    model: str = ""                    # HF model folder or name; "" = embedded SmolLM2-135M-Instruct [any]
    data: str = "toy_nq"               # training questions: "toy", a toy kind (toy_nq = single-hop), a .jsonl/.parquet file or a dataset folder [any]
    eval_data: str = ""                # held-out questions; "" = the test split of --data [any]
    corpus: str = ""                   # JSONL corpus of an in-process retriever; "" = the toy world's [file]
    retriever: str = "bm25"            # "bm25", "dense" or a Search-R1 server URL http://host:port/retrieve [any]
    index: str = ""                    # retriever index folder (built there when absent); "" = cache [any]
    retriever_timeout: float = 30.0    # a retriever server's seconds per request, plus 0.1 s per query [> 0]
    template: str = "fewshot"          # prompt: "fewshot" (small models) or "search-r1" (the paper's) [choice]
    max_turns: int = 2                 # search turns per episode in training (one answer-only turn follows) [>= 0]
    topk: int = 1                      # passages per search (paper: 3; 1 keeps the CPU demo short) [>= 0]
    max_turn_tokens: int = 32          # sampled tokens per turn (paper: 500) [>= 1]
    max_obs_tokens: int = 200          # tokens per observation (paper: 500) [>= 1]
    max_prompt_tokens: int = 2048      # longer prompts (few-shot template included) are dropped at load [>= 1]
    on_long_prompt: str = "drop"       # a prompt over max-prompt-tokens: "drop" it at load (one line names it) or "error" [choice]
    max_context: int = 4096            # prompt + turns + observations [>= 2]
    temperature: float = 0.7           # rollout sampling temperature, log-probs too (paper: 1.0); held-out EM is greedy [> 0]
    top_p: float = 1.0                 # nucleus sampling of the rollouts; 1.0 = off [> 0, <= 1]
    steps: int = 6                     # training steps (one rollout batch each) [>= 1]
    prompts_per_step: int = 8          # questions per step [>= 1]
    group_size: int = 8                # rollouts per question (the GRPO group G; paper: 5): 8 lets a rare right answer show [>= 2]
    drop_tied_groups: int = 1          # redraw the prompts of groups whose rewards all tie, up to N extra rollout rounds a step (DAPO); 0 = off [>= 0]
    mini_batch_size: int = 32          # trajectories per optimizer step; < prompts x G gives several updates per step [>= 1]
    micro_batch_size: int = 4          # trajectories per forward/backward (gradient accumulation; 8 peaks near 8 GB on CPU) [>= 1]
    lr: float = 5e-5                   # AdamW learning rate (paper: 1e-6 for 3B over 1005 steps) [>= 0]
    warmup_ratio: float = 0.1          # linear warm-up over this fraction of the steps, then constant [0..1]
    weight_decay: float = 0.01         # AdamW weight decay [>= 0]
    grad_clip: float = 1.0             # gradient-norm clip; a step with a non-finite norm is skipped [> 0]
    clip_eps: float = 0.2              # PPO ratio clip [> 0]
    kl_coef: float = 0.0               # k3 KL to the initial policy; 0 = no reference model is loaded [>= 0]
    entropy_coef: float = 0.0          # entropy bonus coefficient [>= 0]
    llds: bool = True                  # LLDS regulariser on; --no-llds = plain GRPO
    llds_lambda: float = 0.2           # LLDS coefficient (0 = plain GRPO) [>= 0]
    llds_gate: str = "action"          # LLDS gate: action, response or token [choice]
    llds_reduction: str = "token-mean"  # LLDS normaliser: token-mean (authors' code) or seq-mean (paper eq. 4) [choice]
    answer_weight: str = "1.0"         # LLDS-MA weight of the final answer span: a number, or "adaptive" = min(V/2, 1) [any]
    displacement_every: int = 1        # measure correct-response displacement every N steps (one extra forward); 0 = never [>= 0]
    token_view_every: int = 10         # write <run>/views/step_N.html and .jsonl (each token's change) every N steps and at the last; 0 = never [>= 0]
    samples_per_step: int = 4          # trajectories saved as text per step in <run>/samples/ [>= 0]
    spiral_window: int = 5             # warn when correct-response log-lik falls this many steps in a row [>= 1]
    spiral_grad_factor: float = 10.0   # warn when the grad norm exceeds this times its running median [> 0]
    eval_every: int = 0                # held-out evaluation every N steps; 0 = only before and after training [>= 0]
    eval_size: int = 100               # held-out questions (fixed subset, greedy decoding); 0 = no evaluation [>= 0]
    eval_samples: int = 0              # also sample each held-out question this many times at --temperature (eval/em_sampled) [>= 0]
    eval_max_turns: int = 2            # search turns at evaluation (paper: 4) [>= 0]
    ckpt_every: int = 5                # checkpoint every N steps (and always at the end); 0 = only at the end [>= 0]
    keep_ckpts: int = 2                # checkpoints kept on disk (older ones are deleted) [>= 1]
    rollout_batch_size: int = 100      # episodes generated together (100: the demo's evaluation in one batch) [>= 1]
    device: str = "auto"               # auto (cuda if available), cuda or cpu [choice]
    bf16: bool = True                  # bf16 autocast (fp32 weights) where the device supports it
    grad_checkpointing: bool = False   # recompute activations in backward (GPU memory for long contexts)
    save_bf16: bool = False            # at the end also write <run>/model-bf16: the weights alone in bf16, an HF folder for eval.py
    report_to: str = "none"            # metrics.jsonl also goes to: none, tensorboard, wandb or tensorboard,wandb (TRL's report_to) [any]


# "paper": the paper's settings (Qwen2.5-3B, NQ+HotpotQA, E5 retriever server; section 4 of the LLDS paper);
# "one-gpu-<0.5b|1.5b|3b>-<80gb|141gb>": the same algorithm, 64 prompts x 5, sized for one card (plumbing/presets.py).
PRESETS = dict(presets.GPU_PRESETS)

# The LLD lab (docs/lab/prereg.md): the paper's RL settings on a ~1M-parameter model warm-started by
# sft.py, over the lab's questions (tasks/lab.py). Pass --model (the SFT folder), --lr, --mini-batch-size.
PRESETS["lab"] = dict(
    data=str(lab_dir() / "rl"), corpus=str(lab_dir() / "corpus.jsonl"), template="search-r1", max_turns=2,
    topk=3, max_turn_tokens=24, max_obs_tokens=200, temperature=1.0, steps=300, prompts_per_step=8,
    group_size=5, drop_tied_groups=0, micro_batch_size=10, rollout_batch_size=64, warmup_ratio=0.285, clip_eps=0.2,
    kl_coef=0.001, entropy_coef=0.001, grad_clip=1.0, llds_lambda=0.2, llds_gate="action", llds_reduction="token-mean",
    eval_every=50, eval_size=100, eval_samples=4, eval_max_turns=2, ckpt_every=25, keep_ckpts=1, samples_per_step=2,
    bf16=False, token_view_every=50)

# The values of each [choice] field; check_config refuses any other before a model is loaded.
CHOICES = {"template": rollout.TEMPLATES, "on_long_prompt": rollout.ON_LONG_PROMPT, "llds_gate": GATES,
           "llds_reduction": REDUCTIONS, "device": ("auto", "cuda", "cpu")}


def rollout_config(cfg: Config, **overrides) -> rollout.RolloutConfig:
    """The rollout settings: cfg's fields of the same names, rollout_batch_size, then `overrides`."""
    return rollout.RolloutConfig(**{**shared_fields(rollout.RolloutConfig, dataclasses.asdict(cfg)),
                                    "batch_size": cfg.rollout_batch_size, **overrides})


# ---- GRPO objective ------------------------------------------------------------------------

def group_advantages(rewards, group_ids):
    """GRPO advantages (r - mean_group) / (std_group + 1e-6), unbiased std: rewards (N,) float, group_ids (N,)
    long tensor or hashable ids, in any order -> (N,) float. A group whose rewards are all equal gets exactly 0
    (no signal, no 1e-6-scaled noise), and so does a group of ONE (std 0/0). veRL returns the raw reward there,
    which is how a group-id bug in Search-R1 silently turned GRPO into REINFORCE."""
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
    """Sum of x where mask != 0 -> scalar, or over `dim`; NaN/inf where mask == 0 reach neither value nor grad."""
    picked = torch.where(mask.bool(), x, 0.0)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x, mask, dim=None):
    """Mean of x over mask != 0 (NaN-safe like masked_sum); 0 where nothing is selected."""
    return masked_sum(x, mask, dim) / masked_sum(torch.ones_like(x), mask, dim).clamp(min=1)


def policy_loss(logp, old_logp, advantages, loss_mask, clip=0.2, agg="token-mean"):
    """PPO clipped surrogate on token ratios exp(logp - old_logp), to be minimised. logp (B, T)
    with grad, old_logp (B, T), advantages (B,) or (B, T), loss_mask (B, T). agg: "token-mean" (over
    the batch's loss-mask tokens) or "seq-mean-token-mean" (per response, then over responses).
    -> (loss, {"clip_ratio": fraction of tokens clipped, "approx_kl": mean of old_logp - logp})"""
    if agg not in ("token-mean", "seq-mean-token-mean"):
        raise ValueError(f"policy_loss: agg must be 'token-mean' or 'seq-mean-token-mean', got {agg!r}")
    valid = loss_mask.bool()
    log_ratio = torch.where(valid, logp - old_logp.detach(), 0.0)   # (B, T), 0 off-mask: no garbage in exp or grad
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None] if advantages.dim() == 1 else torch.where(valid, advantages, 0.0)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    per_token = torch.maximum(unclipped, clipped)                    # (B, T)
    if agg == "token-mean":
        loss = masked_mean(per_token, valid)
    else:                                                            # per response, then over responses
        loss = masked_mean(masked_mean(per_token, valid, dim=1), valid.any(dim=1))
    with torch.no_grad():
        stats = {"clip_ratio": masked_mean((clipped > unclipped).float(), valid).item(),
                 "approx_kl": masked_mean(-log_ratio, valid).item()}
    return loss, stats


def kl_k3(logp, ref_logp):
    """k3 ("low_var_kl") estimate of KL(pi || pi_ref) per token, (B, T) -> (B, T): exp(u) - u - 1 >= 0."""
    u = torch.clamp(ref_logp - logp, -20.0, 20.0)     # changes no clamped result, keeps exp() finite
    return torch.clamp(torch.exp(u) - u - 1.0, -10.0, 10.0)


# ---- Log-probs -----------------------------------------------------------------------------

def entropy_from_logprobs(logp_all):
    """Token entropy H = -sum_v p_v log p_v from float32 log-probabilities (..., V) -> (...)."""
    return -(logp_all.exp() * logp_all).sum(dim=-1)


def head_logprobs(lm_head, hidden, targets, temperature):
    """log p(target) and the entropy at the sampling temperature: hidden (N, H), targets (N,) -> 2 x (N,) float32."""
    logp_all = torch.log_softmax(lm_head(hidden).float() / temperature, dim=-1)   # (N, V), once for both
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy_from_logprobs(logp_all)


def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature=1.0, share_prefix=True, prefix_store=None):
    """log p(token_t | tokens_<t) and the entropy at the sampling temperature, on model tokens only: (B, T) ids
    and masks -> two (B, T) float32, 0 elsewhere. The same numbers as `log_softmax(model(input_ids).logits[:, :-1]
    / T)` at the next tokens (tested). share_prefix is a config choice, never a grad-mode one: old, reference and
    update passes must take the same path to agree bit for bit."""
    # model.base_model(input_ids, attention_mask).last_hidden_state, the rows' common prefix run once
    hidden = fast_hf.hidden_states(model, input_ids, attention_mask, share_prefix, prefix_store)   # (B, T, H)
    targets = input_ids[:, 1:]                        # (B, T-1): the hidden state at t predicts token t + 1
    picked = loss_mask[:, 1:].bool()                  # (B, T-1): the target is a model token
    # head_logprobs on the picked rows only, in checkpointed chunks: at most 1024 x vocab logits live
    logp, entropy = fast_hf.head_in_chunks(head_logprobs, model.get_output_embeddings(), hidden[:, :-1][picked],
                                           targets[picked], temperature)          # (N,), (N,)

    def place(values):                                # (N,) -> (B, T): position t scores token t
        full = torch.zeros(picked.shape, dtype=torch.float32, device=hidden.device)
        return torch.nn.functional.pad(full.masked_scatter(picked, values), (1, 0))

    return place(logp), place(entropy)


@torch.no_grad()
def batch_logprobs(model, batch, minibatches, cfg, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of all trajectories, micro-batch by micro-batch as in `minibatches`
    -> (logp, entropy): (N, T) float32 on the CPU, aligned with batch["input_ids"]."""
    n, t = batch["input_ids"].shape
    logp, ent = torch.zeros(n, t), torch.zeros(n, t)
    prefix_store = fast_hf.PrefixStore(batch["input_ids"], batch["attention_mask"])   # the prefix runs once per pass
    for micro in (mu for mb in minibatches for mu in mb):
        r = micro_batch(batch, micro, device)
        with fast_hf.autocast(device, cfg.bf16):
            lp, e = token_logprobs(model, r["input_ids"], r["attention_mask"], r["loss_mask"], cfg.temperature,
                                   share_prefix=not cfg.grad_checkpointing, prefix_store=prefix_store)
        logp[micro, :lp.shape[1]], ent[micro, :e.shape[1]] = lp.cpu(), e.cpu()
    return logp, ent


# ---- One training step ---------------------------------------------------------------------

def train_step(step, cfg, model, tokenizer, ref, optimizer, sampler, retriever, device, run_dir, show=None) -> dict:
    """One GRPO(+LLDS) step, steps 1-5 of the module docstring; show(text) is told which phase runs."""
    phases = runs.Phases(show)
    lr = cfg.lr * min(1.0, step / max(1, round(cfg.warmup_ratio * cfg.steps)))
    for group in optimizer.param_groups:
        group["lr"] = lr

    # 1. G rollouts per prompt; the group id is the prompt's slot in this step: unique even for a question drawn twice
    prompts = sampler.next(cfg.prompts_per_step)
    records = [r for r in prompts for _ in range(cfg.group_size)]
    group_ids = torch.arange(len(prompts)).repeat_interleave(cfg.group_size)              # (N,)
    with phases("rollout"):
        out = rollout.rollout(model, tokenizer, records, retriever, rollout_config(cfg), progress=phases.note)
        out, records, redrawn = dynamic_sampling.redraw_tied_groups(   # --drop-tied-groups N (DAPO); N = 0: unchanged
            out, records, cfg.drop_tied_groups, cfg.group_size, sampler.next,
            lambda recs: rollout.rollout(model, tokenizer, recs, retriever, rollout_config(cfg), progress=phases.note))

    # 2. Rewards (exact match of the final answer, one number per episode) and advantages.
    rewards = torch.tensor([e["reward"] for e in out.episodes], dtype=torch.float32)      # (N,)
    batch = {"input_ids": out.input_ids, "attention_mask": out.attention_mask,             # (N, T)
             "loss_mask": out.loss_mask, "answer_mask": out.answer_mask,
             "advantages": group_advantages(rewards, group_ids)}                           # (N,)

    # 3. Old (rollout-policy) and reference log-probs, in the micro-batches the update will use.
    minibatches = shuffle_into_minibatches(out.attention_mask.sum(1), cfg.mini_batch_size, cfg.micro_batch_size)
    with phases("logprob", release=False):
        # [1:]: mini-batch 0 is updated before any optimizer step, when the policy still is the
        # rollout policy, so its update pass gives its old log-probs (step 4); rows stay 0 till then
        batch["old_logp"], old_entropy = batch_logprobs(model, batch, minibatches[1:], cfg, device)  # (N, T)
        if ref is not None:
            batch["ref_logp"] = batch_logprobs(ref, batch, minibatches, cfg, device)[0]

    # 4. One AdamW step per mini-batch; micro-batches accumulate gradients. The loss is a token-mean over the whole
    #    mini-batch, so each micro-batch's mean is weighted by its share of the tokens (for LLDS's seq-mean: of the
    #    preserving responses). beta, LLDS-MA's answer weight: fixed, or min(V/2, 1), V = mean valid searches.
    beta = (min(statistics.fmean(e["n_search"] for e in out.episodes) / 2, 1.0) if cfg.answer_weight == "adaptive"
            else float(cfg.answer_weight))
    logged, norms = [], []
    model.train()  # no dropout in these models; needed for gradient checkpointing to engage
    with phases("update"):
        for i, mini in enumerate(phases.each(minibatches, "mini-batch")):
            optimizer.zero_grad(set_to_none=True)
            prefix = fast_hf.PrefixStore(batch["input_ids"], batch["attention_mask"])   # once per mini-batch
            idx = torch.cat(mini)
            mini_tokens = batch["loss_mask"][idx].sum().clamp(min=1)
            mini_preserving = preserving_responses(batch["advantages"][idx], batch["loss_mask"][idx]).sum().clamp(min=1)
            for micro in mini:
                r = micro_batch(batch, micro, device)
                mask, adv = r["loss_mask"], r["advantages"]
                token_share = float(mask.sum() / mini_tokens)
                with fast_hf.autocast(device, cfg.bf16):
                    logp, entropy = token_logprobs(model, r["input_ids"], r["attention_mask"], mask,
                                                   cfg.temperature, not cfg.grad_checkpointing, prefix)
                if i == 0:                            # on-policy: the old log-probs are these, bit for bit
                    r["old_logp"] = logp.detach()
                    batch["old_logp"][micro, :logp.shape[1]], old_entropy[micro, :logp.shape[1]] = \
                        logp.detach().cpu(), entropy.detach().cpu()
                pg, pg_stats = policy_loss(logp, r["old_logp"], adv, mask, clip=cfg.clip_eps)
                loss = (pg - cfg.entropy_coef * masked_mean(entropy, mask)) * token_share
                kl = masked_mean(kl_k3(logp, r["ref_logp"]), mask) if ref is not None else None
                if kl is not None:
                    loss = loss + cfg.kl_coef * kl * token_share
                # computed even when LLDS is off, to be logged: a --no-llds run's llds/loss is what LLDS would add
                llds_term, llds_stats = llds_loss(logp, r["old_logp"], adv, mask, gate=cfg.llds_gate,
                                                  answer_mask=r["answer_mask"], answer_weight=beta,
                                                  reduction=cfg.llds_reduction)
                llds_share = token_share if cfg.llds_reduction == "token-mean" else float(
                    preserving_responses(adv, mask).sum() / mini_preserving)
                if cfg.llds and cfg.llds_lambda > 0:
                    loss = loss + cfg.llds_lambda * llds_term * llds_share
                loss.backward()
                # The step logs each metric's mean over micro-batches, weighted as in the loss (runs.update_stats)
                logged.append({"weight": token_share, "pg_loss": pg.item(), "clip_ratio": pg_stats["clip_ratio"],
                               "ppo_kl": pg_stats["approx_kl"], "kl": None if kl is None else kl.item(),
                               **{k: llds_stats[k] for k in ("llds/active_token_frac", "llds/active_action_frac")}})
                logged.append({"weight": llds_share, "llds/loss": llds_term.item()})
            prefix.backward()                         # the prefix's gradient, summed over the micro-batches
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
            norms.append(norm)
            if math.isfinite(norm):                   # inf/NaN cannot be clipped: stepping would poison the weights
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)        # free the gradients' memory for the rollout
    model.eval()

    # 5. Monitor and log: what the step did to the likelihood of correct responses.
    metrics = {"step": step, "lr": lr, **rollout_stats(out, batch["old_logp"], rewards, group_ids),
               **runs.update_stats(logged, norms), "entropy": masked_mean(old_entropy, out.loss_mask).item(),
               "llds/answer_weight": beta, "lld/displacement_correct": None, "lld/frac_correct_fell": None,
               "rollout/redrawn_groups": redrawn}
    view = cfg.token_view_every and (step % cfg.token_view_every == 0 or step == cfg.steps)
    if view or (cfg.displacement_every and step % cfg.displacement_every == 0):
        with phases("logprob", release=False):
            lld, change = displacement(model, batch, minibatches, rewards > 0, batch["old_logp"], cfg, device, view)
        metrics.update(lld)
    if view:    # where the likelihood fell, token by token: <run>/views/ (plumbing/token_view.py)
        with phases("view", release=False):
            token_view.write_step_view(run_dir, step, tokenizer, out, batch, change, group_ids, records,
                                       action_ids(batch["loss_mask"]), functools.partial(llds_loss, gate=cfg.llds_gate))
    metrics.update(phases.timing(out.timing, out.n_generated))      # timing/*, rollout_tokens_per_s
    runs.write_samples(run_dir / "samples" / f"step_{step:04d}.txt", records, out.episodes, cfg.samples_per_step)
    return metrics


# ---- LLD monitor ---------------------------------------------------------------------------

def rollout_stats(ro_out, old_logp, rewards, group_ids) -> dict:
    """Per-step rollout numbers; lld/logp_(in)correct: mean over (in)correct responses of their mean token log-lik."""
    eps, mask = ro_out.episodes, ro_out.loss_mask
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
        "valid_action_ratio": sum(e["n_valid"] for e in eps) / max(int(action_ids(mask).amax(dim=1).sum()), 1),
        "finished": statistics.fmean(float(e["finished"]) for e in eps),
        "lld/logp_correct": mean_or_none(per_response, correct & has_tokens),
        "lld/logp_incorrect": mean_or_none(per_response, ~correct & has_tokens),
        **search_health(eps, rewards, group_ids, rollout.normalize_answer),   # frac_reward_zero_std, search/*, ...
        "rollout/logp_diff": masked_mean((ro_out.logp - old_logp).abs(), mask).item(),   # KV decode vs forward
    }


@torch.no_grad()
def displacement(model, batch, minibatches, correct, old_logp, cfg, device, every_row=False) -> tuple[dict, torch.Tensor]:
    """Likelihood displacement of the correct responses (correct: (N,) bool) by this step's updates:
    summed log-prob after minus before, one no-grad forward over the very micro-batches that computed
    `old_logp`, so unchanged weights give exactly 0 (regrouped rows moved sums by 0.32 nats in bf16).
    -> (metrics, change (N, T): after - before per model token of the rows forwarded, all with every_row)."""
    micros = [mu for mb in minibatches for mu in mb if every_row or correct[mu].any()]
    after = batch_logprobs(model, batch, [micros], cfg, device)[0] if micros else old_logp
    change = torch.where(batch["loss_mask"].bool(), after - old_logp, 0.0)             # (N, T) per token
    if not correct.any():
        return dict.fromkeys(["lld/displacement_correct", "lld/frac_correct_fell", "lld/displacement_correct_search",
                              "lld/displacement_correct_answer"]), change
    idx = torch.nonzero(correct).flatten()
    delta = change[idx].sum(1)                                                          # (C,)
    # the paper's Fig. 5: the answer action (the model turn holding <answer>) vs the turns before it
    turn = action_ids(batch["loss_mask"][idx])                                          # (C, T)
    answer_turn = (turn * batch["answer_mask"][idx].bool()).amax(1, keepdim=True)       # (C, 1), 0 = none
    in_answer = (turn == answer_turn) & (answer_turn > 0)
    return {"lld/displacement_correct": delta.mean().item(),
            "lld/frac_correct_fell": (delta < 0).float().mean().item(),
            "lld/displacement_correct_search": change[idx].masked_fill(in_answer, 0.0).sum(1).mean().item(),
            "lld/displacement_correct_answer": change[idx].masked_fill(~in_answer, 0.0).sum(1).mean().item()}, change


# ---- The loop ------------------------------------------------------------------------------

def setup(cfg: Config, model=None, tokenizer=None) -> runs.Run:
    """Everything a run needs; user errors (paths, flags, servers) raise ValueError / SystemExit."""
    check_config(cfg, CHOICES)
    device = runs.pick_device(cfg.device)
    train_records = data.load_questions(cfg.data, split="train")
    eval_records = data.heldout_set(cfg.eval_data or cfg.data, cfg.eval_size)
    if model is None:
        model, tokenizer = load_policy(cfg.model or None)
    # Each prompt is checked once, here: one too long would stop the run whenever drawn, and after every resume.
    train_records, _ = rollout.drop_long_prompts(train_records, tokenizer, rollout_config(cfg), cfg.on_long_prompt,
                                                 "training questions")
    eval_records, _ = rollout.drop_long_prompts(eval_records, tokenizer, rollout_config(cfg), cfg.on_long_prompt,
                                                "held-out questions")
    prompts = (rollout.prompt_ids(r, tokenizer, cfg.template) for r in train_records + eval_records)
    memory_plan.check(cfg, device, model, prompts)   # one line; stops here, naming the flag, when the run cannot fit
    run_dir = runs.start_run_dir(Path(cfg.out_dir) / cfg.name, cfg.resume, cfg.seed)   # also: allocator settings, seeds
    corpus = data.corpus_for([cfg.data], cfg.retriever, cfg.corpus)
    retriever = retrieval.open_retriever(cfg.retriever, corpus=corpus, index=cfg.index or None, timeout=cfg.retriever_timeout)
    # The frozen initial policy of the k3 KL term (none when kl_coef is 0), before a resume.
    ref = reference_copy(model, reference_in_bf16(device, cfg.bf16)).to(device) if cfg.kl_coef > 0 else None
    place_for_training(model, device, cfg.grad_checkpointing)
    optimizer = runs.adamw(model.parameters(), cfg.lr, cfg.weight_decay, device)   # foreach on a CPU, fused on CUDA
    return runs.Run(device=device, dir=run_dir, train_records=train_records, eval_records=eval_records,
                    retriever=retriever, model=model, tokenizer=tokenizer, ref=ref, optimizer=optimizer)


def train(cfg: Config, model=None, tokenizer=None) -> dict:
    """Train (or resume) the run <out_dir>/<name>; model/tokenizer may be injected (tests).
    -> {"before": eval metrics at step 0, "after": at the end, "last": the last step's metrics}"""
    run = setup(cfg, model, tokenizer)
    state = runs.start_or_resume(run.dir, run.model, run.optimizer, cfg.resume)   # step 0, or the last checkpoint's
    start, skipped, evals = state["step"], state["skipped_steps"], state["evals"]
    sampler = runs.PromptSampler(run.train_records, cfg.seed, **state["sampler"])
    monitor = runs.SpiralMonitor(cfg.spiral_window, cfg.spiral_grad_factor, state["monitor"])
    log = report.open_run_log(run.dir, cfg, start, run.device, len(run.eval_records))
    held_out = functools.partial(heldout_eval, run.model, run.tokenizer, run.eval_records, run.retriever,
                                 rollout_config(cfg, greedy=True, max_turns=cfg.eval_max_turns), cfg.eval_samples)
    if start == 0 and run.eval_records:
        evals["before"] = held_out()
        log({"step": 0, **evals["before"]})
        print(f"held-out EM before training: {evals['before']['eval/em']:.3f}")

    metrics = {}
    bar = tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, desc=cfg.name, unit="step")
    for step in bar:
        metrics = train_step(step, cfg, run.model, run.tokenizer, run.ref, run.optimizer, sampler, run.retriever,
                             run.device, run.dir, show=lambda text: bar.set_description_str(f"{cfg.name} {text}"))
        bar.set_description_str(cfg.name, refresh=False)
        skipped += metrics["grad_norm_nonfinite"]
        metrics["skipped_steps"] = skipped
        metrics["lld/warning"] = monitor.warn(step, metrics)       # 1 when the spiral pattern shows
        if run.eval_records and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            metrics.update(held_out())
            evals["after" if step == cfg.steps else f"step {step}"] = {k: v for k, v in metrics.items()
                                                                      if k.startswith("eval/")}
        metrics["memory/peak_gb"] = peak_memory_gb(run.device)   # so far, evaluation included
        metrics["memory/peak_reserved_gb"] = peak_memory_gb(run.device, reserved=True)   # = RSS on a CPU
        log(metrics)
        bar.set_postfix(runs.postfix(metrics))
        if step == cfg.steps or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
            runs.save_checkpoint(run.dir, step, run.model, run.tokenizer, run.optimizer, keep=cfg.keep_ckpts, state={
                "sampler": sampler.state(), "skipped_steps": skipped, "evals": evals, "monitor": monitor.history})
    bar.close()
    log.close()
    if cfg.save_bf16:
        runs.export_bf16(run.dir / "model-bf16", run.model, run.tokenizer)
    plot_runs([run.dir])
    summary = {"before": evals.get("before"), "after": evals.get("after"), "last": metrics,
               "peak_memory_gb": peak_memory_gb(run.device)}
    print(runs.final_report(run.dir, summary))
    return summary


def main(argv=None) -> None:
    cfg, plot, plot_out, plan = parse_train_args(Config, PRESETS, CHOICES, argv)
    with runs.user_errors_exit(Path(cfg.out_dir) / cfg.name):   # one line "error: ..."; a lost retriever: how to resume
        if plot or plan:                                         # draw saved runs, or print the memory plan; exit
            return print(plot_runs(plot, plot_out) if plot else memory_plan.print_plan(cfg, runs.pick_device(cfg.device)))
        train(cfg)


if __name__ == "__main__":
    main()
