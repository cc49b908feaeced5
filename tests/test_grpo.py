"""Tests for the GRPO objective in train.py's algorithm section, with hand-worked numbers."""
import math

import pytest
import torch

from train import group_advantages, head_logprobs, kl_k3, masked_mean, masked_sum, policy_loss

NAN, INF = float("nan"), float("inf")


def test_group_advantages_by_hand_ties_exactly_zero():
    # Groups of 3: g0 = 1, 1, 0; g1 = 0, 1, 0; g2 = 1, 1, 1 (tie).
    # g0: mean 2/3, unbiased var ((1/3)^2 * 2 + (2/3)^2) / 2 = 1/3, std 1/sqrt(3), so
    #     A = (1/3) * sqrt(3) = 0.57735 for the 1s and -(2/3) * sqrt(3) = -1.15470 for the 0.
    # g1 is the mirror image; the tie gives exactly 0.
    rewards = torch.tensor([1., 1, 0, 0, 1, 0, 1, 1, 1])
    a, b = 1 / math.sqrt(3), 2 / math.sqrt(3)
    adv = group_advantages(rewards, 3)
    assert torch.allclose(adv, torch.tensor([a, a, -b, -a, b, -a, 0, 0, 0]), atol=1e-5)
    assert torch.equal(adv[6:], torch.zeros(3))
    # One value against torch's own unbiased std, eps included.
    g0 = rewards[:3]
    assert adv[0].item() == pytest.approx(((1 - g0.mean()) / (g0.std() + 1e-6)).item())


def test_the_worked_group_of_docs_method():
    # docs/method.md section 5: 3 of 8 right, mean 0.375, std sqrt(15/56) = 0.5175
    adv = group_advantages(torch.tensor([0., 0, 1, 0, 0, 1, 1, 0]), 8)
    assert adv[2].item() == pytest.approx(1.208, abs=5e-4)
    assert adv[0].item() == pytest.approx(-0.725, abs=5e-4)


def test_group_advantages_exact_zero_for_non_binary_ties():
    # 0.1 * 3 / 3 != 0.1 in float32: a plain (r - mean) / (std + 1e-6) gives ~1e-2 noise.
    assert torch.equal(group_advantages(torch.full((6,), 0.1), 3), torch.zeros(6))


def test_masked_sum_and_mean_ignore_garbage():
    x = torch.tensor([[1.0, NAN, 3.0], [INF, -INF, 2.0]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]], dtype=torch.float32)
    assert masked_sum(x, mask).item() == 6.0
    assert masked_mean(x, mask).item() == 2.0
    assert masked_mean(x, mask, dim=1).tolist() == [2.0, 2.0]
    assert masked_sum(x, mask, dim=0).tolist() == [1.0, 0.0, 5.0]
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0   # nothing selected -> 0
    masked_mean(x, mask).backward()
    assert torch.allclose(x.grad, torch.tensor([[1 / 3, 0, 1 / 3], [0, 0, 1 / 3]]))


def surrogate_batch():
    """Row 0 (A = +1): ratios 1.5, 0.5; row 1 (A = -1): ratios 0.5, 1.5, 1.0; padding = NaN.

    Per token loss max(-A r, -A clip(r, 0.8, 1.2)):
      row 0: r 1.5 -> max(-1.5, -1.2) = -1.2 (clipped); r 0.5 -> max(-0.5, -0.8) = -0.5
      row 1: r 0.5 -> max(0.5, 0.8) = 0.8 (clipped);    r 1.5 -> max(1.5, 1.2) = 1.5;
             r 1.0 -> 1.0
    """
    old = torch.tensor([[-1.0, -1.0, NAN], [-1.0, -1.0, -1.0]])
    ratios = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]])
    logp = (old + ratios.log()).nan_to_num(INF).requires_grad_()   # junk at the padding
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    return logp, old, torch.tensor([1.0, -1.0]), mask


def test_policy_loss_clipping_both_sides_token_mean():
    logp, old, adv, mask = surrogate_batch()
    loss, stats = policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5 + 1.0) / 5)   # 0.32
    assert stats["clip_ratio"] == pytest.approx(2 / 5)
    # ppo_kl = mean(old - logp) = -(2 log 1.5 + 2 log 0.5) / 5 = -2 log 0.75 / 5
    assert stats["ppo_kl"] == pytest.approx(-2 * math.log(0.75) / 5, rel=1e-5)
    loss.backward()
    # d/dlogp of -A r is -A r / 5 on unclipped tokens; clipped tokens and padding get 0.
    expected = torch.tensor([[0.0, -0.5 / 5, 0.0], [0.0, 1.5 / 5, 1.0 / 5]])
    assert torch.allclose(logp.grad, expected)


def test_policy_loss_divides_by_the_mini_batch_token_count():
    # The same 5 tokens as a micro-batch of a mini-batch of 20 tokens: the sum over 20.
    logp, old, adv, mask = surrogate_batch()
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, torch.tensor(20.0))
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5 + 1.0) / 20)
    assert stats["clip_ratio"] == pytest.approx(2 / 5)       # stats stay this batch's means


def test_kl_k3_against_direct_computation():
    logp = torch.tensor([-1.0, -1.0, -2.0, -1.0, 0.0])
    ref = torch.tensor([-1.0, -1.0 + math.log(2), -1.0, -30.0, -INF])
    kl = kl_k3(logp, ref)
    # u = ref - logp = 0, log 2, 1, -29, -inf; exp(u) - u - 1 = 0, 1 - log 2, e - 2, 28 -> 10, inf -> 10
    assert kl.tolist() == pytest.approx([0.0, 1 - math.log(2), math.e - 2, 10.0, 10.0], rel=1e-5)
    x, y = torch.randn(50), torch.randn(50)
    u = y - x
    assert torch.allclose(kl_k3(x, y), (u.exp() - u - 1).clamp(-10, 10))


def test_head_logprobs_log_prob_of_the_target_and_entropy():
    head = head_logprobs.__wrapped__                              # one piece, no chunks
    logits = torch.zeros(3, 7)                                    # uniform over 7
    logp, ent = head(torch.nn.Identity(), logits, torch.tensor([0, 3, 6]), 1.0)
    assert torch.allclose(logp, torch.full((3,), -math.log(7))) and torch.allclose(ent, torch.full((3,), math.log(7)))
    big = torch.tensor([[1000.0, 0.0, 0.0]])                      # stable, ~one-hot
    assert head(torch.nn.Identity(), big, torch.tensor([0]), 1.0)[1].item() == pytest.approx(0.0, abs=1e-6)
    x = torch.randn(4, 11)
    logp, ent = head(torch.nn.Identity(), x, torch.tensor([1, 2, 3, 4]), 0.5)
    p = (x / 0.5).double().softmax(-1)
    assert torch.allclose(ent.double(), -(p * p.log()).sum(-1), atol=1e-5)
    assert torch.allclose(logp.double(), p.log()[torch.arange(4), [1, 2, 3, 4]], atol=1e-5)
