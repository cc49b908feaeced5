"""bench_rollout.py — rollout throughput of rollout.py with the embedded SmolLM2-135M on this CPU.

Measured side by side in one run, on the same toy-world questions and the same settings:
  1. the episodes generated as ONE batch (one KV cache, per-row stopping);
  2. the same episodes generated one at a time;
then the share of rollout time spent in (in-process BM25) retrieval, and the peak RSS of a
fresh process that loads everything and rolls out --rss-episodes episodes as one batch.
Targets (issue 4): batched >= 4x one-at-a-time tokens/s; retrieval < 10%; peak RSS < 4 GB.

    python bench/bench_rollout.py                       # ~ a few minutes on 2 cores
    python bench/bench_rollout.py --episodes 8 --max-turn-tokens 32   # quicker
"""
import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import retriever as retrieval  # noqa: E402
import rollout as ro  # noqa: E402
from plumbing import fast_hf  # noqa: E402
from plumbing.models import load_policy  # noqa: E402


def setup(n_episodes: int):
    model, tokenizer = load_policy()
    fast_hf.use_fast_attention(model)                          # as train.py's setup
    world = data.toy_world()
    records = data.load_questions("toy", limit=n_episodes, split="train")
    bm25 = retrieval.open_retriever("bm25", corpus=str(world / "corpus.jsonl"))
    return model, tokenizer, records, bm25


def timed(model, tokenizer, records, bm25, cfg, seed=0):
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = ro.rollout(model, tokenizer, records, bm25, cfg)
    return out, time.perf_counter() - start


def live_share(out) -> tuple[int, int]:
    """(row-steps that sampled a token, row-steps decoded) of a batched rollout: in each turn every
    row still going is decoded until the turn's longest row stops, so a row that stopped early is
    fed pads. From the loss mask: turn k of each episode is its k-th run of model tokens."""
    turns = []                                        # per episode: its turns' lengths
    for row in out.loss_mask.tolist():
        runs, length = [], 0
        for m in row + [0.0]:
            if m:
                length += 1
            elif length:
                runs, length = runs + [length], 0
        turns.append(runs)
    live = decoded = 0
    for k in range(max(len(t) for t in turns)):
        lengths = [t[k] for t in turns if len(t) > k]
        live, decoded = live + sum(lengths), decoded + max(lengths) * len(lengths)
    return live, decoded


def rss_child(args) -> None:
    """Runs in a fresh process: load, roll out --rss-episodes as one batch, print peak RSS."""
    model, tokenizer, records, bm25 = setup(args.rss_episodes)
    cfg = ro.RolloutConfig(max_turn_tokens=args.max_turn_tokens, max_turns=args.max_turns,
                           batch_size=args.rss_episodes, bf16=not args.fp32)
    out, seconds = timed(model, tokenizer, records, bm25, cfg)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(json.dumps({"peak_rss_gb": peak_gb, "episodes": len(records), "tokens": out.n_generated,
                      "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=16, help="episodes per run (default 16)")
    parser.add_argument("--max-turn-tokens", type=int, default=64, help="per-turn token cap (default 64)")
    parser.add_argument("--max-turns", type=int, default=3, help="search turns (default 3)")
    parser.add_argument("--rss-episodes", type=int, default=32, help="episodes for the peak-RSS run (0 = skip)")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast (RolloutConfig.bf16=False)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        return rss_child(args)

    model, tokenizer, records, bm25 = setup(args.episodes)
    cfg = ro.RolloutConfig(max_turn_tokens=args.max_turn_tokens, max_turns=args.max_turns,
                           batch_size=args.episodes, bf16=not args.fp32)
    print(f"SmolLM2-135M, {len(records)} toy questions, T={cfg.temperature}, max_turns={cfg.max_turns}, "
          f"max_turn_tokens={cfg.max_turn_tokens}, bf16 autocast={cfg.bf16}, threads={torch.get_num_threads()}",
          flush=True)
    timed(model, tokenizer, records[:2], bm25, ro.RolloutConfig(max_turn_tokens=8, max_turns=1))  # warm-up

    batched, t_batched = timed(model, tokenizer, records, bm25, cfg)
    print(f"batched: {batched.n_generated} tokens in {t_batched:.1f} s", flush=True)
    one_tokens, t_one = 0, 0.0
    for i, record in enumerate(tqdm(records, desc="one at a time")):
        out, seconds = timed(model, tokenizer, [record], bm25, cfg, seed=i)
        one_tokens, t_one = one_tokens + out.n_generated, t_one + seconds
    rate_batched, rate_one = batched.n_generated / t_batched, one_tokens / t_one
    share = batched.timing["retrieval"] / (batched.timing["generate"] + batched.timing["retrieval"])
    searches = sum(e["n_search"] for e in batched.episodes)

    print(f"{'run':<14}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}")
    print(f"{'batched':<14}{batched.n_generated:>8}{t_batched:>9.1f}{rate_batched:>10.1f}")
    print(f"{'one at a time':<14}{one_tokens:>8}{t_one:>9.1f}{rate_one:>10.1f}")
    print(f"speed-up batched / one-at-a-time: {rate_batched / rate_one:.2f}x (target >= 4x)")
    print(f"retrieval share of the batched rollout: {100 * share:.2f}% over {searches} searches "
          f"({batched.timing['retrieval']:.3f} s; target < 10%)")
    live, decoded = live_share(batched)
    print(f"batched decode: {live} of {decoded} row-steps sampled a token ({100 * live / decoded:.0f}%); the rest "
          f"fed rows that had stopped, waiting for the longest row of their turn")
    print(f"episodes finished: {sum(e['finished'] for e in batched.episodes)}/{len(records)}, "
          f"mean EM {sum(e['em'] for e in batched.episodes) / len(records):.2f}")

    if args.rss_episodes:
        child = subprocess.run([sys.executable, __file__, "--rss-child", "--rss-episodes", str(args.rss_episodes),
                                "--threads", str(args.threads), *(["--fp32"] if args.fp32 else []),
                                "--max-turn-tokens", str(args.max_turn_tokens), "--max-turns", str(args.max_turns)],
                               capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(f"peak-RSS run failed:\n{child.stderr[-2000:]}")
        rss = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"peak RSS, fresh process rolling out {rss['episodes']} episodes: {rss['peak_rss_gb']:.2f} GB "
              f"(target < 4 GB; {rss['tokens']} tokens in {rss['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
