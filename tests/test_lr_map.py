"""experiments/lr_map/: the registered queue, and every landed run against its registration (the
spiral study's training commit, and the spiral study's config but for the levers the map turns)."""
import json
from collections import Counter
from pathlib import Path

import pytest

from experiments.lr_map import map_runs

ROOT = Path(__file__).resolve().parents[1]
LANDED = sorted((ROOT / "experiments" / "lr_map" / "runs").glob("lr*/*-s*"))
SPIRAL = ROOT / "experiments" / "spiral" / "study"


def test_the_queue_is_the_registered_one():
    runs = map_runs.queue()
    assert len(runs) == len(set(runs)) == 94
    cells = Counter((lr, arm) for lr, arm, _ in runs)
    assert cells == {**{(lr, arm): 8 for lr in ("1e-5", "2e-5", "4e-5", "1.6e-4")
                        for arm in ("grpo", "llds")},
                     **{("8e-5", arm): 10 for arm in ("grpo-kl0.001", "grpo-kl0.04",
                                                      "llds-kl0.001")}}
    assert {s for lr, _, s in runs if lr != "8e-5"} == set(range(8))
    assert {s for lr, _, s in runs if lr == "8e-5"} == set(range(10))
    # round 1 (prereg.md §4): seeds 0-1 of the lr cells, then seeds 0-1 of the KL cells
    assert runs[:2] == [("2e-5", "grpo", 0), ("2e-5", "llds", 0)]
    assert {s for _, _, s in runs[:22]} == {0, 1} and runs[16][0] == runs[21][0] == "8e-5"
    assert map_runs.ARMS["grpo-kl0.04"] == ["--no-llds", "--kl-coef", "0.04"]


@pytest.mark.parametrize("folder", LANDED, ids=[f"{d.parent.name}/{d.name}" for d in LANDED])
def test_a_landed_run_ran_the_spiral_studys_training_path_and_setting(folder):
    landed = json.loads((folder / "run.json").read_text())
    assert landed["train_commit"] == map_runs.TRAIN_COMMIT
    arm, seed = folder.name.rsplit("-s", 1)
    config = json.loads((folder / "config.json").read_text())
    spiral = json.loads((SPIRAL / f"grpo-s{seed}" / "config.json").read_text())
    levers = {"lr", "kl_coef", "llds", "name", "out_dir", "model"}
    assert {k for k in spiral if config.get(k) != spiral[k]} <= levers
    assert config.keys() == spiral.keys()
    assert config["lr"] == float(folder.parent.name.removeprefix("lr"))
    assert config["llds"] == arm.startswith("llds")
    assert config["kl_coef"] == float(arm.partition("-kl")[2] or 0)
    assert config["steps"] == 15 and config["seed"] == int(seed)


def test_wilson_interval_against_hand_worked_values():
    from experiments.lr_map.lr_map import wilson
    # 0 of 8: the upper end is z^2 / (n + z^2) = 3.8415 / 11.8415
    assert wilson(0, 8) == pytest.approx((0.0, 0.324408), abs=1e-6)
    # 4 of 8: (0.5 + z^2/16 -+ z sqrt(1/32 + z^2/256)) / (1 + z^2/8)
    assert wilson(4, 8) == pytest.approx((0.215216, 0.784784), abs=1e-6)
    assert wilson(20, 30) == pytest.approx((0.487801, 0.807695), abs=1e-6)


def rows_of(means: dict, seeds=(0, 1, 2), em0=0.55) -> list[dict]:
    """Hand-made runs: every seed of a cell at the cell's mean, so the bootstrap has no spread."""
    return [{"arm": arm, "lr": lr, "seed": s, "em_final": em, "em_before": em0, "onset": None,
             "warm_start": "w", "new": True, "finished": True, "run": f"{arm}-s{s}"}
            for arm, by_lr in means.items() for lr, em in by_lr.items() for s in seeds]


def test_sensitivity_is_the_mean_shortfall_from_the_best_cell_floored_at_the_warm_start():
    from experiments.lr_map import lr_map
    grid = lr_map.GRID                                 # 1e-5, 2e-5, 4e-5, 8e-5, 1.6e-4
    rows = rows_of({"grpo": dict(zip(grid, (0.6, 0.7, 0.5, 0.2, 0.0))),
                    "llds": dict(zip(grid, (0.6, 0.65, 0.6, 0.55, 0.4)))})
    s = lr_map.sensitivity(rows, 0.55, resamples=200)
    # grpo floored at 0.55: (0.6, 0.7, 0.55, 0.55, 0.55); EM* 0.7; shortfalls sum 0.55 over 5
    assert s["grpo"]["S"] == pytest.approx(0.11) and s["llds"]["S"] == pytest.approx(0.06)
    assert s["diff"]["S"] == pytest.approx(-0.05)
    assert s["diff"]["interval"] == pytest.approx((-0.05, -0.05))
    # an arm no learning rate lifts above the warm-start has nothing to be sensitive about
    flat = rows_of({"grpo": dict.fromkeys(grid, 0.3), "llds": dict.fromkeys(grid, 0.5)})
    assert lr_map.sensitivity(flat, 0.55, resamples=50)["grpo"]["S"] == 0.0
    best = lr_map.best_lr(rows)
    assert (best["grpo"]["lr"], best["llds"]["lr"]) == (2e-5, 2e-5)
    assert best["grpo"]["diff"]["mean"] == pytest.approx(-0.05)
    ranges = lr_map.trained_range(rows, 0.55)
    assert ranges["grpo"]["above"] == [1e-5, 2e-5] and ranges["llds"]["above"] == [1e-5, 2e-5,
                                                                                  4e-5]


def test_learning_rates_are_spelled_as_the_folders_spell_them():
    from experiments.lr_map.lr_map import format_lr
    assert [format_lr(x) for x in (1e-5, 2e-5, 8e-5, 1.6e-4)] == ["1e-5", "2e-5", "8e-5", "1.6e-4"]


def test_the_advice_follows_the_registered_difference_at_plain_grpos_best_learning_rate():
    from experiments.lr_map import lr_map
    grid = lr_map.GRID
    kl = {"grpo-kl0.001": {8e-5: 0.6}}
    # plain GRPO best at 2e-5 (0.70); LLDS there 0.65 (lower) or 0.75 (higher)
    lower = rows_of({"grpo": dict(zip(grid, (0.6, 0.7, 0.5, 0.2, 0.0))),
                     "llds": dict(zip(grid, (0.6, 0.65, 0.6, 0.55, 0.4))), **kl})
    higher = rows_of({"grpo": dict(zip(grid, (0.6, 0.7, 0.5, 0.2, 0.0))),
                      "llds": dict(zip(grid, (0.6, 0.75, 0.6, 0.55, 0.4))), **kl})
    assert lr_map.advice(lower).startswith("Tune the learning rate first: in the learning-rate "
                                           "map, at plain GRPO's best learning rate LLDS lowered")
    # S: plain GRPO 0.11, LLDS 0.06 (the sensitivity test's cells): LLDS less sensitive
    assert ", but it made final EM less sensitive to the learning rate" in lr_map.advice(lower)
    assert lr_map.advice(higher).startswith("In the learning-rate map, LLDS added final EM")
    # 0 of 3 KL runs against 0 of 3 plain GRPO runs broke down: nothing said about the KL
    assert "KL" not in lr_map.advice(lower)
    # every plain GRPO run at 8e-5 broke down, no KL run: Fisher's p = 0.1 at 3 + 3 runs, still
    # not shown; at 6 + 6 runs p = 0.002, and the advice names the cut
    for r in lower:
        r["onset"] = 5 if (r["arm"], r["lr"]) == ("grpo", 8e-5) else None
    assert "KL" not in lr_map.advice(lower)
    six = rows_of({"grpo": {8e-5: 0.2}, "llds": {8e-5: 0.5}, **kl}, seeds=range(6))
    six += rows_of({"grpo": dict(zip(grid, (0.6, 0.7, 0.5))),
                    "llds": dict(zip(grid, (0.6, 0.65, 0.6)))})
    for r in six:
        r["onset"] = 5 if (r["arm"], r["lr"]) == ("grpo", 8e-5) else None
    assert lr_map.advice(six).endswith("the paper's KL 0.001 alone cut plain GRPO's breakdowns")
    same = rows_of({"grpo": {2e-5: 0.7}, "llds": {2e-5: 0.7}})
    assert "LLDS made no difference to final EM that 3 seeds could show" in lr_map.advice(same)
    apart = rows_of({"grpo": dict(zip(grid, (0.6, 0.7, 0.5, 0.2, 0.0))),
                     "llds": dict(zip(grid, (0.6, 0.65, 0.68, 0.55, 0.4)))})
    assert lr_map.answer(apart).startswith(
        "At plain GRPO's best learning rate, 2e-5 (mean final EM 0.70), LLDS - GRPO was -0.05 "
        "[-0.05, -0.05] over 3 seeds (LLDS lower); at GRPO + LLDS's, 4e-5 (mean final EM 0.68), "
        "LLDS - GRPO was +0.18 [+0.18, +0.18] over 3 seeds (LLDS higher). Without a breakdown")
    # sentences joined for the READMEs, which end the last one themselves
    assert not lr_map.answer(apart).endswith(".") and not lr_map.answer(lower).endswith(".")
    # the summary names a shared best learning rate once, distinct ones once each
    best = [x for x in lr_map.summary_lines(lower) if "best lr" in x]
    assert best == ["- both arms' best lr 2e-5 (mean final EM 0.70 and 0.65); there LLDS - GRPO "
                    "paired over 3 seeds: -0.050 [-0.050, -0.050]"]
    assert [x.split(" (")[0] for x in lr_map.summary_lines(apart) if "best lr" in x] == [
        "- plain GRPO's best lr 2e-5", "- GRPO + LLDS's best lr 4e-5"]
    assert lr_map.answer(same).startswith("Both arms were best at lr 2e-5 (mean final EM 0.70 and "
                                          "0.70); there LLDS - GRPO was +0.00 [+0.00, +0.00] over "
                                          "3 seeds (no difference shown). ")


def test_the_readmes_end_the_answer_and_the_advice_once_every_run_has_landed(monkeypatch):
    import importlib.util
    from experiments.lr_map import lr_map
    spec = importlib.util.spec_from_file_location(
        "numbers", Path(__file__).resolve().parents[1] / "docs" / "readme_numbers.py")
    numbers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(numbers)
    grid = lr_map.GRID
    rows = rows_of({"grpo": dict(zip(grid, (0.6, 0.7, 0.5, 0.2, 0.0))),
                    "llds": dict(zip(grid, (0.6, 0.65, 0.6, 0.55, 0.4))),
                    "grpo-kl0.001": {8e-5: 0.6}})
    monkeypatch.setattr(numbers, "lr_map_landed", lambda: (rows, len(rows), len(rows)))
    monkeypatch.setattr(lr_map, "map_rows", lambda: rows)
    answers, advice = numbers.lr_map_answers(), numbers.llds_advice()
    assert "**In words**: Both arms were best at lr 2e-5" in answers
    assert answers.endswith("against it.") and advice.endswith("(experiments/lr_map/README.md)).")
    for text in (answers, advice):
        assert ".." not in text.replace("...", "") and ". ." not in text
