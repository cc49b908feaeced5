"""integrations/verl_llds.py: LLDS in veRL's actor update. Put this file and llds.py on the
PYTHONPATH of the process that starts Ray (its workers inherit it).

veRL (0.9, `verl/workers/utils/losses.py::ppo_loss`) holds response-only tensors of shape (B, R):
`log_prob` (with grad), `old_log_prob`, `advantages` (GRPO's score broadcast over the response and
zero-padded), `response_mask` (1 on model tokens; multi-turn rollouts zero the tool observations).
`old_log_prob` must be the rollout policy's log-probs recomputed by the actor before the update,
what LLDS measures displacement against. veRL's `algorithm.rollout_correction.bypass_mode=True`
replaces them with the sampler's (vLLM/SGLang) log-probs (`ray_trainer.py` -> `apply_bypass_mode`:
old_log_probs = rollout_log_probs), so LLDS would penalise the sampler-trainer mismatch from the
first update on: `check_verl_config` refuses it. Where the LLDS authors put the penalty, right after
the policy loss:

    llds, llds_metrics = llds_verl_loss(log_prob, old_log_prob, advantages, response_mask,
                                        llds_agg_mode(config), gate=config.llds_gate, **config.global_batch_info)
    policy_loss += config.llds_coef * llds

`llds_agg_mode` is the aggregation veRL applies to the policy loss: `loss_agg_mode`, except for the
loss modes that force their own (sapo: seq-mean-token-mean). `integrations/verl_llds.patch` is that
change for veRL 0.9.1, plus the `llds_coef` / `llds_gate` config fields and `check_verl_config` in
veRL's startup checks: `cd verl && git apply verl_llds.patch`, then train with
`actor_rollout_ref.actor.llds_coef=0.2` and several optimiser steps per batch (`ppo_mini_batch_size`
< `data.train_batch_size`; veRL 0.9 multiplies it by `rollout.n`, so 500 prompts and 50 per
mini-batch give the authors' 10 updates a batch; or `ppo_epochs` > 1).
Older veRL (Search-R1's fork, `dp_actor.update_policy`) has no aggregation modes: there, after
`policy_loss = pg_loss - entropy_loss * entropy_coeff`, add

    llds, _ = llds_verl_loss(log_prob, old_log_prob, advantages, response_mask)
    policy_loss = policy_loss + llds_coef * llds

with the state-masked `response_mask` (observations excluded).
"""
from llds import GATES, llds_loss

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
# veRL 0.9.1 loss modes (core_algos.py) that aggregate their policy loss whatever loss_agg_mode says.
FORCED_AGG_MODE = {"sapo": "seq-mean-token-mean"}
# Loss modes LLDS cannot sit beside: why.
REFUSED_LOSS_MODES = {
    "bypass_mode": "its old_log_probs are the sampler's log-probs, not the actor's recomputed ones",
    "geo_mean": "it averages over the micro-batch's sequences without veRL's global batch information",
}


def llds_agg_mode(config):
    """The loss_agg_mode veRL 0.9.1 applies to the policy loss of this ActorConfig (ValueError where
    LLDS cannot follow it)."""
    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    if loss_mode in REFUSED_LOSS_MODES:
        raise ValueError(f"LLDS (llds_coef > 0) does not work with policy_loss.loss_mode={loss_mode!r}: "
                         f"{REFUSED_LOSS_MODES[loss_mode]}. Use another loss mode or llds_coef=0.")
    return FORCED_AGG_MODE.get(loss_mode, config.loss_agg_mode)


def check_verl_config(actor_config, rollout_correction=None):
    """veRL's startup check (`verl.utils.config.validate_config`) for LLDS: ValueError with what to change."""
    if actor_config.llds_gate not in GATES:
        raise ValueError(f"actor.llds_gate must be one of {GATES}, got {actor_config.llds_gate!r}")
    if rollout_correction is not None and rollout_correction.get("bypass_mode", False):
        raise ValueError("LLDS (actor.llds_coef > 0) needs old_log_probs recomputed by the actor, and "
                         "algorithm.rollout_correction.bypass_mode=True replaces them with the sampler's "
                         "log-probs: LLDS would penalise the sampler-trainer mismatch. Set bypass_mode=False.")
    llds_agg_mode(actor_config)


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
    # As agg_loss: with several data-parallel ranks, local counts would weigh each rank's batch differently.
    missing = ("batch_num_tokens" if loss_agg_mode == "token-mean" and batch_num_tokens is None else
               "global_batch_size" if loss_agg_mode.startswith("seq-mean") and global_batch_size is None else None)
    if dp_size > 1 and missing:
        raise ValueError(f"llds_verl_loss: {loss_agg_mode} with dp_size={dp_size} needs the global {missing} "
                         "(pass veRL's config.global_batch_info)")
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
