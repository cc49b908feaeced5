"""train.py: GRPO + LLDS training of a search agent (Search-R1 re-implementation).

(Placeholder: the training loop and this docstring's full description come with issue 5.)

The algorithm section below is the GRPO objective of Search-R1 (Jin et al., arXiv 2503.09516)
as used by Deng et al. (arXiv 2512.04220): group-relative advantages, the PPO clipped
surrogate on token ratios, the k3 KL to the frozen reference and the token entropy. The LLDS
regulariser lives in llds.py. All per-token tensors are (B, T) and aligned with the token they
score: position t holds log p(token_t | tokens_<t); callers shift logits by one.
"""
import torch


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


if __name__ == "__main__":
    print("train.py: the training loop is not written yet (issue 5); see README.")
    raise SystemExit(0)
