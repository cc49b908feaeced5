"""Tests for the LLD lab's setting (experiments/lab/lab.py) at toy size: deterministic tokenizer and model,
disjoint SFT and RL questions, and the lab preset running train.py end to end with the sampled
held-out evaluation and the metrics the lab's analysis reads."""
import json

import pytest
import torch

import data
import rollout as ro
import train
from experiments.lab import lab
from tasks.toy_world import parse_question
from test_sft import tiny_lab_model

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def test_tokenizer_and_model_are_built_the_same_every_time():
    texts = lab.tokenizer_texts(data.toy_world(), [ro.SEARCH_R1_TEMPLATE])[:2000]
    first, second = (lab.train_tokenizer(texts, vocab_size=400) for _ in range(2))
    assert first.get_vocab() == second.get_vocab() and len(first) == 400
    text = 'Doc 1(Title: "Velboford") Velboford is a city in Vepoaria.'
    assert first.decode(first(text)["input_ids"]) == text          # byte-level: every text round-trips
    a, b = (lab.random_model(400, first.eos_token_id) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    # per layer: q, o 128x128, k, v 128x64, MLP 3 x 128x384, 2 norms; 4 layers, a final norm; tied embedding
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128
    assert sum(p.numel() for p in a.parameters()) == 400 * 128 + 4 * per_layer + 128 == 51_200 + 787_584


def test_sft_and_rl_questions_ask_about_different_entities(tmp_path):
    lab.write_question_sets(data.toy_world(), tmp_path)
    rows = {h: [json.loads(l) for l in (tmp_path / h / "train.jsonl").read_text().splitlines()] for h in ("sft", "rl")}
    names = {h: {parse_question(r["question"])[0] for r in rs} for h, rs in rows.items()}
    assert not names["sft"] & names["rl"]
    every = [r for r in data.load_questions("toy_nq", split="train")]
    assert len(rows["sft"]) + len(rows["rl"]) == len(every) and min(map(len, rows.values())) > 0.4 * len(every)
    assert (tmp_path / "rl" / "test.jsonl").read_text() == (tmp_path / "sft" / "test.jsonl").read_text()


def test_other_worlds_widen_the_sft_set_and_its_corpus_only(tmp_path):
    world, other = data.toy_world(), data.toy_world(1)
    lab.write_question_sets(world, tmp_path)
    before = {h: (tmp_path / h / "train.jsonl").read_text() for h in ("sft", "rl")}
    lab.add_other_worlds(tmp_path / "sft", world, [other])
    sft = (tmp_path / "sft" / "train.jsonl").read_text()
    assert sft.startswith(before["sft"]) and (tmp_path / "rl" / "train.jsonl").read_text() == before["rl"]
    extra = [json.loads(l) for l in sft[len(before["sft"]):].splitlines()]
    other_nq = [r for r in map(json.loads, (other / "train.jsonl").read_text().splitlines()) if r["data_source"] == "toy_nq"]
    assert extra and all(r in other_nq for r in extra)
    corpus = [json.loads(l) for l in (tmp_path / "sft" / "corpus.jsonl").read_text().splitlines()]
    passages = [json.loads(l)["contents"] for w in (world, other) for l in (w / "corpus.jsonl").read_text().splitlines()]
    assert [r["contents"] for r in corpus] == passages and [r["id"] for r in corpus] == [str(i) for i in range(len(passages))]


def test_the_lab_preset_trains_and_logs_what_the_analysis_reads(tmp_path):
    tiny_lab_model(tmp_path / "model")
    world = data.toy_world()
    lab.write_question_sets(world, tmp_path / "q")
    preset = {**train.PRESETS["lab"], "data": str(tmp_path / "q" / "rl"), "corpus": str(world / "corpus.jsonl")}
    cfg = train.Config(**{**preset, "out_dir": str(tmp_path), "name": "run", "steps": 2, "prompts_per_step": 2,
                          "group_size": 2, "mini_batch_size": 2, "eval_size": 2, "eval_samples": 3,
                          "eval_every": 1, "max_turn_tokens": 8, "index": str(tmp_path / "index")})
    from plumbing.models import load_policy
    train.train(cfg, *load_policy(str(tmp_path / "model")))
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1, 2]
    assert all(0 <= l["eval/em_sampled"] <= 1 for l in lines)
    for key in ("frac_reward_zero_std", "grad_zero", "lld/correct_displacement_search",
                "lld/correct_displacement_answer", "grad_norm_max", "entropy"):
        assert key in lines[1] and key in lines[2]
