"""monitor.py: the rollout's numbers and the displacement of correct responses; the death-spiral
warning: hand-made runs, a resumed history, and the replay of the
committed runs (experiments/lld_study/spiral_replay.py) through the same class."""
import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch

from experiments.lld_study import spiral_replay
import monitor
import train
from monitor import SpiralMonitor, lost_nats

ROOT = Path(__file__).resolve().parent.parent


def feed(warning, rewards, displacements, start=1):
    """The step numbers at which the monitor warns, fed one (reward, displacement) per step."""
    return [step for step, (r, d) in enumerate(zip(rewards, displacements), start)
            if warning.check(step, {"reward": r, "lld/correct_displacement": d})]


# A spiral in miniature: reward rises to a 0.5 plateau (best 5-step mean 0.5, steps 3-9), the
# correct responses lose 2 nats a step from step 8, and reward falls from step 10.
SPIRAL_REWARDS = [0.1, 0.3, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.3, 0.2, 0.1, 0.0, 0.0]
SPIRAL_DISPLACEMENTS = [-1.0, -1.0, -0.5, -0.5, None, -0.5, 0.0] + [2.0] * 5 + [None, None]


def test_a_spiral_warns_when_the_lost_likelihood_meets_a_falling_reward():
    warning = SpiralMonitor(window=5, nats=5.0)
    warnings = [warning.check(s, {"reward": r, "lld/correct_displacement": d})
                for s, (r, d) in enumerate(zip(SPIRAL_REWARDS, SPIRAL_DISPLACEMENTS), 1)]
    # step 11 has lost 8 nats over steps 7-11, but its mean reward 0.40 is not below 0.7 x 0.5;
    # step 12: 10 nats over steps 8-12, mean reward 0.32
    assert [s for s, w in enumerate(warnings, 1) if w] == [12, 13, 14]
    assert "lost 10.0 nats" in warnings[11][0] and "fell to 0.320 (best 0.500)" in warnings[11][0]


def test_losing_likelihood_while_reward_rises_is_not_a_warning():
    # what plain GRPO's seeds 2-4 did in the study: displaced every step, and went on learning
    rewards = [min(0.05 * s, 0.8) for s in range(1, 41)]
    assert feed(SpiralMonitor(), rewards, [3.0] * 40) == []


def noisy_flat_run(dip_at: int, loss_at: int) -> tuple[list, list]:
    """300 steps on a plateau: reward as noisy as a batch of ~100 episodes, the correct
    responses' displacement 1.5 nats either way a step (a step in ten without a correct one);
    then reward dips to 0.1 for 5 steps from `dip_at`, and the correct responses lose 3 nats a
    step for 5 steps from `loss_at`."""
    rng = random.Random(0)
    rewards = [min(max(rng.gauss(0.4, 0.05), 0.0), 1.0) for _ in range(300)]
    displacements = [-rng.gauss(0.0, 1.5) if rng.random() < 0.9 else None for _ in range(300)]
    rewards[dip_at - 1:dip_at + 4] = [0.1] * 5
    displacements[loss_at - 1:loss_at + 4] = [3.0] * 5
    return rewards, displacements


def test_a_noisy_flat_run_warns_only_where_a_loss_meets_a_dip():
    assert feed(SpiralMonitor(), *noisy_flat_run(dip_at=100, loss_at=200)) == []
    assert feed(SpiralMonitor(), *noisy_flat_run(dip_at=200, loss_at=200))[0] == 202


@pytest.mark.parametrize("norm", [math.nan, math.inf])
def test_a_non_finite_gradient_norm_is_reported_at_once(norm):
    warnings = SpiralMonitor().check(1, {"grad_norm_max": norm})
    assert len(warnings) == 1 and str(norm) in warnings[0] and "skipped" in warnings[0]


def test_the_displacement_is_read_in_one_place():
    # d = before - after: 3 means the correct responses lost 3 nats; None: none sampled
    assert lost_nats({"lld/correct_displacement": 3.0}) == 3.0
    assert lost_nats({"lld/correct_displacement": None}) == lost_nats({}) == 0.0


def test_a_resumed_monitor_warns_where_an_unbroken_one_does():
    first = SpiralMonitor()
    assert feed(first, SPIRAL_REWARDS[:8], SPIRAL_DISPLACEMENTS[:8]) == []
    saved = json.loads(json.dumps(first.history))             # as state.json stores it
    resumed = SpiralMonitor(history=saved)
    assert feed(resumed, SPIRAL_REWARDS[8:], SPIRAL_DISPLACEMENTS[8:], start=9) == [12, 13, 14]


def test_an_old_checkpoints_history_loads_and_the_rule_starts_afresh():
    old = {"logp_correct": [-0.1, -0.2], "grad_norm": [1.0, 2.0], "tied": [1.0],
           "answer_in_passages": [0.9]}
    monitor = SpiralMonitor(5, 5.0, old)
    assert monitor.history == {"lost": [], "reward": [], "best": None, "grad_norms": []}
    assert feed(monitor, SPIRAL_REWARDS, SPIRAL_DISPLACEMENTS) == [12, 13, 14]


def test_the_committed_runs_replayed():
    rows = {r["run"]: r for r in spiral_replay.replay(
        ROOT / "experiments/lld_study/compare", ROOT / "experiments/lab/pilot")}
    assert len(rows) == 20 + 48
    # plain GRPO seeds 6 and 8 learned, then fell to zero reward: warned at least a step before
    for run in ("compare-grpo-s6", "compare-grpo-s8"):
        assert rows[run]["breakdown"] == 13 and rows[run]["warning"] <= 12
    design = [r for r in rows.values() if r["design"]]
    held_out = [r for r in rows.values() if not r["design"]]
    # the counts experiments/lld_study/README.md gives
    assert spiral_replay.counts(design) == "warned before breakdown 2/5, false alarms 0/25"
    assert spiral_replay.counts(held_out) == "warned before breakdown 0/3, false alarms 0/35"


def test_the_replay_prints_one_line_per_run(capsys):
    spiral_replay.main([str(ROOT / "experiments/lld_study/compare"),
                        str(ROOT / "experiments/lab/pilot")])
    lines = capsys.readouterr().out.splitlines()
    assert "warning compare-grpo-s6: first 11, breakdown 13" in lines
    assert "warning lab-lr1e-5-u4-grpo-s1000: first none, breakdown none" in lines
    assert sum(l.startswith("warning ") for l in lines) == 68


def test_rollout_stats_mean_log_likelihood_of_correct_and_incorrect_responses():
    from types import SimpleNamespace
    ep = lambda em, q: {"em": em, "f1": em, "n_search": 1, "n_valid": 1, "finished": True,  # noqa: E731
                        "queries": [q], "golds": ["Orvale"], "text": f"<information>{q} Orvale</information>"}
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    old = torch.tensor([[9., -1., -3., 9.], [9., -2., -2., -5.], [9., -4., 9., 9.], [9., 9., 9., 9.]])
    out = SimpleNamespace(episodes=[ep(1.0, "a"), ep(0.0, "a"), ep(0.0, "b"), ep(0.0, "a")],
                          loss_mask=mask, logp=old.clone())
    stats = monitor.rollout_stats(out, old, torch.tensor([1., 0., 0., 0.]), torch.tensor([0, 0, 0, 0]))
    # correct: row 0, mean(-1, -3) = -2. incorrect with tokens: rows 1, 2 -> mean(-3, -4) = -3.5
    # (row 3 has no model tokens and is left out). Pairs (0,1), (0,2), (0,3): one shares "a" with
    # a row that has tokens, row 3 also searched "a" -> 2 of 3.
    assert stats["lld/logp_correct"] == -2.0 and stats["lld/logp_incorrect"] == -3.5
    assert stats["lld/shared_first_search"] == pytest.approx(2 / 3)
    assert stats["search/answer_in_passages"] == 1.0 and stats["search/unique_queries"] == 2   # "a", "b"
    assert stats["rollout/logp_diff"] == 0.0 and stats["reward"] == 0.25


def test_displacement_splits_into_search_turns_and_the_answer_turn():
    # row 0 correct: turns at 1-2 (search) and 4-5 (answer, <answer> on 5); row 1 correct, no answer; row 2 wrong
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.float32)
    answer = torch.tensor([[0, 0, 0, 0, 0, 1], [0] * 6, [0] * 6], dtype=torch.float32)
    old = torch.zeros(3, 6)
    after = torch.tensor([[9., -1., -2., 9., 0.5, -3.], [9., 1., 1., -4., 9., 9.], [5.] * 6])
    batch = {"loss_mask": mask, "answer_mask": answer, "old_logp": old}
    out, change = monitor.displacement(batch, after, torch.tensor([True, True, False]))
    assert torch.equal(change, torch.where(mask.bool(), after, 0.0))
    # d = before - after. Row 0: search 3, answer 2.5 (total 5.5 nats lost); row 1: search 2,
    # answer 0 (total 2)
    assert out["lld/correct_displacement"] == pytest.approx(3.75)
    assert out["lld/correct_displacement_search"] == pytest.approx(2.5)
    assert out["lld/correct_displacement_answer"] == pytest.approx(1.25)
    assert out["lld/correct_frac_lost"] == 1.0


def test_the_spiral_flags_default_to_the_monitor_the_study_replays():
    # experiments/lld_study/spiral_replay.py measures SpiralMonitor() with its own defaults
    cfg, warning = train.Config(), monitor.SpiralMonitor()
    assert (cfg.spiral_window, cfg.spiral_nats) == (warning.window, warning.nats)


def test_control_tag_probs_multiply_the_probabilities_of_a_tags_tokens():
    from plumbing.models import byte_tokenizer
    tok = byte_tokenizer()
    turn1, obs, turn2 = "x<search> a </search>", "<information>", "<answer>b</answer>"
    ids = tok(turn1 + obs + turn2, add_special_tokens=False)["input_ids"]
    kinds = [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert len(ids) == len(kinds)         # one token a character
    mask = torch.tensor([kinds], dtype=torch.float32)
    old = torch.full((1, len(ids)), -0.1)
    old[0, 1] = -2.0                      # the "<" of <search>
    probs = monitor.control_tag_probs(tok, torch.tensor([ids]), mask, old)
    # <search>: 8 tokens, one at -2.0; <answer>: 8 at -0.1; the closes: 9 tokens each
    assert probs["ctrl/p_search"] == pytest.approx(math.exp(-2.0 - 0.7))
    assert probs["ctrl/p_answer"] == pytest.approx(math.exp(-0.8))
    assert probs["ctrl/p_close"] == pytest.approx(math.exp(-0.9))
    # a tag in an observation (mask 0) is not the policy's: no <information> kind, none counted
    none = monitor.control_tag_probs(tok, torch.tensor([ids]), torch.zeros_like(mask), old)
    assert none == dict.fromkeys(monitor.CONTROL_TAGS)


def test_grad_norm_z_against_the_runs_own_earlier_steps():
    warning = SpiralMonitor()
    # 0.0 (every group tied) and inf (skipped) never join the history
    zs = [warning.grad_norm_z(n) for n in (1.0, 0.0, 2.0, math.inf, 3.0, 5.0)]
    assert zs[:5] == [None] * 5
    assert zs[5] == pytest.approx((5.0 - 2.0) / 1.0)      # mean 2, sd 1 over 1, 2, 3
    resumed = SpiralMonitor(history=json.loads(json.dumps(warning.history)))
    assert resumed.grad_norm_z(2.0) == pytest.approx((2.0 - 2.75) / statistics.stdev([1, 2, 3, 5]))


def test_a_condition_reads_a_level_or_a_change_from_the_runs_first_steps_causally():
    level = monitor.Condition("entropy", change=False, window=2, above=True, threshold=0.5)
    change = monitor.Condition("entropy", change=True, window=1, above=True, threshold=0.25)
    values = [0.3, None, 0.5, 0.6, 0.9]
    # level, mean of 2 steps: None while a value of the window is missing
    assert [level.reading(values[:i]) for i in range(1, 6)] == [
        None, None, None, pytest.approx(0.55), pytest.approx(0.75)]
    # change from the mean of steps 1-3's logged values (0.4), only after step 3
    assert [change.reading(values[:i]) for i in range(1, 6)] == [
        None, None, None, pytest.approx(0.2), pytest.approx(0.5)]
    assert [change.fires(values[:i]) for i in range(1, 6)] == [False] * 4 + [True]
    assert str(level) == "entropy (mean of 2 steps) > 0.5"
