"""Shared test fixtures: tiny random models and tokenizers built in code (no downloads)."""
import pytest
import torch

from plumbing import models

def tiny_policy(seed=0, **shape):
    """(random tiny Qwen2, byte-level tokenizer); `shape` overrides TINY_QWEN2's sizes."""
    tokenizer = models.byte_tokenizer()
    return models.random_qwen2({**models.TINY_QWEN2, **shape}, len(tokenizer), torch.device("cpu"), seed), tokenizer


@pytest.fixture
def one_thread():
    """Tiny models: thread start-up costs more than the maths, and is 10x worse on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
