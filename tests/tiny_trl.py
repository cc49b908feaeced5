"""Tiny TRL runs for tests/test_trl_llds.py, and the script its two-process test launches.

A random 2-layer Qwen2 model and a byte-level tokenizer with the Qwen2.5 chat tokens (built in
code, nothing downloaded) trained by integrations/trl_llds.py's LLDSGRPOTrainer on CPU.

    python tests/tiny_trl.py OUT.json                                          # one process
    accelerate launch --multi_gpu --num_processes 2 tests/tiny_trl.py OUT.json # two, CPU + gloo without a GPU

runs the same deterministic training in each setting (scripted completions, rewards computed
from them) and writes every logged `loss` and `llds/loss` to OUT.json (from process 0).
"""
import json
import os
import random
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from plumbing.models import TINY_QWEN2, random_qwen2  # noqa: E402
from integrations.trl_llds import LLDSGRPOTrainer  # noqa: E402


def chat_tokenizer():
    """Byte-level BPE, no merges, plus <|im_start|>, <|im_end|> (eos) and <|endoftext|> (pad),
    with TRL's own copy of the Qwen2.5 chat template (the one it knows how to parse tool calls of)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_model(tokenizer, seed=0, **shape):
    """A random 2-layer Qwen2 for `tokenizer`; `shape` overrides TINY_QWEN2's fields."""
    return random_qwen2({**TINY_QWEN2, **shape}, len(tokenizer), torch.device("cpu"), seed)


def config(out_dir, **overrides):
    """2 generation batches x 2 optimiser steps, 2 micro-batches each, for the tiny model on CPU."""
    base = dict(output_dir=str(out_dir), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                steps_per_generation=4, num_generations=4, max_completion_length=12, learning_rate=1e-2,
                max_steps=4, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                gradient_checkpointing=False, seed=0, loss_type="dapo", disable_tqdm=True)
    return GRPOConfig(**{**base, **overrides})


def length_reward(completions, **kwargs):
    """Rewards that differ within a group: 0, 1 or 2 by the completion's length mod 3."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t) % 3) for t in texts]


def prompts(n):
    return Dataset.from_dict({"prompt": [f"Question {i}: where was Talia Wrenn born?" for i in range(n)]})


class Scripted(LLDSGRPOTrainer):
    """Completions fixed by (prompt, how many times it came before in this batch): the same text
    whatever the number of processes, so a one-process and a two-process run see the same data."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        seen, completions = {}, []
        eos, vocab = self._tokenizer.eos_token_id, 256
        for ids in prompt_ids:
            k = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
            rng = random.Random(zlib.crc32(bytes(str((ids, k)), "ascii")))
            completions.append([rng.randrange(vocab) for _ in range(rng.randrange(3, 11))] + [eos])
        return completions, None


def main(out_path):
    """The two-process test's workload: three objectives, each trained from the same weights."""
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))          # set by accelerate launch
    results = {}
    for name, loss_type, reduction in [("dapo", "dapo", "policy"), ("grpo", "grpo", "policy"),
                                       ("dapo-seq-mean", "dapo", "seq-mean")]:
        tokenizer = chat_tokenizer()
        # num_iterations 2 with steps_per_generation == gradient_accumulation_steps: every optimiser
        # step sees its whole generation batch, whatever order each process shuffled it into.
        args = config(Path(out_path).parent / name, loss_type=loss_type, per_device_train_batch_size=4 // world,
                      steps_per_generation=2, num_iterations=2)
        trainer = Scripted(model=tiny_model(tokenizer), reward_funcs=length_reward, train_dataset=prompts(8),
                           args=args, processing_class=tokenizer, llds_reduction=reduction)
        trainer.train()
        results[name] = [{k: log[k] for k in ("step", "loss", "llds/loss")} for log in trainer.state.log_history
                         if "loss" in log]
    if trainer.accelerator.is_main_process:
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        Path(out_path).write_text(json.dumps({"processes": trainer.accelerator.num_processes, "backend": backend,
                                              **results}))


if __name__ == "__main__":
    main(sys.argv[1])
