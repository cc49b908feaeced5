"""bench_decode.py — decode throughput at equal work: rollout.py's engine against HF `generate`.

Both sides get the same model (embedded SmolLM2-135M-Instruct), the same prompts (the few-shot
prompts of the first B toy questions, ~460 tokens, left-padded for HF) and make exactly N new
tokens per row, greedily, with no early stop (HF: min_new_tokens = max_new_tokens = N). So the
sampling luck that the TRL comparison cannot remove is out: both do the same arithmetic work.

Each side runs in its own fresh process (ours with the model's attention switched by
fast_hf.use_fast_attention, as train.py sets it; HF's with its own "sdpa"), in each precision the CPU offers (float32; where it has bf16 units, bf16
autocast over float32 weights, as train.py runs, and bf16 weights), and its best is compared. Decode time = time(prefill + N tokens) - time(prefill +
1 token), so prefill is out; decode tokens/s = B x (N - 1) / decode time.

    python bench/bench_decode.py                         # batch 8, 32, 64; N = 32
    python bench/bench_decode.py --batch 32 --new-tokens 64 --threads 1 --precision fp32
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def prompts_for(tokenizer, batch: int) -> list[list[int]]:
    import data
    import rollout as ro
    records = data.load_questions("toy_nq", limit=batch, split="train")
    return [ro.prompt_ids(r, tokenizer, "fewshot") for r in records]


def ours(model, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """rollout.py's turn loop (`_generate_turn`): one KV cache, shared prefix, per-row stop checks."""
    import rollout as ro
    from plumbing import fast_hf
    kv = fast_hf.KVBatch(model, pad_id=0)
    logits = kv.start(prompts)
    never = torch.zeros(logits.shape[-1], dtype=torch.bool)
    stops = type("NoStop", (), {"eos": never, "closes": never})()       # no EOS, no stop strings
    tokens, _ = ro._generate_turn(kv, logits, [n_new] * len(prompts), stops, ro.RolloutConfig(greedy=True))
    return tokens


def hf_generate(model, prompts: list[list[int]], n_new: int, pad_id: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                         do_sample=False, pad_token_id=pad_id)
    return out[:, width:].tolist()


def child(args) -> None:
    """One side, one precision, one batch: prints {"seconds_1", "seconds_n", "tokens"} as JSON."""
    from plumbing.fast_hf import autocast
    from plumbing.models import load_policy
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, tokenizer = load_policy(dtype=torch.bfloat16 if args.precision == "bf16-weights" else None)
    if args.side == "ours":
        from plumbing import fast_hf
        fast_hf.use_fast_attention(model)                      # as train.py's and eval.py's setup
    prompts = prompts_for(tokenizer, args.batch)
    device = torch.device("cpu")

    def run(rows, n_new):
        with torch.no_grad(), autocast(device, args.precision == "bf16"):
            start = time.perf_counter()
            if args.side == "ours":
                tokens = ours(model, rows, n_new)
            else:
                tokens = hf_generate(model, rows, n_new, tokenizer.pad_token_id)
            return tokens, time.perf_counter() - start

    run(prompts[:2], 2)                                                    # warm-up
    _, seconds_1 = run(prompts, 1)
    tokens, seconds_n = run(prompts, args.new_tokens)
    print(json.dumps({"seconds_1": seconds_1, "seconds_n": seconds_n, "tokens": tokens}))


def measure(args, side: str, precision: str, batch: int) -> dict:
    command = [sys.executable, __file__, "--child", "--side", side, "--precision", precision, "--batch", str(batch),
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{side} {precision} batch {batch} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["decode_s"] = result["seconds_n"] - result["seconds_1"]
    result["tok_s"] = batch * (args.new_tokens - 1) / result["decode_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64], help="rows (default 8 32 64)")
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens per row, N (default 32, the demo's turn cap)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--precision", nargs="+", default=None, choices=["fp32", "bf16", "bf16-weights"],
                        help="fp32; bf16 (autocast); bf16-weights. Default: all three where the CPU has bf16 "
                             "units, else fp32")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=["ours", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.batch, args.precision = args.batch[0], args.precision[0]
        return child(args)

    from plumbing.fast_hf import bf16_supported
    precisions = args.precision or (["fp32", "bf16", "bf16-weights"] if bf16_supported(torch.device("cpu"))
                                    else ["fp32"])
    print(f"SmolLM2-135M, few-shot toy prompts, {args.new_tokens} new tokens per row, greedy, no early stop; "
          f"precisions {', '.join(precisions)}; threads {args.threads or torch.get_num_threads()}", flush=True)
    print(f"{'batch':>5} {'side':<5} {'precision':<12} {'prefill s':>9} {'decode s':>9} {'tok/s':>8}", flush=True)
    for batch in args.batch:
        best = {}
        for side in ("ours", "hf"):
            for precision in precisions:
                r = measure(args, side, precision, batch)
                print(f"{batch:>5} {side:<5} {precision:<12} {r['seconds_1']:>9.2f} {r['decode_s']:>9.2f} "
                      f"{r['tok_s']:>8.1f}", flush=True)
                if side not in best or r["tok_s"] > best[side]["tok_s"]:
                    best[side] = {**r, "precision": precision}
        same = sum(a == b for x, y in zip(best["ours"]["tokens"], best["hf"]["tokens"]) for a, b in zip(x, y))
        print(f"batch {batch}: ours ({best['ours']['precision']}) / HF generate ({best['hf']['precision']}) "
              f"decode tokens/s = {best['ours']['tok_s'] / best['hf']['tok_s']:.2f}x (target >= 2x at batch 32); "
              f"greedy tokens identical: {same}/{batch * args.new_tokens}", flush=True)


if __name__ == "__main__":
    main()
