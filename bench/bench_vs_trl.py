"""bench/bench_vs_trl.py: a training step of our train.py vs TRL's GRPOTrainer on the same work.

Both sides train the embedded SmolLM2-135M-Instruct on the same toy-world questions (train.py's
prompt order, seed 0), with the same prompt token ids (TRL gets ours unchanged), 8 prompts x 4
completions per step, T = 0.7, one turn (no search), two optimiser steps per generation batch
(mini-batch 16), micro-batch 4, AdamW lr 2e-5, no KL, no LLDS, no evaluation, bf16 autocast where
the CPU has it, no gradient checkpointing. Ours is pinned to that work, whatever train.py's defaults
become: no redrawing of tied groups (dynamic sampling would generate again, which TRL does not), no
entropy bonus, no top-p, no displacement pass, no token view, no samples, no checkpoints. Workloads:
  fewshot    our 3-shot prompt (~1,000 shared tokens, what train.py runs once per micro-batch), 64 new tokens
  search-r1  the paper's prompt in the chat template (distinct prompts, nothing shared), 256 new tokens
TRL: loss_type dapo (a token mean like ours), per_device_train_batch_size 4,
gradient_accumulation_steps 4, steps_per_generation 8. Its "step" here is one generation batch
(two optimiser steps), like ours.

Each side runs in a fresh process (so peak RSS is its own), alternating ours / TRL for --rounds
rounds; every step is timed and split into generation / log-probs (old log-probs; TRL: rewards
too) / update. Completion lengths differ a little: our rollout stops at </answer>, TRL's
generate only at EOS; the table shows both.

    .venv/bin/python bench/bench_vs_trl.py                               # both workloads, 2 rounds x 2 steps
    .venv/bin/python bench/bench_vs_trl.py --workload fewshot --rounds 1 --steps 1 --threads 1
    .venv/bin/python bench/bench_vs_trl.py --tiny                        # a tiny random model (smoke run)
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOADS = {"fewshot": dict(template="fewshot", tokens=64), "search-r1": dict(template="search-r1", tokens=256)}
PROMPTS, GROUP, MINI, MICRO, LR, TEMPERATURE = 8, 4, 16, 4, 2e-5, 0.7
PARTS = ("generation", "logprob", "update")


def policy(tiny: bool):
    """(model, tokenizer): the embedded SmolLM2, or a tiny random Qwen2 with a byte tokenizer."""
    import torch
    from plumbing import models
    if not tiny:
        return models.load_policy()
    tokenizer = models.byte_tokenizer()
    return models.random_qwen2(models.TINY_QWEN2, len(tokenizer), torch.device("cpu")), tokenizer


def questions(n: int) -> list[dict]:
    """The questions train.py draws for its first steps (same sampler, seed 0)."""
    import data
    from plumbing.sampler import PromptSampler
    return PromptSampler(data.load_questions("toy_nq", split="train"), seed=0).next(n)


def run_ours(workload: dict, steps: int, tiny: bool, out_dir: Path) -> list[dict]:
    import train
    cfg = train.Config(name="ours", out_dir=str(out_dir), template=workload["template"], max_turns=0,
                       max_turn_tokens=workload["tokens"], temperature=TEMPERATURE, steps=steps,
                       prompts_per_step=PROMPTS, group_size=GROUP, mini_batch_size=MINI, micro_batch_size=MICRO,
                       lr=LR, warmup_ratio=0.0, kl_coef=0.0, entropy_coef=0.0, llds=False, top_p=1.0,
                       drop_tied_groups=0, displacement_every=0, token_view_every=0,
                       samples_per_step=0, eval_size=0, ckpt_every=0, rollout_batch_size=PROMPTS * GROUP)
    train.train(cfg, *policy(tiny))
    lines = [json.loads(l) for l in (out_dir / "ours" / "metrics.jsonl").read_text().splitlines()]
    return [{"total": l["timing/step"], "generation": l["timing/rollout"], "logprob": l["timing/logprob"],
             "update": l["timing/update"], "completion_tokens": l["response_length"]} for l in lines if "reward" in l]


def run_trl(workload: dict, steps: int, tiny: bool, out_dir: Path) -> list[dict]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import rollout
    model, tokenizer = policy(tiny)
    records = questions(PROMPTS * steps)
    prompt_ids = [rollout.build_prompt(r["question"], tokenizer, workload["template"]) for r in records]
    ids_of = {tokenizer.decode(ids): ids for ids in prompt_ids}      # TRL gets our token ids unchanged
    dataset = Dataset.from_dict({"prompt": list(ids_of), "golds": [r["golds"] for r in records]})
    timers = {"generation": 0.0, "scoring": 0.0}

    def exact_match(completions, golds, **kwargs):
        return [rollout.exact_match(rollout.extract_answer(c), g) for c, g in zip(completions, golds)]

    class Timed(GRPOTrainer):
        def _tokenize_prompts(self, prompts):
            return [ids_of[p] for p in prompts], None, {}

        def _generate_single_turn(self, *args, **kwargs):
            t = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            timers["generation"] += time.perf_counter() - t
            return out

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            timers["scoring"] += time.perf_counter() - t
            return out

    results, start = [], {}

    class PerGenerationBatch(TrainerCallback):      # two optimiser steps = one generation batch
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % 2 == 0:
                start["t"], timers["generation"], timers["scoring"] = time.perf_counter(), 0.0, 0.0

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 2 == 0:
                total = time.perf_counter() - start["t"]
                results.append({"total": total, "generation": timers["generation"],
                                "logprob": timers["scoring"] - timers["generation"],
                                "update": total - timers["scoring"]})

    from plumbing.fast_hf import bf16_supported
    bf16 = bf16_supported(__import__("torch").device("cpu"))
    args = GRPOConfig(output_dir=str(out_dir / "trl"), per_device_train_batch_size=MICRO,
                      gradient_accumulation_steps=MINI // MICRO, steps_per_generation=PROMPTS * GROUP // MICRO,
                      num_generations=GROUP, max_completion_length=workload["tokens"], temperature=TEMPERATURE,
                      learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.01, beta=0.0, loss_type="dapo",
                      max_steps=2 * steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                      bf16=bf16, gradient_checkpointing=False, shuffle_dataset=False, seed=0, disable_tqdm=True)
    trainer = Timed(model=model, reward_funcs=exact_match, args=args, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[PerGenerationBatch()])
    trainer.train()
    lengths = [l["completions/mean_length"] for l in trainer.state.log_history if "completions/mean_length" in l]
    return [{**r, "completion_tokens": n} for r, n in zip(results, lengths)]


def child(side: str, workload: str, steps: int, tiny: bool, threads: int, out: Path) -> None:
    if threads:
        import torch
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        run = run_ours if side == "ours" else run_trl
        result = run(WORKLOADS[workload], steps, tiny, Path(tmp))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out.write_text(json.dumps({"steps": result, "peak_rss_gb": peak}))


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", nargs="+", choices=sorted(WORKLOADS), default=["fewshot", "search-r1"])
    parser.add_argument("--rounds", type=int, default=2, help="alternations ours / TRL per workload")
    parser.add_argument("--steps", type=int, default=2, help="steps per side per round (each its own process)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model: checks the script, times nothing")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0 = torch's default); "
                        "1 wastes less time in thread barriers when other jobs share the cores")
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)   # child process
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        return child(args.side, args.workload[0], args.steps, args.tiny, args.threads, args.out)

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workload:
            runs = {"ours": [], "trl": []}
            for rnd in range(args.rounds):
                for side in ("ours", "trl"):
                    out = Path(tmp) / f"{workload}-{side}-{rnd}.json"
                    cmd = [sys.executable, __file__, "--side", side, "--workload", workload, "--steps",
                           str(args.steps), "--threads", str(args.threads), "--out", str(out)] + ["--tiny"] * args.tiny
                    t = time.perf_counter()
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    result = json.loads(out.read_text())
                    runs[side].append(result)
                    print(f"{workload} round {rnd + 1} {side}: steps "
                          + ", ".join(f"{s['total']:.1f}" for s in result["steps"])
                          + f" s; process {time.perf_counter() - t:.0f} s, peak RSS {result['peak_rss_gb']:.2f} GiB",
                          flush=True)
            report[workload] = runs
    print(table(report))


def table(report: dict) -> str:
    lines = ["| workload | side | median step (s) | generation / log-probs / update (s) | completion tokens "
             "| generation tok/s | peak RSS (GiB) | steps, per round |", "|---|---|---|---|---|---|---|---|"]
    for workload, runs in report.items():
        medians = {}
        for side, rounds in runs.items():
            steps = [s for r in rounds for s in r["steps"]]
            medians[side] = median([s["total"] for s in steps])
            split = " / ".join(f"{median([s[p] for s in steps]):.1f}" for p in PARTS)
            per_round = "; ".join(", ".join(f"{s['total']:.1f}" for s in r["steps"]) for r in rounds)
            lines.append(f"| {workload} | {'ours' if side == 'ours' else 'TRL'} | {medians[side]:.1f} | {split} "
                         f"| {median([s['completion_tokens'] for s in steps]):.1f} "
                         f"| {sum(s['completion_tokens'] for s in steps) * PROMPTS * GROUP / sum(s['generation'] for s in steps):.1f} "
                         f"| {max(r['peak_rss_gb'] for r in rounds):.2f} | {per_round} |")
        lines.append(f"| {workload} | **ours / TRL** | **{medians['ours'] / medians['trl']:.2f}x** | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
