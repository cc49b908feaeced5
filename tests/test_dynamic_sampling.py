"""--drop-tied-groups (train.py's step 1): rows swapped in whole, padding widened
(plumbing/dynamic_sampling.py); at most N rounds, and a run that logs what it redrew."""
import torch

import rollout as ro
import train
from conftest import tiny_policy
from plumbing.dynamic_sampling import replace_rows
from test_train import step_lines, tiny_config


def fake_rollout(records, width, reward):
    """A Rollout of len(records) rows of `width` real tokens, rewards reward(record)."""
    n = len(records)
    rows = torch.arange(n)[:, None].float() + torch.zeros(n, width)
    return ro.Rollout(input_ids=rows.long(), attention_mask=torch.ones(n, width, dtype=torch.long),
                      loss_mask=torch.ones(n, width), answer_mask=torch.zeros(n, width),
                      prompt_len=torch.ones(n, dtype=torch.long), logp=-rows,
                      episodes=[{"reward": reward(r), "id": r["id"]} for r in records],
                      timing={"generate": 1.0, "retrieval": 0.5}, n_generated=n * width)


def test_replace_rows_swaps_whole_rows_and_widens_the_padding():
    records = [{"id": q} for q in "abcd"]
    out = fake_rollout(records, 3, lambda r: 0.0)
    new = fake_rollout([{"id": "x"}, {"id": "y"}], 5, lambda r: 1.0)
    merged = replace_rows(out, [1, 3], new)
    assert [e["id"] for e in merged.episodes] == ["a", "x", "c", "y"]
    assert merged.input_ids.shape == (4, 5) and merged.attention_mask.sum(1).tolist() == [3, 5, 3, 5]
    assert merged.logp[1].tolist() == [-0.0] * 5 and merged.logp[3].tolist() == [-1.0] * 5
    assert merged.timing == {"generate": 2.0, "retrieval": 1.0} and merged.n_generated == 12 + 10


def test_a_run_with_drop_tied_groups_logs_the_groups_it_redrew(tmp_path):
    # a random tiny model never answers right: every group ties, each round redraws both
    train.train(tiny_config(tmp_path, steps=1, eval_size=0, drop_tied_groups=2), *tiny_policy())
    assert step_lines(tmp_path / "run")[0]["rollout/redrawn_groups"] == 4


def test_groups_with_a_spread_are_kept(tmp_path, alternating_rewards):
    train.train(tiny_config(tmp_path, steps=1, eval_size=0, drop_tied_groups=2), *tiny_policy())
    assert step_lines(tmp_path / "run")[0]["rollout/redrawn_groups"] == 0
