"""Tests for integrations/trl_llds.py: LLDS inside TRL's GRPOTrainer, on a tiny random model on CPU.

Every run is a real `trainer.train()`: 2 generation batches x 2 optimiser steps (the shapes and
builders are in tests/tiny_trl.py). The normaliser is checked against TRL's own code: fed
per-token advantages -hinge with the ratio at 1, GRPOTrainer._compute_loss returns exactly its
policy normaliser applied to the hinge.
"""
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer

import data
import retriever as retrieval
import rollout as ro
from integrations.trl_llds import LLDSGRPOTrainer, answer_mask
from llds import llds_loss
import tiny_trl  # tests/tiny_trl.py (pytest puts tests/ on the path; verl ships a top-level `tests` package)

# cispo and vespo share dapo's normaliser code in TRL, sapo shares grpo's (with another per-token loss).
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def penalised_hinge(logp, old_logp, advantages, mask):
    """(B, C): max(0, old - logp) on exactly the tokens llds_loss penalises (read off its gradient)."""
    leaf = logp.detach().clone().requires_grad_()
    reg, _ = llds_loss(leaf, old_logp, advantages, mask)
    (grad,) = torch.autograd.grad(reg, leaf)
    hinge = torch.where(grad != 0, old_logp - leaf.detach(), 0.0)
    torch.testing.assert_close(hinge.sum(), reg.detach() * mask.sum().clamp(min=1))
    return hinge


class Checked(LLDSGRPOTrainer):
    """Records each micro-batch's LLDS term and, for every loss type, the term next to TRL's own
    normalisation of the same hinge."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def llds_term(self, logp, inputs):
        term, stats = super().llds_term(logp, inputs)
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        hinge = penalised_hinge(logp, inputs["old_per_token_logps"], inputs["advantages"], mask)
        pairs, configured = {}, self.loss_type
        for loss_type in LOSS_TYPES:
            self.loss_type = loss_type
            ours = super().llds_term(logp, inputs)[0].item()
            with torch.no_grad():   # ratio exactly 1 (no old log-probs), advantages -hinge per token
                trl = GRPOTrainer._compute_loss(self, self.model, {**inputs, "advantages": -hinge,
                                                                   "old_per_token_logps": None}).item()
            pairs[loss_type] = (ours, trl)
        self.loss_type = configured
        generate_every = self.args.steps_per_generation * self.num_iterations
        first = self._step % generate_every < self.args.gradient_accumulation_steps   # first optimiser step
        self.records.append({"first_update": first, "term": term.item(), "pairs": pairs})
        return term, stats


def test_llds_is_zero_on_the_first_update_then_normalised_like_trl(tmp_path):
    tokenizer = tiny_trl.chat_tokenizer()
    trainer = Checked(model=tiny_trl.tiny_model(tokenizer), reward_funcs=tiny_trl.length_reward,
                      args=tiny_trl.config(tmp_path), train_dataset=tiny_trl.prompts(8), processing_class=tokenizer)
    trainer.train()

    records = trainer.records
    assert len(records) == 8                        # 4 optimiser steps x 2 micro-batches
    first = [r["term"] for r in records if r["first_update"]]
    later = [r["term"] for r in records if not r["first_update"]]
    assert len(first) == 4 and all(abs(t) < 1e-7 for t in first)   # pi_theta == pi_old: LLDS is 0
    assert max(later) > 1e-3
    for r in records:
        for loss_type, (ours, trl) in r["pairs"].items():
            assert ours == pytest.approx(trl, rel=1e-5, abs=1e-8), (loss_type, r)
    logs = [l for l in trainer.state.log_history if "llds/loss" in l]
    assert [l["step"] for l in logs] == [1, 2, 3, 4]
    assert logs[0]["llds/loss"] == 0 and logs[1]["llds/loss"] > 0
    assert {"llds/active_token_frac", "llds/active_action_frac", "llds/displacement",
            "llds/n_preserving"} <= set(logs[1])


def search_tool():
    """Our BM25 over the toy world's corpus as a TRL tool (a typed function with a docstring)."""
    index = retrieval.open_retriever("bm25", corpus=str(data.toy_world() / "corpus.jsonl"))

    def search(query: str) -> str:
        """Search the encyclopedia.

        Args:
            query: the words to look up
        """
        return ro.format_passages(index.search([query], 1)[0])[:120]

    return search


class SearchesFirst(LLDSGRPOTrainer):
    """A random model never calls a tool, so its first turn is a scripted search for the question;
    what follows the tool result is sampled from the model. Records what LLDS saw."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if num_generations == 1:                    # the tool loop: after a tool result
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, 1, has_tool_images)
        calls = []
        for ids in prompt_ids:
            question = re.findall(r"Question: (.*?)<\|im_end\|>", self._tokenizer.decode(ids))[-1]
            text = f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{question}"}}}}\n</tool_call><|im_end|>'
            calls.append(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        return calls, None

    def llds_term(self, logp, inputs):
        leaf = logp.detach().requires_grad_()
        (grad,) = torch.autograd.grad(super().llds_term(leaf, inputs)[0], leaf)
        # The same penalty with the tool results left in the mask: what a trainer that forgot tool_mask does.
        careless, _ = llds_loss(leaf, inputs["old_per_token_logps"], inputs["advantages"], inputs["completion_mask"])
        (careless_grad,) = torch.autograd.grad(careless, leaf)
        self.records.append({"tool_mask": inputs["tool_mask"], "completion_mask": inputs["completion_mask"],
                             "completion_ids": inputs["completion_ids"], "grad": grad, "careless_grad": careless_grad})
        return super().llds_term(logp, inputs)


def test_tool_result_tokens_never_get_the_penalty(tmp_path):
    tokenizer = tiny_trl.chat_tokenizer()
    questions = [r["question"] for r in data.load_questions("toy_nq", split="train")[:4]]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Question: {q}"}] for q in questions]})
    trainer = SearchesFirst(model=tiny_trl.tiny_model(tokenizer), reward_funcs=tiny_trl.length_reward,
                            args=tiny_trl.config(tmp_path, max_completion_length=320), train_dataset=dataset,
                            processing_class=tokenizer, tools=[search_tool()])
    trainer.train()

    assert len(trainer.records) == 8
    for r in trainer.records:
        tool = (r["tool_mask"] == 0) & (r["completion_mask"] == 1)           # (B, C) tool-result tokens
        assert tool.any(dim=1).all()                                          # every completion searched
        result = tokenizer.decode(r["completion_ids"][0][tool[0]])
        assert "<tool_response>" in result and "Doc 1(Title:" in result      # a retrieved passage
        assert not r["grad"][tool].any()                                      # never penalised
    assert any(r["grad"].any() for r in trainer.records)                      # LLDS did act (on model tokens)
    assert any(r["careless_grad"][(r["tool_mask"] == 0) & (r["completion_mask"] == 1)].any()
               for r in trainer.records)                                      # ...and tool tokens had lost likelihood


def test_two_processes_give_the_loss_of_one(tmp_path):
    tiny_trl.main(tmp_path / "one" / "out.json")
    # `accelerate launch --cpu --num_processes 2` starts ONE process (accelerate runs several CPU
    # processes only under mpirun); its torchrun path (--multi_gpu) starts two, and with no GPU
    # (and use_cpu) they train on CPU over gloo.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:                        # a free port: other jobs may hold torchrun's 29500
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(port), tiny_trl.__file__, str(tmp_path / "two" / "out.json")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    one = json.loads((tmp_path / "one" / "out.json").read_text())
    two = json.loads((tmp_path / "two" / "out.json").read_text())
    assert (one["processes"], two["processes"], two["backend"]) == (1, 2, "gloo")
    for name in ("dapo", "grpo", "dapo-seq-mean"):
        assert [l["step"] for l in one[name]] == [l["step"] for l in two[name]] == [1, 2, 3, 4]
        assert one[name][1]["llds/loss"] > 0
        for a, b in zip(one[name], two[name]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6), name
            assert b["llds/loss"] == pytest.approx(a["llds/loss"], rel=1e-4, abs=1e-7), name


def test_one_update_per_generation_batch_is_an_error(tmp_path):
    tokenizer = tiny_trl.chat_tokenizer()
    with pytest.raises(ValueError, match="LLDS is exactly 0.*steps_per_generation"):
        LLDSGRPOTrainer(model=tiny_trl.tiny_model(tokenizer), reward_funcs=tiny_trl.length_reward,
                        args=tiny_trl.config(tmp_path, steps_per_generation=2), train_dataset=tiny_trl.prompts(8),
                        processing_class=tokenizer)
    with pytest.raises(ValueError, match="llds_gate"):
        LLDSGRPOTrainer(model=None, llds_gate="turn")


def test_answer_mask_covers_the_last_answer_span_with_its_tags():
    tokenizer = tiny_trl.chat_tokenizer()
    text = "<answer> no </answer> so <answer> Orvale </answer><|im_end|>"
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"] + [0, 0]])
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0                                  # padding
    picked = answer_mask(tokenizer, ids, mask)[0].bool()
    assert tokenizer.decode(ids[0][picked]) == "<answer> Orvale </answer>"
