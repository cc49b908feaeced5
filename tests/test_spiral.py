"""experiments/spiral/: the survival statistics against independent computations (the values
below are lifelines 0.30's KaplanMeierFitter and logrank_test and scipy's fisher_exact on the same
data, pinned), and the study's rules on hand-made runs."""
import json
import math

import pytest

from experiments.spiral import survival

ARM_A = ([3, 5, 5, 8, 10], [1, 1, 0, 1, 0])
ARM_B = ([4, 6, 10, 10, 2, 9], [1, 0, 0, 0, 1, 1])


def test_kaplan_meier_and_its_greenwood_band():
    rows = survival.kaplan_meier(*ARM_A)
    # by hand: S(3) = 4/5, S(5) = 4/5 * 3/4 (the censored run at 5 is at risk at 5), S(8) = 0.6 / 2
    assert [(r["time"], r["at_risk"], r["events"]) for r in rows] == [
        (3, 5, 1), (5, 4, 1), (8, 2, 1)]
    assert [r["survival"] for r in rows] == pytest.approx([0.8, 0.6, 0.3])
    assert [r["low"] for r in rows] == pytest.approx([0.203809, 0.125730, 0.012302], abs=1e-6)
    assert [r["high"] for r in rows] == pytest.approx([0.969180, 0.881756, 0.719218], abs=1e-6)
    assert survival.kaplan_meier([5, 7], [0, 0]) == []          # no breakdown: S stays 1


def test_log_rank_fisher_and_the_paired_bootstrap():
    result = survival.log_rank(*ARM_A, *ARM_B)
    assert result["chi2"] == pytest.approx(0.143010, abs=1e-6)
    assert result["p"] == pytest.approx(0.705307, abs=1e-6)
    assert (result["observed_a"], result["expected_a"]) == pytest.approx((3.0, 2.548990), abs=1e-6)
    assert survival.fisher_exact(3, 10, 8, 10) == pytest.approx(0.0697785, abs=1e-7)
    assert survival.fisher_exact(0, 30, 12, 30) == pytest.approx(1.236184e-4, rel=1e-6)
    assert survival.fisher_exact(5, 30, 5, 30) == 1.0
    boot = survival.paired_bootstrap([0.1, 0.2, 0.3], [0.2, 0.2, 0.6])
    assert boot["mean"] == pytest.approx(0.4 / 3)
    assert 0.0 <= boot["low"] <= boot["mean"] <= boot["high"] <= 0.3
    assert math.isclose(survival.paired_bootstrap([1, 1], [2, 2])["low"], 1.0)


def steps_of(rewards):
    return [{"step": s, "reward": r} for s, r in enumerate(rewards, 1)]


def test_breakdown_needs_half_the_best_earlier_window_and_no_recovery():
    from experiments.spiral.spiral_study import breakdown_onset
    # windows of 3: R(3) .. R(9) = 0.4, R(10) = 0.8 / 3, R(11) = 0.4 / 3 <= 0.5 x 0.4
    learned_then_fell = [0.4] * 9 + [0.0] * 6
    assert breakdown_onset(steps_of(learned_then_fell)) == 11
    # the same fall, then back above 0.75 x 0.4 = 0.3 at the end: not a breakdown there
    assert breakdown_onset(steps_of(learned_then_fell + [0.4] * 3)) is None
    # back to 0.3 exactly is not above it: broken down at 11
    assert breakdown_onset(steps_of(learned_then_fell + [0.3] * 3)) == 11
    # a best window below 0.1 is noise, not learning
    assert breakdown_onset(steps_of([0.08] * 9 + [0.0] * 6)) is None
    # steps without a reward (the evaluation lines) do not count
    lines = steps_of(learned_then_fell) + [{"step": 15, "eval/em": 0.1}]
    assert breakdown_onset(lines) == 11


def test_the_detectors_design_finds_the_signal_that_rises_before_the_breakdowns():
    from experiments.spiral import detector
    runs = []
    for k in range(10):           # runs 0-4 fall from reward 0.5 to 0.05 at step 12; 5-9 do not
        falls = k < 5
        lines = [{"step": s, "reward": 0.05 if falls and s >= 12 else 0.5,
                  # entropy rises from step 9 in the runs that fall; noise in the 3rd decimal
                  "entropy": (1.0 if falls and s >= 9 else 0.4) + 0.001 * ((s * 7 + k) % 5),
                  "valid_action_ratio": 0.9 - 0.001 * ((s + k) % 3)} for s in range(1, 21)]
        runs.append({"run": f"r{k}", "lines": lines, "onset": detector.breakdown_onset(lines)})
    # R(12) = (0.5 + 0.5 + 0.05) / 3 = 0.35 > 0.25; R(13) = 0.2: onset 13
    assert [r["onset"] for r in runs] == [13] * 5 + [None] * 5
    result = detector.design(runs)
    assert result["chosen"][0].signal == "entropy" and len(result["chosen"]) == 1
    # warned at step 9, 4 steps before the onset, in every falling run; no false alarm
    assert result["score"] | {"rule": None} == {
        "rule": None, "breakdowns": 5, "warned": 5, "recall": 1.0, "median_lead": 4, "calm": 5,
        "false_alarms": 0, "alarms_per_10": 0.0}
    # a warning 1 step before the onset is too late: not warned
    late = detector.Condition("reward", False, 1, False, 0.3)          # fires at step 12
    assert detector.score((late,), runs)["warned"] == 0
    assert detector.first_warning((late,), runs[0]["lines"]) == 12


def test_make_spiral_runs_on_the_committed_folders(tmp_path, capsys):
    from pathlib import Path

    from experiments.spiral import spiral_study
    root = Path(__file__).resolve().parent.parent / "experiments/spiral"
    spiral_study.main([str(root), "--figure", str(tmp_path / "survival.png")])
    out = capsys.readouterr().out
    assert "| learning rate | steps |" in out
    assert (tmp_path / "survival.png").exists() == (root / "study").is_dir()


def test_a_design_is_recorded_and_replayed_on_other_seeds(tmp_path):
    import json

    from experiments.spiral import detector
    for k in range(4):            # seeds 0-3; 0 and 2 fall at step 12, entropy up from step 9
        falls = k % 2 == 0
        run = tmp_path / f"grpo-s{k}"
        run.mkdir()
        run.joinpath("metrics.jsonl").write_text("".join(json.dumps(
            {"step": s, "reward": 0.05 if falls and s >= 12 else 0.5,
             "entropy": (1.0 if falls and s >= 9 else 0.4) + 0.001 * (s % 3)}) + "\n"
            for s in range(1, 16)))
    record = detector.write_design(tmp_path, "0-1", tmp_path / "design.json")
    assert json.loads((tmp_path / "design.json").read_text()) == record
    assert record["chosen"][0]["signal"] == "entropy"
    rows = detector.table(record, tmp_path, {2, 3})
    assert rows[2].startswith("| **chosen** | entropy") and "| 1 / 1 | 4 | 0 / 1 | 0.0 |" in rows[2]
    # every signal has its row: one these runs never logged has no condition to offer
    assert len(rows) == 3 + len(detector.SIGNALS) + 2
    text = "".join(rows)
    assert "| grad_norm_z | none warned a breakdown within 1 false alarm in 10 on the" in text
    assert "| reward | none warned" in text      # it falls with the onset: no lead on seeds 0-1
    assert rows[-1].endswith("steps): grpo-s2 13 / 9.")           # onset 13: the 3-step mean


def test_a_landed_run_is_committed_alone(tmp_path):
    import subprocess

    from experiments.spiral import spiral_runs
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True,  # noqa: E731
                                    capture_output=True, text=True).stdout
    git("init", "-q")
    git("config", "user.email", "t@t"), git("config", "user.name", "t")
    (tmp_path / "README.md").write_text("a\n")
    git("add", "README.md"), git("commit", "-q", "-m", "start")
    (tmp_path / "README.md").write_text("a, rendered anew\n")
    (tmp_path / "notes.txt").write_text("not the runner's\n")
    (tmp_path / "experiments/spiral").mkdir(parents=True)
    (tmp_path / "experiments/spiral/README.md").write_text("rendered\n")
    run = tmp_path / "experiments/spiral/study/grpo-s0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    spiral_runs.commit_landed(tmp_path, run, "landed")        # no Makefile here: nothing renders
    assert git("log", "--format=%s") == "landed\nstart\n"
    assert sorted(git("show", "--name-only", "--format=", "HEAD").split()) == [
        "README.md", "experiments/spiral/README.md",
        "experiments/spiral/study/grpo-s0/metrics.jsonl"]


def test_every_counted_run_ran_the_registering_commit_in_the_registered_setting():
    import json
    import re
    from pathlib import Path

    from experiments.spiral import spiral_runs
    root = Path(__file__).resolve().parent.parent / "experiments/spiral"
    registered = re.search(r"\*\*Registering commit\*\*.*?([0-9a-f]{40})",
                           (root / "prereg.md").read_text(), re.S).group(1)
    lr, steps = spiral_runs.parse_cell(spiral_runs.STUDY_CELL)
    for run in sorted((root / "study").glob("*-s*")):
        assert json.loads((run / "run.json").read_text())["commit"] == registered, run.name
        config = json.loads((run / "config.json").read_text())
        assert (config["lr"], config["steps"], config["llds"]) == (
            float(lr), int(steps), run.name.startswith("llds")), run.name


def test_the_cost_line_is_read_from_the_runs_own_timings():
    from experiments.spiral.spiral_study import cost
    rows = [{"finished": True, "minutes": 30.4, "s_step": 112.2, "cpu": ["A"], "bf16": False},
            {"finished": True, "minutes": 41.6, "s_step": 150.0, "cpu": ["A", "B"], "bf16": False},
            {"finished": False, "minutes": 3.0, "s_step": 90.0, "cpu": ["C"], "bf16": True}]
    assert cost(rows) == ("Cost: a finished run took 30-42 minutes (112-150 s a step), two runs "
                          "side by side, one thread each, on A; B in float32; 1 of 2 resumed "
                          "after an interruption.")
    assert cost(rows[2:]) == "No run has finished yet."


def test_the_warm_start_line_names_each_build_with_its_seeds():
    from experiments.spiral.spiral_study import warm_starts
    rows = [{"seed": s, "warm_start": sha} for s, sha in
            [(0, "9213aee0ff"), (1, "9213aee0ff"), (2, "9213aee0ff"), (3, "081acc68aa"),
             (4, "9213aee0ff"), (6, "081acc68aa"), (6, "081acc68aa"), (7, None)]]
    assert warm_starts(rows) == ("Warm-start builds, by sha256: 9213aee0 (seeds 0-2, 4); "
                                 "081acc68 (seeds 3, 6); unrecorded (seeds 7).")


def test_the_wide_class_finds_a_trend_that_warns_earlier_than_any_level():
    from experiments.spiral import detector
    runs = []
    for k in range(10):      # runs 0-4 break down at step 14; their entropy climbs from step 6
        falls, base = k < 5, 0.5 + 0.4 * (k % 5)      # the same levels in both kinds of run
        lines = [{"step": s, "reward": 0.05 if falls and s >= 13 else 0.5,
                  "entropy": base + (0.1 * (s - 5) if s > 5 else 0.0) if falls
                  else base + (1 if (s + k) % 2 else -1)} for s in range(1, 21)]
        runs.append({"run": f"r{k}", "lines": lines, "onset": detector.breakdown_onset(lines)})
    assert [r["onset"] for r in runs] == [14] * 5 + [None] * 5
    narrow = detector.design(runs)
    wide = detector.design(runs, readings=detector.WIDE_CLASS)
    # the calm runs swing +-1 a step: an odd window's slope of the swing is 0, the climb's > 0
    assert [str(c) for c in wide["chosen"]] == ["trend of entropy over 3 steps (a step) > 0"]
    assert (wide["score"]["warned"], wide["score"]["false_alarms"]) == (5, 0)
    assert (narrow["score"]["median_lead"], wide["score"]["median_lead"]) == (5, 8)


def test_the_late_redesign_reads_every_folder_and_replays_with_the_default(tmp_path):
    from experiments.late_spiral import warning
    from experiments.spiral import detector
    for k in range(10):       # the hand-made set above, half in a study, half in a pilot's cell
        falls, base = k < 5, 0.5 + 0.4 * (k % 5)
        folder = tmp_path / ("study" if k % 2 else "pilot/lr1e-5") / f"grpo-s{k}"
        folder.mkdir(parents=True)
        folder.joinpath("metrics.jsonl").write_text("".join(json.dumps(
            {"step": s, "reward": 0.05 if falls and s >= 13 else 0.5,
             "entropy": base + (0.1 * (s - 5) if s > 5 else 0.0) if falls
             else base + (1 if (s + k) % 2 else -1)}) + "\n" for s in range(1, 21)))
    runs = warning.runs_in(("study", "pilot/*"), tmp_path)
    assert [r["run"] for r in runs] == ([f"study/grpo-s{k}" for k in (1, 3, 5, 7, 9)]
                                        + [f"pilot/lr1e-5/grpo-s{k}" for k in (0, 2, 4, 6, 8)])
    record = warning.write_design(runs, tmp_path / "design.json")
    assert json.loads((tmp_path / "design.json").read_text()) == record
    assert [str(c) for c in detector.from_json(record["chosen"])] == [
        "trend of entropy over 3 steps (a step) > 0"]
    table = warning.replay_table(record, runs)
    # warned 8 steps ahead: recall 5 of 5 at >= 2 and at >= 5; the default reads ctrl/p_close,
    # which these runs never log, so it never fires
    assert table[2].startswith("| **redesigned** | trend of entropy")
    assert "| 5 / 5 | 5 / 5 | 8 | 0 / 5 | 0.0 |" in table[2]
    assert table[3].startswith("| the default |") and "| 0 / 5 | 0 / 5 | - | 0 / 5 |" in table[3]
