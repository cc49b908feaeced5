"""Parity with the LLDS authors' veRL fork (github.com/vengdeng/LLDS-On-Group-Relative-Policy-
Optimization-Collapse-in-Search-R1 at c19a094): where we claim their numbers, the same numbers;
where we do not, the difference docs/method.md names, and no other.

`authors_micro_loss` restates in plain per-row loops what their actor computes for one
micro-batch (`dp_actor.py` update_policy, `core_algos.py` compute_policy_loss and kl_penalty
"low_var_kl"): each term a token-mean over the micro-batch's model tokens, the ratio clamped at
100 before PPO's clip, LLDS's coefficient lambda off the answer span and min(w, lambda) on it
(adaptively min(w * max(V - 1, 0), lambda)). A mini-batch is the mean of its micro-batches: their
loss / gradient-accumulation steps, and FSDP's mean over GPUs of equal micro-batch counts.
"""
import math

import pytest
import torch

import train
from llds import answer_weight, llds_loss


def authors_micro_loss(logp, old, ref, entropy, adv, mask, answer, *, lam, gate, w=math.inf,
                       valid_searches=None, clip=0.2, kl_coef=0.001, entropy_coef=0.001):
    """One micro-batch's loss as the authors' actor computes it. (B, T) tensors (logp with grad);
    adv (B,); mask: model tokens; answer: 1 on the final answer span."""
    if valid_searches is not None:
        w = w * max(valid_searches - 1, 0) if math.isfinite(w) else w
    answer_coef = min(w, lam)
    pg = ent = kl = reg = 0.0
    n = 0
    for i in range(len(logp)):
        tokens = [t for t in range(logp.shape[1]) if mask[i, t]]
        n += len(tokens)
        d = {t: old[i, t] - logp[i, t] for t in tokens}
        for t in tokens:
            ratio = torch.clamp(torch.exp(logp[i, t] - old[i, t]), -100.0, 100.0)
            pg = pg + torch.max(-adv[i] * ratio, -adv[i] * torch.clamp(ratio, 1 - clip, 1 + clip))
            ent = ent + entropy[i, t]
            u = ref[i, t] - logp[i, t]
            kl = kl + torch.clamp(torch.exp(u) - u - 1, -10.0, 10.0)
        if adv[i] < 0:
            continue
        if gate == "response":
            pieces = [tokens]
        else:       # runs of consecutive model tokens
            pieces = []
            for t in tokens:
                if pieces and pieces[-1][-1] == t - 1:
                    pieces[-1].append(t)
                else:
                    pieces.append([t])
        for piece in pieces:
            if sum(d[t].item() for t in piece) > 0:
                for t in piece:
                    coef = answer_coef if answer[i, t] else lam
                    reg = reg + coef * torch.clamp(d[t], min=0.0)
    return (pg - entropy_coef * ent + kl_coef * kl + reg) / max(n, 1)


def ours_micro_loss(logp, old, ref, entropy, adv, mask, answer, *, lam, gate, n_tokens,
                    w=math.inf, valid_searches=None, clip=0.2, kl_coef=0.001, entropy_coef=0.001):
    """One micro-batch's loss as train.py's step 4 writes it, every term over n_tokens."""
    pg, _ = train.policy_loss(logp, old, adv, mask, clip, n_tokens)
    beta = answer_weight(lam, w, valid_searches)
    reg, _ = llds_loss(logp, old, adv, mask, gate=gate, answer_mask=answer, answer_weight=beta,
                       denominator=n_tokens)
    kl = train.masked_sum(train.kl_k3(logp, ref), mask) / n_tokens
    return pg - entropy_coef * train.masked_sum(entropy, mask) / n_tokens + kl_coef * kl + lam * reg


def random_micro_batch(gen, rows, length, lengths=None):
    """A micro-batch of `rows` responses after a prompt of 3 tokens, with an observation cutting
    each into two actions and an answer span at its end; float64 so sums are exact to 1e-12."""
    lengths = lengths or torch.randint(6, length + 1, (rows,), generator=gen).tolist()
    mask = torch.zeros(rows, length + 3)
    answer = torch.zeros(rows, length + 3)
    for i, n in enumerate(lengths):
        mask[i, 3:3 + n] = 1
        mask[i, 3 + n // 2] = 0                              # the observation
        answer[i, 3 + n - 2:3 + n] = 1
    old = -torch.rand(rows, length + 3, generator=gen, dtype=torch.float64) * 2
    logp = (old + 0.3 * torch.randn(rows, length + 3, generator=gen, dtype=torch.float64))
    ref = old + 0.1 * torch.randn(rows, length + 3, generator=gen, dtype=torch.float64)
    entropy = torch.rand(rows, length + 3, generator=gen, dtype=torch.float64)
    adv = torch.tensor([1.0, 0.0, -0.5, 0.7, -1.2, 0.0][:rows], dtype=torch.float64)
    return dict(logp=logp.requires_grad_(), old=old, ref=ref, entropy=entropy, adv=adv, mask=mask,
                answer=answer)


MA = [dict(), dict(w=0.05), dict(w=0.4), dict(w=0.1, valid_searches=0.8),
      dict(w=0.1, valid_searches=1.0), dict(w=0.1, valid_searches=2.5),
      dict(w=0.3, valid_searches=3.0)]


@pytest.mark.parametrize("gate", ["action", "response"])
@pytest.mark.parametrize("ma", MA, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()) or "no-MA")
def test_one_micro_batch_is_the_authors_loss_and_gradient(gate, ma):
    """With n_tokens = the micro-batch's own tokens our terms are theirs: the per-token loss,
    LLDS's gates and LLDS-MA's capped coefficient (fixed and adaptive)."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        mb = random_micro_batch(gen, rows=6, length=12)
        theirs = authors_micro_loss(*mb.values(), lam=0.2, gate=gate, **ma)
        ours = ours_micro_loss(*mb.values(), lam=0.2, gate=gate, n_tokens=mb["mask"].sum(), **ma)
        (g_theirs,) = torch.autograd.grad(theirs, mb["logp"])
        (g_ours,) = torch.autograd.grad(ours, mb["logp"])
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-9)
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-6, atol=1e-9)


def test_the_answer_weight_is_the_authors_coefficient_over_lambda():
    assert answer_weight(0.2, math.inf) == 1.0                     # no LLDS-MA
    assert answer_weight(0.2, 0.05) == pytest.approx(0.25)         # their MASK_WEIGHT 0.05
    assert answer_weight(0.2, 0.4) == 1.0                          # capped at lambda
    assert answer_weight(0.2, 0.1, valid_searches=1.0) == 0.0      # the paper's min(V/2, 1): 0.5
    assert answer_weight(0.2, 0.1, valid_searches=2.5) == pytest.approx(0.75)
    assert answer_weight(0.2, 0.1, valid_searches=4.0) == 1.0


def minibatch(gen, lengths_per_micro):
    return [random_micro_batch(gen, rows=len(ls), length=max(ls), lengths=ls)
            for ls in lengths_per_micro]


def losses(micros, **kw):
    """(the authors' mini-batch loss, train.py's, ours with their normaliser), each with its
    gradient on every micro-batch's logp."""
    m, n = len(micros), sum(mb["mask"].sum() for mb in micros)
    theirs = sum(authors_micro_loss(*mb.values(), lam=0.2, gate="action", **kw) for mb in micros) / m
    as_train = sum(ours_micro_loss(*mb.values(), lam=0.2, gate="action", n_tokens=n, **kw)
                   for mb in micros)
    renormed = sum(ours_micro_loss(*mb.values(), lam=0.2, gate="action",
                                   n_tokens=mb["mask"].sum() * m, **kw) for mb in micros)
    logps = [mb["logp"] for mb in micros]
    return [(x, torch.cat([g.flatten() for g in torch.autograd.grad(x, logps)]))
            for x in (theirs, as_train, renormed)]


def test_the_mini_batch_normaliser_differs_from_the_authors_only_by_its_per_micro_batch_weights():
    """train.py divides every term by the mini-batch's model tokens N; the authors take each
    micro-batch's token-mean and average them, so a token of micro-batch m weighs N / (M N_m) times
    ours. Equal micro-batch token counts: the same loss. Unequal: our functions reweighted so give
    theirs exactly, and train.py's loss is another number (the deviation docs/method.md names)."""
    gen = torch.Generator().manual_seed(2)
    equal = minibatch(gen, [[10, 6, 8]] * 4)
    (theirs, g_theirs), (as_train, g_train), _ = losses(equal)
    assert as_train.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(g_train, g_theirs, rtol=1e-6, atol=1e-9)

    for ma in ({}, dict(w=0.05), dict(w=0.1, valid_searches=2.5)):
        unequal = minibatch(gen, [[20, 18, 16], [6, 7, 6], [12, 8, 30], [9, 6, 6]])
        (theirs, g_theirs), (as_train, g_train), (renormed, g_renormed) = losses(unequal, **ma)
        assert renormed.item() == pytest.approx(theirs.item(), rel=1e-6)
        torch.testing.assert_close(g_renormed, g_theirs, rtol=1e-6, atol=1e-9)
        assert abs(as_train.item() - theirs.item()) > 1e-3 * abs(theirs.item())
        assert torch.nn.functional.cosine_similarity(g_train, g_theirs, dim=0) < 0.999


def test_the_size_of_the_normaliser_difference_at_the_papers_lengths():
    """Per GPU the authors' mini-batch is 64 episodes in micro-batches of 16, over 4 GPUs: 16
    micro-batches averaged. With independent lengths U[60, 900] a token weighs N / (16 N_m) times
    ours: docs/method.md quotes this test's spread."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(60, 901, (10000, 16, 16), generator=gen).double()
    n_m = lengths.sum(-1)                                                     # (10000, 16)
    ratio = (n_m.mean(1, keepdim=True) / n_m).flatten()
    low, high = torch.quantile(ratio, torch.tensor([0.01, 0.99], dtype=torch.float64)).tolist()
    assert (round(low, 2), round(high, 2), round(ratio.std().item(), 2)) == (0.78, 1.39, 0.13)
    assert (round(ratio.min().item(), 2), round(ratio.max().item(), 2)) == (0.64, 2.02)


def test_the_authors_ratio_clamp_is_a_named_difference():
    """Their ratio is clamped at 100 before PPO's clip: ratio 148 with A = -1 gets gradient 0 there
    and the ratio, 148, here (PPO's clip does not bound a negative advantage's rising ratio)."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[0.0, math.log(148.0)]], dtype=torch.float64, requires_grad=True)
    mask, adv = torch.tensor([[0.0, 1.0]]), torch.tensor([-1.0], dtype=torch.float64)
    zeros = torch.zeros_like(old)
    theirs = authors_micro_loss(logp, old, logp.detach(), zeros, adv, mask, zeros, lam=0.2,
                                gate="action", kl_coef=0.0, entropy_coef=0.0)
    ours, _ = train.policy_loss(logp, old, adv, mask)
    assert torch.autograd.grad(theirs, logp)[0][0, 1].item() == 0.0
    assert torch.autograd.grad(ours, logp)[0][0, 1].item() == pytest.approx(148.0)
