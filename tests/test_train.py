"""Tests for the training loop in train.py: a tiny random Qwen2 model with a byte-level tokenizer
on the toy world (in-process BM25). Every run here is a real train() call, a few seconds each."""
import collections
import dataclasses
import functools
import json
import math
import re

import pytest
import torch

import data
import monitor
import rollout as ro
import train
from plumbing import checkpoints, cli, fast_hf, memory_plan, models, plots, runs, summary
from plumbing.sampler import PromptSampler
from conftest import tiny_policy

TIMING = ("timing/", "rollout_tokens_per_s", "memory/", "rollout/occupancy")

# Every key the LLD monitor promises in metrics.jsonl (issue 5).
KEYS = ["reward", "em", "response_length", "searches", "valid_action_ratio", "entropy", "kl",
        "clip_ratio", "grad_norm", "skipped_steps", "llds/loss", "llds/active_token_frac",
        "llds/active_action_frac", "lld/logp_correct", "lld/logp_incorrect",
        "lld/correct_displacement", "lld/correct_frac_lost", "timing/rollout", "timing/retrieval",
        "timing/logprob", "timing/update", "timing/step", "memory/peak_gb"]


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def tiny_config(tmp_path, **overrides):
    # 2 prompts x 2 rollouts, 2 mini-batches of 2 (LLDS active), micro-batches of 1.
    base = dict(out_dir=str(tmp_path), name="run", steps=2, prompts_per_step=2, group_size=2,
                mini_batch_size=2, micro_batch_size=1, max_turns=1, max_turn_tokens=6,
                max_obs_tokens=40, max_prompt_tokens=1500, max_context=2048, lr=1e-2, warmup_ratio=0.0, entropy_coef=0.01,
                eval_size=2, eval_max_turns=1, ckpt_every=1, samples_per_step=2, bf16=False,
                device="cpu", rollout_batch_size=8)
    return train.Config(**{**base, **overrides})


def step_lines(run_dir):
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [l for l in lines if "reward" in l]


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_steps_end_to_end(tmp_path, alternating_rewards):
    model, tokenizer = tiny_policy()
    summary = train.train(tiny_config(tmp_path), model, tokenizer)
    run = tmp_path / "run"
    lines = step_lines(run)
    assert [l["step"] for l in lines] == [1, 2]
    for line in lines:
        missing = [k for k in KEYS if k not in line]
        assert not missing, f"metrics.jsonl lacks {missing}"
        assert line["reward"] == 0.5 and line["lld/logp_correct"] < 0 and line["lld/logp_incorrect"] < 0
        assert 0 <= line["lld/correct_frac_lost"] <= 1 and line["skipped_steps"] == 0
    assert summary["before"]["eval/em"] == 0.0 and "eval/em" in summary["after"]
    assert (run / "samples" / "step_0002.txt").read_text().count("=== episode") == 2
    assert (run / "curves.png").stat().st_size > 0 and (run / "latest").read_text() == "ckpt-2"
    # keep_ckpts=2 keeps ckpt-1 and ckpt-2; the final one is a loadable HF folder.
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-1", "ckpt-2"]
    reloaded = type(model).from_pretrained(run / "ckpt-2")
    assert torch.equal(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_the_bars_show_each_phase_of_a_step_while_it_runs(tmp_path, alternating_rewards, capsys):
    model, tokenizer = tiny_policy()
    train.train(tiny_config(tmp_path, steps=1), model, tokenizer)
    err = capsys.readouterr().err                     # tqdm writes to stderr, terminal or not
    shown = ["eval search", "turn 1/2, 2 episodes going",          # the held-out evaluation before
             "run rollout turn 1/2, 4 episodes going", "run rollout turn 2/2", "run logprob",
             "run update mini-batch 1/2", "run update mini-batch 2/2",
             "reward=0.5", "disp_c=", "step_s="]     # then what the step measured
    at = [err.find(text) for text in shown]
    assert -1 not in at and at == sorted(at), dict(zip(shown, at))


def test_llds_changes_the_update_only_with_several_mini_batches(tmp_path, alternating_rewards):
    def run(name, **kw):
        model, tokenizer = tiny_policy()
        train.train(tiny_config(tmp_path, name=name, steps=1, ckpt_every=0, eval_size=0, **kw), model, tokenizer)
        return params(model), step_lines(tmp_path / name)[0]

    # Two optimizer steps per rollout batch: the second mini-batch sees a moved policy.
    on, m_on = run("on2")
    off, m_off = run("off2", llds=False)
    assert m_on["llds/loss"] > 0 and m_off["llds/loss"] > 0  # logged even when off
    assert any(not torch.equal(on[k], off[k]) for k in on)
    # One optimizer step: the policy is still the rollout policy, so LLDS is exactly 0 (same
    # micro-batches as the old log-prob pass, so not even rounding noise) and changes nothing.
    on, m_on = run("on1", mini_batch_size=4)
    off, _ = run("off1", mini_batch_size=4, llds=False)
    assert m_on["llds/loss"] == 0.0 and m_on["clip_ratio"] == 0.0 and m_on["ppo_kl"] == 0.0
    assert all(torch.equal(on[k], off[k]) for k in on)


class GradRecorder(torch.optim.SGD):
    """An optimizer that only records the (clipped) gradient it is asked to apply."""
    seen = None

    def __init__(self, params):
        super().__init__(params, lr=0.0)

    def step(self, closure=None):
        GradRecorder.seen = torch.cat([p.grad.flatten() for g in self.param_groups for p in g["params"]
                                       if p.grad is not None])


def test_micro_batches_accumulate_to_the_mini_batch_token_mean(tmp_path, alternating_rewards, monkeypatch):
    # One mini-batch of 4 episodes with different numbers of model tokens: the gradient with
    # micro-batches of 1 must equal the gradient of one micro-batch of 4 (token-mean over all),
    # entropy bonus and KL included.
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **kwargs: GradRecorder(params))
    grads = []
    for micro in (4, 1):
        model, tokenizer = tiny_policy()
        train.train(tiny_config(tmp_path, name=f"micro{micro}", steps=1, eval_size=0, mini_batch_size=4,
                                micro_batch_size=micro, entropy_coef=0.01, kl_coef=0.1), model, tokenizer)
        grads.append(GradRecorder.seen)
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_token_logprobs_match_a_full_forward():
    model, _ = tiny_policy()
    ids = torch.randint(0, 250, (2, 10))
    attention = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 0, 1], [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]],
                        dtype=torch.float32)
    with torch.no_grad():
        logp, ent = train.token_logprobs(model, ids, attention, mask, 0.5)
        logits = model(input_ids=ids, attention_mask=attention).logits.float() / 0.5
    # Position t scores token t from the logits at t - 1.
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    full = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    full_ent = -(logp_all.exp() * logp_all).sum(-1)
    on = mask[:, 1:].bool()
    assert torch.allclose(logp[:, 1:][on], full[on], atol=1e-5)
    assert torch.allclose(ent[:, 1:][on], full_ent[on], atol=1e-5)
    assert torch.all(logp[mask == 0] == 0) and torch.all(ent[mask == 0] == 0)


def test_the_lm_head_in_checkpointed_chunks_gives_the_numbers_and_gradients_of_one_piece():
    model, _ = tiny_policy()
    plain = train.head_logprobs.__wrapped__                       # without the decorator
    in_threes = fast_hf.in_checkpointed_chunks(rows=3)(plain)
    h, targets = torch.randn(7, model.config.hidden_size), torch.randint(0, 250, (7,))
    results = []
    for f in (plain, in_threes):
        x = h.clone().requires_grad_()
        logp, ent = f(model.lm_head, x, targets, 0.7)
        (logp.sum() + ent.sum()).backward()
        results.append((logp.detach(), ent.detach(), x.grad))
    for whole, chunked in zip(*results):
        assert torch.allclose(chunked, whole, atol=1e-6)
    empty = in_threes(model.lm_head, h[:0], targets[:0], 0.7)
    assert [t.shape for t in empty] == [(0,), (0,)]


def test_shared_prompt_prefix_gives_the_plain_forward_and_its_gradients():
    model, _ = tiny_policy()
    prefix = torch.randint(0, 250, (20,))
    ids = torch.cat([prefix.expand(3, -1), torch.randint(0, 250, (3, 9))], 1)         # (3, 29)
    ids[2, 20] = ids[0, 20]                     # rows 0 and 2 share one token more: still p = 20
    attention = torch.ones_like(ids)
    attention[1, -4:] = 0                       # right padding
    assert fast_hf.shared_prefix_len(ids, attention) == 20

    def run(shared):
        model.zero_grad()
        with fast_hf.prefix_once(model, ids, attention, enabled=shared) as policy:
            hidden = policy.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
            (hidden[attention.bool()] ** 2).mean().backward()
            inside = [p.grad.clone() for p in model.base_model.parameters()]
        return hidden.detach(), [p.grad.clone() for p in model.base_model.parameters()], inside

    plain, plain_grads, _ = run(False)
    shared, shared_grads, inside = run(True)
    on = attention.bool()
    assert torch.allclose(shared[on], plain[on], atol=1e-5)
    for g, h in zip(shared_grads, plain_grads):
        assert torch.allclose(g, h, atol=1e-6, rtol=1e-4)
    # the prefix's own gradient arrives when the context closes, not before
    assert any(not torch.equal(g, h) for g, h in zip(inside, shared_grads))
    # and a forward outside the context, whose prefix gradient nobody would run, is refused
    with fast_hf.prefix_once(model, ids, attention) as policy:
        pass
    with pytest.raises(RuntimeError, match="after its context closed"):
        policy.get_decoder()(input_ids=ids, attention_mask=attention)


def test_the_prefix_runs_once_per_context_and_changes_no_number():
    model, _ = tiny_policy()
    prefix = torch.randint(0, 250, (20,))
    batches = [torch.cat([prefix.expand(3, -1), torch.randint(0, 250, (3, 9))], 1)
               for _ in range(3)]
    calls = []
    hook = model.base_model.register_forward_hook(
        lambda m, args, kw, out: calls.append(kw["input_ids"].shape), with_kwargs=True)

    def hidden(policy, ids):
        return policy.get_decoder()(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state

    with torch.no_grad():
        alone = []
        for ids in batches:                    # a context per batch: its prefix, then its rest
            with fast_hf.prefix_once(model, ids, torch.ones_like(ids)) as policy:
                alone.append(hidden(policy, ids))
        n_alone, calls[:] = len(calls), []
        rows = torch.cat(batches)
        with fast_hf.prefix_once(model, rows, torch.ones_like(rows)) as policy:
            together = [hidden(policy, ids) for ids in batches]
    hook.remove()
    assert n_alone == 6 and len(calls) == 4     # the prefix once, then each batch's rest
    for a, b in zip(alone, together):
        assert torch.equal(a, b)                # bit for bit


def test_an_exception_inside_prefix_once_drops_the_prefix_gradient_and_the_step_starts_clean(
        tmp_path, alternating_rewards):
    """An exception in the second of three micro-batches: the store closes without the prefix's
    backward (its graph dropped), and train_step zeroes gradients before its first mini-batch, so
    the half gradient left in .grad never reaches an update."""
    model, tokenizer = tiny_policy()
    prefix = torch.randint(0, 100, (20,))              # token ids the rows' own parts never use
    batches = [torch.cat([prefix.expand(2, -1), torch.randint(100, 250, (2, 9))], 1)
               for _ in range(3)]
    rows = torch.cat(batches)
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with fast_hf.prefix_once(model, rows, torch.ones_like(rows)) as policy:
            for i, ids in enumerate(batches):
                if i == 1:
                    raise KeyboardInterrupt
                hidden = policy.get_decoder()(input_ids=ids, attention_mask=torch.ones_like(ids))
                hidden.last_hidden_state[:, 20:].pow(2).mean().backward()
                ran.append(i)
    assert ran == [0] and policy.store.closed and policy.store.graphs == []
    embed = model.base_model.embed_tokens.weight.grad
    assert not embed[prefix].any()       # the prefix's share never arrived: a partial gradient
    for p in model.parameters():         # what a stopped step would leave behind, at its worst
        p.grad = torch.full_like(p, math.nan)
    train.train(tiny_config(tmp_path, steps=1, eval_size=0), model, tokenizer)
    line = step_lines(tmp_path / "run")[0]
    assert line["grad_norm_nonfinite"] == 0 and math.isfinite(line["grad_norm_max"])


def test_the_prefix_with_grad_runs_once_and_gives_the_same_gradients():
    """One mini-batch of three micro-batches, each one question's rows (their common prefix runs
    6 tokens past the few-shot prompt): prefix_once over the step's rows runs the prompt all rows
    share forward once and backward once (with the summed gradient); the forward values are bit
    for bit those of a no-grad pass over the same rows, and the gradients those of the plain
    forward."""
    model, _ = tiny_policy()
    prefix = torch.randint(0, 250, (20,))
    batches = [torch.cat([prefix.expand(3, -1), torch.randint(0, 250, (1, 6)).expand(3, -1),
                          torch.randint(0, 250, (3, 9))], 1) for _ in range(3)]
    rows = torch.cat(batches)

    def mini_batch(shared):
        model.zero_grad()
        hiddens = []
        with fast_hf.prefix_once(model, rows, torch.ones_like(rows), enabled=shared) as policy:
            for ids in batches:
                hidden = policy.get_decoder()(input_ids=ids, attention_mask=torch.ones_like(ids))
                (hidden.last_hidden_state[:, 15:] ** 2).mean().backward()
                hiddens.append(hidden.last_hidden_state.detach())
            if shared:
                assert len(policy.store.graphs) == 1               # one prefix forward
                assert policy.store.graphs[0][0][0].shape[1] == 20  # the prompt all rows share
        return hiddens, [p.grad.clone() for p in model.base_model.parameters()]

    plain, plain_grads = mini_batch(False)
    stored, stored_grads = mini_batch(True)
    with torch.no_grad():                       # the old-log-prob pass of the same step's rows
        with fast_hf.prefix_once(model, rows, torch.ones_like(rows)) as policy:
            old = [policy.get_decoder()(input_ids=ids, attention_mask=torch.ones_like(ids))
                   .last_hidden_state for ids in batches]
    for a, b, c in zip(plain, stored, old):
        assert torch.equal(b, c)                # bit for bit: both split every micro-batch at 20
        torch.testing.assert_close(a, b)        # the plain forward does not split: other rounding
    for g, h in zip(stored_grads, plain_grads):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in stored_grads[:3])   # the prefix's gradient arrived


def test_minibatches_partition_the_rows_and_group_rows_of_similar_length(tmp_path, alternating_rewards,
                                                                          monkeypatch):
    seen, real_pass = [], train.logprob_pass

    def recording(model, batch, minibatches, *args):
        seen.append((batch["attention_mask"].sum(1), minibatches))
        return real_pass(model, batch, minibatches, *args)

    monkeypatch.setattr(train, "logprob_pass", recording)
    cfg = tiny_config(tmp_path, steps=1, eval_size=0, prompts_per_step=4, group_size=2,
                      mini_batch_size=4, micro_batch_size=2)
    train.train(cfg, *tiny_policy())
    lengths, minibatches = seen[0]                          # the old-log-prob pass of step 1
    assert sorted(torch.cat([torch.cat(mb) for mb in minibatches]).tolist()) == list(range(8))
    for mb in minibatches:
        order = lengths[torch.cat(mb)].tolist()
        assert order == sorted(order) and [len(mu) for mu in mb] == [2, 2]


@pytest.mark.parametrize("tuning", [{}, {"lora_rank": 4, "lr": 5e-2}], ids=["full", "lora"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, alternating_rewards, monkeypatch, tuning):
    # kl_coef > 0 also checks that the resumed run's reference is the initial policy (for LoRA:
    # the adapter off); a LoRA checkpoint holds only the adapter and its optimizer state.
    cfg = tiny_config(tmp_path, steps=3, kl_coef=0.05, eval_size=0, **tuning)
    model, tokenizer = tiny_policy()
    train.train(dataclasses.replace(cfg, name="full"), model, tokenizer)
    full = params(model)
    real_step = train.train_step

    def killed_at_step_3(step, *args, **kwargs):
        if step == 3:
            raise KeyboardInterrupt("simulated kill")
        return real_step(step, *args, **kwargs)

    monkeypatch.setattr(train, "train_step", killed_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train.train(dataclasses.replace(cfg, name="cut"), *tiny_policy())
    monkeypatch.setattr(train, "train_step", real_step)
    model, tokenizer = tiny_policy()
    train.train(dataclasses.replace(cfg, name="cut", resume=True), model, tokenizer)
    assert all(torch.equal(full[k], v) for k, v in params(model).items())

    def kept(line):
        return {k: v for k, v in line.items() if not k.startswith(TIMING)}
    cut, ref = step_lines(tmp_path / "cut"), step_lines(tmp_path / "full")
    assert [l["step"] for l in cut] == [1, 2, 3]
    assert [kept(l) for l in cut] == [kept(l) for l in ref]
    assert ref[2]["kl"] > 0 and any(l["llds/loss"] > 0 for l in ref)


def question_file(tmp_path, questions: list[dict], name="questions.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return str(path)


def with_a_long_question(tmp_path) -> dict:
    """Config overrides: 3 toy questions and, second, one whose prompt is over max_prompt_tokens
    (1500 bytes, the few-shot examples take 1400), searched in the toy corpus."""
    short = [{k: r[k] for k in ("id", "question", "golds")} for r in data.load_questions("toy_nq", limit=3)]
    long = {"id": "long:6", "question": "Where was " + "a very " * 30 + "long name born?", "golds": ["x"]}
    return dict(data=question_file(tmp_path, short[:1] + [long] + short[1:]), eval_size=0,
                corpus=str(data.toy_world() / "corpus.jsonl"))


def test_an_over_long_question_is_dropped_at_load_and_the_run_trains_through(tmp_path, alternating_rewards, capsys):
    cfg = tiny_config(tmp_path, steps=3, **with_a_long_question(tmp_path))
    train.train(cfg, *tiny_policy())
    assert [l["step"] for l in step_lines(tmp_path / "run")] == [1, 2, 3]   # 6 draws from 3 questions
    assert ("dropped 1 of 4 training questions with a prompt over max_prompt_tokens=1500 tokens (fewshot "
            "template): long:6\n") in capsys.readouterr().out
    assert not any("long name" in p.read_text() for p in (tmp_path / "run" / "samples").iterdir())
    # fail fast instead: at load, before any step
    with pytest.raises(ValueError, match=r"^1 of 4 training questions have a prompt over .*: long:6; raise"):
        train.train(dataclasses.replace(cfg, name="strict", on_long_prompt="error"), *tiny_policy())
    assert not (tmp_path / "strict" / "metrics.jsonl").exists()
    # no question at all, or none short enough: one clear error at start, never a wait
    with pytest.raises(ValueError, match=r"empty\.jsonl: no questions in this file"):
        train.setup(dataclasses.replace(cfg, name="empty", data=question_file(tmp_path, [], "empty.jsonl")), *tiny_policy())
    with pytest.raises(ValueError, match="no training questions left: every prompt is over max_prompt_tokens=1000"):
        train.setup(dataclasses.replace(cfg, name="none_fit", max_prompt_tokens=1000), *tiny_policy())
    with pytest.raises(ValueError, match="--on-long-prompt must be one of drop, error, not 'skip'"):
        train.setup(dataclasses.replace(cfg, on_long_prompt="skip"))


def test_a_run_killed_at_any_step_resumes_and_finishes(tmp_path, alternating_rewards, monkeypatch):
    cfg = tiny_config(tmp_path, steps=3, **with_a_long_question(tmp_path))
    model, tokenizer = tiny_policy()
    train.train(dataclasses.replace(cfg, name="full"), model, tokenizer)
    full = params(model)
    real_step = train.train_step
    for kill in (1, 2, 3):
        def killed(step, *args, **kwargs):
            if step == kill:
                raise KeyboardInterrupt(f"simulated kill in step {kill}")
            return real_step(step, *args, **kwargs)

        name = f"killed_in_{kill}"
        monkeypatch.setattr(train, "train_step", killed)
        with pytest.raises(KeyboardInterrupt):
            train.train(dataclasses.replace(cfg, name=name), *tiny_policy())
        monkeypatch.setattr(train, "train_step", real_step)
        model, tokenizer = tiny_policy()
        train.train(dataclasses.replace(cfg, name=name, resume=True), model, tokenizer)
        assert [l["step"] for l in step_lines(tmp_path / name)] == [1, 2, 3]
        assert all(torch.equal(full[k], v) for k, v in params(model).items()), f"killed in step {kill}"


def test_non_finite_gradient_skips_the_step(tmp_path, alternating_rewards):
    model, tokenizer = tiny_policy()
    before = params(model)
    model.lm_head.weight.register_hook(lambda g: g * math.nan)   # every backward yields NaN
    train.train(tiny_config(tmp_path, steps=1, eval_size=0), model, tokenizer)
    line = step_lines(tmp_path / "run")[0]
    assert line["skipped_steps"] == 2                      # both mini-batch updates skipped
    assert line["grad_norm"] is None                       # no finite norm to average
    assert all(torch.equal(before[k], v) for k, v in params(model).items())


def test_a_non_finite_norm_in_a_later_mini_batch_reaches_the_log_not_the_warning(
        tmp_path, alternating_rewards, capsys):
    model, tokenizer = tiny_policy()
    calls = []

    def nan_on_second_mini_batch(g):                   # micro-batches of 1: backward 3 is mini-batch 2
        calls.append(1)
        return g * math.nan if len(calls) == 3 else g

    model.lm_head.weight.register_hook(nan_on_second_mini_batch)
    train.train(tiny_config(tmp_path, steps=1, eval_size=0), model, tokenizer)
    line = step_lines(tmp_path / "run")[0]
    assert line["skipped_steps"] == 1 and line["grad_norm_nonfinite"] == 1
    assert line["grad_norm"] > 0 and line["grad_norm_max"] is None   # NaN, logged as null
    assert line["lld/warning"] == 0                  # the warning is the spiral rule's alone
    assert "step 1: 1 update(s) skipped" in capsys.readouterr().out


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("grad_checkpointing", [True, False])
def test_equal_weights_give_equal_logprobs_on_every_path(tmp_path, alternating_rewards, monkeypatch,
                                                         bf16, grad_checkpointing):
    # lr 0: the weights never move, so every ratio, KL and displacement must be exactly 1 / 0.
    # Micro-batches of 2 rows share the few-shot prefix, so the shared-prefix path is live.
    seen = []
    real_policy_loss = train.policy_loss

    def recording(logp, old_logp, advantages, loss_mask, *args):
        seen.append(float(((logp - old_logp) * loss_mask).abs().max().detach()))
        return real_policy_loss(logp, old_logp, advantages, loss_mask, *args)

    monkeypatch.setattr(train, "policy_loss", recording)
    model, tokenizer = tiny_policy(hidden_size=64, intermediate_size=128)   # at 32 bf16 paths agree
    cfg = tiny_config(tmp_path, steps=1, lr=0.0, eval_size=0, micro_batch_size=2, mini_batch_size=2,
                      kl_coef=0.1, bf16=bf16, grad_checkpointing=grad_checkpointing)
    train.train(cfg, model, tokenizer)
    line = step_lines(tmp_path / "run")[0]
    # each mini-batch compares the no-grad old pass with its update pass, and the displacement
    # pass compares with the old pass
    assert seen == [0.0, 0.0]
    assert line["clip_ratio"] == 0 and line["ppo_kl"] == 0 and line["kl"] == 0
    assert line["llds/active_token_frac"] == 0 and line["llds/loss"] == 0
    assert line["lld/correct_displacement"] == 0 and line["lld/correct_frac_lost"] == 0


def test_reference_keeps_its_buffers_in_fp32():
    model, _ = tiny_policy()
    ref = models.reference_copy(model, bf16_weights=True)   # as setup() makes it on CUDA
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16, torch.float32}   # embeddings and norms fp32
    buffers = dict(ref.named_buffers())
    assert buffers and {b.dtype for b in buffers.values()} == {torch.float32}
    assert all(torch.equal(b, dict(model.named_buffers())[k]) for k, b in buffers.items())


def test_kill_during_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, steps=2, eval_size=0)
    run = tmp_path / "run"
    real_save, calls = torch.save, []

    def dies_in_second_checkpoint(obj, path, *args, **kwargs):
        if str(path).endswith("rng.pt"):
            calls.append(path)
            if len(calls) == 2:
                raise KeyboardInterrupt("killed while writing the second checkpoint")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_in_second_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train.train(cfg, *tiny_policy())
    monkeypatch.setattr(torch, "save", real_save)
    assert (run / "latest").read_text() == "ckpt-1" and not (run / "ckpt-2").exists()
    assert not list(run.glob(".tmp-ckpt-*"))
    # A SIGKILL leaves its temp folder behind: it must be ignored, then cleaned by the resume.
    (run / ".tmp-ckpt-dead").mkdir()
    (run / ".tmp-ckpt-dead" / "config.json").write_text("{")
    assert checkpoints.find_checkpoint(run) == run / "ckpt-1"
    model, tokenizer = tiny_policy()
    train.train(dataclasses.replace(cfg, resume=True), model, tokenizer)
    assert [l["step"] for l in step_lines(run)] == [1, 2]
    assert not list(run.glob(".tmp-ckpt-*")) and (run / "latest").read_text() == "ckpt-2"


def test_flags_presets_and_errors(tmp_path):
    cfg, plot, _, _ = cli.parse_train_args(train.Config, train.PRESETS, train.CHOICES, ["--preset", "paper", "--lr", "3e-6", "--no-llds", "--answer-coef", "0.05", "--answer-adaptive"])
    assert (cfg.lr, cfg.llds, cfg.prompts_per_step, cfg.mini_batch_size, cfg.kl_coef) == (3e-6, False, 512, 256, 0.001)
    assert (cfg.answer_coef, cfg.answer_adaptive, cfg.top_p, plot) == (0.05, True, 0.95, None)
    assert cli.parse_train_args(train.Config, train.PRESETS, train.CHOICES, []) == (train.Config(), None, None, False)
    assert cli.parse_train_args(train.Config, train.PRESETS, train.CHOICES, ["--plot", "a", "b", "--plot-out", "c.png"])[1:3] == (["a", "b"], "c.png")
    helps = cli.field_help(train.Config)
    assert set(helps) == {f.name for f in dataclasses.fields(train.Config)}
    with pytest.raises(ValueError, match="mini-batch-size 5 must divide"):
        cli.check_config(train.Config(mini_batch_size=5), train.CHOICES)
    with pytest.raises(ValueError, match="answer-coef"):
        cli.check_config(train.Config(answer_coef=math.nan), train.CHOICES)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="--resume"):
        train.setup(tiny_config(tmp_path))


def test_prompt_sampler_resumes_mid_epoch():
    records = [{"id": str(i)} for i in range(5)]
    a = PromptSampler(records, seed=3)
    first = [r["id"] for r in a.next(4)]
    b = PromptSampler(records, seed=3, **a.state())
    assert [r["id"] for r in a.next(4)] == [r["id"] for r in b.next(4)]
    assert sorted(first + [r["id"] for r in PromptSampler(records, 3, 0, 4).next(1)]) == list("01234")


def test_prompt_sampler_never_waits_forever():
    with pytest.raises(ValueError, match="no training questions"):
        PromptSampler([], seed=0)
    # a checkpoint's position past the end (the data shrank since): the next epoch begins
    sampler = PromptSampler([{"id": "a"}, {"id": "b"}], seed=0, epoch=3, pos=7)
    assert sorted(r["id"] for r in sampler.next(2)) == ["a", "b"] and sampler.state() == {"epoch": 5, "pos": 0}


def test_the_step_logs_each_mini_batch_value_as_its_micro_batches_sum_it():
    # two mini-batches; the first of two micro-batches holding 1/4 and 3/4 of its tokens
    pg, lld, kl = torch.tensor(0.5), torch.tensor(0.25), torch.tensor(0.0)
    stats = {"clip_ratio": 0.2, "ppo_kl": 0.4}
    lstats = {"llds/active_token_frac": 0.8, "llds/active_action_frac": 1.0, "llds/n_preserving": 9.0}
    sums = collections.Counter()
    sums.update(runs.micro_metrics(0.25, pg, stats, kl, lld, lstats))
    sums.update(runs.micro_metrics(0.75, pg, {"clip_ratio": 0.6, "ppo_kl": 0.0}, kl, lld, lstats))
    sums.update(runs.micro_metrics(1.0, pg, stats, kl, lld, lstats))
    out = runs.update_stats(sums, [1.0, math.inf], 2, kl=False)
    assert out["pg_loss"] == (0.5 + 0.5 + 0.5) / 2 and out["llds/loss"] == 0.75 / 2
    assert out["clip_ratio"] == pytest.approx(((0.25 * 0.2 + 0.75 * 0.6) + 0.2) / 2)   # 0.35
    assert out["llds/active_token_frac"] == pytest.approx(0.8) and "llds/n_preserving" not in out
    assert out["kl"] is None and runs.update_stats(sums, [1.0], 2, kl=True)["kl"] == 0.0
    assert (out["grad_norm"], out["grad_norm_max"], out["grad_norm_nonfinite"]) == (1.0, math.inf, 1)


@pytest.mark.slow
def test_smollm2_displacement_monitor_has_no_noise_floor():
    # The real model in bf16 autocast: regrouping the correct rows into new micro-batches (new
    # padding, new prefix sharing) moved per-response sums by up to 0.32 nats with the weights
    # unchanged. Recomputed in the old pass's own micro-batches, every sum is exactly 0.
    model, tokenizer = models.load_policy()
    prompt = ro.build_prompt("Where was Doravin Kelso born?", tokenizer)
    tails = ["<search> Doravin Kelso </search>", "Doravin Kelso was born in Mirefield. <answer> Mirefield </answer>",
             "<answer> 1961 </answer>", "<search> Kelso birthplace city </search> and more words here"]
    seqs = [prompt + tokenizer(t, add_special_tokens=False)["input_ids"] for t in tails]
    width = max(map(len, seqs))
    batch = {"input_ids": torch.tensor([s + [0] * (width - len(s)) for s in seqs]),
             "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])}
    batch["loss_mask"] = batch["attention_mask"].float()
    batch["loss_mask"][:, :len(prompt)] = 0
    batch["answer_mask"] = torch.zeros(batch["loss_mask"].shape)
    cfg, cpu = train.Config(bf16=True, micro_batch_size=2), torch.device("cpu")
    plan = [[torch.tensor([0, 1]), torch.tensor([2, 3])]]
    batch["old_logp"], _ = train.logprob_pass(model, batch, plan, cfg, cpu)
    after, _ = train.logprob_pass(model, batch, plan, cfg, cpu)     # as monitor_step runs it
    assert monitor.displacement(batch, after, torch.tensor([True, False, True, False]))[0] == {
        "lld/correct_displacement": 0.0, "lld/correct_frac_lost": 0.0,
        "lld/correct_displacement_search": 0.0, "lld/correct_displacement_answer": 0.0}
    # the same rows regrouped (what the monitor did before) are not bit-identical under bf16 (a CPU
    # without bf16 units runs float32, where this regrouping changed nothing on an AVX2 EPYC)
    regrouped, _ = train.logprob_pass(model, batch, [[torch.tensor([0, 2])]], cfg, cpu)
    if fast_hf.bf16_supported(cpu):
        moved = train.masked_sum(regrouped - batch["old_logp"], batch["loss_mask"], dim=1)
        assert moved[[0, 2]].abs().max() > 0


def test_plot_overlays_runs_and_names_the_settings_that_differ(tmp_path, alternating_rewards, capsys):
    for name, extra in (("grpo", {"llds": False}), ("llds", {})):
        model, tokenizer = tiny_policy()
        train.train(tiny_config(tmp_path, name=name, steps=2, eval_size=0, ckpt_every=0, **extra), model, tokenizer)
    runs_ = [tmp_path / "grpo", tmp_path / "llds"]
    assert plots.run_labels(runs_) == ["grpo (llds=False)", "llds (llds=True)"]
    assert plots.run_labels(runs_[:1]) == ["grpo"]
    capsys.readouterr()
    train.main(["--plot", str(runs_[0]), str(runs_[1]), "--plot-out", str(tmp_path / "both.png")])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "both.png")
    assert (tmp_path / "both.png").stat().st_size > 10_000
    train.main(["--plot", str(runs_[1])])                 # one run: its own curves.png, as before
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(runs_[1] / "curves.png")
    with pytest.raises(SystemExit, match="metrics.jsonl not found"):
        train.main(["--plot", str(tmp_path / "nowhere")])


def test_log_scale_panel_leaves_out_zero_grad_norms():
    lines = [{"step": 0, "eval/em": 0.2}, {"step": 1, "grad_norm_max": 2.0}, {"step": 2, "grad_norm_max": 0.0}]
    assert plots.series(lines, "grad_norm_max") == [(1, 2.0), (2, 0.0)]
    assert plots.series(lines, "grad_norm_max", positive_only=True) == [(1, 2.0)]


def test_a_retriever_lost_mid_run_ends_in_one_line_naming_the_checkpoint(tmp_path, alternating_rewards, monkeypatch):
    cfg = tiny_config(tmp_path, steps=2, eval_size=0)
    real_step = train.train_step

    def retriever_gone(step, *args, **kwargs):
        if step == 2:
            raise ConnectionError("retriever http://127.0.0.1:8000/retrieve is unreachable")
        return real_step(step, *args, **kwargs)

    monkeypatch.setattr(train, "train_step", retriever_gone)
    monkeypatch.setattr(train, "parse_train_args", lambda *a: (cfg, None, None, False))
    real_train = train.train
    monkeypatch.setattr(train, "train", lambda c: real_train(c, *tiny_policy()))
    with pytest.raises(SystemExit) as stop:
        train.main([])
    assert str(stop.value) == (f"error: retriever http://127.0.0.1:8000/retrieve is unreachable; the run continues "
                               f"from {tmp_path / 'run' / 'ckpt-1'} (step 1) with --resume")



def test_paired_change_counts_turned_questions_and_gives_the_exact_sign_test():
    before = {"eval/correct": [0] * 10 + [1] * 5}
    after = {"eval/correct": [1] * 8 + [0] * 2 + [1] * 4 + [0]}
    # 8 turned right, 1 turned wrong: p = 2 * (C(9,0) + C(9,1)) / 2^9 = 20 / 512
    assert summary.paired_change(summary.sign_test(before, after)) == \
        " (15 questions: 8 turned right, 1 turned wrong; sign test p = 0.039)"
    assert summary.paired_change(summary.sign_test(before, before)).endswith(
        "0 turned right, 0 turned wrong; sign test p = 1)")
    assert summary.paired_change(summary.sign_test({}, {})) == ""


def test_the_verdict_says_in_words_whether_the_change_is_beyond_noise():
    nine_wrong, eight_turned_right = {"eval/correct": [0] * 9}, {"eval/correct": [1] * 8 + [0]}
    # 8 turned right, 0 wrong: p = 2 / 2^8 = 0.0078; the reverse: the same p, the other way
    assert summary.verdict(summary.sign_test(nine_wrong, eight_turned_right)) == \
        "beyond noise (p = 0.0078 < 0.05): the policy learned"
    assert summary.verdict(summary.sign_test(eight_turned_right, nine_wrong)).startswith("EM fell beyond noise (p = 0.0078")
    # 6 turned right, 2 wrong: p = 2 * (C(8,0) + C(8,1) + C(8,2)) / 2^8 = 74 / 256 = 0.29
    test = summary.sign_test({"eval/correct": [0] * 6 + [1] * 2}, {"eval/correct": [1] * 6 + [0] * 2})
    assert (test["right"], test["wrong"]) == (6, 2)
    assert summary.verdict(test).startswith("within noise (p = 0.29 >= 0.05)")


def test_tied_groups_and_zero_gradient_steps_are_named(tmp_path, alternating_rewards):
    from types import SimpleNamespace
    ep = {"em": 0.0, "f1": 0.0, "n_search": 0, "n_valid": 0, "finished": False, "queries": [], "golds": ["x"], "text": ""}
    out = SimpleNamespace(episodes=[ep] * 6, loss_mask=torch.ones(6, 2), logp=torch.zeros(6, 2))
    stats = monitor.rollout_stats(out, torch.zeros(6, 2), torch.tensor([1., 1., 0., 1., 0., 0.]),
                                torch.tensor([0, 0, 1, 1, 2, 2]))
    assert stats["frac_reward_zero_std"] == pytest.approx(2 / 3)     # groups 0 (1, 1) and 2 (0, 0) tie
    train.train(tiny_config(tmp_path, name="signal"), *tiny_policy())
    assert [l["grad_zero"] for l in step_lines(tmp_path / "signal")] == [0.0, 0.0]
    assert [l["frac_reward_zero_std"] for l in step_lines(tmp_path / "signal")] == [0.0, 0.0]


def test_every_group_tied_gives_an_exactly_zero_gradient_flagged(tmp_path):
    # a random model never answers: reward 0 everywhere, and with no entropy, KL or LLDS term the
    # loss has no gradient at all (AdamW still decays the weights)
    train.train(tiny_config(tmp_path, llds=False, entropy_coef=0.0, eval_size=0), *tiny_policy())
    lines = step_lines(tmp_path / "run")
    assert [l["grad_zero"] for l in lines] == [1.0, 1.0] and [l["grad_norm"] for l in lines] == [0.0, 0.0]
    assert [l["frac_reward_zero_std"] for l in lines] == [1.0, 1.0]


def test_unnamed_runs_each_get_a_new_folder_and_resume_takes_the_newest(tmp_path):
    cfg = tiny_config(tmp_path, name="", steps=1, eval_size=0)
    for _ in range(2):
        train.train(cfg, *tiny_policy())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo", "demo-2"]
    train.train(dataclasses.replace(cfg, resume=True, steps=2), *tiny_policy())
    assert [l["step"] for l in step_lines(tmp_path / "demo-2")] == [1, 2]
    assert [l["step"] for l in step_lines(tmp_path / "demo")] == [1]


@pytest.mark.parametrize("bf16", [False, True])
def test_attention_off_cudnn_and_rounded_lengths_keep_the_logprobs(bf16, tmp_path, monkeypatch,
                                                                 alternating_rewards):
    # Every log-prob pass holds SDPA off cuDNN (whose graphs with and without grad need not agree):
    # a CPU then runs the kernel it picks anyway, so the numbers are today's bit for bit. A GPU also pads micro-batches up to a multiple of 128
    # tokens (fewer shapes for its kernels): padding is masked, so the numbers are the same up to
    # the order of a sum (a longer key axis is blocked otherwise), and as every pass pads alike,
    # equal weights still give equal bits.
    if bf16 and not fast_hf.bf16_supported(torch.device("cpu")):
        pytest.skip("no bf16 units on this CPU")
    model, tokenizer = tiny_policy(hidden_size=64, intermediate_size=128)
    torch.manual_seed(0)
    ids = torch.randint(3, 250, (3, 70))
    ids[:, :30] = ids[0, :30]                                        # a shared prompt prefix
    attention = torch.ones_like(ids)
    attention[1, 50:], attention[2, 61:] = 0, 0                      # right-padded rows
    batch = {"input_ids": ids, "attention_mask": attention,
             "loss_mask": (attention * (torch.arange(70) >= 30)).float()}
    rows, cpu = torch.tensor([1, 2]), torch.device("cpu")

    def logprobs(multiple, token_logprobs):
        mb = train.micro_batch(batch, rows, cpu, multiple)
        with torch.no_grad(), fast_hf.autocast(cpu, bf16), \
                fast_hf.prefix_once(model, ids, attention) as policy:
            logp, entropy = token_logprobs(policy, mb["input_ids"], mb["attention_mask"],
                                           mb["loss_mask"], 0.7)
        return mb["input_ids"].shape[1], logp[:, :61], entropy[:, :61]

    width, *plain = logprobs(1, train.token_logprobs.__wrapped__)      # unheld, unpadded
    assert width == 61 and train.micro_batch(batch, rows, cpu)["input_ids"].shape[1] == 61
    assert all(torch.equal(a, b) for a, b in zip(plain, logprobs(1, train.token_logprobs)[1:]))
    for multiple in (8, 64):
        padded_width, *padded = logprobs(multiple, train.token_logprobs)
        assert padded_width == min(-(-61 // multiple) * multiple, 70)   # rounded up, at most T
        assert all(torch.allclose(a, b, rtol=0, atol=5e-3 if bf16 else 2e-6)   # bf16: 1.4e-3
                   for a, b in zip(plain, padded))
    assert "CUDNN_ATTENTION" not in fast_hf.LOGPROB_KERNELS
    # a whole step at lr 0 with every micro-batch padded to a multiple of 64: exactly 0
    monkeypatch.setattr(train, "micro_batch", functools.partial(train.micro_batch, multiple=64))
    cfg = tiny_config(tmp_path, steps=1, lr=0.0, eval_size=0, micro_batch_size=2, kl_coef=0.1,
                      bf16=bf16)
    train.train(cfg, model, tokenizer)
    line = step_lines(tmp_path / "run")[0]
    assert line["clip_ratio"] == line["ppo_kl"] == line["kl"] == line["llds/loss"] == 0
    assert line["lld/correct_displacement"] == 0


def test_plan_flag_prints_the_peak_of_the_runs_start_line(tmp_path, capsys):
    model, tokenizer = tiny_policy()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    cfg = tiny_config(tmp_path, model=str(tmp_path / "m"))
    planned = memory_plan.print_plan(cfg, torch.device("cpu"), train.questions)
    train.setup(cfg)
    started = capsys.readouterr().out

    def peak(text):
        return re.search(r"memory plan: peak ([\d.]+) GiB", text).group(1)

    assert peak(planned) == peak(started) and "longest prompt" in planned
    flags = ["--plan", "--model", str(tmp_path / "m"), "--out-dir", str(tmp_path)]
    train.main(flags)
    assert "longest prompt" in capsys.readouterr().out
    # where the data is not there: the bound, and why
    train.main([*flags, "--data", str(tmp_path / "missing.jsonl")])
    out = capsys.readouterr().out
    assert "(the prompts were not read: " in out and "prompts not read: max_prompt_tokens" in out
