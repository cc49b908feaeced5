"""integrations/trl_llds.py: LLDS inside TRL's GRPOTrainer. Copy this file next to llds.py.

    from trl import GRPOConfig
    from trl_llds import LLDSGRPOTrainer
    args = GRPOConfig(output_dir="out", loss_type="dapo", per_device_train_batch_size=8,
                      gradient_accumulation_steps=4, steps_per_generation=16)  # 4 optimiser steps per batch
    trainer = LLDSGRPOTrainer(model, reward_funcs=exact_match, args=args, train_dataset=ds,
                              tools=[search], llds_lambda=0.2, llds_gate="action")
    trainer.train()                                  # logs llds/loss, llds/active_token_frac, ...

What it adds to GRPOTrainer (written against TRL 1.16, `trl/trainer/grpo_trainer.py`): in
`_compute_loss`, after TRL's own loss, `llds_lambda * llds_loss(...)` with
- the current log-probs: caught where `_get_per_token_logps_and_entropies` makes them with grad
  (they are local to `_compute_loss`);
- the rollout policy's log-probs `old_per_token_logps` and TRL's `advantages`;
- model tokens only: `completion_mask * tool_mask` (tool results are 0 in `tool_mask`), the mask
  TRL's policy term uses;
- by default the normaliser TRL applies to its policy term for the configured `loss_type`
  (per-sequence means for grpo/sapo, micro-batch tokens for bnpo, B x max_completion_length for
  dr_grpo, sequences for luspo, the tokens of the whole optimiser step on all processes for
  dapo/cispo/vespo), so lambda weighs LLDS against the policy term exactly as in the paper.
  `llds_reduction="token-mean"` (the authors' code: every model token of the optimiser step) or
  `"seq-mean"` (the paper's eq. 4: per response, then over the step's preserving responses)
  choose llds.py's normalisers instead, counted over the optimiser step on all processes.

LLDS is exactly 0 when each generation batch feeds a single optimiser step (the policy then IS
the rollout policy), so that configuration is an error: set `steps_per_generation` to a multiple
of `gradient_accumulation_steps` above it, or `num_iterations` > 1.
Not offered: the paper's adaptive answer weight min(V/2, 1); set `trainer.llds_answer_weight`
yourself (e.g. from TRL's `tools/call_frequency` in a callback) if you want it.
"""
import re

import torch
from trl import GRPOTrainer

from llds import GATES, llds_loss

# How GRPOTrainer._compute_loss normalises its policy term, per loss_type (TRL 1.16).
POLICY_NORMALISER = {"grpo": "sequence-means", "sapo": "sequence-means", "bnpo": "micro-batch-tokens",
                     "dr_grpo": "max-length", "luspo": "sequences", "dapo": "step-tokens",
                     "cispo": "step-tokens", "vespo": "step-tokens"}
REDUCTIONS = ("policy", "token-mean", "seq-mean")
_ANSWER_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def answer_mask(tokenizer, completion_ids, completion_mask):
    """(B, C) float: 1 on the tokens of each completion's last <answer>...</answer> (tags included).

    A token belongs to the span when its decoded characters overlap the span's characters.
    """
    out = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    for row, (ids, n) in enumerate(zip(completion_ids.tolist(), completion_mask.sum(1).tolist())):
        ids = ids[:int(n)]
        spans = list(_ANSWER_RE.finditer(tokenizer.decode(ids)))
        if not spans:
            continue
        begin, end = spans[-1].span()
        start = 0                                    # characters decoded before token i
        for i in range(len(ids)):
            if start >= end:
                break
            stop = len(tokenizer.decode(ids[:i + 1]))
            if stop > begin:
                out[row, i] = 1.0
            start = stop
    return out


class LLDSGRPOTrainer(GRPOTrainer):
    """GRPOTrainer + lambda * LLDS. Constructed exactly like GRPOTrainer, plus keyword-only:

    llds_lambda: coefficient (0.2 in the paper; 0 turns LLDS off).
    llds_gate: "action" (default), "response" or "token" (see llds.py).
    llds_reduction: "policy" (default: TRL's normaliser for args.loss_type), "token-mean" or "seq-mean".
    llds_answer_weight: LLDS-MA weight beta on the last <answer>...</answer> span (1.0 = plain LLDS).
    """

    def __init__(self, *args, llds_lambda=0.2, llds_gate="action", llds_reduction="policy",
                 llds_answer_weight=1.0, **kwargs):
        if llds_gate not in GATES:
            raise ValueError(f"LLDSGRPOTrainer: llds_gate must be one of {GATES}, got {llds_gate!r}")
        if llds_reduction not in REDUCTIONS:
            raise ValueError(f"LLDSGRPOTrainer: llds_reduction must be one of {REDUCTIONS}, got {llds_reduction!r}")
        super().__init__(*args, **kwargs)
        if self.loss_type not in POLICY_NORMALISER:
            raise ValueError(f"LLDSGRPOTrainer knows the normalisers of loss_type {sorted(POLICY_NORMALISER)}, "
                             f"not {self.loss_type!r}; add it to POLICY_NORMALISER")
        generate_every = self.args.steps_per_generation * self.num_iterations
        if llds_lambda and self.args.gradient_accumulation_steps % generate_every == 0:
            raise ValueError(
                "LLDSGRPOTrainer: each generation batch feeds ONE optimiser step (gradient_accumulation_steps="
                f"{self.args.gradient_accumulation_steps}, steps_per_generation={self.args.steps_per_generation}, "
                f"num_iterations={self.num_iterations}), so the policy never moves away from the rollout policy "
                "and LLDS is exactly 0. Set steps_per_generation to a multiple of gradient_accumulation_steps "
                "(e.g. 2x or 4x), or num_iterations > 1.")
        self.llds_lambda, self.llds_gate = llds_lambda, llds_gate
        self.llds_reduction, self.llds_answer_weight = llds_reduction, llds_answer_weight
        self._llds_logps = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._llds_logps = logps         # the last call inside _compute_loss is the one with grad
        return logps, entropies, aux_loss

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.llds_reduction == "seq-mean":   # its denominator: preserving responses, all processes
            mask = out["completion_mask"] * out.get("tool_mask", 1)
            preserving = (out["advantages"] >= 0) & (mask.sum(1) > 0)
            out["llds_num_preserving"] = self.accelerator.gather(preserving.sum()).sum()
        return out

    def _compute_loss(self, model, inputs):
        self._llds_logps = None
        loss = super()._compute_loss(model, inputs)
        if not self.model.training or not self.llds_lambda:
            return loss
        term, stats = self.llds_term(self._llds_logps, inputs)
        self._llds_logps = None
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
        answer = (answer_mask(self.processing_class, inputs["completion_ids"], mask)
                  if self.llds_answer_weight != 1.0 else None)
        kind = POLICY_NORMALISER[self.loss_type] if self.llds_reduction == "policy" else self.llds_reduction
        per_response = kind in ("sequence-means", "seq-mean")
        reg, stats = llds_loss(logp, old_logp, inputs["advantages"], mask, gate=self.llds_gate,
                               answer_mask=answer, answer_weight=self.llds_answer_weight,
                               reduction="seq-mean" if per_response else "token-mean")
        # Undo llds_loss's own normaliser: `total` is a sum over this micro-batch (of each preserving
        # response's token mean when per_response, else of every penalised token's hinge).
        total = reg * (stats["llds/n_preserving"] if per_response else mask.sum().clamp(min=1))
        n_rows, accumulation = mask.shape[0], self.current_gradient_accumulation_steps
        # dapo's factor: this process's share of one optimiser step of the generation batch.
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
