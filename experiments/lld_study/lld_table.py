"""The README's table of the LLD comparison: one row per run, from each run's metrics.jsonl.

    .venv/bin/python experiments/lld_study/lld_table.py experiments/lld_study/compare/compare-grpo-s0 experiments/lld_study/compare/compare-llds-s0 ...

Columns, all read from the training metrics (no re-running):
- reward: mean training reward of the first 5 and of the last 5 steps (32 episodes a step are noisy);
- held-out EM: the first and the last evaluation (greedy, fixed subset);
- correct log-lik fell: the longest stretch of consecutive steps over which `lld/logp_correct` (mean
  token log-likelihood of the correct responses under the rollout policy) fell, and by how much;
- worst displacement: the largest `lld/correct_displacement` (d = log pi_old - log pi_theta: the
  summed log-prob before minus after the step's updates, mean over the correct responses; > 0:
  they lost likelihood) and its step (the first, on a tie);
- entropy: first step -> last step; grad norm (max over a step's updates): first step -> the
  largest of the last 5 steps (a step whose groups all tie has no gradient: norm 0);
- collapse: the first step at which the 5-step mean reward is below half its best earlier
  value while entropy is above 1.5x its first value; "-" when that never happens;
- s/step: mean seconds of a training step (held-out evaluation excluded).
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from plumbing.metrics_file import read_metrics  # noqa: E402


def longest_fall(points):
    """points [(step, value)] -> (first step, last step, drop) of the longest run of decreases."""
    best, start = None, 0
    for i in range(1, len(points) + 1):
        if i == len(points) or points[i][1] >= points[i - 1][1]:
            if i - 1 > start and (best is None or i - 1 - start > best[1] - best[0]):
                best = (start, i - 1)
            start = i
    if best is None:
        return None
    (a, va), (b, vb) = points[best[0]], points[best[1]]
    return a, b, vb - va


def collapse_step(lines):
    rewards = [l["reward"] for l in lines]
    entropy0 = lines[0]["entropy"]
    best = 0.0
    for i in range(4, len(lines)):
        avg = statistics.fmean(rewards[i - 4:i + 1])
        if best > 0 and avg < best / 2 and lines[i]["entropy"] > 1.5 * entropy0:
            return lines[i]["step"]
        best = max(best, avg)
    return None


def row(run_dir: Path) -> str:
    lines = read_metrics(run_dir)
    train = [l for l in lines if "reward" in l]
    evals = [(l["step"], l["eval/em"]) for l in lines if l.get("eval/em") is not None]
    logp = [(l["step"], l["lld/logp_correct"]) for l in train if l.get("lld/logp_correct") is not None]
    disp = [(l["lld/correct_displacement"], l["step"]) for l in train
            if l.get("lld/correct_displacement") is not None]
    fall = longest_fall(logp)
    first5, last5 = [l["reward"] for l in train[:5]], [l["reward"] for l in train[-5:]]
    worst = max(disp, key=lambda p: p[0]) if disp else None
    collapse = collapse_step(train)
    cells = [
        run_dir.name, str(len(train)),
        f"{statistics.fmean(first5):.2f} -> {statistics.fmean(last5):.2f}",
        f"{evals[0][1]:.2f} -> {evals[-1][1]:.2f} (step {evals[-1][0]})" if evals else "-",
        f"steps {fall[0]}-{fall[1]}: {fall[2]:+.3f}" if fall else "never",
        f"{worst[0]:+.2f} (step {worst[1]})" if worst else "-",
        f"{train[0]['entropy']:.3f} -> {train[-1]['entropy']:.3f}",
        f"{train[0]['grad_norm_max']:.3g} -> {max(l['grad_norm_max'] for l in train[-5:]):.3g}",
        f"step {collapse}" if collapse else "-",
        f"{statistics.fmean(l['timing/step'] for l in train):.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders holding metrics.jsonl")
    args = parser.parse_args()
    print("| run | steps | reward (first 5 -> last 5) | held-out EM | correct log-lik fell | "
          "worst displacement | entropy | grad norm | collapse | s/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run_dir in args.runs:
        print(row(run_dir))


if __name__ == "__main__":
    main()
