"""Tests for integrations/trl_llds.py: LLDS inside TRL's GRPOTrainer, on a tiny random model on CPU.

Every run is a real `trainer.train()`: 2 generation batches x 2 optimiser steps (the shapes and
builders are in tests/tiny_trl.py). The normaliser is checked against TRL's own code: fed
per-token advantages -hinge with the ratio at 1, GRPOTrainer._compute_loss returns exactly its
policy normaliser applied to the hinge. Also: the loss with LLDS minus TRL's loss against the term,
values and gradients; scripted tool calls (tool results never penalised, the answer after them
weighted, the adaptive weight); TRL's rule for old log-probs; dropout; integrations/trl_search_r1.py's
trainer on a tiny model.
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
from integrations import trl_search_r1
from integrations.trl_llds import LLDSGRPOTrainer, answer_mask, switch_off_dropout
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


class Measured(tiny_trl.Scripted):
    """In every training micro-batch: TRL's loss alone, the loss with LLDS, the LLDS term and the
    gradients of all three, and the term recomputed from the generation batch's counts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def llds_term(self, logp, inputs):
        self.term, stats = super().llds_term(logp, inputs)
        return self.term, stats

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        without = GRPOTrainer._compute_loss(self, model, inputs)     # the same pass, TRL's loss only
        params = [p for p in model.parameters() if p.requires_grad]
        grads = []
        for value in (loss, without, self.term):
            parts = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
            grads.append(torch.cat([torch.zeros_like(p).flatten() if g is None else g.flatten()
                                    for p, g in zip(params, parts)]))
        self.records.append({"loss": loss.item(), "without": without.item(), "term": self.term.item(),
                             "reference": self.reference_term(inputs), "grads": grads})
        return loss

    def reference_term(self, inputs):
        """LLDS on this micro-batch with the normaliser written out from the whole generation batch:
        its model tokens (token-mean) or preserving responses (seq-mean), per optimiser step."""
        masks = [b["completion_mask"] * b.get("tool_mask", 1) for b in self._buffered_inputs]
        per_step = self.args.gradient_accumulation_steps / self.args.steps_per_generation   # 1 / steps per batch
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        hinge = penalised_hinge(self._llds_reference_logp, inputs["old_per_token_logps"], inputs["advantages"], mask)
        if self.llds_reduction == "token-mean":
            return hinge.sum().item() / (sum(m.sum() for m in masks).item() * per_step)
        preserving = [((b["advantages"] >= 0) & (m.sum(1) > 0)).sum() for b, m in zip(self._buffered_inputs, masks)]
        per_response = hinge.sum(1) / mask.sum(1).clamp(min=1)
        return per_response.sum().item() / (sum(preserving).item() * per_step)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._llds_reference_logp = out[0].detach()
        return out


@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean"])
def test_llds_reaches_the_loss_and_its_gradient(tmp_path, reduction):
    """loss(lambda = 0.2) - TRL's loss = 0.2 x the LLDS term, in value and in gradient, and the term
    is llds.py's token-mean / seq-mean over the generation batch's average optimiser step."""
    tokenizer = tiny_trl.chat_tokenizer()
    trainer = Measured(model=tiny_trl.tiny_model(tokenizer), reward_funcs=tiny_trl.length_reward,
                       args=tiny_trl.config(tmp_path, loss_type="grpo"), train_dataset=tiny_trl.prompts(8),
                       processing_class=tokenizer, llds_lambda=0.2, llds_reduction=reduction)
    trainer.train()

    assert len(trainer.records) == 8                 # 4 optimiser steps x 2 micro-batches
    assert sum(r["term"] > 1e-3 for r in trainer.records) >= 3
    for r in trainer.records:
        with_llds, without, term = r["grads"]
        assert r["loss"] - r["without"] == pytest.approx(0.2 * r["term"], rel=1e-5, abs=1e-8)
        # float32 differences of two full gradients: exact up to rounding at the scale of the largest entry
        torch.testing.assert_close(with_llds - without, 0.2 * term, rtol=1e-4, atol=1e-5 * with_llds.abs().max().item())
        assert r["term"] == pytest.approx(r["reference"], rel=1e-5, abs=1e-8)
    assert any(r["grads"][2].abs().sum() > 0 for r in trainer.records)


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
    """A random model never calls a tool, so its turns are scripted: first a search for the question
    (every other completion calls a tool that does not exist: a failed call), then, after the tool
    result, an answer. Records what LLDS saw."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if num_generations == 1:                    # the tool loop: the turn after a tool result
            text = "So it says. <answer> Orvale </answer><|im_end|>"
            return [self._tokenizer(text, add_special_tokens=False)["input_ids"] for _ in prompt_ids], None
        calls = []
        for row, ids in enumerate(prompt_ids):
            question = re.findall(r"Question: (.*?)<\|im_end\|>", self._tokenizer.decode(ids))[-1]
            tool = "search" if row % 2 == 0 else "lookup"
            text = f'<tool_call>\n{{"name": "{tool}", "arguments": {{"query": "{question}"}}}}\n</tool_call><|im_end|>'
            calls.append(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        return calls, None

    def llds_term(self, logp, inputs):
        leaf = logp.detach().requires_grad_()
        (grad,) = torch.autograd.grad(super().llds_term(leaf, inputs)[0], leaf)
        # The same penalty with the tool results left in the mask: what a trainer that forgot tool_mask does.
        careless, _ = llds_loss(leaf, inputs["old_per_token_logps"], inputs["advantages"], inputs["completion_mask"])
        (careless_grad,) = torch.autograd.grad(careless, leaf)
        self.records.append({"tool_mask": inputs["tool_mask"], "completion_mask": inputs["completion_mask"],
                             "completion_ids": inputs["completion_ids"], "answer": inputs["llds_answer_mask"],
                             "grad": grad, "careless_grad": careless_grad})
        return super().llds_term(logp, inputs)


def search_reward(completions, **kwargs):
    """1 for the completions whose tool call was the search (the others called a missing tool)."""
    return [float(turns[0]["tool_calls"][0]["function"]["name"] == "search") for turns in completions]


def test_tool_results_never_get_the_penalty_and_the_answer_after_them_gets_its_weight(tmp_path):
    tokenizer = tiny_trl.chat_tokenizer()
    questions = [r["question"] for r in data.load_questions("toy_nq", split="train")[:4]]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Question: {q}"}] for q in questions]})
    trainer = SearchesFirst(model=tiny_trl.tiny_model(tokenizer), reward_funcs=search_reward,
                            args=tiny_trl.config(tmp_path, max_completion_length=400), train_dataset=dataset,
                            processing_class=tokenizer, tools=[search_tool()], llds_answer_coef=0.1,
                            llds_answer_adaptive=True)
    trainer.train()

    assert len(trainer.records) == 8
    searched = 0
    for r in trainer.records:
        tool = (r["tool_mask"] == 0) & (r["completion_mask"] == 1)           # (B, C) tool-result tokens
        assert tool.any(dim=1).all()                                          # every completion called a tool
        for ids, in_tool, in_answer in zip(r["completion_ids"], tool, r["answer"].bool()):
            searched += "Doc 1(Title:" in tokenizer.decode(ids[in_tool])      # a retrieved passage
            # The final answer comes after the tool result, and is found whole.
            assert tokenizer.decode(ids[in_answer]) == "<answer> Orvale </answer>"
            assert in_answer.nonzero().min() > in_tool.nonzero().max()
        assert not r["grad"][tool].any()                                      # never penalised
    assert searched == 16                                                     # half of 32 completions
    assert any(r["grad"].any() for r in trainer.records)                      # LLDS did act (on model tokens)
    assert any(r["careless_grad"][(r["tool_mask"] == 0) & (r["completion_mask"] == 1)].any()
               for r in trainer.records)                                      # ...and tool tokens had lost likelihood
    # LLDS-MA's adaptive weight: one call per completion, half of them failed -> V = 0.5, and the
    # authors' min(0.1 x max(V - 1, 0), lambda) is 0 (the paper's min(V / 2, 1) would give 0.25).
    logs = [l for l in trainer.state.log_history if "llds/answer_weight" in l]
    assert [l["llds/answer_weight"] for l in logs] == [0.0] * 4
    assert [l["tools/call_frequency"] for l in logs if "tools/call_frequency" in l] == [1.0, 1.0]


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

    def build(**overrides):
        return LLDSGRPOTrainer(model=tiny_trl.tiny_model(tokenizer), reward_funcs=tiny_trl.length_reward,
                               args=tiny_trl.config(tmp_path, **overrides), train_dataset=tiny_trl.prompts(8),
                               processing_class=tokenizer)

    # TRL's rule: old log-probs only when gradient_accumulation_steps % (steps_per_generation x
    # num_iterations) != 0; num_iterations > 1 alone does not make one.
    for accumulation, per_generation, iterations in [(2, 2, 1), (4, 1, 2), (4, 2, 2)]:
        message = (rf"gradient_accumulation_steps \({accumulation}\) is a multiple of steps_per_generation "
                   rf"x num_iterations \({per_generation} x {iterations}\)")
        with pytest.raises(ValueError, match=message):
            build(gradient_accumulation_steps=accumulation, steps_per_generation=per_generation,
                  num_iterations=iterations)
    build(gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2)   # 2 updates per batch
    with pytest.raises(ValueError, match="llds_gate"):
        LLDSGRPOTrainer(model=None, llds_gate="turn")
    with pytest.raises(ValueError, match="llds_answer_adaptive counts tool calls"):
        LLDSGRPOTrainer(model=tiny_trl.tiny_model(tokenizer), reward_funcs=tiny_trl.length_reward,
                        args=tiny_trl.config(tmp_path), train_dataset=tiny_trl.prompts(8),
                        processing_class=tokenizer, llds_answer_adaptive=True)


def test_dropout_is_switched_off_so_llds_compares_like_with_like(tmp_path):
    tokenizer = tiny_trl.chat_tokenizer()
    model = tiny_trl.tiny_model(tokenizer, attention_dropout=0.5).train()
    ids = torch.tensor([tokenizer("where was Talia Wrenn born?")["input_ids"]])
    assert not torch.equal(model(ids).logits, model(ids).logits)     # two passes differ: LLDS would be noise
    with pytest.warns(UserWarning, match="switched off dropout in 2 places"):
        trainer = LLDSGRPOTrainer(model=model, reward_funcs=tiny_trl.length_reward, args=tiny_trl.config(tmp_path),
                                  train_dataset=tiny_trl.prompts(8), processing_class=tokenizer)
    trainer.model.train()
    assert torch.equal(trainer.model(ids).logits, trainer.model(ids).logits)
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1), torch.nn.Dropout(0.0))
    assert switch_off_dropout(net) == ["1"] and net[1].p == 0.0


def test_answer_mask_covers_the_last_answer_span_with_its_tags():
    tokenizer = tiny_trl.chat_tokenizer()
    text = "<answer> no </answer> so <answer> Orvale </answer><|im_end|>"
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"] + [0, 0]])
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0                                  # padding
    picked = answer_mask(tokenizer, ids, mask)[0].bool()
    assert tokenizer.decode(ids[0][picked]) == "<answer> Orvale </answer>"


def brute_force_answer_mask(tokenizer, ids):
    """One decode per token: token i is in the span when [len(decode(ids[:i])), len(decode(ids[:i+1])))
    overlaps the last <answer>...</answer>."""
    text = tokenizer.decode(ids)
    spans = list(re.finditer(r"<answer>.*?</answer>", text, re.DOTALL))
    if not spans:
        return [0.0] * len(ids)
    begin, end = spans[-1].span()
    bounds = [len(tokenizer.decode(ids[:i])) for i in range(len(ids) + 1)]
    return [float(bounds[i + 1] > begin and bounds[i] < end) for i in range(len(ids))]


def test_answer_mask_reads_through_holes_and_matches_one_decode_per_token():
    tokenizer = tiny_trl.chat_tokenizer()
    texts = ["<tool_call>x</tool_call><tool_response>Doc 1 Orvale</tool_response> <answer> Orvale </answer><|im_end|>",
             "<answer> Zoë Åberg </answer> then <answer>Café 東京</answer>!",      # multi-byte characters
             "no answer here", "<answer> cut off"]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    holes = mask.clone()
    holes[0, 24:67] = 0                               # the tool result, as completion_mask * tool_mask has it
    for m in (mask, holes):
        got = answer_mask(tokenizer, ids, m)
        for row, r in enumerate(rows):
            assert got[row, :len(r)].tolist() == brute_force_answer_mask(tokenizer, r), texts[row]
            assert not got[row, len(r):].any()
    assert tokenizer.decode(ids[0][answer_mask(tokenizer, ids, holes)[0].bool()]) == "<answer> Orvale </answer>"


def test_search_r1_example_trains_with_llds_and_a_tool(tmp_path):
    """integrations/trl_search_r1.py's setup on a tiny random model (the script's own run takes minutes)."""
    tokenizer = tiny_trl.chat_tokenizer()
    cfg = trl_search_r1.Config(steps=2, questions=2, group_size=4, micro_batch_size=2, max_completion_tokens=24)
    trainer = trl_search_r1.build_trainer(cfg, tiny_trl.tiny_model(tokenizer), tokenizer, tmp_path)
    assert trainer.args.gradient_accumulation_steps == 2 and trainer.args.steps_per_generation == 4
    trainer.train()
    logs = [l for l in trainer.state.log_history if "llds/loss" in l]
    assert len(logs) == 2 and logs[0]["llds/loss"] == 0 and "tools/call_frequency" in logs[0]

    # The pieces a random model cannot show: the prompt teaches TRL's tool calls, the tool finds the
    # passage, the reward reads the final answer.
    prompt = tokenizer.apply_chat_template(trainer.train_dataset[0]["prompt"], tools=trainer.tools, tokenize=False)
    assert prompt.count('<tool_call>\n{"name": "search", "arguments"') == 4     # the worked examples' calls
    record = data.load_questions("toy_nq", split="train")[0]
    passages = trainer.tools[0](record["question"])
    assert passages.startswith("Doc 1(Title:") and record["golds"][0] in passages
    turns = [[{"role": "assistant", "content": ""}, {"role": "assistant", "content": f"<answer> {gold} </answer>"}]
             for gold in ("Orvale", "Kessan")]
    turns.append([{"role": "assistant", "content": "Orvale"}])
    assert trl_search_r1.em_reward(0.1)(turns, [["orvale"], ["Orvale"], ["Orvale"]]) == [1.0, 0.1, 0.0]


@pytest.mark.parametrize("adapter", ["fresh", "lively"])
def test_a_peft_model_keeps_the_old_log_probs_and_the_reference_right(tmp_path, adapter):
    """TRL's own peft_config: the policy trains LoRA adapters and TRL's KL reference is the same
    model with them off. At lr 0 the old log-probs are the current ones (LLDS exactly 0 on every
    update); the reference is the base: KL 0 while the adapter is fresh (B = 0), above 0 once it
    changes every product (a frozen copy of the policy would give 0 there too)."""
    from peft import LoraConfig

    tokenizer = tiny_trl.chat_tokenizer()
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    trainer = tiny_trl.Scripted(model=tiny_trl.tiny_model(tokenizer), reward_funcs=tiny_trl.length_reward,
                                args=tiny_trl.config(tmp_path, learning_rate=0.0, beta=0.1),
                                train_dataset=tiny_trl.prompts(8), processing_class=tokenizer, peft_config=lora)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    if adapter == "lively":
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    trainer.train()
    logs = [l for l in trainer.state.log_history if "llds/loss" in l]
    assert len(logs) == 4 and all(l["llds/loss"] == 0 for l in logs)
    kls = [l["kl"] for l in logs]
    assert all(k > 1e-4 for k in kls) if adapter == "lively" else all(k == 0 for k in kls)
