"""integrations/verl_llds.py: LLDS in veRL's actor update. Put this file and llds.py on the
PYTHONPATH of the process that starts Ray (its workers inherit it).

veRL (0.9, `verl/workers/utils/losses.py::ppo_loss`) holds response-only tensors of shape (B, R):
`log_prob` (with grad), `old_log_prob` (recomputed by the actor before the update: the rollout
policy, what LLDS needs), `advantages` (GRPO's score broadcast over the response and zero-padded),
`response_mask` (1 on model tokens; multi-turn rollouts zero the tool observations). Where the
LLDS authors put it, right after the policy loss:

    llds, llds_metrics = llds_verl_loss(log_prob, old_log_prob, advantages, response_mask,
                                        loss_agg_mode, gate=config.llds_gate, **config.global_batch_info)
    policy_loss += config.llds_coef * llds

`integrations/verl_llds.patch` is that change for veRL 0.9.1 (plus the `llds_coef` / `llds_gate`
config fields): `cd verl && git apply verl_llds.patch`, then train with
`actor_rollout_ref.actor.llds_coef=0.2` and several mini-batches per batch
(`ppo_mini_batch_size` < `data.train_batch_size`; the paper: 512 prompts, 256 per mini-batch).
Older veRL (Search-R1's fork, `dp_actor.update_policy`) has no aggregation modes: there, add
`policy_loss = policy_loss + llds_coef * llds_verl_loss(log_prob, old_log_prob, advantages,
response_mask)[0]` after `policy_loss = pg_loss - entropy_loss * entropy_coeff`, with the
state-masked `response_mask` (observations excluded).
"""
from llds import llds_loss

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def llds_verl_loss(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
                   gate="action", answer_mask=None, answer_weight=1.0, dp_size=1, batch_num_tokens=None,
                   global_batch_size=None, loss_scale_factor=None):
    """The LLDS penalty (without its coefficient), aggregated exactly as veRL's `agg_loss`
    aggregates the policy loss for `loss_agg_mode` and the same global batch information.

    log_prob, old_log_prob, response_mask (B, R); advantages (B, R) zero-padded or (B,).
    -> (loss scalar, {"actor/llds_active_token_frac", ...: float})
    """
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"llds_verl_loss: loss_agg_mode must be one of {AGG_MODES}, got {loss_agg_mode!r}")
    mask = response_mask.float()
    per_response = loss_agg_mode == "seq-mean-token-mean"
    reg, stats = llds_loss(log_prob, old_log_prob, advantages, mask, gate=gate, answer_mask=answer_mask,
                           answer_weight=answer_weight, reduction="seq-mean" if per_response else "token-mean")
    # Undo llds_loss's normaliser: a sum over this micro-batch, of each preserving response's token
    # mean for seq-mean-token-mean, of the hinge of every penalised token otherwise.
    total = reg * (stats["llds/n_preserving"] if per_response else mask.sum().clamp(min=1))
    if loss_agg_mode == "token-mean":
        loss = total / (mask.sum().clamp(min=1) if batch_num_tokens is None else batch_num_tokens)
    elif loss_agg_mode == "token-sum":
        loss = total
    else:
        n_responses = (mask.sum(-1) > 0).sum().clamp(min=1) if global_batch_size is None else global_batch_size
        loss = total / n_responses
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss * dp_size, {name.replace("llds/", "actor/llds_"): value for name, value in stats.items()}
