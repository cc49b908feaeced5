"""Every model family a user brings, as a tiny random copy built in code (models.TINY_FAMILIES:
Qwen2.5, Qwen3, Llama 3.2, SmolLM3, Gemma 3), with full fine-tuning and with LoRA, through the
paths whose numbers must agree: plumbing/fast_hf.py's attention against HF's eager one, the
rollout's KV cache against the forward, the shared prefix against the plain forward, an lr-0 step,
and the memory plan's parameter count. A family the trainer cannot run is refused in one line
before its weights load. Qwen2 itself: tests/test_train.py."""
import json
import re

import pytest
import torch
import transformers

import train
from plumbing import fast_hf, memory_plan, models
from conftest import tiny_family
from test_lora import lively_adapter
from test_train import step_lines, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = list(models.TINY_FAMILIES)
MODES = pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])


def family_policy(family, lora):
    """The tiny `family` as setup() runs it, on fast_hf's attention; with LoRA, adapters that act
    (B != 0)."""
    model, _ = tiny_family(family)
    if lora:
        model = models.with_lora(model, rank=4, alpha=32.0)
        lively_adapter(model)
    fast_hf.use_fast_attention(model)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fast_attention_gives_hf_eager_numbers(family):
    # left padding as in a rollout's batch, 40 tokens: past Gemma's 16-token window
    model, _ = tiny_family(family)
    ids = torch.randint(0, 250, (3, 40))
    attention = torch.ones_like(ids)
    attention[1, :7] = 0
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, attention_mask=attention).logits
        fast_hf.use_fast_attention(model)
        fast = model(input_ids=ids, attention_mask=attention).logits
    on = attention.bool()
    torch.testing.assert_close(fast[on], eager[on], atol=1e-5, rtol=0)
    assert models.unsupported(model.config) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kv_cache_with_holes_gives_each_rows_own_forward(family):
    """KVBatch's rows share a prefix, have holes (masked pads) and count positions over their real
    tokens: each row's logits are a plain forward's of its real tokens, past Gemma's window too."""
    model = family_policy(family, lora=False)
    rows = [list(range(1, 21)) + list(range(30, 30 + k)) for k in (1, 3, 5)]
    kv = fast_hf.KVBatch(model, 0)

    def check(logits, fed=(0, 1, 2)):      # a row fed a masked pad has no logits to check
        for i in fed:
            want = model(input_ids=torch.tensor([rows[i]])).logits[0, -1]
            torch.testing.assert_close(logits[i], want, atol=1e-5, rtol=0)

    with torch.no_grad():
        check(kv.start(rows))
        rows[0].append(3), rows[2].append(5)
        check(kv.feed(torch.tensor([[3], [4], [5]]), torch.tensor([[1], [0], [1]])), fed=(0, 2))
        chunks = [list(range(40, 52)), [7, 8], list(range(60, 66))]
        rows = [row + chunk for row, chunk in zip(rows, chunks)]
        check(kv.feed_padded(chunks))
        kv.keep_rows([0, 2])
        rows = [rows[0] + [8], rows[2] + [9]]
        check(kv.feed(torch.tensor([[8], [9]]), torch.ones(2, 1, dtype=torch.long)), fed=(0, 1))


@MODES
@pytest.mark.parametrize("family", FAMILIES)
def test_the_shared_prefix_gives_the_plain_forward_and_its_gradients(family, lora):
    # as tests/test_train.py's Qwen2 case, with a 40-token prefix: past Gemma's window
    model = family_policy(family, lora)
    prefix = torch.randint(0, 250, (40,))
    ids = torch.cat([prefix.expand(3, -1), torch.randint(0, 250, (3, 9))], 1)         # (3, 49)
    attention = torch.ones_like(ids)
    attention[1, -4:] = 0                       # right padding
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]

    def run(shared):
        model.zero_grad()
        with fast_hf.prefix_once(model, ids, attention, enabled=shared) as policy:
            hidden = policy.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
            (hidden[attention.bool()] ** 2).mean().backward()
        return hidden.detach(), {name: p.grad.clone() for name, p in trained if p.grad is not None}

    plain, plain_grads = run(False)
    shared, shared_grads = run(True)
    on = attention.bool()
    torch.testing.assert_close(shared[on], plain[on], atol=1e-5, rtol=0)
    assert plain_grads.keys() == shared_grads.keys() and len(plain_grads) > 0
    for name, g in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], g, atol=1e-6, rtol=1e-4)


@MODES
@pytest.mark.parametrize("family", FAMILIES)
def test_the_rollout_matches_the_forward_and_an_lr_0_step_is_exactly_0(family, lora, tmp_path,
                                                                       alternating_rewards,
                                                                       monkeypatch):
    """One train() step at lr 0: the KV-cache decode's log-probs equal the forward's (fp32,
    tests/test_rollout.py's tolerance), and ratios, KL, LLDS and displacement are exactly 0 with
    the prefix shared (micro-batches of 2). LoRA's adapter is fresh (B = 0): KL exactly 0 too."""
    # The curves and the memory plan (tokenising every prompt) are 2/3 of a tiny run's time and
    # take no part in what is compared here.
    monkeypatch.setattr(train, "plot_runs", lambda *args: "")
    monkeypatch.setattr(memory_plan, "check", lambda *args: None)
    model, tokenizer = tiny_family(family)
    cfg = tiny_config(tmp_path, steps=1, lr=0.0, eval_size=0, micro_batch_size=2,
                      mini_batch_size=2, kl_coef=0.1, lora_rank=4 if lora else 0)
    train.train(cfg, model, tokenizer)
    line = step_lines(tmp_path / "run")[0]
    assert line["response_length"] > 0 and line["rollout/logp_diff"] < 2e-5
    assert line["clip_ratio"] == 0 and line["ppo_kl"] == 0 and line["kl"] == 0
    assert line["llds/active_token_frac"] == 0 and line["llds/loss"] == 0
    assert line["lld/correct_displacement"] == 0 and line["lld/correct_frac_lost"] == 0


# Shape (plumbing/memory_plan.py) counts a Llama / Qwen2 layer: heads hidden / heads wide, two
# RMSNorms a layer, no norm inside attention.


@pytest.mark.parametrize("family", FAMILIES)
def test_the_memory_plan_counts_the_models_parameters(family):
    model, _ = tiny_family(family)
    assert memory_plan.Shape.of(model.config).parameters() == sum(
        p.numel() for p in model.parameters())


@pytest.mark.parametrize("config, feature", [
    (transformers.Gemma2Config(), "gemma2 uses final_logit_softcapping=30.0"),
    (transformers.Gemma2Config(final_logit_softcapping=None),
     "gemma2 uses attn_logit_softcapping=50.0"),
    (transformers.Gemma3TextConfig(final_logit_softcapping=30.0),
     "gemma3_text uses final_logit_softcapping=30.0"),
    (transformers.CohereConfig(), "cohere uses logit_scale=0.0625"),
    (transformers.Llama4TextConfig(), "llama4_text uses chunked_attention layers"),
    (transformers.Qwen3NextConfig(), "qwen3_next uses linear_attention layers"),
], ids=["gemma2", "gemma2-attention", "gemma3-softcap", "cohere", "llama4", "qwen3-next"])
def test_a_family_the_trainer_cannot_run_ends_in_one_line_naming_what_it_uses(config, feature):
    with pytest.raises(SystemExit) as stop:
        models.check_supported(config, "org/model")
    message = str(stop.value)
    assert message.startswith(f"error: --model org/model: {feature}, which this trainer does "
                              "not support: ") and "\n" not in message


def test_a_refused_family_stops_before_its_weights_load_from_its_folder_or_an_adapter(tmp_path):
    model, tokenizer = tiny_family("gemma3")
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    model, _ = models.load_policy(str(base))
    models.with_lora(model, rank=4, alpha=32.0).save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    assert models.is_lora(models.load_policy(str(adapter))[0])     # supported, adapter and all
    # Gemma 2's final soft-cap, and no weights: only a check before they load can name it
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    (base / "model.safetensors").unlink()
    for folder in (base, adapter):
        with pytest.raises(SystemExit, match=re.escape(f"error: --model {folder}: gemma3_text "
                                                       "uses final_logit_softcapping=30.0, which")):
            models.load_policy(str(folder))
