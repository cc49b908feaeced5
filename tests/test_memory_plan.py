"""The memory plan (plumbing/memory_plan.py) by hand arithmetic and independent recomputation:
Qwen2.5's parameter counts from their configs (bench/configs/), the KV cache of the paper preset,
and a run that cannot fit stopping at once in one line that names the flag to change."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import train
from conftest import tiny_policy
from plumbing import memory_plan
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


def test_the_paper_preset_on_qwen_3b_by_hand():
    shape = memory_plan.Shape.of(json.loads((CONFIGS / "qwen2.5-3b-instruct" / "config.json").read_text()))
    cfg = train.Config(**train.PRESETS["paper"])
    rows = memory_plan.plan(shape, cfg, cuda=True, bf16=True)
    p = 3_085_938_688
    # S = min(4096, 2048 + 4 x 500 + 3 x 500); KV: 128 episodes x S x 36 layers x (k, v) x 2 heads x 128 dims x 2 bytes
    assert rows["rollout: KV cache"] == 128 * 4096 * 36 * 2 * 2 * 128 * 2 == 19_327_352_832
    assert rows["weights (fp32)"] == 4 * p and rows["AdamW moments"] == 8 * p and rows["reference model"] == 2 * p
    assert rows["update: AdamW step transient"] == 0                 # fused on CUDA
    # grad checkpointing: per token 36 layer inputs + one layer, (36 x 2048 + 10 x 2048 + 4 x 11008) x 2 bytes
    assert rows["update: activations"] == 4 * 4096 * (36 * 2048 + 10 * 2048 + 4 * 11008) * 2
    always = 4 * p + 8 * p + 2 * p + 2 * p
    assert rows["rollout: KV copies at turn ends"] == int(0.9 * 19_327_352_832)
    assert rows["peak"] == always + max(rows["rollout: KV cache"] + int(0.9 * 19_327_352_832) + rows["rollout: logits"],
                                        4 * p + rows["update: activations"] + rows["update: logit chunks"])
    assert rows["checkpoint on disk"] == 12 * p


def test_a_run_that_cannot_fit_stops_at_once_naming_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(memory_plan, "device_bytes", lambda cuda: 2**20)          # a 1 MiB device
    with pytest.raises(ValueError, match=r"the memory plan needs .* GB, over 90% of the device's 0\.0 GB: lower --"):
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
