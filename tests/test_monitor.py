"""monitor.py: the rollout's numbers and the displacement of correct responses; the death-spiral
warning: a hand-made rule, a resumed history, the rule the spiral study designed, and the
detector's replay agreeing with the class train.py runs."""
import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch

from experiments.spiral import detector
import monitor
import train
from monitor import Condition, SpiralMonitor
from plumbing.cli import field_help

ROOT = Path(__file__).resolve().parent.parent


# A rule of two conditions: entropy up by more than 0.2 from its mean over steps 1-3, and reward
# (mean of the last 2 steps) below 0.3.
RULE = (Condition("entropy", change=True, window=1, above=True, threshold=0.2),
        Condition("reward", change=False, window=2, above=False, threshold=0.3))
ENTROPY = [0.5, 0.4, 0.6, 0.6, 0.8, 0.9, 0.9, 0.6, 1.0]
REWARDS = [0.2, 0.4, 0.5, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1]


def feed(warning, entropy, rewards, start=1):
    """The step numbers at which the monitor warns, fed one training step's metrics at a time."""
    return [step for step, (e, r) in enumerate(zip(entropy, rewards), start)
            if warning.check(step, {"entropy": e, "reward": r})]


def test_the_rule_warns_where_every_condition_fires():
    # entropy's baseline: mean(0.5, 0.4, 0.6) = 0.5; up > 0.2 at steps 5, 6, 7, 9 (0.8, 0.9, 0.9,
    # 1.0); the 2-step reward mean < 0.3 at steps 7 (0.25), 8 (0.15), 9 (0.1): both at 7 and 9
    warning = SpiralMonitor(RULE)
    out = [warning.check(s, {"entropy": e, "reward": r})
           for s, (e, r) in enumerate(zip(ENTROPY, REWARDS), 1)]
    assert [s for s, w in enumerate(out, 1) if w] == [7, 9]
    assert "change of entropy > 0.2: 0.4;" in out[6][0] and "< 0.3: 0.25 (LLDS" in out[6][0]
    assert feed(SpiralMonitor(()), ENTROPY, REWARDS) == []           # --no-spiral-warning


def test_an_evaluation_line_moves_no_signal():
    warning = SpiralMonitor(RULE)
    for step, (e, r) in enumerate(zip(ENTROPY, REWARDS), 1):
        warning.check(step, {"entropy": e, "reward": r})
        warning.check(step, {"eval/em": 0.5})
    assert warning.history["signals"] == {"entropy": ENTROPY, "reward": REWARDS}


@pytest.mark.parametrize("rule", [RULE, ()])
def test_a_non_finite_gradient_norm_is_no_spiral_warning(rule):
    # lld/warning is the rule alone; train.py reports the skipped update itself
    for norm in (math.nan, math.inf):
        assert SpiralMonitor(rule).check(1, {"grad_norm_max": norm, "reward": 0.1}) == []


def test_a_resumed_monitor_warns_where_an_unbroken_one_does():
    first = SpiralMonitor(RULE)
    assert feed(first, ENTROPY[:6], REWARDS[:6]) == []
    saved = json.loads(json.dumps(first.history))             # as state.json stores it
    resumed = SpiralMonitor(RULE, history=saved)
    assert feed(resumed, ENTROPY[6:], REWARDS[6:], start=7) == [7, 9]


def test_an_old_checkpoints_history_loads_and_the_signals_start_afresh():
    old = {"lost": [1.0, 2.0], "reward": [0.5], "best": 0.5, "grad_norms": [1.0, 2.0]}
    monitor = SpiralMonitor(RULE, old)
    assert monitor.history == {"signals": {}, "grad_norms": [1.0, 2.0]}
    assert feed(monitor, ENTROPY, REWARDS) == [7, 9]


def test_the_default_rule_is_the_one_the_spiral_study_designed():
    record = json.loads(detector.DESIGN.read_text())
    assert monitor.RULE == detector.from_json(record["chosen"]) and monitor.RULE
    s = record["score"]
    assert (f"on the {s['breakdowns'] + s['calm']} runs it was designed on, it warned {s['warned']}"
            f" of {s['breakdowns']} breakdowns 2 or more steps ahead and fired in "
            f"{s['false_alarms']} of the {s['calm']} runs without one") in monitor.RULE_RECORD
    held = detector.held_out(ROOT / "experiments/spiral/study", record)
    assert len(held) == detector.HELD_OUT_RUNS
    h = detector.score(monitor.RULE, held)
    assert (f"on the {len(held)} held-out runs, {h['warned']} of {h['breakdowns']} (median lead "
            f"{h['median_lead']:g} steps) and {h['false_alarms']} of {h['calm']}"
            ) in monitor.RULE_RECORD
    assert train.Config().spiral_warning
    assert monitor.RULE_TEXT in field_help(train.Config)["spiral_warning"]
    # the closing tags' probability: baseline mean(0.9, 0.9, 0.9); steps 4-5 average 0.65, -0.25
    default = monitor.SpiralMonitor()
    out = [default.check(s, {"reward": 0.5, "ctrl/p_close": p})
           for s, p in enumerate([0.9, 0.9, 0.9, 0.7, 0.6], 1)]
    assert [bool(w) for w in out] == [False] * 4 + [True]
    assert ": -0.25 (the default rule: " + monitor.RULE_RECORD in out[4][0]


def test_the_detector_replays_a_committed_run_as_train_pys_monitor_reads_it():
    # every pilot run, and rules on several signals, each read as a level and as a change
    runs = detector.load(ROOT / "experiments/spiral/pilot/lr4e-5-s15", None)
    assert runs
    for rule in [(Condition("entropy", True, 2, True, 0.05),),
                 (Condition("reward", False, 3, False, 0.5),
                  Condition("lld/correct_displacement", False, 1, True, 0.0)),
                 (Condition("grad_norm_z", False, 1, True, 1.0),)]:
        for run in runs:
            warning = SpiralMonitor(rule)
            steps = [l["step"] for l in run["lines"] if warning.check(l["step"], l)]
            assert detector.first_warning(rule, run["lines"]) == (steps[0] if steps else None)


def test_rollout_stats_mean_log_likelihood_of_correct_and_incorrect_responses():
    from types import SimpleNamespace

    def ep(em, q):
        return {"em": em, "f1": em, "n_search": 1, "n_valid": 1, "finished": True,
                "queries": [q], "golds": ["Orvale"],
                "text": f"<information>{q} Orvale</information>"}
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]]).float()
    old = torch.tensor([[9., -1., -3., 9.], [9., -2., -2., -5.], [9., -4., 9., 9.], [9.] * 4])
    out = SimpleNamespace(episodes=[ep(1.0, "a"), ep(0.0, "a"), ep(0.0, "b"), ep(0.0, "a")],
                          loss_mask=mask, logp=old.clone())
    stats = monitor.rollout_stats(out, old, torch.tensor([1., 0., 0., 0.]), torch.zeros(4).long())
    # correct: row 0, mean(-1, -3) = -2. incorrect with tokens: rows 1, 2 -> mean(-3, -4) = -3.5
    # (row 3 has no model tokens and is left out). Pairs (0,1), (0,2), (0,3): one shares "a" with
    # a row that has tokens, row 3 also searched "a" -> 2 of 3.
    assert stats["lld/logp_correct"] == -2.0 and stats["lld/logp_incorrect"] == -3.5
    assert stats["lld/shared_first_search"] == pytest.approx(2 / 3)
    assert stats["search/answer_in_passages"] == 1.0
    assert stats["search/unique_queries"] == 2                                         # "a", "b"
    assert stats["rollout/logp_diff"] == 0.0 and stats["reward"] == 0.25


def test_displacement_splits_into_search_turns_and_the_answer_turn():
    # row 0 correct: turns at 1-2 (search) and 4-5 (answer, <answer> on 5); row 1 correct, no
    # answer; row 2 wrong
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]]).float()
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


def test_a_trend_is_the_least_squares_slope_over_its_window():
    rising = Condition("entropy", change=False, window=3, above=True, threshold=0.2, trend=True)
    # slope of (1.0, 1.5, 1.6) over steps 0, 1, 2: (-1 x 1.0 + 0 + 1 x 1.6) / 2 = 0.3
    assert rising.reading([0.2, 1.0, 1.5, 1.6]) == pytest.approx(0.3)
    assert rising.fires([0.2, 1.0, 1.5, 1.6]) and not rising.fires([1.6, 1.5, 1.0])
    assert rising.reading([1.0, 1.5]) is None and rising.reading([1.0, None, 1.5]) is None
    assert str(rising) == "trend of entropy over 3 steps (a step) > 0.2"
