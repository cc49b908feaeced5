"""A scripted policy: a Python function that writes each model turn, dressed as an HF causal LM so
that `rollout.rollout` drives it exactly as it drives a real model. sft.py's data are its
episodes: the same prompts, observations, token layout and loss masks that RL sees.

`act(context, rng)` gets the episode's text so far (prompt, turns and observations, decoded) and
returns the next turn's text, or None where it cannot act (a prefix shared by all prompts is run
once before the rows split; its prediction is never used). The turn is tokenised once and fed
back one token per decode step as a one-hot logit, so greedy decoding reproduces it exactly; a
turn that closes no tag ends with EOS.
"""
import random

import torch


class _RowsCache:
    """Stands in for the KV cache: each row's real tokens so far, and its planned turn."""

    def __init__(self, n_rows: int):
        self.rows = [[] for _ in range(n_rows)]
        self.plans = [[] for _ in range(n_rows)]

    def batch_repeat_interleave(self, n: int) -> None:
        """The shared prompt prefix becomes every row's start; a turn planned on it is never used."""
        self.rows = [list(r) for r in self.rows for _ in range(n)]
        self.plans = [[] for r in self.rows]

    def batch_select_indices(self, index: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in index.tolist()]
        self.plans = [self.plans[i] for i in index.tolist()]


class ScriptedPolicy(torch.nn.Module):
    """act(context: str, rng: random.Random) -> turn text or None, as a model rollout() can sample.
    Use it with greedy decoding; `seed` fixes the rng that act() draws from."""

    def __init__(self, act, tokenizer, seed: int = 0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))   # gives the module a device
        self.act, self.tokenizer, self.rng = act, tokenizer, random.Random(seed)
        self.vocab = len(tokenizer)

    def forward(self, input_ids, attention_mask, position_ids=None, past_key_values=None, use_cache=True,
                logits_to_keep=0):
        cache = past_key_values if isinstance(past_key_values, _RowsCache) else _RowsCache(input_ids.shape[0])
        real = attention_mask[:, -input_ids.shape[1]:].bool()
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e4)
        eos = self.tokenizer.eos_token_id
        for b in range(input_ids.shape[0]):
            fed = input_ids[b][real[b]].tolist()
            cache.rows[b] += fed
            if len(fed) > 1 or not cache.plans[b]:         # a prompt or an observation: a new turn
                turn = self.act(self.tokenizer.decode(cache.rows[b]), self.rng)
                cache.plans[b] = self.tokenizer(turn, add_special_tokens=False)["input_ids"] + [eos] if turn else []
            logits[b, 0, cache.plans[b].pop(0) if cache.plans[b] else eos] = 0.0   # EOS once the turn is written
        return type("Out", (), {"logits": logits, "past_key_values": cache})()
