"""Tests for llds.py: hand-worked batches with pinned numbers, gradients, masked garbage.

The main batch (B=4, T=8) is built from displacements d = old_logp - logp chosen as exact
binary fractions, so every sum below is exact in float32. old_logp = -2 everywhere, and
logp = old_logp - d on model tokens. "." = not a model token (prompt, observation, padding).

    row A     loss_mask          d on model tokens                   actions (net d)
    0   +1.0  0 1 1 1 0 1 1 0    .  .5 -.25 .125 .  .25 -.5 .         a1 = +.375, a2 = -.25
    1    0.0  0 0 1 1 1 0 0 0    .  .  .5  .25 -.25 .  .  .           a1 = +.5
    2   +0.5  0 1 1 0 1 1 1 1    .  .5 -1   .  .25 .25 -.125 -.125    a1 = -.5, a2 = +.25
    3   -1.0  0 1 1 0 0 0 0 0    .  1  1    .  .  .  .  .             (never pays: A < 0)

Loss-mask tokens in the batch: 5 + 3 + 6 + 2 = 16 (the token-mean normaliser).

action gate: row 0 only a1 is open (a2's net -.25 <= 0); inside a1 only d > 0 pays:
             .5 + .125 = .625. Row 1 (A = 0, still preserving): .5 + .25 = .75. Row 2: a2 is
             open: .25 + .25 = .5. Total 1.875 -> 1.875 / 16 = 0.1171875.
response gate: row sums .125 (open), .5 (open), -.25 (shut) -> .875 + .75 = 1.625 -> 0.1015625
token gate: every d > 0 of rows 0-2: .875 + .75 + 1.0 = 2.625 -> 0.1640625
seq-mean (action gate): (.625/5 + .75/3 + .5/6) / 3 = (27/72 + 6/72) / 3 = 11/72
"""
import math

import pytest
import torch

from llds import action_ids, llds_loss

NAN, INF = float("nan"), float("inf")
B, T = 4, 8
MASK = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0],
                     [0, 0, 1, 1, 1, 0, 0, 0],
                     [0, 1, 1, 0, 1, 1, 1, 1],
                     [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
D = torch.tensor([[0, .5, -.25, .125, 0, .25, -.5, 0],
                  [0, 0, .5, .25, -.25, 0, 0, 0],
                  [0, .5, -1, 0, .25, .25, -.125, -.125],
                  [0, 1, 1, 0, 0, 0, 0, 0]])
ADV = torch.tensor([1.0, 0.0, 0.5, -1.0])
# Tokens that pay under the action gate (row 0: tokens 1, 3; row 1: 2, 3; row 2: 4, 5).
PAID_ACTION = torch.zeros(B, T, dtype=torch.bool)
PAID_ACTION[0, [1, 3]] = PAID_ACTION[1, [2, 3]] = PAID_ACTION[2, [4, 5]] = True


def batch(garbage=False):
    old = torch.full((B, T), -2.0)
    logp = old - D
    if garbage:  # values outside the loss mask must never matter
        junk = torch.tensor([NAN, INF, -INF, 1e30])
        fill = junk[torch.arange(B * T) % 4].view(B, T)
        logp = torch.where(MASK > 0, logp, fill)
        old = torch.where(MASK > 0, old, fill.flip(1))
    return logp.requires_grad_(), old


def test_action_ids():
    mask = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1],
                         [0, 0, 0, 0, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1, 1, 1, 1],
                         [0, 1, 0, 1, 0, 1, 0, 1]])
    assert action_ids(mask).tolist() == [[1, 1, 0, 2, 0, 0, 3, 3],
                                         [0, 0, 0, 0, 0, 0, 0, 0],
                                         [1, 1, 1, 1, 1, 1, 1, 1],
                                         [0, 1, 0, 2, 0, 3, 0, 4]]
    assert action_ids(mask.bool()).dtype == torch.long
    # Observation tokens split actions: row 0 of the main batch has two actions.
    assert action_ids(MASK)[0].tolist() == [0, 1, 1, 1, 0, 2, 2, 0]


@pytest.mark.parametrize("gate, expected", [("action", 1.875 / 16),
                                            ("response", 1.625 / 16),
                                            ("token", 2.625 / 16)])
def test_gates_hand_worked(gate, expected):
    logp, old = batch()
    loss, _ = llds_loss(logp, old, ADV, MASK, gate=gate)
    assert loss.item() == pytest.approx(expected, abs=1e-7)


def test_action_gate_stats():
    logp, old = batch()
    _, stats = llds_loss(logp, old, ADV, MASK)
    # 6 penalised of 14 preserving tokens; 3 open of 5 preserving actions;
    # displacement (.125 + .5 - .25) / 14; rows 0, 1, 2 preserve.
    assert stats == pytest.approx({"llds/active_token_frac": 6 / 14,
                                   "llds/active_action_frac": 3 / 5,
                                   "llds/displacement": .375 / 14,
                                   "llds/n_preserving": 3.0})
    assert all(type(v) is float for v in stats.values())
    _, stats = llds_loss(logp, old, ADV, MASK, gate="response")
    assert stats["llds/active_action_frac"] == pytest.approx(3 / 5)  # rows 0 and 1 open
    _, stats = llds_loss(logp, old, ADV, MASK, gate="token")
    assert stats["llds/active_action_frac"] == 1.0
    assert stats["llds/active_token_frac"] == pytest.approx(8 / 14)


def test_only_positive_net_action_pays_and_only_its_falling_tokens():
    # Row 0 alone: a1 (net +.375) pays .5 + .125; a2 (net -.25) pays nothing even though its
    # first token lost likelihood (d = .25). 5 model tokens -> .625 / 5.
    logp, old = batch()
    loss, _ = llds_loss(logp[:1], old[:1], ADV[:1], MASK[:1])
    assert loss.item() == pytest.approx(.625 / 5)


def test_exactly_zero_net_displacement_keeps_gate_shut():
    mask = torch.ones(1, 2)
    logp = torch.tensor([[-2.5, -1.5]], requires_grad=True)  # d = +.5, -.5: net 0
    loss, stats = llds_loss(logp, torch.full((1, 2), -2.0), torch.zeros(1), mask)
    assert loss.item() == 0.0 and stats["llds/active_action_frac"] == 0.0


def test_negative_advantage_never_pays_zero_advantage_pays():
    logp, old = batch()
    # Row 3 alone (A = -1, every d = +1): nothing, under every gate.
    for gate in ("action", "response", "token"):
        loss, stats = llds_loss(logp[3:], old[3:], ADV[3:], MASK[3:], gate=gate)
        assert loss.item() == 0.0 and stats["llds/n_preserving"] == 0.0
    # Row 1 alone (A = 0): pays .75 / 3.
    loss, _ = llds_loss(logp[1:2], old[1:2], ADV[1:2], MASK[1:2])
    assert loss.item() == pytest.approx(.25)
    # Flipping row 1's advantage to a tiny negative value removes exactly its .75.
    loss, _ = llds_loss(logp, old, torch.tensor([1.0, -1e-6, 0.5, -1.0]), MASK)
    assert loss.item() == pytest.approx((1.875 - .75) / 16)


def test_answer_weight():
    # Answer spans: row 0 tokens 5-6 (a2, shut anyway), row 2 tokens 4-7 (a2, open, pays .5).
    answer = torch.zeros(B, T)
    answer[0, 5:7] = answer[2, 4:8] = 1
    logp, old = batch()
    loss, _ = llds_loss(logp, old, ADV, MASK, answer_mask=answer, answer_weight=0.5)
    assert loss.item() == pytest.approx((.625 + .75 + .5 * .5) / 16)
    # The weight scales the penalty, not the gate: weight 0 just drops row 2's .5.
    loss, _ = llds_loss(logp, old, ADV, MASK, answer_mask=answer, answer_weight=0.0)
    assert loss.item() == pytest.approx((.625 + .75) / 16)
    loss, _ = llds_loss(logp, old, ADV, MASK, answer_mask=answer, answer_weight=1.0)
    assert loss.item() == pytest.approx(1.875 / 16)


def test_seq_mean():
    logp, old = batch()
    loss, _ = llds_loss(logp, old, ADV, MASK, reduction="seq-mean")
    assert loss.item() == pytest.approx(11 / 72)
    # Response gate: (.875/5 + .75/3 + 0/6) / 3.
    loss, _ = llds_loss(logp, old, ADV, MASK, gate="response", reduction="seq-mean")
    assert loss.item() == pytest.approx((.875 / 5 + .25) / 3)


def test_micro_batches_with_the_mini_batch_denominator_sum_to_the_whole():
    # Rows 0-1 and rows 2-3 as two micro-batches of this mini-batch: each divided by the whole
    # batch's Z (16 tokens; 3 preserving responses) sums to the one-batch loss exactly.
    logp, old = batch()
    for reduction, z, whole in (("token-mean", 16.0, 1.875 / 16), ("seq-mean", 3.0, 11 / 72)):
        parts = [llds_loss(logp[rows], old[rows], ADV[rows], MASK[rows], reduction=reduction,
                           denominator=torch.tensor(z))[0] for rows in ([0, 1], [2, 3])]
        assert parts[0].item() == pytest.approx((1.375 / 16) if z == 16 else (27 / 72) / 3)
        assert (parts[0] + parts[1]).item() == pytest.approx(whole)


@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean"])
def test_zero_when_logp_equals_old(reduction):
    old = torch.randn(B, T)
    logp = old.clone().requires_grad_()
    loss, stats = llds_loss(logp, old, ADV, MASK, reduction=reduction)
    loss.backward()
    assert loss.item() == 0.0 and stats["llds/active_token_frac"] == 0.0
    assert torch.count_nonzero(logp.grad) == 0


@pytest.mark.parametrize("garbage", [False, True])
def test_gradient_is_minus_one_over_normaliser_on_penalised_tokens(garbage):
    logp, old = batch(garbage)
    loss, _ = llds_loss(logp, old, ADV, MASK)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    expected = torch.where(PAID_ACTION, -1 / 16, 0.0)
    assert torch.equal(logp.grad, expected)


def test_gradient_seq_mean_and_answer_weight():
    answer = torch.zeros(B, T)
    answer[2, 4:8] = 1
    logp, old = batch()
    loss, _ = llds_loss(logp, old, ADV, MASK, reduction="seq-mean",
                        answer_mask=answer, answer_weight=0.5)
    loss.backward()
    # -w / (n_tokens of the row * n_preserving): rows have 5, 3, 6 model tokens, 3 preserve.
    expected = torch.zeros(B, T)
    expected[0, [1, 3]] = -1 / 15
    expected[1, [2, 3]] = -1 / 9
    expected[2, [4, 5]] = -0.5 / 18
    assert torch.allclose(logp.grad, expected)


@pytest.mark.parametrize("gate", ["action", "response", "token"])
@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean"])
def test_garbage_in_masked_positions(gate, reduction):
    clean_logp, clean_old = batch()
    clean, clean_stats = llds_loss(clean_logp, clean_old, ADV, MASK, gate=gate,
                                   reduction=reduction)
    logp, old = batch(garbage=True)
    adv = ADV[:, None].expand(B, T).clone()
    adv[MASK == 0] = NAN  # (B, T) advantages with junk outside the mask
    answer = torch.where(MASK > 0, 0.0, NAN)
    loss, stats = llds_loss(logp, old, adv, MASK, gate=gate, reduction=reduction,
                            answer_mask=answer, answer_weight=0.5)
    loss.backward()
    assert loss.item() == clean.item() and stats == clean_stats
    assert torch.isfinite(logp.grad).all()


def test_per_token_advantages_match_per_response():
    logp, old = batch()
    per_response, s1 = llds_loss(logp, old, ADV, MASK)
    per_token, s2 = llds_loss(logp, old, ADV[:, None] * MASK, MASK)  # veRL's zero-padded layout
    assert per_token.item() == per_response.item() and s1 == s2


@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean"])
def test_degenerate_batches_give_zero(reduction):
    logp, old = batch()
    for mask, adv in [(torch.zeros(B, T), ADV),             # nothing to train on
                      (MASK, -torch.ones(B)),               # no preserving response
                      (MASK, torch.full((B,), NAN))]:       # NaN advantage: not preserving
        loss, stats = llds_loss(logp, old, adv, mask, reduction=reduction)
        loss.backward()
        assert loss.item() == 0.0 and not math.isnan(stats["llds/displacement"])
        assert torch.count_nonzero(logp.grad) == 0
    loss, _ = llds_loss(logp[:0], old[:0], ADV[:0], MASK[:0], reduction=reduction)  # B = 0
    assert loss.item() == 0.0


def test_bad_arguments_raise_clear_errors():
    logp, old = batch()
    with pytest.raises(ValueError, match="gate"):
        llds_loss(logp, old, ADV, MASK, gate="sequence")
    with pytest.raises(ValueError, match="reduction"):
        llds_loss(logp, old, ADV, MASK, reduction="mean")
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        llds_loss(logp, old[:, :4], ADV, MASK)


def reference_llds(logp, old, adv, mask, gate, reduction):
    """Plain-Python re-computation from the definition (nested lists in, loops everywhere)."""
    total, per_row, n_all, n_pres = 0.0, [], 0, 0
    for i in range(len(logp)):
        toks = [t for t in range(len(logp[i])) if mask[i][t]]
        n_all += len(toks)
        if adv[i] < 0 or not toks:
            continue
        n_pres += 1
        d = {t: old[i][t] - logp[i][t] for t in toks}
        if gate == "token":
            groups = [[t] for t in toks]
            groups_open = [True] * len(groups)
        else:
            groups, prev = [], None
            for t in toks:
                if gate == "action" and prev is not None and t == prev + 1:
                    groups[-1].append(t)
                elif gate == "response" and groups:
                    groups[-1].append(t)
                else:
                    groups.append([t])
                prev = t
            groups_open = [sum(d[t] for t in g) > 0 for g in groups]
        row = sum(max(0.0, d[t]) for g, on in zip(groups, groups_open) if on for t in g)
        total += row
        per_row.append(row / len(toks))
    if reduction == "token-mean":
        return total / max(n_all, 1)
    return sum(per_row) / max(n_pres, 1)


@pytest.mark.parametrize("gate", ["action", "response", "token"])
@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean"])
def test_matches_loop_reference_on_random_batches(gate, reduction):
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        b, t = 6, 40
        mask = torch.rand(b, t, generator=gen) < 0.7
        mask[0] = False                                   # an empty row
        old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
        logp = old + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
        adv = torch.randint(-1, 2, (b,), generator=gen).double()
        loss, _ = llds_loss(logp, old, adv, mask, gate=gate, reduction=reduction)
        ref = reference_llds(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), gate,
                             reduction)
        assert loss.item() == pytest.approx(float(ref), rel=1e-5, abs=1e-7)

