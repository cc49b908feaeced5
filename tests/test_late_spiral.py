"""experiments/late_spiral/: the pilot's registered queue, the counted study's gate, and every
landed run against its registration (the spiral study's training commit and config, but for its
lr, length, arm and checkpoints)."""
import json
from pathlib import Path

import pytest

from experiments.late_spiral import late_runs

ROOT = Path(__file__).resolve().parents[1]
LATE = ROOT / "experiments" / "late_spiral"
LANDED = sorted([*LATE.glob("pilot/lr*/grpo-s*"), *LATE.glob("study/*-s*")])
SPIRAL = ROOT / "experiments" / "spiral" / "study" / "grpo-s0" / "config.json"


def test_the_pilot_queue_is_the_registered_one():
    # prereg.md §3: lr 2e-5 and 4e-5, seeds 1000-1003, seed by seed, plain GRPO, 60 steps
    assert late_runs.queue() == [(lr, "grpo", s, 60) for s in (1000, 1001, 1002, 1003)
                                 for lr in ("2e-5", "4e-5")]
    assert {steps for *_, steps in late_runs.queue("pilot", 120)} == {120}
    assert late_runs.ARMS == {"grpo": ["--no-llds"], "llds": []}
    assert late_runs.TRAIN_COMMIT.startswith("dd7ab09")
    assert late_runs.LONG == ["--ckpt-every", "5", "--keep-ckpts", "1"]


@pytest.mark.parametrize("folder", LANDED, ids=[str(d.relative_to(LATE)) for d in LANDED])
def test_a_landed_run_ran_the_spiral_studys_training_path_and_setting(folder):
    assert json.loads((folder / "run.json").read_text())["train_commit"] == late_runs.TRAIN_COMMIT
    config, spiral = (json.loads(p.read_text()) for p in (folder / "config.json", SPIRAL))
    levers = {"lr", "steps", "seed", "llds", "ckpt_every", "keep_ckpts", "name", "out_dir",
              "model"}
    assert config.keys() == spiral.keys()
    assert {k for k in spiral if config[k] != spiral[k]} <= levers
    arm, seed = folder.name.rsplit("-s", 1)
    assert config["llds"] == (arm == "llds") and config["kl_coef"] == 0
    if folder.parent.parent.name == "pilot":
        assert arm == "grpo" and config["lr"] == float(folder.parent.name.removeprefix("lr"))
        assert config["steps"] in (60, 120)
    else:
        assert (config["lr"], config["steps"]) == tuple(map(float, late_runs.STUDY_CELL))
    assert config["seed"] == int(seed) and (config["ckpt_every"], config["keep_ckpts"]) == (5, 1)


def test_the_counted_study_runs_only_once_its_cell_is_registered(monkeypatch):
    if late_runs.STUDY_CELL is None:
        with pytest.raises(SystemExit, match="prereg.md §5"):
            late_runs.queue("study")
    monkeypatch.setattr(late_runs, "STUDY_CELL", ("2e-5", 60))
    runs = late_runs.queue("study")
    # seeds 0-11, each seed's two arms side by side
    assert runs[:2] == [("2e-5", "grpo", 0, 60), ("2e-5", "llds", 0, 60)] and len(runs) == 24
    assert late_runs.landed_folder(ROOT, "study", "2e-5", "llds", 3) == (
        ROOT / "experiments" / "late_spiral" / "study" / "llds-s3")
