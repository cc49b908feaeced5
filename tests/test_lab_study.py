"""The LLD lab's pre-registered analysis (experiments/lab/lab_study.py) on hand-built run folders."""
import json

import numpy as np
import pytest

from experiments.lab import lab_study
from experiments.lab.lab_runs import lab_cell


def write_run(folder, rewards, evals, seed=1000, llds=False, steps=None, updates=4, lr=1e-5,
              displacement=None, entropy=None, old_names=False):
    """A run folder as train.py writes it: step 0's eval line, one line per step, evals merged in.
    `displacement` in d's sign (> 0: lost); old_names writes it as the committed pilot runs logged
    it, `lld/displacement_correct` = after - before."""
    run = folder / f"{'llds' if llds else 'grpo'}-s{seed}"
    run.mkdir(parents=True)
    ems = dict(evals)
    lines = [{"step": 0, "eval/em": 0.0, "eval/em_sampled": ems.get(0)}]
    for s, r in enumerate(rewards, start=1):
        lines.append({"step": s, "reward": r, "entropy": 1.0 if entropy is None else entropy[s - 1],
                      "grad_norm": 1.0, "grad_norm_max": 1.0, "frac_reward_zero_std": 0.5, "grad_zero": 0,
                      "lld/correct_displacement": None if displacement is None
                      else displacement[s - 1]})
        if old_names:
            d = lines[-1].pop("lld/correct_displacement")
            lines[-1]["lld/displacement_correct"] = None if d is None else -d
        if s in ems:
            lines[-1]["eval/em_sampled"] = ems[s]
    (run / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    config = {"seed": seed, "lr": lr, "mini_batch_size": 4, "prompts_per_step": updates, "group_size": 4,
              "llds": llds, "steps": steps or len(rewards), "name": run.name}
    (run / "config.json").write_text(json.dumps(config))
    return run


def rise_then_fall(fall=50, steps=100):
    """Reward 0.25 for 20 steps, 1.0 up to `fall`, then 0: R10(s) = (fall + 10 - s) / 10 after the fall, so it
    first reaches P / 2 = 0.5 at s* = fall + 5."""
    return [0.25] * 20 + [1.0] * (fall - 20) + [0.0] * (steps - fall)


EM_FELL = [(0, 0.2), (50, 0.6), (100, 0.1)]           # last 0.1 <= half of the best 0.6
EM_HELD = [(0, 0.2), (50, 0.6), (100, 0.4)]           # last 0.4 > 0.3


def test_r10_and_its_running_peak_by_hand():
    reward = np.array([0.0] * 4 + [1.0] * 7 + [0.0] * 4)    # ones on steps 5-11
    r = lab_study.r10(reward)
    assert np.all(np.isnan(r[:9]))                          # undefined before step 10
    assert np.allclose(r[9:], [0.6, 0.7, 0.7, 0.7, 0.7, 0.6])   # steps 10..15: 6, 7, 7, 7, 7, 6 ones in the window
    assert np.allclose(lab_study.peak(r)[9:], [0.6, 0.7, 0.7, 0.7, 0.7, 0.7])


def test_a_run_that_rises_then_falls_and_stays_down_collapses(tmp_path):
    run = lab_study.read_run(write_run(tmp_path, rise_then_fall(), EM_FELL))
    assert lab_study.collapse_step(run) == 55           # R10(55) = 5 / 10 = exactly P / 2: "<=" counts it
    assert lab_study.learned(run)                       # peak 1.0 >= R10(10) = 0.25 + 0.10
    assert run["evals"] == EM_FELL and run["finished"]


def test_no_collapse_when_reward_recovers_or_em_holds_or_nothing_was_learned(tmp_path):
    recovered = rise_then_fall()[:80] + [1.0] * 20      # R10 back to 1.0 > 0.8 P after every candidate s
    partly = rise_then_fall()[:80] + [0.75] * 20        # back to 0.75 <= 0.8 P: still collapsed at 55
    for name, rewards, evals, expected in (("a", recovered, EM_FELL, None), ("b", partly, EM_FELL, 55),
                                           ("c", rise_then_fall(), EM_HELD, None),
                                           ("d", [0.0] * 100, [(0, 0.0), (100, 0.0)], None)):   # P = 0
        run = lab_study.read_run(write_run(tmp_path / name, rewards, evals))
        assert lab_study.collapse_step(run) == expected, name
    early = lab_study.read_run(write_run(tmp_path / "e", [1.0] * 10 + [0.0] * 90, EM_FELL))
    assert lab_study.collapse_step(early) == 30         # fell at step 11, but s* is never before 30
    assert not lab_study.learned(early)                 # its peak is R10(10) itself


def test_phases_around_a_collapse(tmp_path):
    displacement = [-0.5] * 14 + [1.0] * 31 + [-0.5] * 55  # lost on steps 15-45: s* - 40 .. s* - 10
    entropy = [1.0] * 49 + [2.0] * 51                       # 2x its minimum from step 50 = s* - 5
    run = lab_study.read_run(write_run(tmp_path, rise_then_fall(), EM_FELL, displacement=displacement,
                                       entropy=entropy))
    assert lab_study.phases(run, 55) == {"phase2": True, "phase3": True}
    flat = lab_study.read_run(write_run(tmp_path / "flat", rise_then_fall(), EM_FELL,
                                        displacement=[-0.5] * 100))
    assert lab_study.phases(flat, 55) == {"phase2": False, "phase3": False}
    assert lab_study.run_summary(run)["disp_lost"] == 31.0
    old = lab_study.read_run(write_run(tmp_path / "old", rise_then_fall(), EM_FELL,
                                       displacement=displacement, entropy=entropy, old_names=True))
    assert np.array_equal(old["displacement"], run["displacement"])   # today's name and sign
    assert lab_study.run_summary(old) == lab_study.run_summary(run)


def test_mcnemar_exact_p_by_hand():
    assert lab_study.mcnemar_p(6, 0) == 2 * 0.5 ** 6 == 0.03125
    assert lab_study.mcnemar_p(5, 1) == 2 * (1 + 6) / 64 == 0.21875
    assert lab_study.mcnemar_p(0, 0) == 1.0 and lab_study.mcnemar_p(3, 3) == 1.0


def write_cell(folder, name, lr, updates, fall, finished=8):
    for seed in range(1000, 1008 if finished == 8 else 1000 + finished):
        write_run(folder / name, rise_then_fall(fall, 150), [(0, 0.2), (100, 0.6), (150, 0.1)], seed=seed,
                  lr=lr, updates=updates)


def test_pilot_picks_the_mildest_qualifying_cell(tmp_path, capsys):
    write_cell(tmp_path, "lr3e-05-u4", 3e-5, 4, fall=100)
    write_cell(tmp_path, "lr1e-05-u16", 1e-5, 16, fall=100)
    write_cell(tmp_path, "lr1e-05-u10", 1e-5, 10, fall=100)     # smallest qualifying lr, then fewer updates
    write_cell(tmp_path, "lr1e-05-u2", 1e-5, 2, fall=50)        # collapses at 55 < 100: does not qualify
    write_cell(tmp_path, "lr1e-06-u4", 1e-6, 4, fall=100, finished=5)   # incomplete: never chosen
    cells = {c["cell"]: c for c in lab_study.pilot_cells(tmp_path)}
    assert cells["lr1e-05-u10"]["median_collapse"] == 105 and cells["lr1e-05-u10"]["qualifies"]
    assert (cells["lr1e-05-u2"]["collapsed"], cells["lr1e-05-u2"]["qualifies"]) == (8, False)
    assert lab_study.choose_cell(list(cells.values()))["cell"] == "lr1e-05-u10"
    assert lab_study.main(["pilot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| lr1e-06-u4 | 5 of 8 | 5 | 5 | 105 | incomplete: cannot be chosen |" in out
    assert "chosen cell: lr1e-05-u10 (lr 1e-05, 10 updates per rollout batch)" in out
    assert "provisional: lr1e-06-u4 incomplete" in out
    with pytest.raises(SystemExit, match="the pilot has chosen no cell yet"):   # the milder cell could still win
        lab_cell(tmp_path, "study")


def test_pilot_says_plainly_when_no_cell_qualifies(tmp_path, capsys):
    write_cell(tmp_path, "lr1e-05-u2", 1e-5, 2, fall=50)
    assert lab_study.main(["pilot", str(tmp_path)]) == 0
    assert "no cell qualifies yet: 1 of the 6 cells complete" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="the pilot has chosen no cell yet"):
        lab_cell(tmp_path, "study")
    for lr in (2e-5, 3e-5, 4e-5, 5e-5, 6e-5):                       # all six cells of the grid: the pilot is over
        write_cell(tmp_path, f"lr{lr:.0e}-u2", lr, 2, fall=50)
    assert lab_study.main(["pilot", str(tmp_path), "--figure", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert "no cell qualifies: this small model does not spiral" in out
    assert f"figure: {tmp_path / 'f.png'}" in out and (tmp_path / "f.png").stat().st_size > 0   # the harshest cell
    # the study does not run; the demo runs the harshest cell
    assert (lab_cell(tmp_path, "study"), lab_cell(tmp_path, "demo")) == (None, "lr6e-05-u2")


def test_what_the_pilot_runs_did_by_hand(tmp_path, capsys):
    """Rewards 0.25 x 20, 1.0 x 30, 0 x 100: R10(10) = 0.25, peak 1.0; EM 0.2 at step 0, 0.1 at
    the end; the displacement 0.5 on steps 1-4 (lost) and -1 after: its positive part sums to 2;
    entropy 0.3 over the last 10 steps."""
    entropy = [1.0] * 140 + [0.3] * 10
    write_run(tmp_path / "lr1e-05-u4", rise_then_fall(50, 150), [(0, 0.2), (100, 0.6), (150, 0.1)],
              displacement=[0.5] * 4 + [-1.0] * 146, entropy=entropy)
    run = lab_study.read_run(tmp_path / "lr1e-05-u4" / "grpo-s1000")
    assert lab_study.pilot_measures(run) == pytest.approx(
        dict(zip(lab_study.MEASURES, (0.25, 1.0, 0.2, 0.1, 2.0, 0.3))))
    write_run(tmp_path / "lr1e-05-u4", [0.5] * 150, [(0, 0.4), (150, 0.5)], seed=1001)
    assert lab_study.main(["pilot", str(tmp_path)]) == 0
    assert ("| lr1e-05-u4 | 0.25 to 0.50 | 0.50 to 1.00 | 0.20 to 0.40 | 0.10 to 0.50 | "
            "0.000 to 2.000 | 0.300 to 1.000 |") in capsys.readouterr().out


def write_study(folder, grpo_collapses, llds_collapses, llds_displaced=False):
    """One pair per (GRPO collapses?, LLDS collapses?); GRPO's correct responses lose 1 nat a step
    (d = 1)."""
    for seed, pair in enumerate(zip(grpo_collapses, llds_collapses)):
        for llds, falls in zip((False, True), pair):
            rewards = rise_then_fall() if falls else [0.25] * 20 + [1.0] * 80
            write_run(folder, rewards, EM_FELL if falls else EM_HELD, seed=seed, llds=llds,
                      displacement=[0.0 if llds and not llds_displaced else 1.0] * 100)


def verdict(folder):
    runs = map(lab_study.read_run, lab_study.run_folders(folder))
    return lab_study.decide(lab_study.pairs_of([lab_study.run_summary(r) for r in runs]))


def test_study_verdicts(tmp_path, capsys):
    write_study(tmp_path / "helps", [True] * 6, [False] * 6)            # (b, c) = (6, 0), EM +0.3 every pair
    write_study(tmp_path / "mixed", [True] * 5 + [False], [False] * 5 + [True])   # (5, 1): p = 0.219
    write_study(tmp_path / "void", [True] * 6, [False] * 6, llds_displaced=True)
    write_study(tmp_path / "hurts", [False] * 6, [True] * 6)            # the mirror: (0, 6), EM -0.3
    assert lab_study.main(["study", str(tmp_path / "helps")]) == 0
    out = capsys.readouterr().out
    assert "discordant pairs 6 only GRPO / 0 only LLDS, exact McNemar p = 0.03125." in out
    assert "paired LLDS - GRPO +0.300 [+0.300, +0.300] over 6 pairs." in out
    assert ("summed positive displacement LLDS - GRPO -100.00 [-100.00, -100.00] nats: passed. "
            "**Verdict: LLDS helps**.") in out
    assert "| plain GRPO | 0 | 55 | 0.100 | 0.600 | 100.00 | yes / no |" in out
    mixed = verdict(tmp_path / "mixed")
    assert (mixed["b"], mixed["c"], mixed["p"], mixed["verdict"]) == (5, 1, 0.21875, "no difference shown")
    assert verdict(tmp_path / "hurts")["verdict"] == "LLDS hurts"
    assert lab_study.main(["study", str(tmp_path / "void")]) == 0    # same collapses and EM, displacement equal
    assert ("+0.00 [+0.00, +0.00] nats: failed. **Verdict: void** (the manipulation check failed"
            in capsys.readouterr().out)


def test_unfinished_runs_are_listed_not_counted_and_one_pair_draws(tmp_path, capsys):
    write_study(tmp_path, [True], [False])
    write_run(tmp_path, [0.5] * 40, [(0, 0.2)], seed=7, llds=True, steps=100)
    assert lab_study.main(["study", str(tmp_path), "--figure", str(tmp_path / "fig.png")]) == 0
    out = capsys.readouterr().out
    assert "unfinished, not counted: llds-s7 (40 steps)" in out and "over 1 pairs" in out
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_a_folder_without_runs_is_one_clear_line(tmp_path, capsys):
    assert lab_study.main(["study", str(tmp_path)]) == 2
    assert lab_study.main(["pilot", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: no grpo-s<N> / llds-s<N> run folders in {tmp_path}",
                   f"error: no <cell>/grpo-s<N> run folders in {tmp_path / 'missing'}"]


def from_sft(run, sha256):
    (run / "sft_model.json").write_text(json.dumps({"path": "runs/lab/sft/model", "sha256": sha256}))


def test_runs_from_another_sft_build_are_marked_and_the_tables_given_without_them(tmp_path, capsys):
    write_cell(tmp_path / "pilot", "lr1e-05-u4", 1e-5, 4, fall=100)
    for seed in range(1000, 1008):
        from_sft(tmp_path / "pilot" / "lr1e-05-u4" / f"grpo-s{seed}", "0" * 64 if seed >= 1006 else
                 lab_study.REGISTERED["sft"])
    assert lab_study.main(["pilot", str(tmp_path / "pilot")]) == 0
    with_them, without = capsys.readouterr().out.split(lab_study.WITHOUT)
    assert "| lr1e-05-u4 | 8 of 8 (2 from another SFT build) | 8 | 8 | 105 | yes |" in with_them
    assert "| lr1e-05-u4 | 6 of 8 | 6 | 6 | 105 | incomplete: cannot be chosen |" in without
    assert lab_cell(tmp_path / "pilot", "study") == "lr1e-05-u4"
    write_study(tmp_path / "study", [True] * 6, [False] * 6)
    for arm in ("grpo", "llds"):
        from_sft(tmp_path / "study" / f"{arm}-s5", "0" * 64)
    assert lab_study.main(["study", str(tmp_path / "study")]) == 0
    with_them, without = capsys.readouterr().out.split(lab_study.WITHOUT)
    assert "| plain GRPO | 5 (other SFT build) | 55 |" in with_them and "over 6 pairs" in with_them
    assert "over 5 pairs" in without and "exact McNemar p = 0.0625" in without


def test_a_pilot_with_only_unfinished_runs_reports_them(tmp_path, capsys):
    write_run(tmp_path / "lr1e-05-u4", [0.5] * 40, [(0, 0.2)], steps=100)
    assert lab_study.main(["pilot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "unfinished, not counted: lr1e-05-u4/grpo-s1000 (40 steps)" in out and "What the finished" not in out
