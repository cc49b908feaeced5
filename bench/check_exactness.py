"""bench/check_exactness.py: do the old-log-prob pass, the update's forward and the displacement
monitor agree bit for bit at equal weights? (issue 10, items 1 and 2)

Rolls out a few toy questions with the embedded SmolLM2-135M, then, with the weights unchanged:
  * old log-probs (train.logprob_pass, no grad) vs the update's log-probs (train.token_logprobs
    with grad, model.train(), the same micro-batches), with and without gradient checkpointing,
    in bf16 autocast and in fp32: mean and max |old_logp - logp| over model tokens;
  * the displacement monitor (monitor.displacement) with no update in between: its per-response
    sums must all be 0.

    .venv/bin/python bench/check_exactness.py [--questions N]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import retriever as retrieval  # noqa: E402
import rollout as ro  # noqa: E402
import train  # noqa: E402
from plumbing import fast_hf  # noqa: E402
from plumbing.models import load_policy  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4, help="questions, 2 rollouts each")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_policy()
    fast_hf.use_fast_attention(model)                          # as train.py's setup
    records = data.load_questions("toy_nq", split="train")[:args.questions]
    records = [r for r in records for _ in range(2)]
    search = retrieval.open_retriever("bm25", corpus=str(data.toy_world() / "corpus.jsonl"))
    cpu = torch.device("cpu")
    for bf16 in (True, False):
        cfg = train.Config(bf16=bf16, micro_batch_size=4, mini_batch_size=len(records),
                           prompts_per_step=args.questions, group_size=2)
        out = ro.rollout(model, tokenizer, records, search, train.rollout_config(cfg))
        batch = {"input_ids": out.input_ids, "attention_mask": out.attention_mask,
                 "loss_mask": out.loss_mask, "answer_mask": out.answer_mask}
        plan = [list(torch.arange(len(records)).split(cfg.micro_batch_size))]     # one mini-batch
        for ckpt in (False, True):
            cfg.grad_checkpointing = ckpt
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            old, _ = train.logprob_pass(model, batch, plan, cfg, cpu)
            model.train()
            diffs = []
            for mini in plan:                     # as train.py's update: one prefix run per mini-batch
                with fast_hf.prefix_once(model, batch["input_ids"], batch["attention_mask"],
                                         not cfg.grad_checkpointing) as policy:
                    for micro in mini:
                        mb = train.micro_batch(batch, micro, cpu)
                        with fast_hf.autocast(cpu, cfg.bf16):
                            logp, _ = train.token_logprobs(policy, mb["input_ids"], mb["attention_mask"],
                                                           mb["loss_mask"], cfg.temperature)
                        on = mb["loss_mask"].bool()
                        diffs.append((logp.detach() - old[micro, :logp.shape[1]])[on].abs())
            model.eval()
            if ckpt:
                model.gradient_checkpointing_disable()
            d = torch.cat(diffs)
            print(f"bf16 autocast {bf16!s:5}  grad checkpointing {ckpt!s:5}: |old_logp - logp| "
                  f"mean {d.mean():.4g}, max {d.max():.4g} nats/token over {d.numel()} model tokens")
        cfg.grad_checkpointing = False
        old, _ = train.logprob_pass(model, batch, plan, cfg, cpu)
        everyone = torch.arange(len(records))
        sums = displacement_sums(model, batch, plan, everyone, old, cfg)
        print(f"bf16 autocast {bf16!s:5}  displacement with unchanged weights, per response: "
              f"min {sums.min():.4g}, max {sums.max():.4g} nats")


def displacement_sums(model, batch, plan, idx, old, cfg):
    """Per-response summed displacement the monitor would see (all responses treated as correct)."""
    after, _ = train.logprob_pass(model, batch, plan, cfg, torch.device("cpu"))
    return train.masked_sum(after[idx] - old[idx], batch["loss_mask"][idx], dim=1)


if __name__ == "__main__":
    main()
