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
