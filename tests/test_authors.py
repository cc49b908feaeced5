"""Parity with the LLDS authors' veRL fork (github.com/vengdeng/LLDS-On-Group-Relative-Policy-
Optimization-Collapse-in-Search-R1 at c19a094): where we claim their numbers, the same numbers;
where we do not, the difference docs/method.md names.

`authors_micro_loss` restates in plain per-row loops what their actor computes for one
micro-batch (`dp_actor.py` update_policy, `core_algos.py` compute_policy_loss and kl_penalty
"low_var_kl"): each term a token-mean over the micro-batch's model tokens, the ratio clamped at
100 before PPO's clip, the hinge torch.maximum(0, d), LLDS's coefficient lambda off the answer
span and min(w, lambda) on it (adaptively min(w * max(V - 1, 0), lambda)); also written the
same plain way: gate "token" (no gate) and LLDS's seq-mean (the paper's eq. 4). A mini-batch is
the mean of its micro-batches: their loss / gradient-accumulation steps, and FSDP's mean over GPUs
of equal micro-batch counts; its gradient clipped to a total norm (clip_grad_norm_) before the
optimizer step. The whole-step tests run the real `train.train_step` on hand-made batches and
compare the gradient of every update it hands the optimizer with this restatement's
(`gradient_gap`); tests/test_parity_mutations.py checks that changes to train_step fail them.
"""
import dataclasses
import math

import pytest
import torch

import rollout as ro
import train
from conftest import tiny_policy
from llds import answer_weight, llds_loss
from plumbing import cli, runs
from plumbing.minibatches import balanced_parts, verl_order
from plumbing.presets import PRESETS
from plumbing.sampler import PromptSampler

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def authors_micro_loss(logp, old, ref, entropy, adv, mask, answer, *, lam, gate, w=math.inf,
                       valid_searches=None, reduction="token-mean", clip=0.2, kl_coef=0.001,
                       entropy_coef=0.001):
    """One micro-batch's loss as the authors' actor computes it. (B, T) tensors (logp with grad);
    adv (B,); mask: model tokens; answer: 1 on the final answer span. reduction "seq-mean": LLDS's
    part as the paper's eq. 4, over the micro-batch's responses of A >= 0."""
    if valid_searches is not None:
        w = w * max(valid_searches - 1, 0)            # inf * 0 is NaN, as in their code
    answer_coef = min(w, lam)                         # Python's min keeps a NaN first argument
    pg = ent = kl = reg = 0.0
    n = n_preserving = 0
    for i in range(len(logp)):
        tokens = [t for t in range(logp.shape[1]) if mask[i, t]]
        preserving = bool(adv[i] >= 0) and len(tokens) > 0
        n, n_preserving = n + len(tokens), n_preserving + preserving
        d = {t: old[i, t] - logp[i, t] for t in tokens}
        if gate != "action":
            pieces = [tokens]
        else:       # runs of consecutive model tokens
            pieces = []
            for t in tokens:
                if pieces and pieces[-1][-1] == t - 1:
                    pieces[-1].append(t)
                else:
                    pieces.append([t])
        opened = {t for piece in pieces if preserving and (
            gate == "token" or sum(d[t].item() for t in piece) > 0) for t in piece}
        row_reg = 0.0
        for t in tokens:
            ratio = torch.clamp(torch.exp(logp[i, t] - old[i, t]), -100.0, 100.0)
            pg = pg + torch.max(-adv[i] * ratio, -adv[i] * torch.clamp(ratio, 1 - clip, 1 + clip))
            ent = ent + entropy[i, t]
            u = ref[i, t] - logp[i, t]
            kl = kl + torch.clamp(torch.exp(u) - u - 1, -10.0, 10.0)
            # every model token's penalty times its coefficient, 0 where the gate is shut
            coef = answer_coef if answer[i, t] else lam
            row_reg = row_reg + coef * (t in opened) * torch.maximum(torch.zeros_like(d[t]), d[t])
        # seq-mean: each response's penalty over its own tokens, then over the A >= 0 responses
        reg = reg + (row_reg if reduction == "token-mean" else row_reg / max(len(tokens), 1))
    reg = reg / max(n if reduction == "token-mean" else n_preserving, 1)
    return (pg - entropy_coef * ent + kl_coef * kl) / max(n, 1) + reg


# ---- The whole step: train.train_step's gradient against the restatement's ------------------

PROMPT = 6    # tokens of the prompt every row shares (train_step's shared-prefix path runs)


def fixed_rollout(rewards, n_search, actions, observations):
    """A hand-made batch: row i = the prompt, an action of actions[i][0] model tokens, an
    observation of observations[i] tokens, an action of actions[i][1] model tokens whose last 3
    are the answer span; right-padded. Token ids drawn once from a seeded generator."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (PROMPT,), generator=gen).tolist()
    ids, kinds = [], []
    for (a, b), o in zip(actions, observations):
        row = prompt + torch.randint(0, 256, (a + o + b,), generator=gen).tolist()
        ids.append(row)
        kinds.append([0] * PROMPT + [1] * a + [2] * o + [1] * b)
    width = max(map(len, ids))
    pad = lambda rows, v: torch.tensor([r + [v] * (width - len(r)) for r in rows])  # noqa: E731
    loss_mask = pad([[float(k == 1) for k in row] for row in kinds], 0.0)
    answer = torch.zeros_like(loss_mask)
    for i, row in enumerate(kinds):
        answer[i, len(row) - 3:len(row)] = 1.0
    episodes = [{"id": str(i), "text": "", "answer": None, "golds": ["x"], "queries": ["q"] * s,
                 "n_search": s, "n_valid": s, "finished": True, "reward": r, "em": r, "f1": r,
                 "data_source": "toy"} for i, (r, s) in enumerate(zip(rewards, n_search))]
    return ro.Rollout(input_ids=pad(ids, 256), attention_mask=pad([[1] * len(r) for r in ids], 0),
                      loss_mask=loss_mask, answer_mask=answer,
                      prompt_len=torch.full((len(ids),), PROMPT), episodes=episodes,
                      timing={"generate": 0.0, "retrieval": 0.0},
                      logp=torch.zeros_like(loss_mask))


class GradRecorder(torch.optim.SGD):
    """Plain SGD (train_step sets its lr) that records the gradient of every update it applies."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.seen = []

    def step(self, closure=None):
        self.seen.append(torch.cat([p.grad.flatten() for g in self.param_groups
                                    for p in g["params"]]))
        super().step()


# 2 questions x 3 rollouts: advantages +0.577, -1.155, +0.577 and a tied group (0, 0, 0)
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
OBSERVATIONS = [3, 2, 5, 4, 2, 3]
EQUAL = [(4, 6), (3, 7), (5, 5), (6, 4), (4, 6), (5, 5)]       # 10 model tokens in every row
UNEQUAL = [(4, 9), (3, 4), (6, 8), (2, 3), (5, 5), (3, 6)]


def step_config(tmp_path, **overrides):
    """One mini-batch of the 6 rows in 2 micro-batches of 3; coefficients far from the paper's so
    every term moves the gradient well beyond the comparison's tolerance; no clip."""
    base = dict(out_dir=str(tmp_path), name="step", device="cpu", bf16=False, steps=1,
                prompts_per_step=2, group_size=3, drop_tied_groups=0, mini_batch_size=6,
                micro_batch_size=3, warmup_ratio=0.0, grad_clip=1e9, temperature=0.7,
                clip_eps=0.2, kl_coef=0.3, entropy_coef=1.0, llds_lambda=0.5,
                displacement_every=0, token_view_every=0, samples_per_step=0)
    return train.Config(**{**base, **overrides})


def reference():
    """The frozen reference: another seed, its logits x 24, sure where the policy is not, so that
    some tokens' k3 KL passes the clamp at 10 (u = ref_logp - logp from -18 to 1.3 here)."""
    ref = tiny_policy(seed=1)[0].requires_grad_(False)
    ref.lm_head.weight.mul_(24.0)
    return ref


def run_step(tmp_path, monkeypatch, cfg, batch, d, step=1, optimizer=GradRecorder, module=train):
    """module.train_step (train's, or a changed copy's) on `batch` (a Rollout) with the tiny
    policy, the reference, and the rollout policy's log-probs shifted by d (N, T) on model tokens
    (as a later mini-batch sees them: d = log pi_old - log pi_theta)
    -> (the run, the step's metrics, its mini-batches)."""
    model, tokenizer = tiny_policy(seed=0)
    run = runs.Run(device=torch.device("cpu"), dir=tmp_path, train_records=[], eval_records=[],
                   retriever=None, model=model, tokenizer=tokenizer,
                   ref=reference() if cfg.kl_coef > 0 else None,
                   optimizer=optimizer(p for p in model.parameters()))
    monkeypatch.setattr(ro, "rollout", lambda *args, **kwargs: batch)
    seen, real_pass = [], module.logprob_pass

    def shifted_pass(model, batch, minibatches, *args):
        seen.append(minibatches)
        logp, entropy = real_pass(model, batch, minibatches, *args)
        return (logp + d * batch["loss_mask"] if model is run.model else logp), entropy

    monkeypatch.setattr(module, "logprob_pass", shifted_pass)
    sampler = PromptSampler([{"id": str(i), "question": "q", "golds": ["x"]} for i in range(4)], 0)
    metrics = module.train_step(step, cfg, run, sampler)
    return run, metrics, seen[0]


def logprobs(model, batch, temperature):
    """log pi(token t | tokens < t) and the entropy of pi before token t at the sampling
    temperature, from one plain forward of every row: two (N, T), 0 at t = 0."""
    ids = batch.input_ids
    logits = model(input_ids=ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp, entropy = torch.zeros(ids.shape), torch.zeros(ids.shape)
    logp[:, 1:] = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy[:, 1:] = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def authors_updates(cfg, batch, d, minibatches, ref, weights=None, **kw):
    """The restatement's step from the initial policy (seed 0): old log-probs = its own + d, the
    reference's from `ref`, GRPO's advantages; then for each mini-batch (a list of micro-batches'
    rows) the loss sum_m weights[m] x authors_micro_loss(micro-batch m) at the current weights
    (weights default 1 / M: the micro-batches' mean), its gradient scaled to a total norm of at
    most cfg.grad_clip as clip_grad_norm_ does, and a plain SGD step at cfg.lr (none where the
    norm is not finite) -> {"loss", "norm" (before the clip), "grad" (after it), "moved" (the
    largest |log pi - its initial value| on a model token)}: lists, one entry per update."""
    model = tiny_policy(seed=0)[0]
    params = list(model.parameters())
    rewards = torch.tensor([e["reward"] for e in batch.episodes]).view(-1, cfg.group_size)
    adv = ((rewards - rewards.mean(1, keepdim=True))
           / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    with torch.no_grad():
        initial = logprobs(model, batch, cfg.temperature)[0]
        ref_logp = logprobs(ref, batch, cfg.temperature)[0]
    old = initial + d * batch.loss_mask
    updates = {"loss": [], "norm": [], "grad": [], "moved": []}
    for micro_batches in minibatches:
        logp, entropy = logprobs(model, batch, cfg.temperature)
        loss = sum(weight * authors_micro_loss(
            logp[rows], old[rows], ref_logp[rows], entropy[rows], adv[rows], batch.loss_mask[rows],
            batch.answer_mask[rows], lam=cfg.llds_lambda, gate=cfg.llds_gate,
            reduction=cfg.llds_reduction, clip=cfg.clip_eps, kl_coef=cfg.kl_coef,
            entropy_coef=cfg.entropy_coef, **kw)
            for weight, rows in zip(weights or [1 / len(micro_batches)] * len(micro_batches),
                                    micro_batches))
        model.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in params])
        norm = grad.norm().item()
        grad = grad * min(1.0, cfg.grad_clip / (norm + 1e-6))
        if math.isfinite(norm):
            with torch.no_grad():
                for p, g in zip(params, grad.split([p.numel() for p in params])):
                    p -= cfg.lr * g.view_as(p)
        moved = ((logp.detach() - initial) * batch.loss_mask).abs().max().item()
        for key, value in zip(updates, (loss.item(), norm, grad, moved)):
            updates[key].append(value)
    return updates


def gradient_gap(ours, theirs):
    """How far apart two steps' update gradients are, in units of what float32 rounding allows:
    the largest |ours - theirs| over 2e-6 x the update's largest entry + 1e-5 x the entry's own
    size (train_step and one plain forward agree within 5e-7 of the largest entry here; weighting
    the entropy term, the smallest, 60/61 moves 4e-4). <= 1: the same; inf: another number of
    updates, or a non-finite entry."""
    if len(ours) != len(theirs):
        return math.inf
    gap = 0.0
    for o, t in zip(ours, theirs):
        err = ((o - t).abs() / (2e-6 * t.abs().max() + 1e-5 * t.abs())).max().item()
        gap = math.inf if math.isnan(err) else max(gap, err)
    return gap


def assert_same(ours, theirs):
    """Equal up to float32 rounding (gradient_gap)."""
    assert ours.abs().max() > 0 and gradient_gap([ours], [theirs]) <= 1


def displacement(batch):
    """A fixed d on model tokens, none exactly 0: some actions gain, some lose, in all."""
    gen = torch.Generator().manual_seed(3)
    return 0.4 * torch.randn(batch.loss_mask.shape, generator=gen)


MA = {"no-MA": ({}, {}),
      "w=0.05": (dict(answer_coef=0.05), dict(w=0.05)),
      "w=0.9 capped": (dict(answer_coef=0.9), dict(w=0.9)),
      "adaptive w=0.1, V=2.5": (dict(answer_coef=0.1, answer_adaptive=True),
                                dict(w=0.1, valid_searches=2.5)),
      "adaptive w=0.1, V=0.5": (dict(answer_coef=0.1, answer_adaptive=True),
                                dict(w=0.1, valid_searches=0.5)),
      "adaptive w=inf, V=2.5": (dict(answer_coef=math.inf, answer_adaptive=True),
                                dict(w=math.inf, valid_searches=2.5))}
SEARCHES = {2.5: [2, 3, 1, 4, 2, 3], 0.5: [1, 0, 1, 0, 1, 0]}


@pytest.mark.parametrize("gate", ["action", "response"])
@pytest.mark.parametrize("ma", MA, ids=str)
def test_train_steps_gradient_is_the_authors(tmp_path, monkeypatch, gate, ma):
    """One mini-batch of two micro-batches holding as many model tokens each: train_step's
    gradient is the restatement's, so every term of train_step's loss is pinned (the clipped
    surrogate, some ratios clipped, the entropy bonus, the k3 KL, LLDS's hinge and gates (some
    open, some shut), LLDS-MA's coefficient, the normaliser, the temperature)."""
    ours_flags, theirs_flags = MA[ma]
    searches = SEARCHES[theirs_flags.get("valid_searches", 2.5)]
    batch = fixed_rollout(REWARDS, searches, EQUAL, OBSERVATIONS)
    d = displacement(batch)
    cfg = step_config(tmp_path, llds_gate=gate, **ours_flags)
    run, metrics, minibatches = run_step(tmp_path, monkeypatch, cfg, batch, d)
    assert [len(m) for m in minibatches[0]] == [3, 3] and 0 < metrics["clip_ratio"] < 1
    assert 0 < metrics["llds/active_action_frac"] < 1
    (ours,) = run.optimizer.seen
    theirs = authors_updates(cfg, batch, d, minibatches, run.ref, **theirs_flags)["grad"]
    assert_same(ours, theirs[0])


# A whole step of several updates: 4 questions x 3 rollouts, two groups with a spread (one as
# above, one (0, 1, 1)) and two tied (A = 0: LLDS guards them), 10 model tokens in every row.
STEP_BATCH = dict(rewards=REWARDS + [0.0, 1.0, 1.0, 1.0, 1.0, 1.0], n_search=SEARCHES[2.5] * 2,
                  actions=EQUAL + EQUAL[::-1], observations=OBSERVATIONS + [6, 1, 4, 2, 5, 3])
# 3 updates (in the authors' row order: fixed) of 2 micro-batches, plain SGD between them at an
# lr that moves some log-probs by 0.2, a clip that binds at updates 1 and 2 (norms 1.4, 2), not 3
STEP_FLAGS = dict(prompts_per_step=4, mini_batch_size=4, micro_batch_size=2,
                  verl_minibatches=True, lr=0.03, grad_clip=1.0)
# case -> (train.py's flags, the restatement's keywords); seq-mean with one micro-batch an update,
# where the restatement's mean over a micro-batch's responses is the mini-batch's
WHOLE_STEP = {"action gate, adaptive LLDS-MA": (dict(answer_coef=0.1, answer_adaptive=True),
                                                dict(w=0.1, valid_searches=2.5)),
              "response gate, LLDS-MA w=0.05": (dict(llds_gate="response", answer_coef=0.05),
                                                dict(w=0.05)),
              "token gate, seq-mean": (dict(llds_gate="token", llds_reduction="seq-mean",
                                            micro_batch_size=4), {})}


def whole_step(tmp_path, monkeypatch, case, module=train):
    """A case of WHOLE_STEP through module.train_step (train's, or a changed copy's) and through
    the restatement -> (our updates' gradients, the restatement's updates, the step's metrics)."""
    flags, kw = WHOLE_STEP[case]
    batch = fixed_rollout(**STEP_BATCH)
    d = displacement(batch)
    cfg = step_config(tmp_path, **{**STEP_FLAGS, **flags})
    run, metrics, minibatches = run_step(tmp_path, monkeypatch, cfg, batch, d, module=module)
    return run.optimizer.seen, authors_updates(cfg, batch, d, minibatches, run.ref, **kw), metrics


@pytest.mark.parametrize("case", WHOLE_STEP)
def test_a_whole_steps_updates_are_the_authors(tmp_path, monkeypatch, case):
    """Three updates, each the mean of its micro-batches: every update's gradient, clipped, is the
    restatement's (gradient_gap), in conditions where each part of the step shows: updates 2 and 3
    see the d that updates 1 and 2 caused (on top of the injected d) and divide by their own
    mini-batch's count; the clip binds at updates 1 and 2, not at 3, so a term's scale shows;
    some ratios are clipped; some gates open, some shut. tests/test_parity_mutations.py: what
    changes to train_step this catches."""
    ours, theirs, metrics = whole_step(tmp_path, monkeypatch, case)
    assert gradient_gap(ours, theirs["grad"]) <= 1
    assert [norm > STEP_FLAGS["grad_clip"] for norm in theirs["norm"]] == [True, True, False]
    assert theirs["moved"][0] == 0 and min(theirs["moved"][1:]) > 0.1
    assert 0 < metrics["clip_ratio"] < 1
    assert 0 < metrics["llds/active_action_frac"] < 1 or case == "token gate, seq-mean"


def test_the_whole_steps_k3_kl_passes_its_clamp_on_some_tokens():
    """The reference is sure where the policy is not: at the initial weights 13 of the 120 model
    tokens have k3 > 10 (u < -11), clamped to 10 (gradient 0), the others not; no |u| reaches 20,
    where kl_k3's inner clamp would act."""
    batch = fixed_rollout(**STEP_BATCH)
    with torch.no_grad():
        u = (logprobs(reference(), batch, 0.7)[0]
             - logprobs(tiny_policy(seed=0)[0], batch, 0.7)[0])[batch.loss_mask.bool()]
    k3 = u.exp() - u - 1
    assert (int((k3 > 10).sum()), len(k3)) == (13, 120) and u.abs().max() < 20


def test_answer_coef_inf_with_adaptive_is_a_step_the_authors_do_not_have(tmp_path, monkeypatch):
    """--answer-coef inf --answer-adaptive: ours gives the answer span 0 while V <= 1 (the span
    unprotected: the restatement with w = 0) and lambda above it; the authors' formula gives
    inf x max(V - 1, 0) = NaN at V <= 1, so their loss is NaN there (they switch LLDS-MA off with
    MASK_ANS=false, never with an infinite weight)."""
    assert (answer_weight(0.2, math.inf, 0.5), answer_weight(0.2, math.inf, 2.5)) == (0.0, 1.0)
    batch = fixed_rollout(REWARDS, SEARCHES[0.5], EQUAL, OBSERVATIONS)
    d = displacement(batch)
    cfg = step_config(tmp_path, answer_coef=math.inf, answer_adaptive=True)
    run, _, minibatches = run_step(tmp_path, monkeypatch, cfg, batch, d)
    (ours,) = run.optimizer.seen
    span_off = authors_updates(cfg, batch, d, minibatches, run.ref, w=0.0)
    assert_same(ours, span_off["grad"][0])
    theirs = authors_updates(cfg, batch, d, minibatches, run.ref, w=math.inf, valid_searches=0.5)
    assert math.isnan(theirs["loss"][0])


def test_the_normaliser_is_the_one_difference_in_a_whole_step(tmp_path, monkeypatch):
    """Micro-batches holding different numbers of model tokens: train_step divides every term by
    the mini-batch's N; the authors average the micro-batches' token-means, so train_step's
    gradient is another one, and is theirs with micro-batch m's mean weighted N_m / N instead of
    1 / M (the deviation docs/method.md names)."""
    batch = fixed_rollout(REWARDS, SEARCHES[2.5], UNEQUAL, OBSERVATIONS)
    d = displacement(batch)
    cfg = step_config(tmp_path)
    run, _, minibatches = run_step(tmp_path, monkeypatch, cfg, batch, d)
    (ours,) = run.optimizer.seen
    n_m = [batch.loss_mask[rows].sum().item() for rows in minibatches[0]]
    assert n_m[0] != n_m[1]
    (theirs,) = authors_updates(cfg, batch, d, minibatches, run.ref)["grad"]
    (reweighted,) = authors_updates(cfg, batch, d, minibatches, run.ref,
                                    weights=[n / sum(n_m) for n in n_m])["grad"]
    assert_same(ours, reweighted)
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) < 0.999


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


# ---- Single terms: the named differences, worked by hand -----------------------------------

def test_at_d_0_the_hinge_gives_no_gradient_here_and_half_in_the_authors_code():
    """One response (A = 1) of one action, d = (0.5, 0, -0.1): the gate is open (sum 0.4 > 0).
    Both charge max(0, d) = (0.5, 0, 0); at d = 0 exactly the gradient of the max differs: ours
    0 (only d > 0 pays), their torch.maximum 1/2. With lambda 0.2 over 3 tokens, d(L)/d(logp) on
    the LLDS part: ours (-0.2/3, 0, 0), theirs (-0.2/3, -0.1/3, 0)."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[-0.5, 0.0, 0.1]], dtype=torch.float64, requires_grad=True)
    mask, adv, zeros = torch.ones(1, 3), torch.tensor([1.0], dtype=torch.float64), torch.zeros(1, 3)
    ours, _ = llds_loss(logp, old, adv, mask)
    (g_ours,) = torch.autograd.grad(0.2 * ours, logp)

    def theirs(lam):
        return authors_micro_loss(logp, old, logp.detach(), zeros, adv, mask, zeros, lam=lam,
                                  gate="action", kl_coef=0.0, entropy_coef=0.0)
    (g_theirs,) = torch.autograd.grad(theirs(0.2) - theirs(0.0), logp)
    assert 0.2 * ours.item() == pytest.approx(theirs(0.2).item() - theirs(0.0).item())
    assert g_ours[0].tolist() == pytest.approx([-0.2 / 3, 0.0, 0.0], abs=1e-7)     # float32
    assert g_theirs[0].tolist() == pytest.approx([-0.2 / 3, -0.1 / 3, 0.0], abs=1e-12)


def test_the_answer_weight_is_the_authors_coefficient_over_lambda():
    assert answer_weight(0.2, math.inf) == 1.0                     # no LLDS-MA
    assert answer_weight(0.2, 0.05) == pytest.approx(0.25)
    assert answer_weight(0.2, 0.2) == 1.0                          # their script's MASK_WEIGHT
    assert answer_weight(0.2, 0.4) == 1.0                          # capped at lambda
    assert answer_weight(0.2, 0.1, valid_searches=1.0) == 0.0      # the paper's min(V/2, 1): 0.5
    assert answer_weight(0.2, 0.1, valid_searches=2.5) == pytest.approx(0.75)
    assert answer_weight(0.2, 0.1, valid_searches=4.0) == 1.0


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


# ---- --preset paper: the authors' warm-up and mini-batch order -----------------------------

def test_balanced_parts_worked_by_hand():
    """Lengths 1 2 3 5 4 6 7 8 (rows 0-7), 2 parts. By length the rows pair up (0,1) (2,4) (3,5)
    (6,7), each pair one row to each part: spreads 1, 1, 1, 1. The two widest spreads merge, the
    larger first part first, largest part with smallest: {7}+{3} = 13 and {6}+{5} = 13; then
    {4}+{0} = 5 and {2}+{1} = 5; then {7,3}+{2,1} = 18 and {6,5}+{4,0} = 18. The authors' order
    (mini-batches of 4): update 1 takes 2 rows of each part, update 2 the next 2."""
    lengths = [1, 2, 3, 5, 4, 6, 7, 8]
    assert balanced_parts(lengths, 2) == [[1, 2, 3, 7], [0, 4, 5, 6]]
    assert verl_order(torch.tensor(lengths), 4, parts=2).tolist() == [1, 2, 0, 4, 3, 7, 5, 6]


def test_in_the_authors_order_a_groups_rows_share_an_update_more_often():
    """The paper's step (512 questions x 5, 10 updates of 256, 4 parts), lengths independent
    U[60, 900], 10 batches: two rows of a group share an update 0.44 of the time in the authors'
    order (0.10 shuffled, 1 in 10), all 5 rows in 13% of groups (0%), and a group spans 2.3 of the
    10 updates on average (4.1). docs/method.md quotes these numbers."""
    gen = torch.Generator().manual_seed(0)
    measured = torch.zeros(2, 3)
    for _ in range(10):
        lengths = torch.randint(60, 901, (2560,), generator=gen)
        for k, order in enumerate((verl_order(lengths, 256), torch.randperm(2560, generator=gen))):
            update = torch.empty(2560, dtype=torch.long)
            update[order] = torch.arange(2560) // 256
            groups = update.view(512, 5)                                        # (512, 5)
            pairs = ((groups[:, :, None] == groups[:, None, :]).sum() - 2560) / (512 * 20)
            whole = (groups.amax(1) == groups.amin(1)).float().mean()
            spans = torch.tensor([len(set(g)) for g in groups.tolist()]).float().mean()
            measured[k] += torch.stack([pairs, whole, spans]) / 10
    assert [[round(x, 2) for x in row] for row in measured.tolist()] == [[0.44, 0.13, 2.33],
                                                                      [0.1, 0.0, 4.11]]


def test_the_paper_preset_warms_up_and_orders_the_rows_as_the_authors(tmp_path, monkeypatch):
    """The authors' LambdaLR, min(1, s / int(0.285 x 1005)), stepped after each step's updates
    (fsdp_workers.py), restated with torch's own LambdaLR: their step s runs at lr x (s - 1) / 286,
    the first at 0. --preset paper's train_step gives those rates; at lr 0 AdamW takes in the
    step's gradients (its state counts the updates) and leaves every weight as it was. Its
    mini-batches are the authors' order (verl_order). Without the flags: s / 286, shuffled."""
    paper = {k: v for k, v in PRESETS["paper"].items()
             if k in ("steps", "warmup_ratio", "warmup_from_zero", "verl_minibatches")}
    assert paper == dict(steps=1005, warmup_ratio=0.285, warmup_from_zero=True,
                         verl_minibatches=True)
    param = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.AdamW([param], lr=1e-6)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1, s / max(1, int(0.285 * 1005))))
    theirs = {}
    for s in range(1, 290):
        theirs[s] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedule.step()

    batch = fixed_rollout([1.0, 0.0] * 4, [1] * 8, EQUAL + EQUAL[:2], OBSERVATIONS + [4, 2])
    d = torch.zeros(batch.loss_mask.shape)
    cfg = step_config(tmp_path, **paper, lr=1e-6, prompts_per_step=4, group_size=2,
                      mini_batch_size=4, micro_batch_size=2)
    for s in (2, 3, 286, 287, 288):
        metrics = run_step(tmp_path, monkeypatch, cfg, batch, d, step=s)[1]
        assert metrics["lr"] == pytest.approx(theirs[s], rel=1e-12, abs=0)
    adamw = lambda params: runs.adamw(params, 1e-6, 0.01, torch.device("cpu"))   # noqa: E731
    run, metrics, minibatches = run_step(tmp_path, monkeypatch, cfg, batch, d, optimizer=adamw)
    assert metrics["lr"] == theirs[1] == 0.0
    assert all(torch.equal(p, q) for p, q in zip(run.model.parameters(),
                                                  tiny_policy(seed=0)[0].parameters()))
    assert {s["step"].item() for s in run.optimizer.state.values()} == {2.0}
    order = verl_order(batch.attention_mask.sum(1), 4)
    assert [sorted(torch.cat(m).tolist()) for m in minibatches] == [
        sorted(order[:4].tolist()), sorted(order[4:].tolist())]

    with pytest.raises(ValueError, match="multiple of 4"):     # the authors' 4 parts
        cli.check_config(dataclasses.replace(cfg, mini_batch_size=6, prompts_per_step=3),
                         train.CHOICES)
    plain = dataclasses.replace(cfg, warmup_from_zero=False, verl_minibatches=False)
    assert run_step(tmp_path, monkeypatch, plain, batch, d, step=2)[1]["lr"] == pytest.approx(
        1e-6 * 2 / 286, rel=1e-12)
