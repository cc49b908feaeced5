"""integrations/trl_llds.py: LLDS inside TRL's GRPOTrainer. Copy this file next to llds.py.

    from trl import GRPOConfig
    from trl_llds import LLDSGRPOTrainer
    args = GRPOConfig(output_dir="out", gradient_accumulation_steps=4, steps_per_generation=16)  # 4 updates
    trainer = LLDSGRPOTrainer(model, reward_funcs=..., args=args, train_dataset=..., tools=[...],
                              llds_lambda=0.2, llds_gate="action")
    trainer.train()                                  # logs llds/loss, llds/active_token_frac, ...

`integrations/trl_search_r1.py` is a complete run: Search-R1 on the toy world with our BM25 as a
TRL tool. What this subclass adds to GRPOTrainer (written against TRL 1.16,
`trl/trainer/grpo_trainer.py`): in `_compute_loss`, after TRL's own loss, `llds_lambda * llds_loss(...)`
with
- the current log-probs: caught where `_get_per_token_logps_and_entropies` makes them with grad
  (they are local to `_compute_loss`);
- the rollout policy's log-probs `old_per_token_logps` and TRL's `advantages`. TRL computes
  `old_per_token_logps` only when gradient_accumulation_steps % (steps_per_generation x num_iterations)
  != 0 (`_generate_and_score_completions`): otherwise every pass over a generation batch falls inside
  one optimiser step, the policy is still the rollout policy and LLDS is exactly 0, so that
  configuration is an error. steps_per_generation = k x gradient_accumulation_steps gives k
  optimiser steps per generation batch; num_iterations > 1 alone does not help (4, 1, 2: still none);
- model tokens only: `completion_mask * tool_mask` (tool results are 0 in `tool_mask`), the mask
  TRL's policy term uses;
- by default the normaliser TRL applies to its policy term for the configured `loss_type`
  (per-sequence means for grpo/sapo, micro-batch tokens for bnpo, B x max_completion_length for
  dr_grpo, sequences for luspo, dapo/cispo/vespo's per-step average below), so lambda weighs LLDS
  against the policy term exactly as in the paper. `llds_reduction="token-mean"` (model tokens, every
  token alike) or `"seq-mean"` (the paper's eq. 4: per response, then over preserving responses)
  choose llds.py's normalisers instead, counted like TRL's dapo: the model tokens (or preserving
  responses) of the whole generation batch on all processes x gradient_accumulation_steps /
  steps_per_generation, i.e. the average count per optimiser step, not each step's own count.

Dropout: LLDS compares two forward passes over the same tokens (rollout time and now), which
dropout would make differ by noise; TRL leaves it on (disable_dropout=False) and its switch misses
the `attention_dropout` of HF attention layers. With llds_lambda > 0 this trainer switches all of
it off in the policy, with a warning when any was on.
LLDS-MA: `llds_answer_coef` is the coefficient of the last <answer>...</answer> of each completion,
capped at llds_lambda, as in the authors' code (llds.answer_weight); `llds_answer_adaptive` scales it
by max(V - 1, 0), V the generation batch's mean number of tool calls that ran without error per
episode. The weight relative to lambda is logged as llds/answer_weight.
"""
import math
import re
import warnings

import torch
from trl import GRPOTrainer

from llds import GATES, answer_weight, llds_loss

# How GRPOTrainer._compute_loss normalises its policy term, per loss_type (TRL 1.16).
POLICY_NORMALISER = {"grpo": "sequence-means", "sapo": "sequence-means", "bnpo": "micro-batch-tokens",
                     "dr_grpo": "max-length", "luspo": "sequences", "dapo": "step-tokens",
                     "cispo": "step-tokens", "vespo": "step-tokens"}
REDUCTIONS = ("policy", "token-mean", "seq-mean")
_ANSWER_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def answer_mask(tokenizer, completion_ids, completion_mask):
    """(B, C) float: 1 on the tokens of each completion's last <answer>...</answer> (tags included).

    completion_ids, completion_mask (B, C): right-padded completions. A row's text runs to its last
    token with mask 1, so a mask with holes (tool results) does not cut it short. A token belongs to
    the span when its decoded characters overlap the span's characters.
    """
    out = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    for row, (ids, mask) in enumerate(zip(completion_ids.tolist(), completion_mask.tolist())):
        ids = ids[:max((i + 1 for i, m in enumerate(mask) if m), default=0)]
        spans = list(_ANSWER_RE.finditer(tokenizer.decode(ids)))
        if not spans:
            continue
        begin, end = spans[-1].span()
        # Token i covers characters [chars(i), chars(i + 1)) where chars(k) = len(decode(ids[:k])).
        first, last = _tokens_within(tokenizer, ids, begin), _tokens_within(tokenizer, ids, end - 1)
        out[row, first:last + 1] = 1.0
    return out


def _tokens_within(tokenizer, ids, n_chars):
    """The largest k whose first k tokens decode to at most n_chars characters: a binary search
    (decoded length grows with k), so O(log C) decodes per row instead of one per token."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(ids[:mid])) <= n_chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


def switch_off_dropout(model):
    """Set every dropout probability in `model` to 0 -> the names of those that were on.

    nn.Dropout modules (what TRL's disable_dropout covers) and the float `attention_dropout` that
    HF attention layers (Qwen2, Llama, ...) hand to their attention kernel in training mode.
    """
    was_on = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            was_on.append(name)
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            module.attention_dropout = 0.0
            was_on.append(f"{name}.attention_dropout")
    return was_on


class LLDSGRPOTrainer(GRPOTrainer):
    """GRPOTrainer + lambda * LLDS. Constructed exactly like GRPOTrainer, plus keyword-only:

    llds_lambda: coefficient (0.2 in the paper; 0 turns LLDS off).
    llds_gate: "action" (default), "response" or "token" (see llds.py).
    llds_reduction: "policy" (default: TRL's normaliser for args.loss_type), "token-mean" or "seq-mean".
    llds_answer_coef: LLDS-MA: the last <answer>...</answer> span's coefficient, capped at
        llds_lambda (inf = plain LLDS); llds_answer_adaptive: it x max(V - 1, 0), V = tool calls
        without error per episode (needs tools).
    """

    def __init__(self, *args, llds_lambda=0.2, llds_gate="action", llds_reduction="policy",
                 llds_answer_coef=math.inf, llds_answer_adaptive=False, **kwargs):
        if llds_gate not in GATES:
            raise ValueError(f"LLDSGRPOTrainer: llds_gate must be one of {GATES}, got {llds_gate!r}")
        if llds_reduction not in REDUCTIONS:
            raise ValueError(f"LLDSGRPOTrainer: llds_reduction must be one of {REDUCTIONS}, got {llds_reduction!r}")
        if not (isinstance(llds_answer_coef, (int, float)) and llds_answer_coef >= 0):
            raise ValueError(f"LLDSGRPOTrainer: llds_answer_coef must be a number >= 0 or math.inf, "
                             f"got {llds_answer_coef!r}")
        super().__init__(*args, **kwargs)
        if self.loss_type not in POLICY_NORMALISER:
            raise ValueError(f"LLDSGRPOTrainer knows the normalisers of loss_type {sorted(POLICY_NORMALISER)}, "
                             f"not {self.loss_type!r}; add it to POLICY_NORMALISER")
        accumulation, per_generation = self.args.gradient_accumulation_steps, self.args.steps_per_generation
        if llds_lambda and accumulation % (per_generation * self.num_iterations) == 0:
            raise ValueError(
                f"LLDSGRPOTrainer: gradient_accumulation_steps ({accumulation}) is a multiple of steps_per_generation "
                f"x num_iterations ({per_generation} x {self.num_iterations}), so every pass over a generation batch "
                "falls inside one optimiser step: the policy is still the rollout policy, TRL computes no old "
                "log-probs and LLDS is exactly 0. Make it not a multiple, e.g. steps_per_generation = "
                f"{4 * accumulation} (4 x gradient_accumulation_steps: 4 optimiser steps per generation batch).")
        if llds_answer_adaptive and not self.tools:
            raise ValueError("LLDSGRPOTrainer: llds_answer_adaptive counts tool calls per episode; "
                             "pass tools=[...] or a fixed coefficient")
        if llds_lambda:
            was_on = switch_off_dropout(self.model)
            if was_on:
                warnings.warn(f"LLDSGRPOTrainer: switched off dropout in {len(was_on)} places ({was_on[0]}, ...): "
                              "LLDS compares the rollout-time and current log-probs of the same tokens, which "
                              "dropout would make differ by noise", stacklevel=2)
        self.llds_lambda, self.llds_gate = llds_lambda, llds_gate
        self.llds_reduction = llds_reduction
        self.llds_answer_coef, self.llds_answer_adaptive = llds_answer_coef, llds_answer_adaptive
        self._llds_logps, self._llds_valid_calls = None, 0

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._llds_logps = logps         # the last call inside _compute_loss is the one with grad
        return logps, entropies, aux_loss

    def _tool_call_loop(self, *args, **kwargs):
        out = super()._tool_call_loop(*args, **kwargs)
        tool_call_count, tool_failure_count = out[4], out[5]     # this process's generation batch
        self._llds_valid_calls = tool_call_count - tool_failure_count
        return out

    def _generate_and_score_completions(self, inputs):
        self._llds_valid_calls = 0
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return out
        model_tokens = out["completion_mask"] * out.get("tool_mask", 1)          # (B, C)
        if self.llds_reduction == "seq-mean":   # its denominator: preserving responses, all processes
            preserving = (out["advantages"] >= 0) & (model_tokens.sum(1) > 0)
            out["llds_num_preserving"] = self.accelerator.gather(preserving.sum()).sum()
        if self.llds_answer_adaptive or self.llds_answer_coef < self.llds_lambda:   # once per batch
            # The text runs through the tool results (completion_mask); the weight lands on model tokens only.
            answer = answer_mask(self.processing_class, out["completion_ids"], out["completion_mask"])
            out["llds_answer_mask"] = answer * model_tokens
            out["llds_answer_weight"] = torch.tensor(self.answer_weight(len(model_tokens)), device=answer.device)
        return out

    def answer_weight(self, n_episodes):
        """LLDS-MA's weight for this generation batch (llds.answer_weight); adaptive, V = tool calls
        without error per episode over all processes (this process has n_episodes of them)."""
        if not self.llds_answer_adaptive:
            return answer_weight(self.llds_lambda, self.llds_answer_coef)
        counts = torch.tensor([[self._llds_valid_calls, n_episodes]], dtype=torch.float32,
                              device=self.accelerator.device)
        calls, episodes = self.accelerator.gather(counts).sum(0).tolist()
        return answer_weight(self.llds_lambda, self.llds_answer_coef, calls / episodes)

    def _compute_loss(self, model, inputs):
        self._llds_logps = None
        loss = super()._compute_loss(model, inputs)
        if not self.model.training or not self.llds_lambda:
            return loss
        term, stats = self.llds_term(self._llds_logps, inputs)
        self._llds_logps = None
        if "llds_answer_weight" in inputs:
            stats["llds/answer_weight"] = inputs["llds_answer_weight"].item()
        # Logged per micro-batch, x the accumulation steps: their mean over a step is the step's LLDS.
        values = torch.tensor([term.item() * self.current_gradient_accumulation_steps, *stats.values()],
                              device=loss.device)
        for name, value in zip(["llds/loss", *stats], self.accelerator.gather(values[None]).mean(0).tolist()):
            self._metrics["train"][name].append(value)
        return loss + self.llds_lambda * term

    def llds_term(self, logp, inputs):
        """The LLDS penalty of one micro-batch (without lambda), normalised like TRL's policy term.

        logp (B, C): current log-probs of the completion tokens, with grad. -> (scalar, llds stats)
        """
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)              # (B, C) model tokens
        old_logp = inputs.get("old_per_token_logps")
        if old_logp is None:   # TRL skips it only when the policy is still the rollout policy
            old_logp = logp.detach()
        kind = POLICY_NORMALISER[self.loss_type] if self.llds_reduction == "policy" else self.llds_reduction
        per_response = kind in ("sequence-means", "seq-mean")
        reg, stats = llds_loss(logp, old_logp, inputs["advantages"], mask, gate=self.llds_gate,
                               answer_mask=inputs.get("llds_answer_mask"),
                               answer_weight=float(inputs.get("llds_answer_weight", 1.0)),
                               reduction="seq-mean" if per_response else "token-mean")
        # Undo llds_loss's own normaliser: `total` is a sum over this micro-batch (of each preserving
        # response's token mean when per_response, else of every penalised token's hinge).
        total = reg * (stats["llds/n_preserving"] if per_response else mask.sum().clamp(min=1))
        n_rows, accumulation = mask.shape[0], self.current_gradient_accumulation_steps
        # dapo's factor: the generation batch's count -> its average per optimiser step, per process.
        step_share = accumulation / self.args.steps_per_generation / self.accelerator.num_processes
        if kind in ("sequence-means", "sequences"):
            z = n_rows * accumulation
        elif kind == "micro-batch-tokens":
            z = mask.sum().clamp(min=1) * accumulation
        elif kind == "max-length":
            z = n_rows * self.max_completion_length * accumulation
        elif kind in ("step-tokens", "token-mean"):
            z = inputs["num_items_in_batch"].clamp(min=1) * step_share
        else:  # seq-mean
            z = inputs["llds_num_preserving"].clamp(min=1) * step_share
        return total / z, stats
