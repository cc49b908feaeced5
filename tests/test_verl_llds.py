"""Tests for integrations/verl_llds.py and verl_llds.patch: LLDS on veRL's tensor layout, against
veRL's own loss aggregation, and inside veRL's patched `ppo_loss`.

veRL's actor sees response-only (B, R) tensors: a multi-turn response_mask with holes where the
observations were, right padding, and advantages = score x response_mask (zero-padded).
veRL 0.9.1 is installed without its dependencies plus the few its loss code imports
(requirements-verl.txt); its Ray workers never start here.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from integrations.verl_llds import AGG_MODES, llds_verl_loss
from llds import llds_loss

ROOT = Path(__file__).resolve().parent.parent


def verl_batch(seed=0):
    """6 responses x 12 tokens in veRL's layout, and the same episodes as full rows (prompt + response)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [12, 9, 12, 5, 11, 7]
    response_mask = torch.zeros(6, 12)
    for i, n in enumerate(lengths):
        response_mask[i, :n] = 1
    response_mask[[0, 2, 4], 3:6] = 0                  # an observation inside three responses
    score = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5, 1.5])
    old_log_prob = -torch.rand(6, 12, generator=g) * 3
    log_prob = (old_log_prob + 0.3 * torch.randn(6, 12, generator=g)).requires_grad_()
    return log_prob, old_log_prob, score, response_mask


def test_verl_layout_gives_the_penalty_of_full_rows():
    log_prob, old, score, response_mask = verl_batch()
    advantages = score[:, None] * response_mask       # zero-padded: the -1.0 and -0.5 rows stay negative
    ours, _ = llds_verl_loss(log_prob, old, advantages, response_mask, "token-mean")
    (grad,) = torch.autograd.grad(ours, log_prob)

    # The same episodes as train.py holds them: a left-padded prompt before each response.
    prompt = 5
    full_logp = torch.cat([torch.zeros(6, prompt), log_prob], dim=1)
    full_old = torch.cat([torch.zeros(6, prompt), old], dim=1)
    full_mask = torch.cat([torch.zeros(6, prompt), response_mask], dim=1)
    reference, _ = llds_loss(full_logp, full_old, score, full_mask)
    (reference_grad,) = torch.autograd.grad(reference, log_prob)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad, reference_grad)
    assert ours > 0 and not grad[[1, 4]].any()        # negative advantages: never penalised


@pytest.mark.parametrize("mode", AGG_MODES)
def test_two_data_parallel_ranks_give_the_one_rank_loss(mode):
    """With veRL's global batch info, the mean over ranks (what DDP/FSDP gradients are) of each
    rank's loss on half the batch is the one-rank loss on the whole batch."""
    log_prob, old, score, mask = verl_batch()
    advantages = score[:, None] * mask
    whole, _ = llds_verl_loss(log_prob, old, advantages, mask, mode, loss_scale_factor=12)
    info = dict(dp_size=2, batch_num_tokens=mask.sum(), global_batch_size=6, loss_scale_factor=12)
    halves = [llds_verl_loss(log_prob[rows], old[rows], advantages[rows], mask[rows], mode, **info)[0]
              for rows in (slice(0, 3), slice(3, 6))]
    torch.testing.assert_close(sum(halves) / 2, whole)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_several_ranks_without_global_batch_info_are_an_error_as_in_agg_loss(mode):
    """Local counts would weigh each rank's half differently: veRL's agg_loss raises, so does LLDS."""
    log_prob, old, score, mask = verl_batch()
    advantages = score[:, None] * mask
    if mode == "token-sum":                           # a plain sum needs no count
        llds_verl_loss(log_prob, old, advantages, mask, mode, dp_size=2)
        return
    with pytest.raises(ValueError, match=f"{mode} with dp_size=2 needs the global"):
        llds_verl_loss(log_prob, old, advantages, mask, mode, dp_size=2)
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    with pytest.raises(ValueError, match="required when dp_size > 1"):
        core_algos.agg_loss(log_prob, mask, mode, dp_size=2)


def penalised_hinge(log_prob, old, advantages, mask):
    """(B, R): max(0, old - log_prob) on exactly the tokens llds_loss penalises (read off its gradient)."""
    leaf = log_prob.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(llds_loss(leaf, old, advantages, mask)[0], leaf)
    return torch.where(grad != 0, old - leaf.detach(), 0.0)


class ActorConfig(dict):
    """The fields of veRL's ActorConfig that compute_policy_loss_vanilla reads."""
    __getattr__ = dict.__getitem__


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregated_like_verls_policy_loss(mode):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    log_prob, old, score, mask = verl_batch(seed=1)
    advantages = score[:, None] * mask
    hinge = penalised_hinge(log_prob, old, advantages, mask)
    assert hinge.sum() > 0
    for info in ({}, dict(dp_size=2, batch_num_tokens=150, global_batch_size=12, loss_scale_factor=40)):
        ours, stats = llds_verl_loss(log_prob, old, advantages, mask, mode, **info)
        verl = core_algos.agg_loss(hinge, mask, mode, **info)
        # veRL's PPO loss at ratio 1 with per-token advantages -hinge is its own aggregation of the hinge.
        config = ActorConfig(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                             global_batch_info=info)
        pg, _ = core_algos.compute_policy_loss_vanilla(log_prob.detach(), log_prob.detach(), -hinge, mask,
                                                        mode, config)
        torch.testing.assert_close(ours, verl.float())
        torch.testing.assert_close(ours, pg.float())
    assert set(stats) == {"actor/llds_active_token_frac", "actor/llds_active_action_frac",
                          "actor/llds_displacement", "actor/llds_n_preserving"}


PATCHED_RUN = """
import inspect
import json
import torch
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.utils import tensordict_utils as tu
from verl.utils.config import validate_config
from verl.workers.config import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss
from verl_llds import check_verl_config, llds_verl_loss

B, P, R = 4, 3, 6
torch.manual_seed(0)
attention_mask = torch.ones(B, P + R, dtype=torch.long)
attention_mask[0, -2:] = 0
response_mask = attention_mask[:, P:].clone()
response_mask[1, 2:4] = 0                                   # an observation
old = -torch.rand(B, R) * 3
advantages = torch.tensor([[1.0], [0.5], [-1.0], [0.0]]) * response_mask
log_prob = old + 0.3 * torch.randn(B, R)
# veRL's model output: unpadded log-probs of all B prompt + response tokens, shifted by one
flat = torch.cat([torch.cat([torch.zeros(P - 1), log_prob[i, :n], torch.zeros(1)])
                  for i, n in enumerate(attention_mask[:, P:].sum(1).tolist())])
data = tu.get_tensordict({"prompts": torch.ones(B, P, dtype=torch.long),
                          "responses": torch.ones(B, R, dtype=torch.long), "attention_mask": attention_mask,
                          "response_mask": response_mask, "old_log_probs": old, "advantages": advantages},
                         {"dp_size": 1, "batch_num_tokens": int(response_mask.sum()), "global_batch_size": B})


def actor(coef, loss_mode="vanilla"):
    return ActorConfig(strategy="fsdp", rollout_n=2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                       llds_coef=coef, loss_agg_mode="token-mean", policy_loss=PolicyLossConfig(loss_mode=loss_mode))


def refused(call):
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


out = {}
for loss_mode in ("vanilla", "sapo"):                       # sapo aggregates seq-mean-token-mean, always
    losses = {coef: ppo_loss(actor(coef, loss_mode), {"log_probs": flat}, data) for coef in (0.0, 0.2)}
    out[loss_mode] = {"added": float(losses[0.2][0] - losses[0.0][0]),
                      "logged": "actor/llds_loss" in losses[0.2][1],
                      **{mode: float(0.2 * llds_verl_loss(log_prob, old, advantages, response_mask, mode)[0])
                         for mode in ("token-mean", "seq-mean-token-mean")}}
out["bypass_mode loss"] = refused(lambda: ppo_loss(actor(0.2, "bypass_mode"), {"log_probs": flat}, data))
out["bypass_mode config"] = refused(lambda: check_verl_config(actor(0.2), RolloutCorrectionConfig(bypass_mode=True)))
out["decoupled config"] = refused(lambda: check_verl_config(actor(0.2), RolloutCorrectionConfig(bypass_mode=False)))
out["startup check"] = "check_verl_config(actor_config" in inspect.getsource(validate_config)
print(json.dumps(out))
"""


def test_patch_applies_to_verl_and_adds_llds_to_its_ppo_loss(tmp_path):
    pytest.importorskip("verl.trainer.ppo.core_algos")
    installed = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    shutil.copytree(installed, tmp_path / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "apply", str(ROOT / "integrations" / "verl_llds.patch")], cwd=tmp_path, check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "integrations"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", PATCHED_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    vanilla, sapo = out["vanilla"], out["sapo"]
    assert vanilla["token-mean"] > 0 and vanilla["logged"] and sapo["logged"]
    assert vanilla["added"] == pytest.approx(vanilla["token-mean"], rel=1e-5)
    # sapo ignores loss_agg_mode="token-mean" for its policy loss; LLDS follows it, not the config.
    assert sapo["token-mean"] != pytest.approx(sapo["seq-mean-token-mean"], rel=1e-3)
    assert sapo["added"] == pytest.approx(sapo["seq-mean-token-mean"], rel=1e-5)
    assert "loss_mode='bypass_mode'" in out["bypass_mode loss"]
    assert "bypass_mode=True replaces them with the sampler's" in out["bypass_mode config"]
    assert out["decoupled config"] is None and out["startup check"]
