"""bench/gpu_check.py: a few full GRPO + LLDS steps of a Qwen2.5-3B-shaped model, offline.

Checks that the paper-sized CUDA path of train.py works and how fast it is, on a machine with
no network (GPU boxes often have none): the model is Qwen2.5-3B's architecture built from a
config in code with RANDOM weights (speed and memory are those of the real model; the text is
noise), the tokenizer needs no download, and the retriever is an in-process BM25 over the toy
world. Random weights never emit a stop tag, so every turn runs to the paper's 500-token cap:
the worst case for rollout time and context length (3 search turns + 1 answer turn).

It calls train.train_step, the same function `python train.py` runs, with the paper's
objective (k3 KL 0.001 to a frozen reference, entropy 0.001, LLDS lambda 0.2 with the action
gate, several mini-batches per step), bf16 autocast over fp32 weights, gradient checkpointing,
and prints per step: rollout / log-prob / update time, rollout tokens/s, peak GPU memory.

    python bench/gpu_check.py              # on one GPU; aims at < 5 minutes on an H100/H200
    python bench/gpu_check.py --tiny       # a tiny random model on CPU (what the tests run)
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import retriever as retrieval  # noqa: E402
import train  # noqa: E402
from plumbing import cache_dir, cli, models, runs  # noqa: E402

# Qwen2.5-3B-Instruct's config.json, the parts that set compute and memory.
QWEN25_3B = dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def offline_tokenizer():
    """SmolLM2's tokenizer when rollout.py has converted it into the cache, else byte-level."""
    folder = cache_dir() / "smollm2-135m-instruct"
    if (folder / "tokenizer.json").exists():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        tokenizer.padding_side = "left"
        return tokenizer
    return models.byte_tokenizer()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random model on CPU, short turns (a smoke test)")
    parser.add_argument("--steps", type=int, default=3, help="training steps to run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=5, help="rollouts per prompt")
    parser.add_argument("--turn-tokens", type=int, default=500, help="tokens per turn (paper: 500)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="trajectories per forward/backward")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    tokenizer = models.byte_tokenizer() if args.tiny else offline_tokenizer()
    shape = models.TINY_QWEN2 if args.tiny else QWEN25_3B
    vocab = len(tokenizer) if args.tiny else QWEN25_3B["vocab_size"]   # ids < vocab either way
    turn = min(args.turn_tokens, 8) if args.tiny else args.turn_tokens
    batch = args.prompts * args.group_size
    cfg = train.Config(
        name="gpu_check", template="search-r1" if tokenizer.chat_template else "fewshot",
        max_turns=3, topk=3, max_turn_tokens=turn, max_obs_tokens=64 if args.tiny else 500,
        max_prompt_tokens=2048, max_context=4096, steps=args.steps, prompts_per_step=args.prompts,
        group_size=args.group_size, mini_batch_size=batch // 2, micro_batch_size=args.micro_batch_size,
        lr=1e-6, kl_coef=0.001, entropy_coef=0.001, llds_lambda=0.2, samples_per_step=0,
        rollout_batch_size=batch, grad_checkpointing=device.type == "cuda")
    cli.check_config(cfg, train.CHOICES)

    t = time.perf_counter()
    model = models.random_qwen2(shape, vocab, device)
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = models.reference_copy(model, bf16_weights=device.type == "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    n_params = sum(p.numel() for p in model.parameters())
    world = data.toy_world()
    retriever = retrieval.open_retriever("bm25", corpus=str(world / "corpus.jsonl"))
    sampler = runs.PromptSampler(data.load_questions("toy", split="train"), seed=0)
    print(f"{'tiny' if args.tiny else 'Qwen2.5-3B-shaped'} random model, {n_params / 1e9:.2f} B params, "
          f"on {device}; tokenizer vocab {len(tokenizer)}; {args.prompts} prompts x {args.group_size}, "
          f"{cfg.max_turns} search turns + 1 of {turn} tokens, {batch // cfg.mini_batch_size} optimizer "
          f"steps per step; setup {time.perf_counter() - t:.1f} s", flush=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    results = []
    with tempfile.TemporaryDirectory() as run_dir:
        for step in range(1, args.steps + 1):
            m = train.train_step(step, cfg, model, tokenizer, ref, optimizer, sampler, retriever,
                                 device, Path(run_dir))
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            results.append({**m, "peak_gpu_gb": peak})
            print(f"step {step}: {m['timing/step']:.1f} s = rollout {m['timing/rollout']:.1f} "
                  f"(retrieval {m['timing/retrieval']:.2f}) + logprob {m['timing/logprob']:.1f} + "
                  f"update {m['timing/update']:.1f}; rollout {m['rollout_tokens_per_s']:.0f} tokens/s; "
                  f"response {m['response_length']:.0f} tokens; grad_norm {m['grad_norm']:.3g}; "
                  f"llds/loss {m['llds/loss']:.3g}; peak GPU memory {peak:.1f} GiB", flush=True)
    return {"steps": results, "params": n_params}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
