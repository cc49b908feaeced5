"""The README's LLD table (experiments/lld_study/lld_table.py) on hand-built metrics."""
import json

import pytest

from experiments.lld_study import lld_table


def test_longest_fall_finds_the_longest_run_of_decreases():
    points = [(1, -0.1), (2, -0.2), (3, -0.1), (4, -0.2), (5, -0.3), (6, -0.5), (7, -0.4)]
    step_a, step_b, drop = lld_table.longest_fall(points)
    assert (step_a, step_b) == (3, 6) and abs(drop - (-0.4)) < 1e-12
    assert lld_table.longest_fall([(1, 0.0), (2, 0.1)]) is None


def test_collapse_needs_reward_halved_and_entropy_up():
    line = lambda step, reward, entropy: {"step": step, "reward": reward, "entropy": entropy}  # noqa: E731
    rewards = [0.3] * 5 + [0.0] * 5
    # 5-step mean: best 0.3 up to step 5, then 0.24, 0.18, 0.12 (< 0.15 at step 8)
    assert lld_table.collapse_step([line(i + 1, r, 1.0 if i < 7 else 2.0) for i, r in enumerate(rewards)]) == 8
    assert lld_table.collapse_step([line(i + 1, r, 1.0) for i, r in enumerate(rewards)]) is None


# The committed runs logged `lld/displacement_correct` = after - before; read_metrics gives it
# today's name and llds.py's sign, d = before - after (> 0: lost): both give the same row.
@pytest.mark.parametrize("key, sign", [("lld/correct_displacement", 1),
                                       ("lld/displacement_correct", -1)])
def test_row_reads_a_run_folder(tmp_path, key, sign):
    lines = [{"step": 0, "eval/em": 0.2}] + [
        {"step": s, "reward": 0.1 * s, "entropy": 0.5, "grad_norm_max": float(s), "timing/step": 10.0,
         "lld/logp_correct": -0.1 * s, key: sign * (s - 1.0)} for s in (1, 2, 3)]
    lines.append({"step": 3, "eval/em": 0.4})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    assert lld_table.row(tmp_path) == (
        f"| {tmp_path.name} | 3 | 0.20 -> 0.20 | 0.20 -> 0.40 (step 3) | steps 1-3: -0.200 | "
        "+2.00 (step 3) | 0.500 -> 0.500 | 1 -> 3 | - | 10 |")


# ---- experiments/lld_study/lld_study.py: the many-seed study ----

def write_run(folder, arm, seed, rewards, displacements, ems, bf16=True, steps=None,
              old_names=False):
    """A run folder; displacements in d's sign (> 0: lost), written as the older runs logged them
    (`lld/displacement_correct`, after - before) with old_names."""
    from pathlib import Path
    run = Path(folder) / f"compare-{arm}-s{seed}"
    run.mkdir(parents=True)
    lines = [{"step": 0, "eval/em": 0.2}]
    key, sign = ("lld/displacement_correct", -1) if old_names else ("lld/correct_displacement", 1)
    lines += [{"step": i + 1, "reward": r, "entropy": 0.5, key: sign * d}
              for i, (r, d) in enumerate(zip(rewards, displacements))]
    lines[-1]["eval/em"] = ems
    (run / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    (run / "config.json").write_text(json.dumps({"steps": steps or len(rewards)}))
    (run / "machine.json").write_text(json.dumps([{"from_step": 0, "bf16_autocast": bf16}]))
    return run


def test_run_summary_measures_by_hand(tmp_path):
    from experiments.lld_study import lld_study
    rewards, displacements = [0.0, 0.5, 0.5, 1.0, 0.0, 0.5], [-1.0, 2.0, -0.5, 0.25, 3.0, -2.0]
    run = write_run(tmp_path, "llds", 3, rewards, displacements, 0.4)
    (run / "heldout200.json").write_text(json.dumps({"questions": 200, "eval/em": 0.35}))
    s = lld_study.run_summary(run)
    assert (s["arm"], s["seed"], s["precision"], s["finished"]) == ("llds", 3, "bf16", True)
    assert s["em_final"] == 0.4 and s["em_heldout"] == {200: 0.35}
    assert abs(s["reward_last5"] - 0.5) < 1e-12                      # (0.5 + 0.5 + 1 + 0 + 0.5) / 5
    assert (s["disp_sum"], s["disp_worst"], s["disp_pos_steps"]) == (5.25, 3.0, 3)  # 2 + .25 + 3
    old = lld_study.run_summary(write_run(tmp_path / "old", "llds", 3, rewards, displacements, 0.4,
                                          old_names=True))
    assert {**old, "em_heldout": {200: 0.35}} == s           # the old name and sign, read alike
    unfinished = lld_study.run_summary(write_run(tmp_path, "grpo", 3, [0.1] * 3, [0.0] * 3, 0.1, steps=20))
    assert not unfinished["finished"] and unfinished["em_final"] is None
    assert s["em_low"] is None and unfinished["em_low"] is None      # EM 0.2 -> 0.4; 0.2 -> 0.1
    fell = lld_study.run_summary(write_run(tmp_path, "grpo", 4, [0.1] * 4, [0.0] * 4, 0.05))
    assert fell["em_low"] == 4                                       # 0.05 at step 4: at the threshold


def test_bootstrap_interval_and_pairing():
    from experiments.lld_study import lld_study
    mean, lo, hi = lld_study.bootstrap_mean([0.1, 0.1, 0.1])
    assert all(abs(v - 0.1) < 1e-12 for v in (mean, lo, hi))        # no spread, no interval
    mean, lo, hi = lld_study.bootstrap_mean([-1.0, 1.0] * 10)
    assert mean == 0.0 and -0.5 < lo < -0.3 and 0.3 < hi < 0.5      # sd 1, n 20: +-1.96 * 1 / sqrt(20) = 0.44
    runs = [{"seed": 0, "arm": "grpo", "x": 1.0}, {"seed": 0, "arm": "llds", "x": 3.0},
            {"seed": 1, "arm": "grpo", "x": 2.0}, {"seed": 2, "arm": "llds", "x": 5.0}]
    assert lld_study.paired(runs, lambda r: r["x"]) == [(0, 1.0, 3.0)]


def test_study_keeps_precisions_apart(tmp_path, capsys):
    from experiments.lld_study import lld_study
    for seed, bf16 in ((0, True), (1, True), (2, False)):
        write_run(tmp_path, "grpo", seed, [0.2] * 5, [1.0] * 5, 0.3, bf16=bf16)
        write_run(tmp_path, "llds", seed, [0.4] * 5, [-1.0] * 5, 0.5, bf16=bf16)
    lld_study.main([str(tmp_path), "--figure", str(tmp_path / "fig.png")])
    out = capsys.readouterr().out
    assert "### bf16: seeds 0, 1" in out and "### fp32: seeds 2" in out
    assert "| final EM, 30 questions | 2 | +0.200 | [+0.200, +0.200] | 2 / 0 / 0 |" in out
    assert "| plain GRPO | 2 / 2 | 0 / 2 | 0 / 2 | 0.30 |" in out
    # the headline, by hand: GRPO lost 1 nat on each of 5 steps, 5 in all; LLDS gained: 0
    assert ("in 2 of 2 seeds:** their summed positive displacement (mean over seeds) was 5.0 nats "
            "under plain GRPO and 0.0 under LLDS (paired difference -5.0, 95% bootstrap interval "
            "[-5.0, -5.0])") in out
    assert "final held-out EM (30 questions) 0.30 against 0.50, paired difference LLDS - GRPO +0.20 [+0.20, +0.20]" in out
    assert "Training reward over the last 5 steps: 0.20 plain GRPO, 0.40 LLDS (paired +0.20 [+0.20, +0.20])" in out
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_study_headline_names_the_seeds_where_neither_arm_displaced(tmp_path, capsys):
    from experiments.lld_study import lld_study
    write_run(tmp_path, "grpo", 0, [0.2] * 5, [1.0] * 5, 0.3)
    write_run(tmp_path, "llds", 0, [0.4] * 5, [-1.0] * 5, 0.5)
    write_run(tmp_path, "grpo", 1, [0.2] * 5, [-1.0] * 5, 0.3)   # seed 1: both arms gained
    write_run(tmp_path, "llds", 1, [0.4] * 5, [-1.0] * 5, 0.5)
    lld_study.main([str(tmp_path)])
    out = capsys.readouterr().out
    # paired differences in summed positive displacement: -5 (seed 0) and 0 (seed 1): mean -2.5
    assert ("in 1 of 2 seeds (in 1 neither arm displaced them):** their summed positive "
            "displacement (mean over seeds) was 2.5 nats under plain GRPO and 0.0 under LLDS "
            "(paired difference -2.5") in out
    assert ("| summed positive displacement (nats) | 2 | -2.500 | [-5.000, +0.000] | 0 / 1 / 1 |"
            in out)
