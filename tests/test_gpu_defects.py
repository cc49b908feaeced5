"""The defects of the one-GPU review (../shared/reviews/gpu-review.md) that a CPU can show: each
fix pinned against its definition or its setting."""
import os
import random
import re

import torch

from plumbing import fast_hf, models, runs
from plumbing.search_health import shared_first_search
from plumbing.tokens import answer_token_span
from test_sft import tiny_lab_model

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def test_shared_first_search_counts_the_same_pairs_as_the_n_squared_definition():
    rng = random.Random(0)
    episodes = [{"queries": [rng.choice(["a", "b", "A ", "c"])] if rng.random() < 0.8 else []} for _ in range(300)]
    correct = torch.tensor([rng.random() < 0.4 for _ in episodes])
    groups = torch.tensor([i // 5 for i in range(300)])
    first = [" ".join(e["queries"][0].lower().split()) if e["queries"] else None for e in episodes]
    pairs = [(i, j) for i in range(300) for j in range(300) if groups[i] == groups[j] and correct[i] and not correct[j]]
    expected = sum(first[i] is not None and first[i] == first[j] for i, j in pairs) / len(pairs)
    assert shared_first_search(episodes, correct, groups) == expected


def test_answer_span_from_offsets_equals_the_prefix_decoding_definition(tmp_path):
    tiny_lab_model(tmp_path / "m")
    for tok in (models.byte_tokenizer(), models.load_policy(str(tmp_path / "m"))[1]):
        for text in ["<answer> Velboford </answer>", "x <answer>a</answer> y <answer> 386,000 </answer>\n",
                     "<search> q </search>", "no tag <answer> unclosed"]:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]
            starts = [0] + ends[:-1]
            matches = list(ANSWER.finditer(tok.decode(ids)))
            want = (None, []) if not matches else (matches[-1].group(1).strip(), [
                i for i, (s, e) in enumerate(zip(starts, ends)) if s < matches[-1].end() and e > matches[-1].start()])
            assert answer_token_span(tok, ids, ANSWER) == want, (text, tok)


def test_adamw_is_fused_on_cuda_and_foreach_on_a_cpu():
    params = [torch.nn.Parameter(torch.zeros(3))]
    cuda = runs.adamw(params, 1e-3, 0.01, torch.device("cuda")).defaults   # built only: no GPU needed
    cpu = runs.adamw(params, 1e-3, 0.01, torch.device("cpu")).defaults
    assert (cuda["fused"], cuda["foreach"]) == (True, False) and (cpu["fused"], cpu["foreach"]) == (False, True)


def test_emulated_bf16_on_a_gpu_does_not_count(monkeypatch):
    asked = {}
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kw: asked.update(kw) or False)
    assert fast_hf.bf16_supported(torch.device("cuda")) is False and asked == {"including_emulation": False}


def test_cuda_runs_get_expandable_segments_unless_the_user_set_the_allocator(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert runs.pick_device("cuda").type == "cuda" and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    runs.pick_device("cuda")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    runs.pick_device("cpu")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_the_closing_tag_mask_is_built_once_per_tokenizer(monkeypatch):
    tok = models.byte_tokenizer()
    calls = []
    real = tok.convert_ids_to_tokens
    monkeypatch.setattr(tok, "convert_ids_to_tokens", lambda ids: calls.append(len(ids)) or real(ids))
    first = fast_hf.closing_tokens(tok, len(tok))
    again = fast_hf.closing_tokens(tok, len(tok))
    assert calls == [len(tok)] and again is first                     # P5: not once per rollout batch
    assert first[tok.convert_tokens_to_ids(">")] and not first[tok.convert_tokens_to_ids("a")]


def test_only_the_newest_checkpoint_keeps_the_optimizer_state(tmp_path):
    from conftest import tiny_policy

    model, tokenizer = tiny_policy()
    optimizer = runs.adamw(model.parameters(), 1e-3, 0.0, torch.device("cpu"))
    for step in (1, 2, 3):
        runs.save_checkpoint(tmp_path, step, model, tokenizer, optimizer, state={}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-2", "ckpt-3"]
    assert (tmp_path / "ckpt-3" / "optimizer.pt").exists() and not (tmp_path / "ckpt-2" / "optimizer.pt").exists()
    assert (tmp_path / "ckpt-2" / "config.json").exists() and runs.find_checkpoint(tmp_path).name == "ckpt-3"
