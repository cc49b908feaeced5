"""--drop-tied-groups N: DAPO's dynamic sampling (veRL's DAPO recipe; SkyRL and prime-rl have it).
A group whose G rewards all tie has advantage 0 everywhere and gives GRPO no gradient; its prompt
is replaced by a new one from the sampler, rolled out and swapped in, for at most N extra rollout
rounds a step. Groups still tied after N rounds stay in the batch.

What it does to LLDS: LLDS protects every response with advantage >= 0, tied groups' included
(an all-correct group's responses are the ones GRPO never pushes up, so only LLDS guards their
likelihood). With tied groups redrawn, LLDS guards only the responses of groups with a spread.
"""
import dataclasses

import torch


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))      # right-padded rows: 0s on the right


def replace_rows(out, rows: list[int], new):
    """`out` (a rollout.Rollout) with its rows `rows` replaced by the rows of `new`, in order."""
    width = max(out.input_ids.shape[1], new.input_ids.shape[1])
    index = torch.tensor(rows, dtype=torch.long)
    merged = {}
    for name in ("input_ids", "attention_mask", "loss_mask", "answer_mask", "logp"):
        x = _widen(getattr(out, name), width).clone()
        x[index] = _widen(getattr(new, name), width).to(x.dtype)
        merged[name] = x
    prompt_len = out.prompt_len.clone()
    prompt_len[index] = new.prompt_len
    episodes = list(out.episodes)
    for row, episode in zip(rows, new.episodes):
        episodes[row] = episode
    timing = {k: out.timing.get(k, 0.0) + new.timing.get(k, 0.0) for k in out.timing}
    return dataclasses.replace(out, **merged, prompt_len=prompt_len, episodes=episodes, timing=timing,
                               n_generated=out.n_generated + new.n_generated)


def redraw_tied_groups(out, records: list[dict], rounds: int, group_size: int, draw, roll):
    """Up to `rounds` times: the tied groups' prompts replaced by draw(n) -> n new records, rolled
    out by roll(records) -> Rollout, swapped in. Groups are consecutive runs of group_size rows.
    -> (rollout, its records, groups redrawn)."""
    redrawn = 0
    for _ in range(rounds):
        rewards = torch.tensor([e["reward"] for e in out.episodes]).view(-1, group_size)   # (groups, G)
        tied = torch.nonzero(rewards.amax(1) == rewards.amin(1)).flatten().tolist()
        if not tied:
            break
        fresh = [r for r in draw(len(tied)) for _ in range(group_size)]
        rows = [g * group_size + k for g in tied for k in range(group_size)]
        out = replace_rows(out, rows, roll(fresh))
        records = list(records)
        for row, record in zip(rows, fresh):
            records[row] = record
        redrawn += len(tied)
    return out, records, redrawn
