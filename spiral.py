"""spiral.py: the death-spiral warning train.py prints and logs as `lld/warning` (1 or 0).

The paper's spiral has three phases (Deng et al., arXiv 2512.04220, figure 2): I. reward rises
while the correct responses' likelihood stays flat; II. that likelihood falls slowly, reward still
rises, entropy creeps up; III. the likelihood drops sharply, the gradient norm explodes, entropy
surges and reward collapses.

The rule: warn at a step when the correct responses lost more than `nats` of log-likelihood over
the last `window` steps' updates (their displacement, summed: gains offset losses) while the
`window`-step mean training reward is below 0.7 of its best earlier `window`-step mean. That is
phase II's likelihood loss met by phase III's first fall of reward; defaults 5 steps, 5 nats.

Why not phase II alone, nor phase III's other signs: in the LLD study, plain-GRPO runs that kept
learning displaced their correct responses as much as the two that broke down, entropy fell in
one that broke down, and a broken-down run has no gradient at all (every group tied at 0). The
rule was chosen on part of the committed runs and checked on the rest by replaying their
metrics.jsonl through this class: experiments/lld_study/spiral_replay.py, `make study`.

Also reported, as a fact rather than a forecast: a non-finite gradient norm (that update was
skipped). A step without a correct response displaces none; with --displacement-every 0 (or N > 1)
the displacement is missing on the steps without it and the rule sees less.

Pure Python: the replay runs it without torch.
"""
import math
import statistics

from tqdm import tqdm

REWARD_FRACTION = 0.7      # of the best earlier window's mean reward: below it, reward is falling


def lost_nats(metrics: dict) -> float:
    """Summed log-likelihood the step's updates took from its correct responses (mean over them;
    > 0 = lost; 0 when the step had none). The one place that reads the displacement's sign."""
    return -(metrics.get("lld/displacement_correct") or 0.0)     # logged as after - before


class SpiralMonitor:
    """The rule above, one step at a time. `history` (checkpointed as state["monitor"]) holds the
    last `window` losses and rewards and the best window mean so far; an older checkpoint's
    history (other keys) is dropped, and the rule waits for a full window again."""

    def __init__(self, window: int = 5, nats: float = 5.0, history: dict | None = None):
        self.window, self.nats = window, nats
        kept = {k: v for k, v in (history or {}).items() if k in ("lost", "reward", "best")}
        self.history = {"lost": [], "reward": [], "best": None, **kept}

    def warn(self, step: int, metrics: dict) -> int:
        """check(), printing each warning above the progress bar; 1 if there was one, else 0."""
        warnings = self.check(step, metrics)
        for text in warnings:
            tqdm.write("LLD WARNING " + text)
        return int(bool(warnings))

    def check(self, step: int, metrics: dict) -> list[str]:
        """The warnings of this step (a list of sentences, empty when all is well)."""
        warnings, h = [], self.history
        norm = metrics.get("grad_norm_max")
        if norm is not None and not math.isfinite(norm):
            warnings.append(f"step {step}: gradient norm {norm}; the update was skipped "
                            "(skipped_steps)")
        if metrics.get("reward") is None:          # not a training step: no window moves
            return warnings
        h["lost"] = (h["lost"] + [lost_nats(metrics)])[-self.window:]
        h["reward"] = (h["reward"] + [metrics["reward"]])[-self.window:]
        if len(h["reward"]) < self.window:
            return warnings
        lost, mean = sum(h["lost"]), statistics.fmean(h["reward"])
        best = h["best"]
        # best is over earlier windows only, so the window that falls is never its own yardstick
        if best and lost > self.nats and mean < REWARD_FRACTION * best:
            warnings.append(
                f"step {step}: correct responses lost {lost:.1f} nats of log-likelihood over "
                f"{self.window} steps while mean reward fell to {mean:.3f} (best {best:.3f}): "
                "lazy likelihood displacement turning into collapse (LLDS guards against it: "
                "--llds, or a larger --llds-lambda)")
        h["best"] = max(best or 0.0, mean)
        return warnings
