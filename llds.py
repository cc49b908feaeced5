# SPDX-License-Identifier: MIT. Copyright (c) 2026 the search-r1-llds authors (see LICENSE).
"""LLDS: likelihood-preserving regularisation for GRPO on agent-search trajectories.

Re-implements the regulariser of Deng et al., "On GRPO Collapse in Search-R1: The Lazy
Likelihood-Displacement Death Spiral" (arXiv 2512.04220), as one loss function you can copy into
any trainer. Imports only torch.

The problem. In multi-turn search RL a trajectory alternates model *actions* (one assistant
turn: think + search, or the final answer) with tool *observations* (retrieved passages) that
get no gradient. Under GRPO the log-likelihood of correct trajectories often stagnates and
then falls while reward still rises ("lazy likelihood displacement"); entropy then grows, the
gradient norm explodes and training collapses. Incorrect responses that resemble correct ones
push their shared tokens down.

The fix. Within one rollout batch the policy takes several optimiser steps (mini-batches). For
token k of action t of response i, the displacement against the rollout-time policy is

    d_itk = log pi_old(y_itk) - log pi_theta(y_itk)        (> 0: the token lost likelihood)

where pi_old is the policy that *generated the rollout* (the one in the PPO ratio), not the
frozen reference model. Only responses with advantage A_i >= 0 are protected (correct ones
and zero-advantage ones); responses with A_i < 0 are never regularised. An action's gate
opens when its net displacement is positive, sum_k d_itk > 0 (computed without gradient),
and then every token of it whose likelihood fell pays a one-sided hinge:

    L_LLDS = (1 / Z) * sum_{i: A_i >= 0} sum_t sum_k  1[sum_k' d_itk' > 0] * max(0, d_itk) * w_itk
    L_total = L_GRPO + lambda * L_LLDS                       (lambda = 0.2 in the paper)

The hinge's gradient is -grad log pi_theta on exactly the tokens whose probability fell: a
lambda-weighted likelihood push-up. With one optimiser step per rollout batch, d == 0 and L == 0.

Options, all from the paper or the authors' code:
- gate="action" (default, best in the paper): an action is a maximal run of consecutive
  loss-mask tokens, so observations (loss_mask 0) split actions. gate="response" uses one gate
  per response (sum of d over all its model tokens); gate="token" has no gate at all.
- answer_mask / answer_weight (LLDS-MA): w = answer_weight (the paper's beta) on the final
  <answer>...</answer> span, w = 1 elsewhere. The weight scales the penalty, not the gate.
- reduction="token-mean" (the authors' code): Z = number of loss-mask tokens of ALL responses
  in the batch, negative-advantage ones included. reduction="seq-mean" (the paper's eq. 4):
  each preserving response is divided by its own number of model tokens, then the mean is
  taken over preserving responses (0 if there are none).

Choices made here (not fixed by the paper):
- advantages may be (B,) or (B, T). For (B, T) the response's advantage is the mean over its
  loss-mask tokens; GRPO advantages are constant along a response, so this is exactly A_i
  (values outside the loss mask are ignored, so veRL's zero-padded layout works as is).
- The gate uses the raw float32 displacement; a net displacement of exactly 0 keeps the gate
  shut (the paper's strict "> 0"), and a token with d == 0 gets no gradient.
- NaN/inf where loss_mask == 0 are replaced (torch.where) first: they reach neither loss nor grad.

Stats returned (floats, veRL-style names):
    llds/active_token_frac    penalised tokens / tokens of preserving responses
    llds/active_action_frac   actions with an open gate / actions of preserving responses
                              (always 1.0 for gate="token", response-level for "response")
    llds/displacement         mean d over tokens of preserving responses (> 0: likelihood fell)
    llds/n_preserving         number of preserving responses (A >= 0, at least one model token)
"""
import torch

GATES = ("action", "response", "token")
REDUCTIONS = ("token-mean", "seq-mean")


def action_ids(mask):
    """0 outside the mask; 1..K numbering the maximal contiguous runs of 1s in each row.

    mask: (B, T) bool or 0/1 -> (B, T) long.
    """
    on = mask.bool()
    return _run_starts(on).cumsum(dim=1) * on


def _run_starts(on):
    # (B, T) bool -> (B, T) bool: True on the first token of every run of True.
    starts = on.clone()
    starts[:, 1:] &= ~on[:, :-1]
    return starts


def _response_advantage(advantages, valid, n_tok):
    # (B,) or (B, T) -> (B,) float: one advantage per response (see module docstring).
    if advantages.dim() == 1:
        return advantages.float()
    total = torch.where(valid, advantages.float(), 0.0).sum(dim=1)
    return total / n_tok.clamp(min=1)


def preserving_responses(advantages, loss_mask):
    """(B,) bool: the responses LLDS protects, advantage >= 0 and at least one model token."""
    valid = loss_mask > 0
    n_tok = valid.sum(dim=1)
    return (_response_advantage(advantages, valid, n_tok) >= 0) & (n_tok > 0)


def _gate(gate, d, valid, preserving, starts):
    """Which tokens may pay, and how many actions have an open gate (for the stats).

    d: (B, T) float32, 0 outside the loss mask; valid, starts: (B, T) bool; preserving: (B,)
    bool -> (open: (B, T) bool, n_open_actions: scalar tensor).
    """
    if gate == "token":
        open_ = valid & preserving[:, None]
        return open_, (starts.sum(dim=1) * preserving).sum()
    if gate == "response":
        on = preserving & (d.sum(dim=1) > 0)
        return valid & on[:, None], (starts.sum(dim=1) * on).sum()
    # Number the actions of preserving responses 1..N across the whole batch (0 = everything
    # else), sum d per action with one index_add, and look the gate back up per token.
    keep = valid & preserving[:, None]
    ids = starts.flatten().cumsum(dim=0).view_as(d) * keep
    n_actions = int(starts.sum())
    sums = d.new_zeros(n_actions + 1).index_add_(0, ids.flatten(), d.flatten())
    on = sums > 0
    on[0] = False
    return on[ids], on.sum()


def llds_loss(logp, old_logp, advantages, loss_mask, *, gate="action",
              answer_mask=None, answer_weight=1.0, reduction="token-mean", denominator=None):
    """LLDS penalty (without lambda; the caller adds `lam * loss`).

    logp (B, T): log-probs of the sampled tokens under the current policy (carries grad).
    old_logp (B, T): the same under the rollout-time policy (treated as constant).
    advantages (B,) or (B, T); loss_mask (B, T): 1 on model tokens only.
    answer_mask (B, T) or None: nonzero on the final answer span, weighted by answer_weight.
    denominator: Z when this batch is a micro-batch of a larger one (gradient accumulation): the
    larger batch's loss-mask tokens (token-mean) or preserving responses (seq-mean); None: these.
    -> (loss: float32 scalar tensor, stats: dict[str, float]; names in the module docstring)
    """
    if gate not in GATES:
        raise ValueError(f"llds_loss: gate must be one of {GATES}, got {gate!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"llds_loss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if logp.shape != old_logp.shape or logp.shape != loss_mask.shape or logp.dim() != 2:
        raise ValueError("llds_loss: logp, old_logp and loss_mask must all be (B, T); got "
                         f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(loss_mask.shape)}")
    valid = loss_mask > 0                                        # (B, T) bool
    # d carries grad; it may hold NaN/inf outside the mask, which torch.where below never
    # selects (and whose backward sends exactly 0 there, so no NaN * 0 in the gradient either).
    d = old_logp.detach().float() - logp.float()                 # (B, T)

    with torch.no_grad():
        d_value = torch.where(valid, d, 0.0)                     # (B, T) float32, clean, no grad
        n_tok = valid.sum(dim=1)                                 # (B,) model tokens
        preserving = preserving_responses(advantages, loss_mask)
        starts = _run_starts(valid)
        open_, n_open_actions = _gate(gate, d_value, valid, preserving, starts)
        penalised = open_ & (d_value > 0)                        # (B, T) bool

    hinge = torch.where(penalised, d, 0.0)                       # (B, T), = max(0, d) if open
    if answer_mask is not None:
        hinge = hinge * torch.where(answer_mask > 0, float(answer_weight), 1.0)
    if reduction == "token-mean":
        total, z = hinge.sum(), n_tok.sum()
    else:   # per response (B,), 0 if not preserving
        total, z = (hinge.sum(dim=1) / n_tok.clamp(min=1)).sum(), preserving.sum()
    loss = total / (z.clamp(min=1) if denominator is None else denominator)

    with torch.no_grad():
        n_pres_tok = (n_tok * preserving).sum()
        n_pres_actions = (starts.sum(dim=1) * preserving).sum()
        values = torch.stack([
            penalised.sum() / n_pres_tok.clamp(min=1),
            n_open_actions / n_pres_actions.clamp(min=1),
            (d_value.sum(dim=1) * preserving).sum() / n_pres_tok.clamp(min=1),
            preserving.sum().float(),
        ]).tolist()
    names = ("llds/active_token_frac", "llds/active_action_frac", "llds/displacement",
             "llds/n_preserving")
    return loss, dict(zip(names, values))
