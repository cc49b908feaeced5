"""Tests for sft.py and its data: the scripted policy reproduces its turns exactly inside a real
rollout, the lab's noisy searcher errs as its MIXTURE says, the loss is the cross-entropy on model
tokens only, and a warm-start writes a folder train.py loads (a tiny model, and SmolLM2)."""
import random

import pytest
import torch

import data
import retriever as retrieval
import rollout as ro
import sft
from conftest import tiny_policy
from plumbing.models import load_policy
from plumbing.scripted import ScriptedPolicy
from experiments.lab import lab
from tasks.toy_world import parse_question

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def toy_retriever():
    return retrieval.open_retriever("bm25", corpus=data.corpus_for(["toy_nq"], "bm25"))


def test_scripted_policy_writes_exactly_its_turns_with_the_loss_mask_on_them():
    _, tok = tiny_policy()
    turns = {}

    def act(context, rng):                   # search once, then answer with the passage's title
        if "Question:" not in context:
            return None
        if "<information>" not in context.split("Question:")[-1]:
            return "<search> Velboford </search>"
        return "<answer> " + context.split('(Title: "')[-1].split('"')[0] + " </answer>"

    records = [{"id": f"q{i}", "question": "In which country is Velboford?", "golds": ["Vepoaria"],
                "data_source": "toy_nq"} for i in range(3)]
    cfg = ro.RolloutConfig(max_turns=2, topk=1, greedy=True, bf16=False, template="search-r1")
    out = ro.rollout(ScriptedPolicy(act, tok), tok, records, toy_retriever(), cfg)
    for row, episode in enumerate(out.episodes):
        written = tok.decode(out.input_ids[row][out.loss_mask[row].bool()])
        assert written == '<search> Velboford </search><answer> Velboford </answer>'
        assert episode["queries"] == ["Velboford"] and episode["finished"] and episode["answer"] == "Velboford"
        assert "<information>Doc 1(Title: \"Velboford\")" in episode["text"]   # a real observation between


def test_noisy_searcher_errs_as_its_mixture_says():
    rng = random.Random(0)
    question = "Where was Lovrein Relloby born?"
    name = parse_question(question)[0]
    context = lab_prompt(question)
    firsts = [lab.noisy_searcher(context, rng) for _ in range(2000)]
    right = sum(f == f"<search> {name} </search>" for f in firsts) / len(firsts)
    assert right == pytest.approx(lab.MIXTURE["search_right"], abs=0.03)
    assert "<search> Relloby </search>" in firsts                   # the surname-only mistake
    assert "<search> Where was born </search>" in firsts            # the question's other words
    passages = ('Doc 1(Title: "Lovrein Relloby") Lovrein Relloby was born in Kelford in 1970.\n'
                'Doc 2(Title: "Lovren Relloby") Lovren Relloby was born in Orlan in 1981.')
    after = context + firsts[0] + f"\n\n<information>{passages}</information>\n\n"
    answers = [lab.noisy_searcher(after, rng) for _ in range(2000)]
    p_right = lab.MIXTURE["answer_right"]
    wrong = lab.MIXTURE["wrong_answer"]
    assert answers.count("<answer> Kelford </answer>") / 2000 == pytest.approx(p_right, abs=0.03)
    assert answers.count("<answer> Orlan </answer>") / 2000 == pytest.approx(
        (1 - p_right) * wrong["distractor_same_relation"], abs=0.03)
    assert answers.count("<answer> 1970 </answer>") / 2000 == pytest.approx(
        (1 - p_right) * wrong["right_doc_other_fact"], abs=0.03)
    assert lab.noisy_searcher(context[:30], rng) is None            # a prompt prefix: nothing to do


def lab_prompt(question):
    return ro.SEARCH_R1_TEMPLATE.format(question=question)


def test_sft_loss_is_the_cross_entropy_on_model_tokens_only():
    model, tok = tiny_policy()
    ids = torch.randint(0, len(tok), (2, 7))
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 0], [0, 1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    attention = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    loss = sft.sft_loss(model, ids, attention, mask)
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits.float(), -1)
    picked = [(b, t) for b in range(2) for t in range(1, 7) if mask[b, t]]
    reference = -sum(logp[b, t - 1, ids[b, t]] for b, t in picked) / len(picked)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)


def tiny_lab_model(folder):
    """A lab-shaped model at toy size: a BPE of 300 tokens trained on the toy world, 2 layers."""
    world = data.toy_world()
    tok = lab.train_tokenizer(lab.tokenizer_texts(world, [ro.SEARCH_R1_TEMPLATE])[:3000], vocab_size=300)
    model = lab.random_model(len(tok), tok.eos_token_id, shape=dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=1024))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def test_sft_warm_starts_a_lab_model_that_train_py_loads(tmp_path, capsys):
    tiny_lab_model(tmp_path / "init")
    summary = sft.main(["--model", str(tmp_path / "init"), "--out", str(tmp_path / "sft"), "--questions", "12",
                        "--episodes-per-question", "2", "--heldout-questions", "4", "--batch-size", "8",
                        "--epochs", "3", "--lr", "3e-3", "--warmup-steps", "1", "--eval-every", "1",
                        "--eval-size", "3", "--eval-samples", "2"])
    lines = [__import__("json").loads(l) for l in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [l["loss"] for l in lines if "loss" in l]
    assert len(losses) == 9 and losses[-1] < losses[0]
    assert 0 <= summary["eval/em_sampled"] <= 1 and summary["script_em"] > 0
    model, tok = load_policy(str(tmp_path / "sft" / "model"))        # what train.py --model does
    assert type(model).__name__ == "LlamaForCausalLM" and len(tok) == 300
    assert "train.py --model" in capsys.readouterr().out


def test_sft_warm_starts_smollm2(tmp_path):
    summary = sft.main(["--out", str(tmp_path), "--questions", "2", "--episodes-per-question", "1",
                        "--heldout-questions", "1", "--batch-size", "2", "--epochs", "3", "--lr", "1e-4",
                        "--warmup-steps", "1", "--eval-every", "1", "--eval-size", "0", "--template", "fewshot"])
    lines = [__import__("json").loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [l["loss"] for l in lines if "loss" in l]
    assert len(losses) == 3 and losses[2] < losses[0]                # it fits its two episodes
    assert summary["heldout_loss"] > 0
    assert (tmp_path / "model" / "config.json").exists()
