"""experiments/late_spiral/: the pilot's registered queue, and every landed pilot run against its
registration (the spiral study's training commit and config, but for its lr and length)."""
import json
from pathlib import Path

import pytest

from experiments.late_spiral import late_runs

ROOT = Path(__file__).resolve().parents[1]
LANDED = sorted((ROOT / "experiments" / "late_spiral" / "pilot").glob("lr*/grpo-s*"))
SPIRAL = ROOT / "experiments" / "spiral" / "study" / "grpo-s0" / "config.json"


def test_the_pilot_queue_is_the_registered_one():
    # prereg.md §3: lr 2e-5 and 4e-5, seeds 1000-1003, seed by seed
    assert late_runs.queue() == [(lr, s) for s in (1000, 1001, 1002, 1003)
                                 for lr in ("2e-5", "4e-5")]
    assert late_runs.TRAIN_COMMIT.startswith("dd7ab09")
    assert late_runs.LONG == ["--ckpt-every", "5", "--keep-ckpts", "1"]


@pytest.mark.parametrize("folder", LANDED, ids=[f"{d.parent.name}/{d.name}" for d in LANDED])
def test_a_landed_pilot_run_ran_the_spiral_studys_training_path_and_setting(folder):
    assert json.loads((folder / "run.json").read_text())["train_commit"] == late_runs.TRAIN_COMMIT
    config, spiral = (json.loads(p.read_text()) for p in (folder / "config.json", SPIRAL))
    levers = {"lr", "steps", "seed", "ckpt_every", "keep_ckpts", "name", "out_dir", "model"}
    assert config.keys() == spiral.keys()
    assert {k for k in spiral if config[k] != spiral[k]} <= levers
    assert not config["llds"] and config["kl_coef"] == 0
    assert config["lr"] == float(folder.parent.name.removeprefix("lr"))
    assert config["steps"] in (60, 120) and config["seed"] == int(folder.name[len("grpo-s"):])
    assert (config["ckpt_every"], config["keep_ckpts"]) == (5, 1)
