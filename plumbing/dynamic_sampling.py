"""The row swap of train.py's dynamic sampling (--drop-tied-groups, DAPO's; step 1 of train_step):
the rows of redrawn groups replaced by their new rollouts in a Rollout's padded tensors."""
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
                               decode=out.decode + new.decode, n_generated=out.n_generated + new.n_generated)
