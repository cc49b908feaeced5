# SPDX-License-Identifier: MIT. Copyright (c) 2026 the search-r1-llds authors (see LICENSE).
"""LLDS: likelihood-preserving regularisation for GRPO on agent-search episodes.

Re-implements the regulariser of Deng et al., "On GRPO Collapse in Search-R1: The Lazy
Likelihood-Displacement Death Spiral" (arXiv 2512.04220), as one loss function you can copy into
any trainer. Imports only torch.

The problem. A search agent's response alternates model *actions* (think + search, or the
final answer) with tool *observations* (retrieved passages) that get no gradient. Under GRPO the
likelihood of correct responses often stagnates, then falls while reward still rises ("lazy
likelihood displacement": incorrect responses that resemble them push shared tokens down);
entropy then grows, the gradient norm explodes and training collapses.

The fix. Within one rollout batch the policy takes several updates (one AdamW step per
mini-batch). For token k of action t of response i, the displacement against the rollout-time
policy is

    d_itk = log pi_old(y_itk) - log pi_theta(y_itk)        (> 0: the token lost likelihood)

where pi_old is the policy that *generated the rollout* (the one in the PPO ratio), not the
frozen reference model. Only responses with advantage A_i >= 0 are protected (correct ones
and zero-advantage ones); responses with A_i < 0 are never regularised. An action's gate
opens when its net displacement is positive, sum_k d_itk > 0 (computed without gradient),
and then every token of it whose likelihood fell pays a one-sided hinge:

    L_LLDS = (1 / Z) * sum_{i: A_i >= 0} sum_t sum_k  1[sum_k' d_itk' > 0] * max(0, d_itk) * w_itk
    L_total = L_GRPO + lambda * L_LLDS                       (lambda = 0.2 in the paper)

The hinge's gradient is -grad log pi_theta on exactly the tokens whose probability fell: a
lambda-weighted likelihood push-up. With one update per rollout batch, d == 0 and L == 0.

Options:
- gate="action" (default, best in the paper): an action is a maximal run of loss-mask tokens,
  so observations split actions; gate="response": one gate per response; "token": no gate.
- answer_mask, answer_weight (LLDS-MA): w = answer_weight on the final <answer>...</answer>
  span, 1 elsewhere; it scales the penalty, not the gate. answer_weight() sets it as the
  authors' code does.
- reduction="token-mean": Z = the loss-mask tokens of ALL responses in the batch. Called per
  micro-batch and divided by their number, this is the authors' code; given denominator= the
  mini-batch's count (train.py), it is current veRL's and DAPO's token-mean, every token alike.
  "seq-mean" (the paper's eq. 4): each preserving response over its own model tokens, then the
  mean over preserving responses (0 if there are none).

Choices made here (not fixed by the paper):
- advantages (B,) or (B, T); for (B, T) a response's advantage is the mean over its loss-mask
  tokens, exactly A_i for GRPO (veRL's zero-padded layout works as is).
- An action's net displacement must be > 0 (the paper's strict "> 0"); a token with d == 0
  gets no gradient (the authors' torch.maximum gives it half).
- NaN/inf where loss_mask == 0 reach neither loss nor gradient (torch.where).

Stats returned (floats, veRL-style names; train.py logs the two fractions, averaged over the
step's micro-batches; integrations/ logs all four):
    llds/active_token_frac    penalised tokens / tokens of preserving responses
    llds/active_action_frac   actions with an open gate / actions of preserving responses
                              (always 1.0 for gate="token", response-level for "response")
    llds/displacement         mean d over tokens of preserving responses (> 0: likelihood fell)
    llds/n_preserving         number of preserving responses (A >= 0, at least one model token)
"""
import torch

GATES = ("action", "response", "token")
REDUCTIONS = ("token-mean", "seq-mean")


def action_starts(loss_mask):
    """loss_mask (B, T) bool or 0/1 -> (B, T) bool: True on the first token of each action, a
    maximal run of model tokens (an observation between two turns ends one)."""
    on = loss_mask.bool()
    starts = on.clone()
    starts[:, 1:] &= ~on[:, :-1]
    return starts


def action_ids(loss_mask):
    """loss_mask (B, T) bool or 0/1 -> (B, T) long: each row's actions numbered 1..K, else 0."""
    return action_starts(loss_mask).cumsum(dim=1) * loss_mask.bool()


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
        preserving = preserving_responses(advantages, loss_mask)    # (B,) bool
        starts = action_starts(valid)                            # (B, T) bool
        # The gate: which tokens may pay. "action": the actions of preserving responses numbered
        # 1..N across the batch (0: everything else), d summed per action with one index_add, the
        # sign looked back up per token. "response": one sum per response. "token": no gate.
        if gate == "action":
            ids = starts.flatten().cumsum(dim=0).view_as(d) * (valid & preserving[:, None])
            sums = d_value.new_zeros(int(starts.sum()) + 1).index_add_(0, ids.flatten(),
                                                                       d_value.flatten())
            on = sums > 0
            on[0] = False
            open_, n_open_actions = on[ids], on.sum()
        elif gate == "response":
            on = preserving & (d_value.sum(dim=1) > 0)
            open_, n_open_actions = valid & on[:, None], (starts.sum(dim=1) * on).sum()
        else:
            open_, n_open_actions = valid & preserving[:, None], (starts.sum(1) * preserving).sum()
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
        n_pres_tok = (n_tok * preserving).sum().clamp(min=1)
        n_pres_actions = (starts.sum(dim=1) * preserving).sum().clamp(min=1)
        stats = {"llds/active_token_frac": penalised.sum() / n_pres_tok,
                 "llds/active_action_frac": n_open_actions / n_pres_actions,
                 "llds/displacement": (d_value.sum(dim=1) * preserving).sum() / n_pres_tok,
                 "llds/n_preserving": preserving.sum().float()}
        return loss, dict(zip(stats, torch.stack(list(stats.values())).tolist()))


def answer_weight(lam, coef, valid_searches=None):
    """LLDS-MA's answer_weight as the authors' code sets it, relative to lam: the answer span's
    coefficient min(coef, lam), adaptively min(coef * max(V - 1, 0), lam), V = valid_searches the
    batch's mean valid searches per episode (coef = inf: no masking; adaptively 0 while
    V <= 1, where their formula gives NaN). The paper's appendix writes the adaptive one as
    min(V / 2, 1) x lam: 0.5 lam at V = 1, where the code gives 0. The authors' shipped script
    leaves LLDS-MA off (MASK_ANS=false; its MASK_WEIGHT 0.2 is lambda)."""
    if valid_searches is not None:
        coef = coef * (valid_searches - 1) if valid_searches > 1 else 0.0
    return min(coef, lam) / lam if lam > 0 else 1.0
