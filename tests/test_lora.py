"""LoRA (--lora-rank): what holds for full fine-tuning holds with adapters. A tiny random Qwen2
with peft's adapters on every linear layer, through real train() calls."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import train
from plumbing import checkpoints, fast_hf, models
from conftest import tiny_policy
from test_train import step_lines, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def saved_policy(tmp_path, **shape):
    """A tiny model and tokenizer saved as an HF folder: the base a LoRA run's adapter names."""
    model, tokenizer = tiny_policy(**shape)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    return str(tmp_path / "base")


def lively_adapter(model, seed=1):
    """B = 0 at the start makes an adapter do nothing; random B makes it change every product."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def test_only_the_adapters_train_and_the_reference_is_the_same_model_with_them_off(tmp_path):
    base = saved_policy(tmp_path)
    cfg = tiny_config(tmp_path, model=base, lora_rank=4, kl_coef=0.1, eval_size=0)
    run = train.setup(cfg, *models.load_policy(base))
    trainable = [n for n, p in run.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2                  # A and B on 7 linear layers x 2 layers
    assert sum(len(g["params"]) for g in run.optimizer.param_groups) == len(trainable)
    assert isinstance(run.ref, models.AdapterOff)      # no second model
    lively_adapter(run.model)
    plain, _ = models.load_policy(base)                 # the base, loaded on its own
    fast_hf.use_fast_attention(plain)
    ids = torch.randint(0, 250, (3, 40))
    attention, loss_mask = torch.ones_like(ids), torch.ones_like(ids)
    loss_mask[:, :10] = 0
    with torch.no_grad():
        ref_logp, _ = train.token_logprobs(run.ref, ids, attention, loss_mask, 0.7)
        base_logp, _ = train.token_logprobs(plain, ids, attention, loss_mask, 0.7)
        policy_logp, _ = train.token_logprobs(run.model, ids, attention, loss_mask, 0.7)
    assert torch.equal(ref_logp, base_logp)
    assert not torch.equal(policy_logp, base_logp)     # the adapter is on outside the reference


@pytest.mark.parametrize("lively", [False, True], ids=["fresh", "lively-adapter"])
@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("grad_checkpointing", [True, False])
def test_lr_0_gives_exactly_0_on_every_path(tmp_path, alternating_rewards, monkeypatch, bf16,
                                           grad_checkpointing, lively):
    """lr 0: ratios, LLDS and displacement exactly 0, with the prefix shared (micro-batches of 2)
    or checkpointed; KL exactly 0 while the adapter is fresh (B = 0), above 0 once it acts."""
    if lively:
        real_with_lora = train.with_lora

        def with_lively_lora(*args):
            model = real_with_lora(*args)
            lively_adapter(model)
            return model
        monkeypatch.setattr(train, "with_lora", with_lively_lora)
    model, tokenizer = tiny_policy(hidden_size=64, intermediate_size=128)
    cfg = tiny_config(tmp_path, steps=1, lr=0.0, eval_size=0, micro_batch_size=2, mini_batch_size=2,
                      kl_coef=0.1, bf16=bf16, grad_checkpointing=grad_checkpointing, lora_rank=4)
    train.train(cfg, model, tokenizer)
    line = step_lines(tmp_path / "run")[0]
    assert line["clip_ratio"] == 0 and line["ppo_kl"] == 0
    assert line["llds/active_token_frac"] == 0 and line["llds/loss"] == 0
    assert line["lld/correct_displacement"] == 0 and line["lld/correct_frac_lost"] == 0
    assert (line["kl"] > 0) if lively else (line["kl"] == 0)


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_only(tmp_path,
                                                                          alternating_rewards):
    base = saved_policy(tmp_path)
    cfg = tiny_config(tmp_path, steps=1, eval_size=0, model=base)
    train.train(dataclasses.replace(cfg, name="full"), *models.load_policy(base))
    train.train(dataclasses.replace(cfg, name="lora", lora_rank=4, save_bf16=True),
                *models.load_policy(base))
    full, lora = tmp_path / "full" / "ckpt-1", tmp_path / "lora" / "ckpt-1"
    assert (lora / "adapter_model.safetensors").exists() and not (lora / "model.safetensors").exists()
    adapter = json.loads((lora / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == base and adapter["r"] == 4

    def size(folder, name):
        return (folder / name).stat().st_size
    # AdamW: 2 moments per trainable parameter; the adapter: 2 x 7 x (r x (in + out)) per layer
    assert size(lora, "optimizer.pt") < size(full, "optimizer.pt") / 5
    assert size(lora, "adapter_model.safetensors") < size(full, "model.safetensors") / 5
    # --save-bf16: the adapter merged, a plain HF model of the base's architecture
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "model-bf16")
    assert not hasattr(merged, "peft_config") and type(merged).__name__ == "Qwen2ForCausalLM"
    lora_model = AutoModelForCausalLM.from_pretrained(lora, dtype=torch.float32)   # base + adapter
    ids = torch.randint(0, 250, (2, 30))
    with torch.no_grad():
        a, b = merged(ids).logits.float(), lora_model(ids).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()   # the same model, up to bf16 rounding
    assert checkpoints.resolve_model(str(tmp_path / "lora")) == str(lora)


def test_eval_and_ask_take_a_lora_runs_folder(tmp_path, alternating_rewards):
    base = saved_policy(tmp_path)
    cfg = tiny_config(tmp_path, steps=1, eval_size=0, model=base, lora_rank=4)
    train.train(cfg, *models.load_policy(base))
    run = str(tmp_path / "run")
    done = subprocess.run([sys.executable, "ask.py", "Where was Talia Wrenn born?", "--model", run,
                           "--max-turns", "1", "--max-turn-tokens", "4"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "eval"
    done = subprocess.run([sys.executable, "eval.py", "--model", run, "--data", "toy_nq",
                           "--limit", "2", "--max-turns", "1", "--max-turn-tokens", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "results.json").read_text())
