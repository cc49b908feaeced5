"""The memory plan (plumbing/memory_plan.py) by hand arithmetic and independent recomputation:
Qwen2.5's parameter counts from their configs (bench/configs/), the KV cache of the paper preset,
and a run that cannot fit stopping at once in one line that names the flag to change; LoRA's rows
against peft's adapter count and what autograd keeps; each one-GPU preset against its card, also
planned without a GPU or the model; on a CPU, bf16 matmuls of new shapes that stop adding memory
the plan does not count."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import train
from conftest import tiny_policy
from plumbing import fast_hf, memory_plan, models
from test_train import tiny_config

CONFIGS = Path(__file__).resolve().parent.parent / "bench" / "configs"
PUBLISHED = {"qwen2.5-0.5b-instruct": 494_032_768, "qwen2.5-1.5b-instruct": 1_543_714_304,
             "qwen2.5-3b-instruct": 3_085_938_688}                   # the model cards' exact counts


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_ones_and_a_meta_model(name):
    config = AutoConfig.for_model(**json.loads((CONFIGS / name / "config.json").read_text()))
    with torch.device("meta"):                                       # no memory: shapes only
        model = AutoModelForCausalLM.from_config(config)
    counted = sum(p.numel() for p in model.parameters())
    assert memory_plan.Shape.of(config).parameters() == counted == PUBLISHED[name]


def shape_of(name):
    return memory_plan.Shape.of(json.loads((CONFIGS / name / "config.json").read_text()))


def test_the_paper_preset_on_qwen_3b_by_hand():
    shape = shape_of("qwen2.5-3b-instruct")
    cfg = train.Config(**train.PRESETS["paper"])
    rows = memory_plan.plan(shape, cfg, cuda=True, bf16=True)
    p = 3_085_938_688
    # all linear: 36 layers x (q, o 2048^2; k, v 2048 x 256; their biases; gate, up, down 2048 x 11008)
    lin = 36 * (2 * 2048 ** 2 + 2 * 2048 * 256 + 2048 + 2 * 256 + 3 * 2048 * 11008)
    assert shape.linear_only() == lin == 2_774_624_256 and p - lin == 151936 * 2048 + 73 * 2048   # embedding, norms
    # S = min(4096, 2048 + 4 x 500 + 3 x 500) = 4096, no prompts read: no shared prefix; per token 36 layers x
    # (k, v) 2 x 128 x (2 bytes of key on a GPU + 2 of value); 256 spare positions per row and for the prefix
    kv = (128 * (4096 + 256) + 256) * 36 * 256 * (2 + 2)
    assert rows["rollout: KV cache"] == kv == 20_544_749_568 and rows["rollout: one layer's copy"] == kv // 36
    # the prompt's 2048-token chunk for 128 rows: 3 MLP tensors bf16 + 4 fp32 residual-sized, its mask; HF's
    # repeat of keys and values to 16 heads of 128
    assert rows["rollout: a chunk's forward"] == 128 * 2048 * (3 * 11008 * 2 + 4 * 2048 * 4 + 4096 * 2) + \
        128 * 16 * 128 * 4096 * 2 * 2
    assert rows["weights (fp32)"] == 4 * p and rows["AdamW moments"] == 8 * p
    assert rows["reference model"] == 2 * lin + 4 * (p - lin)              # bf16 linear weights, fp32 embeddings
    assert rows["autocast bf16 weights"] == 2 * (lin + 151936 * 2048)       # the tied head is cast too
    assert rows["update: AdamW step transient"] == 0                        # fused on CUDA
    # grad checkpointing: per token the 36 fp32 layer inputs and, twice, one layer's saved set under autocast
    # (4 H fp32 + 7 H + 2 kv + 4 I bf16), and that layer's mask twice
    per_layer = 4 * 4 * 2048 + 2 * (7 * 2048 + 2 * 256 + 4 * 11008)
    assert rows["update: activations"] == 4 * 4096 * (36 * 4 * 2048 + 2 * per_layer) + 2 * 4 * 4096 * 4096 * 2
    always = 4 * p + 8 * p + rows["reference model"] + rows["autocast bf16 weights"]
    rollout = kv + kv // 36 + rows["rollout: a chunk's forward"] + 128 * 151936 * 12
    update = 4 * p + rows["update: activations"] + 1024 * 151936 * 4 * 5        # a full chunk of logits
    assert (rows["always"], rows["rollout total"], rows["update total"]) == (always, rollout, update)
    assert rows["peak"] == always + max(rollout, update) and rows["checkpoint on disk"] == 12 * p


def test_prompt_lengths_reads_the_longest_and_the_shared_prefix_once():
    assert memory_plan.prompt_lengths(iter([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 9, 9, 9]])) == (6, 2)
    assert memory_plan.prompt_lengths(iter([[7, 8], [7, 8, 9]])) == (3, 2)     # a prompt that is the prefix
    assert memory_plan.prompt_lengths([[4, 5, 6]]) == (3, 3)


def test_the_cpu_path_by_hand_with_real_prompts_and_a_shared_prefix():
    # The CPU demo's path: keys fp32 beside bf16 values, prefix stored once in the cache and run once per
    # mini-batch in the update (no checkpointing), the evaluation's 50 rows over training's 32.
    shape = memory_plan.Shape(vocab=300, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tied=False,
                              qkv_bias=True)
    cfg = train.Config(max_turns=2, max_turn_tokens=32, max_obs_tokens=200, prompts_per_step=8, group_size=4,
                       rollout_batch_size=64, eval_size=50, micro_batch_size=4, kl_coef=0.0)
    rows = memory_plan.plan(shape, cfg, cuda=False, bf16=True, prompts=(468, 459))
    s = 468 + 3 * 32 + 2 * 200
    assert rows["episode tokens"] == s == 964
    kv = (50 * (s - 459 + 256) + 459 + 256) * 2 * 32 * (4 + 2)
    assert rows["rollout: KV cache"] == kv
    assert rows["rollout: a chunk's forward"] == 50 * 201 * (3 * 128 * 2 + 4 * 64 * 4 + s * 2)    # an observation
    per_layer = 4 * 4 * 64 + 2 * (7 * 64 + 2 * 32 + 4 * 128)
    rest = 4 * (s - 459)
    assert rows["update: activations"] == 3 * (rest * per_layer + rest * s * 2 + 4 * 459 * 2 * 32 * 2) \
        + 459 * 2 * per_layer
    assert rows["update: AdamW step transient"] == 4 * shape.parameters() and rows["reference model"] == 0
    # the head's chunk: the micro-batch's model tokens, 4 rows x 3 turns x 32, under 1024
    assert rows["update total"] == 4 * shape.parameters() + rows["update: activations"] + 4 * 3 * 32 * 300 * 4 * 5


def test_lora_counts_the_adapters_peft_trains_and_the_frozen_base_once():
    model, _ = tiny_policy(tie_word_embeddings=True)
    shape = memory_plan.Shape.of(model.config)
    lora = models.with_lora(model, 4, 8.0)
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    # r x (in + out) on q, k, v, o, gate, up, down of each layer, nothing else: peft's exact count
    h, kv, i = shape.hidden, shape.kv, shape.intermediate
    assert adapters == shape.lora_parameters(4) == shape.layers * 4 * (9 * h + 2 * kv + 3 * i)
    assert sum(p.numel() for p in lora.parameters()) == shape.parameters() + adapters
    p, lin = shape.parameters(), shape.linear_only()
    cfg = train.Config(lora_rank=4, kl_coef=0.001, micro_batch_size=2)
    full = memory_plan.plan(shape, dataclasses.replace(cfg, lora_rank=0), cuda=False, bf16=False)
    cpu = memory_plan.plan(shape, cfg, cuda=False, bf16=False)
    # only the adapters train: their fp32 weights, moments, gradients, the CPU's AdamW transient
    # and the checkpoint scale with them; the base is held once, fp32 on a CPU, and is the
    # reference (no copy with kl_coef > 0)
    assert (cpu["weights (fp32)"], cpu["AdamW moments"], cpu["update: gradients"],
            cpu["update: AdamW step transient"], cpu["checkpoint on disk"]) == \
        (4 * adapters, 8 * adapters, 4 * adapters, 4 * adapters, 12 * adapters)
    assert (cpu["frozen base (LoRA)"], cpu["reference model"]) == (4 * p, 0)
    assert (full["frozen base (LoRA)"], full["reference model"], full["AdamW moments"]) == \
        (0, 4 * p, 8 * p)
    assert cpu["rollout total"] == full["rollout total"]             # the rollout does not change
    # a GPU under bf16: the base's linear weights in bf16 (the tied head is the fp32 embedding,
    # which autocast casts as it casts the adapters); a CPU under bf16 casts the whole base
    gpu = memory_plan.plan(shape, cfg, cuda=True, bf16=True)
    assert gpu["frozen base (LoRA)"] == 2 * lin + 4 * (p - lin)
    assert gpu["autocast bf16 weights"] == 2 * (adapters + shape.vocab * h)
    assert memory_plan.plan(shape, cfg, cuda=False, bf16=True)["autocast bf16 weights"] == \
        2 * (adapters + lin + shape.vocab * h)


def saved_bytes_per_token_and_layer(rank: int, bf16: bool) -> float:
    """What autograd keeps in a tiny Qwen2's forward, per token and layer: the difference between
    3 and 2 layers and 512 and 256 tokens leaves out the embedding, the final norm and whatever
    does not grow with tokens (the weights' bf16 casts)."""
    def kept(layers, tokens):
        model, _ = tiny_policy(num_hidden_layers=layers)
        model = models.with_lora(model, rank, 8.0) if rank else model
        fast_hf.use_fast_attention(model)
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        ids = torch.randint(0, 200, (1, tokens))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            model.get_decoder()(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in weights)
    return (kept(3, 512) - kept(2, 512) - kept(3, 256) + kept(2, 256)) / 256


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_lora_changes_the_activations_by_what_autograd_keeps(bf16, one_thread):
    # The plan's per-token, per-layer activations with LoRA differ from full fine-tuning's by what
    # saved-tensor hooks see autograd keep: the norms' normalised inputs no longer, B's rank-r
    # inputs, and under autocast A's bf16 copy of o's input.
    model, _ = tiny_policy()
    shape, rank, s = memory_plan.Shape.of(model.config), 8, 64
    cfg = train.Config(max_prompt_tokens=s - 1, max_context=s, micro_batch_size=1, eval_size=0)

    def per_layer(r):
        rows = memory_plan.plan(shape, dataclasses.replace(cfg, lora_rank=r), cuda=False, bf16=bf16)
        return rows["update: activations"] / ((shape.layers + 1) * s)     # micro 1, no prefix store
    h = shape.hidden
    assert per_layer(rank) - per_layer(0) == (-2 * h * 4 + 7 * rank * 4 if not bf16 else
                                              -2 * h * 4 + h * 2 + 7 * rank * 2)
    measured = [saved_bytes_per_token_and_layer(r, bf16) for r in (rank, 0)]
    assert measured[0] - measured[1] == per_layer(rank) - per_layer(0)


def test_a_run_that_cannot_fit_stops_at_once_naming_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(memory_plan, "device_bytes", lambda cuda: 2**20)          # a 1 MiB device
    with pytest.raises(ValueError, match=r"the memory plan needs .* GiB, over 90% of the device's 0\.0 GiB: lower --"):
        train.setup(tiny_config(tmp_path, name="big"), *tiny_policy())
    assert not (tmp_path / "big").exists()                         # stopped before the run folder
    monkeypatch.undo()
    train.setup(tiny_config(tmp_path, name="fits"), *tiny_policy())
    assert "memory plan: peak" in capsys.readouterr().out


def test_plan_flag_prints_the_table_and_exits(tmp_path, capsys):
    model, tokenizer = tiny_policy()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    train.main(["--plan", "--model", str(tmp_path / "m"), "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "memory plan:" in out and "rollout: KV cache" in out and "peak" in out
    assert not (tmp_path / "demo").exists()


GIB = 2**30
# The paper's settings, as train.py held them before they moved to plumbing/presets.py.
PAPER = dict(
    model="Qwen/Qwen2.5-3B-Instruct", data="data/nq_hotpotqa_train/train.parquet",
    eval_data="data/nq_hotpotqa_train/test.parquet", retriever="http://127.0.0.1:8000/retrieve", template="search-r1",
    max_turns=3, topk=3, max_turn_tokens=500, max_obs_tokens=500, max_prompt_tokens=2048, max_context=4096,
    temperature=1.0, top_p=0.95, steps=1005, prompts_per_step=512, group_size=5, drop_tied_groups=0, mini_batch_size=256,
    micro_batch_size=4, lr=1e-6,
    warmup_ratio=0.285, clip_eps=0.2, kl_coef=0.001, entropy_coef=0.001, llds_lambda=0.2, llds_gate="action",
    eval_every=50, eval_size=1000, eval_max_turns=4, ckpt_every=50, rollout_batch_size=128, grad_checkpointing=True,
    warmup_from_zero=True, verl_minibatches=True)
ALGORITHM = ("template", "max_turns", "topk", "max_turn_tokens", "max_obs_tokens", "max_context", "temperature",
             "group_size", "drop_tied_groups", "lr", "warmup_ratio", "clip_eps", "kl_coef", "entropy_coef", "llds", "llds_lambda",
             "warmup_from_zero", "verl_minibatches",
             "llds_gate", "llds_reduction", "answer_coef", "answer_adaptive", "top_p", "grad_checkpointing", "retriever", "data", "eval_max_turns")


def test_each_one_gpu_preset_keeps_the_papers_algorithm_and_fits_its_card_as_tight_as_it_can():
    # what torch reports of each card, rounded down: 24 GB (an RTX 4090), 48 GB (an RTX A6000), an
    # H100 80GB, an H200
    assert memory_plan.CARD_GIB == {"24gb": 23.5, "48gb": 47.5, "80gb": 79.0, "141gb": 139.0}
    assert train.PRESETS["paper"] == PAPER
    names = sorted(n for n in train.PRESETS if n.startswith("one-gpu-"))
    assert names == [f"one-gpu-{s}-{c}" for s in ("0.5b", "1.5b", "3b")
                     for c in ("141gb", "24gb", "48gb", "80gb")]
    lora = {"one-gpu-1.5b-24gb", "one-gpu-3b-24gb", "one-gpu-3b-48gb"}
    paper = train.Config(**PAPER)
    for name in names:
        size, card = name.split("-")[2:]
        cfg = train.Config(**train.PRESETS[name])
        # LoRA at rank 32 and 10x the paper's lr where full fine-tuning cannot fit; else the paper's
        assert (cfg.lora_rank, cfg.lr) == ((32, 1e-5) if name in lora else (0, 1e-6)), name
        assert all(getattr(cfg, f) == getattr(paper, f) for f in ALGORITHM if f != "lr"), name
        n = cfg.prompts_per_step * cfg.group_size
        assert (n, n // cfg.mini_batch_size) == (320, 10)                 # 64 x 5, 10 updates a step as the paper's

        def peak(**change):
            return memory_plan.plan(shape_of(f"qwen2.5-{size}-instruct"), dataclasses.replace(cfg, **change),
                                    cuda=True, bf16=True)["peak"]

        limit = 0.85 * memory_plan.CARD_GIB[card] * GIB
        assert peak() <= limit, name
        larger = min((d for d in range(cfg.rollout_batch_size + 1, n + 1) if n % d == 0), default=None)
        assert larger is None or peak(rollout_batch_size=larger) > limit, name
        assert cfg.micro_batch_size == 8 or peak(micro_batch_size=2 * cfg.micro_batch_size) > limit, name
        # full fine-tuning fits no rollout batch, even one row a micro-batch, where LoRA is used
        assert name not in lora or peak(lora_rank=0, rollout_batch_size=1,
                                        micro_batch_size=1) > limit, name


def test_a_presets_plan_without_a_gpu_is_for_its_card_from_the_shipped_config(monkeypatch, tmp_path,
                                                                              capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    train.main(["--preset", "one-gpu-3b-24gb", "--plan", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    peak = float(re.search(r"memory plan: peak ([\d.]+) GiB of 23\.5 GiB GPU memory "
                           r"\(a 24gb card's; no GPU here\)", out).group(1))
    assert peak <= 0.85 * 23.5 and "3,085.9M parameters" in out and "frozen base (LoRA)" in out
    # the same preset with --device cpu plans for this machine's RAM, as asked
    train.main(["--preset", "one-gpu-3b-24gb", "--plan", "--device", "cpu",
                "--out-dir", str(tmp_path)])
    assert "GiB RAM" in capsys.readouterr().out


def test_a_model_not_downloaded_is_planned_from_its_shipped_config(capsys):
    # a name no cache holds, whose model bench/configs/ ships
    config = memory_plan.model_config(train.Config(model="nobody/Qwen2.5-0.5B-Instruct"))
    assert memory_plan.Shape.of(config).parameters() == PUBLISHED["qwen2.5-0.5b-instruct"]
    assert "planning from bench/configs/qwen2.5-0.5b-instruct" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no config to plan from"):
        memory_plan.model_config(train.Config(model="nobody/no-such-model"))


def test_the_step_time_estimate_by_hand():
    shape, cfg = shape_of("qwen2.5-3b-instruct"), train.Config(**train.PRESETS["one-gpu-3b-80gb"])
    t = memory_plan.step_seconds(shape, cfg, "H100 80GB")
    s = min(4096, 512 + 4 * 500 + 3 * 500)                                 # 4012 tokens
    # decode: 80 rows; 36 layers x 0.9 ms of launches against (bf16 weights + 5 x the KV cache at s / 2) / 3.35 TB/s
    traffic = 2 * (2_774_624_256 + 151936 * 2048) + 5 * 80 * s / 2 * 36 * 256 * 4
    assert traffic / 3.35e9 < 36 * 0.9                                     # launch-bound: 32.4 ms a step
    assert t["rollout"] == pytest.approx(320 / 80 * 4 * 500 * 32.4e-3)     # 4 batches x 2000 steps: 259 s
    forward = 320 * s * (2 * (2_774_624_256 + 151936 * 2048) + 2 * 36 * s * 2048)
    passes = 3 + 1 + (1 - 32 / 320) + 1 + 1 / 10                          # fwd+bwd, recompute, old, ref, displacement
    assert t["training"] == pytest.approx(forward * passes / (0.35 * 989e12))
    assert t["step"] == pytest.approx(t["rollout"] + t["training"]) and 5 * 60 < t["step"] < 8 * 60
    # LoRA on an RTX 4090, 40 rows: 35% more launches (the adapters' kernels), the adapters'
    # FLOPs, and fwd+bwd 2 forwards (no weight gradients for the frozen base)
    cfg = train.Config(**train.PRESETS["one-gpu-3b-24gb"])
    t = memory_plan.step_seconds(shape, cfg, "RTX 4090 24GB")
    adapters = 36 * 32 * (9 * 2048 + 2 * 256 + 3 * 11008)                 # 59.9M
    assert t["rollout"] == pytest.approx(320 / 40 * 4 * 500 * 36 * 0.9 * 1.35e-3)
    forward = 320 * s * (2 * (2_774_624_256 + 151936 * 2048 + adapters) + 2 * 36 * s * 2048)
    assert t["training"] == pytest.approx(forward * (2 + 1 + 0.9 + 1 + 0.1) / (0.35 * 165e12))


ONEDNN_PROBE = """
import os, sys, torch
from plumbing import fast_hf, memory
if sys.argv[1] == "bounded":
    memory.configure_allocator(torch.device("cpu"))                 # what every train.py run does first
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
torch.set_num_threads(1)
w, x = torch.randn(1536, 576), torch.randn(600, 576)
with torch.autocast("cpu", dtype=torch.bfloat16):
    torch.nn.functional.linear(x[:1], w)
    before = rss()
    for rows in range(2, 600):                                      # 598 new shapes, as new sequence lengths are
        torch.nn.functional.linear(x[:rows], w)
print(fast_hf.bf16_supported(torch.device("cpu")), (rss() - before) / 2**20)
"""


def test_a_cpu_run_bounds_onednns_caches_so_new_shapes_stop_adding_memory():
    # bf16 matmuls on a CPU keep each new shape in two caches of 1,024 entries: unbounded, 598 new
    # shapes of one SmolLM2 weight add ~0.4 GiB; after configure_allocator(cpu) at most 64 entries stay.
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}

    def grown_mib(mode):
        out = subprocess.run([sys.executable, "-c", ONEDNN_PROBE, mode], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parent.parent, env=env).stdout.split()
        return out[0] == "True", float(out[1])

    supported, bounded = grown_mib("bounded")
    if not supported:
        pytest.skip("no bf16 matmuls on this CPU: train.py runs float32 here, which oneDNN does not cache")
    unbounded = grown_mib("default")[1]
    assert bounded < 0.5 * unbounded, (bounded, unbounded)


def test_on_a_gpu_the_plan_counts_what_is_free_and_names_what_others_hold(monkeypatch):
    # A retriever's encoder (or anything else) on the same card is not the run's to use.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (40 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 2 * GIB)
    assert memory_plan.device_bytes(True) == 42 * GIB
    assert memory_plan.held_by_others(True) == ", 38.0 GiB held by other processes"
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 40 * GIB - 2**20)
    assert memory_plan.held_by_others(True) == "" and memory_plan.held_by_others(False) == ""
