"""The defects a review of the one-GPU path found that a CPU can show: each
fix pinned against its definition or its setting."""
import os
import random
import re

import pytest
import torch

from plumbing import checkpoints, fast_hf, memory, models, runs
from plumbing.search_health import shared_first_search
from plumbing.tokens import answer_token_span
from conftest import tiny_policy
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
    memory.configure_allocator(torch.device("cuda"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    memory.configure_allocator(torch.device("cuda"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    memory.configure_allocator(torch.device("cpu"))
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
        checkpoints.save_checkpoint(tmp_path, step, model, tokenizer, optimizer, state={}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-2", "ckpt-3"]
    assert (tmp_path / "ckpt-3" / "optimizer.pt").exists() and not (tmp_path / "ckpt-2" / "optimizer.pt").exists()
    assert (tmp_path / "ckpt-2" / "config.json").exists() and checkpoints.find_checkpoint(tmp_path).name == "ckpt-3"


def tiny_kv_run(model):
    """A KVBatch under CPU bf16 autocast: prefill (a shared prefix, then each row's rest), a chunk
    of several tokens per row, a turn end keeping rows 0 and 2, one decode step -> (kv, logits)."""
    prompts = [list(range(1, 30)) + [40 + k] * (k + 1) for k in range(3)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        kv = fast_hf.KVBatch(model, 0)
        logits = [kv.start(prompts), kv.feed_padded([[1, 2, 3], [4], [5, 6]])]
        kv.keep_rows([0, 2])
        logits.append(kv.feed(torch.tensor([[8], [9]]), torch.ones(2, 1, dtype=torch.long)))
    return kv, logits


def test_kv_keys_are_stored_in_the_compute_dtype_where_attention_runs_in_it(monkeypatch):
    # D1: under bf16 autocast over fp32 weights RoPE leaves the keys fp32 (q * cos, cos in the fp32
    # residual's dtype) beside bf16 values: 1.5x the KV memory on a GPU, whose SDPA casts them to bf16
    # anyway. A CPU's decode attention runs in float32, so its cache keeps them (its numbers unchanged).
    model, _ = tiny_policy(hidden_size=64, intermediate_size=128)
    fast_hf.use_fast_attention(model)
    cpu, cpu_logits = tiny_kv_run(model)
    layer = cpu.cache.layers[0]
    assert type(layer) is fast_hf.SharedPrefixLayer
    assert (layer.prefix[0].dtype, layer.keys.dtype, layer.values.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    monkeypatch.setattr(fast_hf, "FLOAT32_ATTENTION", ())             # as on a GPU
    gpu, gpu_logits = tiny_kv_run(model)
    for layer in gpu.cache.layers:
        assert {layer.prefix[0].dtype, layer.keys.dtype, layer.values.dtype, *(b.dtype for b in layer.buffers)} \
            == {torch.bfloat16}
    # chunks of several tokens run SDPA under autocast, which casts fp32 keys to bf16 itself: the same logits
    assert torch.equal(gpu_logits[0], cpu_logits[0]) and torch.equal(gpu_logits[1], cpu_logits[1])


def test_a_turn_end_frees_the_full_batch_buffers_layer_by_layer():
    # D2: keep_rows used to make compact copies while every layer's full-batch buffers stayed alive
    # until its next update (up to ~1.9x the cache at each turn end); now each buffer is replaced by
    # its kept rows, spare room included, so the next step writes in place.
    import weakref
    model, _ = tiny_policy(hidden_size=64, intermediate_size=128)
    fast_hf.use_fast_attention(model)
    with torch.no_grad():
        kv = fast_hf.KVBatch(model, 0)
        kv.start([[1, 2, 3, 4, 5, 6, 7, 8, 9, k] for k in range(3)])
        kv.feed(torch.tensor([[3], [4], [5]]), torch.ones(3, 1, dtype=torch.long))
        old = [weakref.ref(b) for layer in kv.cache.layers for b in layer.buffers]
        capacity = kv.cache.layers[0].buffers[0].shape[-2]
        kept = [layer.keys[[0, 2]].clone() for layer in kv.cache.layers]
        kv.keep_rows([0, 2])
        assert all(ref() is None for ref in old)                       # freed, not kept beside the copies
        for layer, keys in zip(kv.cache.layers, kept):
            assert [b.shape[0] for b in layer.buffers] == [2, 2] and layer.buffers[0].shape[-2] == capacity
            assert torch.equal(layer.keys, keys) and layer.keys.data_ptr() == layer.buffers[0].data_ptr()
        kv.feed(torch.tensor([[8], [9]]), torch.ones(2, 1, dtype=torch.long))
        assert kv.cache.layers[0].buffers[0].shape[-2] == capacity    # written into the spare room


@pytest.mark.parametrize("tied", [False, True])
def test_the_bf16_reference_gives_kl_exactly_0_at_equal_weights(tied):
    # S2: a bf16 reference ran a bf16 residual stream (bf16 embeddings) against the policy's fp32 one,
    # so the logged KL started above 0. Now only weights that only linear layers use are bf16 (autocast
    # rounds the policy's the same way): the reference's log-probs equal the update pass's bit for bit.
    import train

    model, _ = tiny_policy(hidden_size=64, intermediate_size=128, tie_word_embeddings=tied)
    ref = models.reference_copy(model, bf16_weights=True)
    bf16 = {n for n, p in ref.named_parameters() if p.dtype == torch.bfloat16}
    assert bf16 and all(".mlp." in n or ".self_attn." in n or n == "lm_head.weight" for n in bf16)
    assert ref.get_input_embeddings().weight.dtype == torch.float32 and ("lm_head.weight" in bf16) == (not tied)
    torch.manual_seed(1)
    ids = torch.randint(0, 250, (3, 40))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 30:] = 0
    loss_mask = attention_mask.float()
    loss_mask[:, :10] = 0
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = train.token_logprobs(model, ids, attention_mask, loss_mask, 1.0)[0]   # the update pass
        with torch.no_grad():
            ref_logp = train.token_logprobs(ref, ids, attention_mask, loss_mask, 1.0)[0]
    assert torch.equal(logp.detach(), ref_logp) and train.masked_mean(train.kl_k3(logp, ref_logp), loss_mask) == 0


def test_the_reference_is_bf16_only_on_a_gpu_computing_in_bf16(monkeypatch):
    monkeypatch.setattr(fast_hf, "bf16_supported", lambda device: device.type == "cuda")
    assert models.frozen_in_bf16(torch.device("cuda"), True)
    assert not models.frozen_in_bf16(torch.device("cuda"), False)     # --no-bf16: fp32 activations
    assert not models.frozen_in_bf16(torch.device("cpu"), True)       # a CPU keeps its exact fp32 copy
    monkeypatch.setattr(fast_hf, "bf16_supported", lambda device: False)  # a V100: no autocast, so no bf16 weights
    assert not models.frozen_in_bf16(torch.device("cuda"), True)


@pytest.mark.parametrize("tied", [False, True])
def test_the_bf16_export_is_an_hf_folder_of_the_rounded_weights(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny_policy(tie_word_embeddings=tied)
    folder = checkpoints.export_bf16(tmp_path / "model-bf16", model, tokenizer)
    auto = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")   # what other tools do: config says bf16
    loaded, tok = models.load_policy(str(folder), dtype=torch.bfloat16)  # what eval.py does
    assert auto.dtype == loaded.dtype == torch.bfloat16 and tok("ab")["input_ids"] == tokenizer("ab")["input_ids"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16)), name
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    params = sum(p.numel() for p in model.parameters())                  # tied weights counted once
    assert 2 * params <= size < 2 * params + 100_000                      # 2 bytes a parameter, plus the header
    assert not list(tmp_path.glob(".tmp-*"))


def _decode_inputs(prefix: int):
    torch.manual_seed(0)
    n, heads, kv_heads, dim, own = 5, 8, 2, 32, 60
    query = torch.randn(n, heads, 1, dim)
    key, value = torch.randn(n, kv_heads, own, dim) * 2, torch.randn(n, kv_heads, own, dim)
    prefix_kv = (torch.randn(1, kv_heads, prefix, dim) * 2, torch.randn(1, kv_heads, prefix, dim))
    mask = torch.rand(n, 1, 1, prefix + own) > 0.3                   # holes in each row's own keys
    mask[..., :prefix + 1] = True                                   # the prefix is always attended
    return query, key, value, prefix_kv if prefix else (None, None), mask


def _reference(query, key, value, prefix_kv, mask):
    """HF's way: the prefix copied to every row, K/V repeated to every query head, float64 SDPA."""
    if prefix_kv[0] is not None:
        key, value = (torch.cat([p.expand(len(t), -1, -1, -1), t], 2) for p, t in zip(prefix_kv, (key, value)))
    groups = query.shape[1] // key.shape[1]
    key, value = (t.double().repeat_interleave(groups, 1) for t in (key, value))
    return torch.nn.functional.scaled_dot_product_attention(
        query.double(), key, value, attn_mask=mask, scale=query.shape[-1] ** -0.5).transpose(1, 2)


@pytest.mark.parametrize("prefix", [0, 40])
def test_the_gpus_bf16_decode_attention_matches_the_reference(prefix, monkeypatch):
    # N5: a GPU's decode step copied every key and value of the cache to float32 at every step and
    # layer. Now its products run in the cache's dtype (bf16), the softmax in float32, and K/V
    # are never repeated across query heads. Its error is the rounding of bf16: at most 2.5x what
    # bf16 inputs alone give (SDPA on them: 0.0103 here; ours 0.0191 with a prefix).
    query, key, value, prefix_kv, mask = _decode_inputs(prefix)
    want = _reference(query, key, value, prefix_kv, mask)
    scale = query.shape[-1] ** -0.5
    cpu, _ = fast_hf.decode_attention(query, key, value, mask, scale, *prefix_kv)   # float32
    assert cpu.dtype == torch.float32 and (cpu - want).abs().max() < 1e-5
    monkeypatch.setattr(fast_hf, "FLOAT32_ATTENTION", ())                          # as on a GPU
    bf16 = [None if t is None else t.bfloat16() for t in (key, value, *prefix_kv)]
    got, _ = fast_hf.decode_attention(query, bf16[0], bf16[1], mask, scale, *bf16[2:])
    rounded_inputs = _reference(query.bfloat16().float(), *(t.float() for t in bf16[:2]),
                                [None if t is None else t.float() for t in bf16[2:]], mask)
    floor = (rounded_inputs - want).abs().max()
    assert got.dtype == query.dtype and got.shape == (5, 1, 8, 32)
    assert 0 < (got - want).abs().max() < 2.5 * floor and floor < 0.02


def test_a_gpus_decode_mask_is_built_without_reading_it_on_the_host():
    # HF skips an all-ones decode mask after testing it on the host: a sync at every GPU decode
    # step. On a GPU the mask is always built (an all-True mask gives the same attention); a CPU
    # keeps HF's shortcut, and its numbers.
    ones = dict(batch_size=2, q_length=1, kv_length=5, kv_offset=0)
    assert fast_hf._mask(**ones, attention_mask=torch.ones(2, 5, dtype=torch.bool)) is None
    meta = fast_hf._mask(**ones, attention_mask=torch.ones(2, 5, dtype=torch.bool, device="meta"),
                         device="meta")
    assert meta is not None and meta.shape == (2, 1, 1, 5)
