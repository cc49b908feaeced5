"""--drop-tied-groups (plumbing/dynamic_sampling.py): tied groups' prompts redrawn, rows swapped in
whole (padding widened), at most N rounds; and a train.py run that logs what it redrew."""
import torch

import rollout as ro
import train
from conftest import tiny_policy
from plumbing.dynamic_sampling import redraw_tied_groups
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


def test_tied_groups_are_redrawn_until_they_spread_or_the_rounds_run_out():
    # groups of 2: "a" spreads (1, 0), "b" ties (0, 0); new prompts "c" (tied) then "d" (spread)
    spread = {"a", "d"}
    reward = lambda r: float(r["id"] in spread and r["k"] == 0)                      # noqa: E731
    records = [{"id": q, "k": k} for q in "ab" for k in range(2)]
    pool = iter([{"id": "c"}, {"id": "d"}])
    draw = lambda n: [next(pool) for _ in range(n)]                                  # noqa: E731
    calls = []

    def roll(recs):
        recs = [{**r, "k": i % 2} for i, r in enumerate(recs)]
        calls.append([r["id"] for r in recs])
        return fake_rollout(recs, width=5, reward=reward)

    out, recs, redrawn = redraw_tied_groups(fake_rollout(records, 3, reward), records, 5, 2, draw, roll)
    assert calls == [["c", "c"], ["d", "d"]] and redrawn == 2
    assert [r["id"] for r in recs] == ["a", "a", "d", "d"] and [e["id"] for e in out.episodes] == ["a", "a", "d", "d"]
    assert out.input_ids.shape == (4, 5) and out.attention_mask[:2].sum(1).tolist() == [3, 3]   # old rows: 0s added
    assert out.attention_mask[2:].sum(1).tolist() == [5, 5] and out.timing == {"generate": 3.0, "retrieval": 1.5}
    # one round only: "c" stays, tied
    pool = iter([{"id": "c"}, {"id": "d"}])
    out, recs, redrawn = redraw_tied_groups(fake_rollout(records, 3, reward), records, 1, 2, draw, roll)
    assert [r["id"] for r in recs] == ["a", "a", "c", "c"] and redrawn == 1


def test_a_run_with_drop_tied_groups_logs_the_groups_it_redrew(tmp_path):
    # a random tiny model never answers right: every group ties, each round redraws both
    train.train(tiny_config(tmp_path, steps=1, eval_size=0, drop_tied_groups=2), *tiny_policy())
    assert step_lines(tmp_path / "run")[0]["rollout/redrawn_groups"] == 4
