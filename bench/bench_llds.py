"""Benchmark: cost of llds_loss next to the PPO clipped surrogate it is added to.

Times forward + backward of llds.llds_loss and train.policy_loss on the same random batch
(default B=256, T=4096, the paper's context length) with a realistic Search-R1 mask: a prompt,
then model actions separated by retrieved observations, then padding. Both run side by side in
one process, alternating, and the median of the repeats is reported with the ratio
LLDS / surrogate (target: <= 1.0). Stats (the .item() calls) are included in both timings.

    .venv/bin/python bench/bench_llds.py              # B=256, T=4096, 10 repeats
    .venv/bin/python bench/bench_llds.py --help
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from llds import llds_loss  # noqa: E402
from train import policy_loss  # noqa: E402


def search_r1_mask(batch, length, gen):
    """(B, T) float loss mask: prompt 0s, 2-4 actions split by observations, padding 0s."""
    mask = torch.zeros(batch, length)
    for row in range(batch):  # setup only, not timed
        pos = int(torch.randint(200, 1000, (1,), generator=gen))             # prompt
        for turn in range(int(torch.randint(2, 5, (1,), generator=gen))):
            if turn:
                pos += int(torch.randint(100, 500, (1,), generator=gen))     # observation
            n = int(torch.randint(30, 300, (1,), generator=gen))             # action
            mask[row, pos:pos + n] = 1
            pos += n
            if pos >= length:
                break
    return mask


def time_it(fn, logp):
    logp.grad = None
    start = time.perf_counter()
    loss, _ = fn()
    loss.backward()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="responses per batch (B)")
    parser.add_argument("--length", type=int, default=4096, help="tokens per response (T)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats (median taken)")
    parser.add_argument("--gate", default="action", choices=["action", "response", "token"])
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.length)
    mask = search_r1_mask(*shape, gen)
    old = -torch.rand(shape, generator=gen) * 4
    logp = (old + 0.05 * torch.randn(shape, generator=gen)).requires_grad_()
    adv = torch.randn(args.batch, generator=gen)
    answer = torch.zeros(shape)

    runs = {"policy_loss": lambda: policy_loss(logp, old, adv, mask),
            "llds_loss": lambda: llds_loss(logp, old, adv, mask, gate=args.gate),
            "llds_loss+answer_mask": lambda: llds_loss(logp, old, adv, mask, gate=args.gate,
                                                       answer_mask=answer, answer_weight=0.5)}
    times = {name: [] for name in runs}
    for name, fn in runs.items():  # warm-up
        time_it(fn, logp)
    for _ in range(args.repeats):  # interleaved so that machine noise hits all alike
        for name, fn in runs.items():
            times[name].append(time_it(fn, logp))

    print(f"B={args.batch} T={args.length} gate={args.gate} model tokens={int(mask.sum())} "
          f"torch={torch.__version__} threads={torch.get_num_threads()} repeats={args.repeats}")
    base = statistics.median(times["policy_loss"])
    for name, samples in times.items():
        med = statistics.median(samples)
        print(f"  {name:24s} median {med * 1e3:8.1f} ms  (min {min(samples) * 1e3:7.1f})  "
              f"ratio to policy_loss {med / base:.2f}")
    print("reproduce: .venv/bin/python bench/bench_llds.py "
          f"--batch {args.batch} --length {args.length} --repeats {args.repeats} --gate {args.gate}")


if __name__ == "__main__":
    main()
