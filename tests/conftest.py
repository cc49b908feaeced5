"""Shared test fixtures: tiny random models and tokenizers built in code (no downloads), and
rollouts whose groups have a spread of rewards."""
import pytest
import torch

import rollout as ro
from plumbing import models

def tiny_policy(seed=0, **shape):
    """(random tiny Qwen2, byte-level tokenizer); `shape` overrides TINY_QWEN2's sizes."""
    tokenizer = models.byte_tokenizer()
    return models.random_qwen2({**models.TINY_QWEN2, **shape}, len(tokenizer), torch.device("cpu"), seed), tokenizer


def tiny_family(family, seed=0, **shape):
    """(random tiny copy of `family` (models.TINY_FAMILIES), byte-level tokenizer)."""
    tokenizer = models.byte_tokenizer()
    return models.tiny_model(family, len(tokenizer), seed=seed, **shape), tokenizer


@pytest.fixture
def one_thread():
    """Tiny models: thread start-up costs more than the maths, and is 10x worse on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def alternating_rewards(monkeypatch):
    """A random model never answers correctly; mark every other episode correct so that groups
    have a spread of rewards (advantages +-0.71) and the correct-response metrics are defined."""
    real = ro.rollout

    def fake(*args, **kwargs):
        out = real(*args, **kwargs)
        for i, e in enumerate(out.episodes):
            e["reward"] = float(i % 2 == 0)
        return out

    monkeypatch.setattr(ro, "rollout", fake)
