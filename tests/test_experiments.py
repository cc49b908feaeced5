"""The experiments' tables and figures regenerate from the runs committed in experiments/: the
LLD study (10 seeds per arm) and the LLD lab's pilot (48 plain-GRPO runs), each its headline."""
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(script, *args):
    done = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_lld_study_regenerates_from_its_committed_runs(tmp_path):
    out = run("experiments/lld_study/lld_study.py", "experiments/lld_study/compare",
              "--figure", str(tmp_path / "compare.png"))
    # the committed runs logged the old name and sign; read_metrics maps them to d (> 0: lost)
    assert "29.7 nats under plain GRPO and 4.1 under LLDS (paired difference -25.6" in out
    assert "Plain GRPO collapsed in 2 of 10 runs, LLDS in 0 of 10" in out
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_the_lab_pilot_regenerates_from_its_committed_runs(tmp_path):
    out = run("experiments/lab/lab_study.py", "pilot", "experiments/lab/pilot",
              "--figure", str(tmp_path / "pilot.png"))
    assert "no cell qualifies: this small model does not spiral" in out
    assert (tmp_path / "pilot.png").stat().st_size > 10_000


STUDIES = sorted(d.name for d in (ROOT / "experiments").iterdir() if (d / "README.md").exists())


def test_every_study_is_listed_where_studies_are_listed():
    assert {"spiral", "lr_map", "late_spiral", "lld_study", "lab", "demo_seeds"} <= set(STUDIES)
    index = (ROOT / "experiments" / "README.md").read_text()
    results = (ROOT / "docs" / "results.md").read_text()
    for study in STUDIES:
        assert f"]({study}/README.md)" in index, f"experiments/README.md omits {study}"
        assert f"](../experiments/{study}/README.md)" in results, f"docs/results.md omits {study}"


def test_one_breakdown_rule_counts_every_study():
    from experiments import breakdowns
    counted = {folder.split("/")[0] for _, _, folder, _ in breakdowns.STUDIES}
    assert counted == set(STUDIES) - {"demo_seeds"}         # the demo has no arms to count
    own = next(own for _, _, folder, own in breakdowns.STUDIES if folder == "lld_study/compare")
    lld = breakdowns.counts(breakdowns.study_runs(ROOT / "experiments/lld_study/compare", own))
    # by the one rule: plain GRPO seeds 2, 6, 8 and GRPO + LLDS seeds 3, 5, 8, 9; by the LLD
    # study's entropy rule: plain GRPO seeds 0 and 9, none under LLDS
    assert [(c["arm"], c["breakdowns"], c["onsets"], c["own"]) for c in lld] == [
        ("grpo", 3, [11, 11, 20], 2), ("llds", 4, [14, 16, 19, 20], 0)]


def test_a_breakdown_cell_is_named_as_its_folder_is(tmp_path):
    from experiments import breakdowns
    for cell in ("lr1.6e-4", "lr2e-5", "."):
        (tmp_path / cell / "grpo-s0").mkdir(parents=True, exist_ok=True)
        (tmp_path / cell / "grpo-s0" / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    assert [r["cell"] for r in breakdowns.study_runs(tmp_path)] == ["", "lr1.6e-4", "lr2e-5"]


def test_learned_first_needs_a_window_above_the_first_before_the_onset():
    from experiments.late_spiral.late_study import learned_first
    from experiments.spiral.spiral_study import breakdown_onset

    def steps_of(rewards):
        return [{"step": s, "reward": r} for s, r in enumerate(rewards, 1)]
    # R(3) = 0.4; R rises to 0.6, then falls to 0: learned first, onset 13 (R(13) = 0.2 <= 0.3)
    late = steps_of([0.4] * 3 + [0.6] * 8 + [0.0] * 9)
    assert breakdown_onset(late) == 13 and learned_first(late, 13)
    # the same fall from the warm-start's level, never above R(3): not learned first
    flat = steps_of([0.4] * 11 + [0.0] * 9)
    assert breakdown_onset(flat) == 13 and not learned_first(flat, 13)
    assert not learned_first(late, None)


def test_the_pilot_is_decided_by_the_registered_rule():
    from experiments.late_spiral.late_study import decision

    def pilot(late_at_2e5, late_at_4e5, steps=60):
        return [{"lr": lr, "seed": s, "steps": steps, "learned_first": s < late}
                for lr, late in (("2e-5", late_at_2e5), ("4e-5", late_at_4e5)) for s in range(4)]
    assert decision(pilot(0, 0)[:5]) == "Not decided yet: 5 of 8 runs have landed, at 60 steps."
    assert decision(pilot(1, 2)) == "Decided (prereg §3): lr 4e-5 at 60 steps."
    assert decision(pilot(2, 3)).startswith("Decided (prereg §3): lr 2e-5 at 60 steps (both")
    assert "extended once, to 120" in decision(pilot(1, 1))
    assert "did not break down within 120 steps" in decision(pilot(1, 0, steps=120))
    mixed = pilot(0, 0)[:4] + pilot(0, 0, steps=120)[4:]
    assert decision(mixed) == "Not decided yet: 8 of 8 runs have landed, at 60/120 steps."


def test_phases_align_late_breakdowns_at_their_onsets_and_the_rest_at_their_median(tmp_path):
    from experiments.late_spiral import late_study

    def run(arm, rewards):
        lines = [{"step": s, "reward": r, **dict.fromkeys(late_study.PHASES, float(s))}
                 for s, r in enumerate(rewards, 1)]
        onset = late_study.spiral_study.breakdown_onset(lines)
        return {"arm": arm, "lines": lines, "onset": onset,
                "learned_first": late_study.learned_first(lines, onset)}
    # onsets 13 and 15 (R falls to 0.2 <= 0.3 two steps after the reward drops to 0)
    runs = [run("grpo", [0.4] * 3 + [0.6] * 8 + [0.0] * 9),
            run("grpo", [0.4] * 3 + [0.6] * 10 + [0.0] * 7),
            run("grpo", [0.4] * 3 + [0.6] * 17), run("llds", [0.4] * 3 + [0.6] * 17),
            run("grpo", [0.4] * 11 + [0.0] * 9)]          # broke down without learning: no group
    late, calm, llds = late_study.phase_groups(runs).values()
    assert [at for _, at in late] == [13, 15] and [at for _, at in calm + llds] == [14, 14]
    # the signal is the step: at offset -1 the late runs read 12 and 14 (median 13, quartiles
    # 12.5 and 13.5), the others read 13; offsets from -12 to +3 where both late runs have them
    by_offset = {o: rest for o, *rest in late_study.aligned(late, "grad_norm")}
    assert by_offset[-1] == [13.0, 12.5, 13.5] and min(by_offset) == -12 and max(by_offset) == 3
    # an offset only one of two runs has is left out; a group of one run keeps all of its own
    cut = [(late[0][0][:14], 13), late[1]]                  # the first run ends at offset +1
    assert max(o for o, *_ in late_study.aligned(cut, "grad_norm")) == 1
    assert max(o for o, *_ in late_study.aligned(cut[1:], "grad_norm")) == 3
    assert {o: m for o, m, *_ in late_study.aligned(calm, "grad_norm")}[-1] == 13.0
    assert late_study.phase_groups(runs[2:4]) == {}
    late_study.draw_phases(runs, tmp_path / "phases.png")
    assert (tmp_path / "phases.png").stat().st_size > 10_000


def test_the_late_studys_make_target_renders_every_part_from_run_folders(tmp_path, monkeypatch,
                                                                         capsys):
    import json

    from experiments.late_spiral import late_study, warning
    rewards = {"grpo-s0": [0.4] * 3 + [0.6] * 8 + [0.0] * 9, "llds-s0": [0.4] * 3 + [0.6] * 17,
               "grpo-s1": [0.4] * 3 + [0.6] * 10 + [0.0] * 7, "llds-s1": [0.4] * 3 + [0.6] * 17}
    for name, rs in rewards.items():
        run = tmp_path / "study" / name
        run.mkdir(parents=True)
        lines = [{"step": 0, "eval/em": 0.5}]
        lines += [{"step": s, "reward": r, "timing/step": 1.0,
                   **dict.fromkeys(late_study.PHASES, -0.1 * s)} for s, r in enumerate(rs, 1)]
        lines += [{"step": 20, "eval/em": 0.1 if name.startswith("grpo") else 0.7}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
        (run / "config.json").write_text(json.dumps({"steps": 20}))
        (run / "machine.json").write_text(json.dumps([{"cpu": "x", "bf16_autocast": False}]))
    monkeypatch.setattr(late_study, "HERE", tmp_path)
    monkeypatch.setattr(warning, "DESIGN", tmp_path / "design.json")
    warning.write_design(warning.runs_in(("study",), tmp_path), tmp_path / "design.json")
    late_study.main([])
    out = capsys.readouterr().out
    assert "no pilot run has landed yet" in out and "| **redesigned** |" in out
    assert "2 of 2" in out or "2 / 2" in out          # both plain GRPO runs broke down
    assert (tmp_path / "survival.png").exists() and (tmp_path / "phases.png").exists()
    # the study's README blocks read the same folders (docs/readme_numbers.py)
    spec = importlib.util.spec_from_file_location("numbers", ROOT / "docs" / "readme_numbers.py")
    numbers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(numbers)
    outcome = numbers.study_outcome(tmp_path / "study", "FIGURES")()
    assert outcome.startswith("FIGURES\n\n|") and ("2 of 2" in outcome or "2 / 2" in outcome)
    assert numbers.study_outcome(tmp_path / "none", "FIGURES")().startswith("No counted seed")
    monkeypatch.setattr(warning, "LATE_RUNS", tmp_path / "study")
    assert "| **redesigned** |" in numbers.late_warning()


def test_the_papers_phases_are_read_against_the_control_runs():
    from experiments.late_spiral import late_study as ls

    def curve(o, decay, collapse):       # flat, then `decay` a step from -7, `collapse` from -2
        return -0.1 + decay * max(0, min(o, -3) + 8) + collapse * max(0, o + 3)

    def run(arm, rewards, correct, incorrect, grad):
        lines = [{"step": s, "reward": r} for s, r in enumerate(rewards, 1)]
        onset = ls.spiral_study.breakdown_onset(lines)
        for l in lines:
            o = l["step"] - (onset or 25)     # the controls are aligned at the median onset, 25
            l.update({ls.CORRECT: correct(o), ls.INCORRECT: incorrect(o), ls.GRAD: grad(o)})
        return {"arm": arm, "lines": lines, "onset": onset,
                "learned_first": ls.learned_first(lines, onset)}
    falls = [0.4] * 3 + [0.6] * 20 + [0.0] * 10                     # onset at step 25
    calm = [0.4] * 3 + [0.6] * 30
    spike = lambda o: 5.0 if o >= -2 else 1.0
    runs = [run("grpo", falls, lambda o: curve(o, -0.02, -0.1), lambda o: curve(o, -0.01, -0.05),
                spike),
            run("grpo", falls, lambda o: curve(o, 0.0, -0.1), lambda o: -0.1, spike),  # sudden
            run("grpo", [0.4] * 3 + [0.6] * 2 + [0.0] * 10,                    # onset at step 7
                lambda o: curve(o, -0.02, -0.1), lambda o: curve(o, -0.01, -0.05), spike),
            run("grpo", calm, lambda o: -0.1 + 0.001 * o, lambda o: -0.1, lambda o: 1.0),
            run("llds", calm, lambda o: -0.1 - 0.001 * o, lambda o: -0.1, lambda o: 1.0)]
    assert [r["onset"] for r in runs] == [25, 25, 7, None, None]
    # the third run starts 6 steps before its onset: its early window cannot be read
    assert ls.phases(runs) == {"stagnation": (2, 2), "steady decay": (2, 3),
                               "accelerated collapse": (3, 3)}
    table = ls.phases_table(runs)
    assert table[2] == "| stagnation | -12 to -8 | 2 of 2 | yes |"
    assert ls.phases(runs[3:]) == {} and "no late breakdown" in ls.phases_table(runs[3:])[-1]
