"""monitor.py: the LLD monitor. What a training step did to its correct responses (`lld/*`: the
phenomenon, where `llds/*` describe the regulariser), and the death-spiral warning train.py prints
and logs as `lld/warning` (1 or 0).

Displacement has llds.py's sign everywhere: d = log pi_old - log pi_theta, > 0 where a token lost
likelihood. `lld/correct_displacement` is the mean over the step's correct responses of their
summed d after all the step's updates (exactly 0 at unchanged weights); `_search` / `_answer` split
it between the turns before the answer turn and the answer turn (the paper's figure 5).

The paper's spiral has three phases (Deng et al., arXiv 2512.04220, figure 2): I. reward rises
while the correct responses' likelihood stays flat; II. that likelihood falls slowly, reward still
rises, entropy creeps up; III. the likelihood drops sharply, the gradient norm explodes, entropy
surges and reward collapses.

The warning's rule (RULE, at the end of this file) is a conjunction of conditions on the signals a
step logs, each a threshold on a signal's level or on its change from the run's first BASELINE
steps (Condition). It was chosen, not guessed: experiments/spiral/ ran plain GRPO and GRPO + LLDS
on 30 seeds each, a rule was designed on the first 15 seeds' logs alone (the highest recall with at
most 1 false alarm in 10 runs that never broke down) and committed before the other 15 ran; on
those, held out: RULE_RECORD. That is far from the goal it was designed for (recall 0.7 with a
2-step lead): a hint, not a reliable forecast. The signals it chose among: the correct responses'
displacement, `frac_reward_zero_std`, `valid_action_ratio`, `finished`, entropy, the gradient norm,
clip ratio, response length, searches, reward, and two the literature names as early signs: the
probability the rollout policy gave its control tags where it wrote them (`ctrl/p_search`,
`ctrl/p_answer`, `ctrl/p_close`) and the step's gradient norm as a z-score against the run's own
earlier steps (`grad_norm_z`).

`lld/warning` is this rule alone, and `--no-spiral-warning` silences it. A non-finite gradient
norm is a fact, not a forecast: train.py reports it whatever the switch (`grad_norm_nonfinite`, the
update skipped and counted in `skipped_steps`). A step without a correct response displaces none;
with --displacement-every 0 (or N > 1) the displacement is missing on the steps without it and the
rule sees less.
"""
import itertools
import math
import re
import statistics
from dataclasses import dataclass

import torch
from tqdm import tqdm

from llds import action_ids
from plumbing.search_health import search_health
from rollout import normalize_answer

BASELINE = 3               # a signal's change is read against its mean over the run's first steps


def rollout_stats(ro_out, old_logp, rewards, group_ids) -> dict:
    """The rollout's numbers; lld/logp_(in)correct: the mean over (in)correct responses of their
    mean token log-likelihood under the rollout policy. old_logp (N, T)."""
    eps, mask = ro_out.episodes, ro_out.loss_mask
    n_tok = mask.sum(1)                                                            # (N,)
    per_response = torch.where(mask.bool(), old_logp, 0.0).sum(1) / n_tok.clamp(min=1)   # (N,)
    right, wrong = (rewards > 0) & (n_tok > 0), (rewards <= 0) & (n_tok > 0)
    n_actions = max(int(action_ids(mask).amax(dim=1).sum()), 1)
    return {
        "reward": rewards.mean().item(),
        "em": statistics.fmean(e["em"] for e in eps),
        "f1": statistics.fmean(e["f1"] for e in eps),
        "response_length": n_tok.mean().item(),
        "searches": statistics.fmean(e["n_search"] for e in eps),
        "valid_action_ratio": sum(e["n_valid"] for e in eps) / n_actions,
        "finished": statistics.fmean(float(e["finished"]) for e in eps),
        "lld/logp_correct": per_response[right].mean().item() if right.any() else None,
        "lld/logp_incorrect": per_response[wrong].mean().item() if wrong.any() else None,
        # frac_reward_zero_std, search/*: plumbing/search_health.py
        **search_health(eps, rewards, group_ids, normalize_answer),
        # the KV-cache decode's log-probs against the forward's
        "rollout/logp_diff": (torch.where(mask.bool(), (ro_out.logp - old_logp).abs(), 0.0).sum()
                              / n_tok.sum().clamp(min=1)).item(),
    }


CONTROL_TAGS = {"ctrl/p_search": re.compile(r"<search>"), "ctrl/p_answer": re.compile(r"<answer>"),
                "ctrl/p_close": re.compile(r"</(search|answer)>")}


def control_tag_probs(tokenizer, input_ids, loss_mask, old_logp) -> dict:
    """The probability the rollout policy gave each control tag where it wrote one: the mean, over
    the tags of a kind in the model's turns, of exp(sum of log pi_old over the tag's tokens; a
    token counts when its text overlaps the tag's). None for a kind never written.
    input_ids, loss_mask, old_logp: (N, T)."""
    text_of = {i: tokenizer.decode([i]) for i in input_ids[loss_mask.bool()].unique().tolist()}
    probs = {key: [] for key in CONTROL_TAGS}
    turns = action_ids(loss_mask)                                                    # (N, T)
    for row in range(len(turns)):
        for turn in range(1, int(turns[row].max()) + 1):
            cols = torch.nonzero(turns[row] == turn).flatten()
            ids, logps = input_ids[row, cols].tolist(), old_logp[row, cols]
            ends = list(itertools.accumulate(len(text_of[i]) for i in ids))
            text, starts = "".join(text_of[i] for i in ids), [0] + ends[:-1]
            for key, pattern in CONTROL_TAGS.items():
                for m in pattern.finditer(text):
                    on = [k for k in range(len(ids)) if starts[k] < m.end() and ends[k] > m.start()]
                    probs[key].append(math.exp(float(logps[on].sum())))
    return {key: statistics.fmean(p) if p else None for key, p in probs.items()}


DISPLACEMENT = ("lld/correct_displacement", "lld/correct_frac_lost",
                "lld/correct_displacement_search", "lld/correct_displacement_answer")


def displacement(batch: dict, after, correct) -> tuple[dict, torch.Tensor]:
    """What the step's updates did to its correct responses (correct: (N,) bool), from their
    log-probs before (batch["old_logp"]) and after (N, T) -> (the lld/*displacement metrics,
    None without a correct response; change (N, T): after - before per model token, the token
    view's colours)."""
    change = torch.where(batch["loss_mask"].bool(), after - batch["old_logp"], 0.0)   # (N, T)
    if not correct.any():
        return dict.fromkeys(DISPLACEMENT), change
    idx = torch.nonzero(correct).flatten()
    d = -change[idx]                                                  # (C, T) log pi_old - log pi
    action = action_ids(batch["loss_mask"][idx])                                   # (C, T)
    answer = (action * batch["answer_mask"][idx].bool()).amax(1, keepdim=True)     # (C, 1)
    in_answer = (action == answer) & (answer > 0)
    values = [d.sum(1).mean(), (d.sum(1) > 0).float().mean(),              # the paper's Fig. 5:
              d.masked_fill(in_answer, 0.0).sum(1).mean(),                 # the turns before,
              d.masked_fill(~in_answer, 0.0).sum(1).mean()]                # the answer turn
    return dict(zip(DISPLACEMENT, torch.stack(values).tolist())), change


class SpiralMonitor:
    """RULE, one step at a time: a warning at each training step where every condition of the rule
    fires, each reading its signal's values so far. `history` (checkpointed as state["monitor"])
    holds them and the gradient norms grad_norm_z compares against; an older checkpoint's history
    (other keys) is dropped, and the signals start afresh."""

    def __init__(self, rule: tuple = None, history: dict | None = None):
        self.rule = RULE if rule is None else rule
        kept = {k: v for k, v in (history or {}).items() if k in ("signals", "grad_norms")}
        self.history = {"signals": {}, "grad_norms": [], **kept}

    def grad_norm_z(self, norm: float) -> float | None:
        """The step's gradient norm against the run's earlier steps, (norm - mean) / sd over those
        with a finite nonzero norm (a step whose groups all tied has none); None before 3 of them
        or at sd 0. The norm then joins the history."""
        earlier = self.history["grad_norms"]
        z = None
        if len(earlier) >= 3 and statistics.stdev(earlier) > 0 and math.isfinite(norm):
            z = (norm - statistics.fmean(earlier)) / statistics.stdev(earlier)
        if math.isfinite(norm) and norm > 0:
            earlier.append(norm)
        return z

    def warn(self, step: int, metrics: dict) -> int:
        """check(), printing each warning above the progress bar; 1 if there was one, else 0."""
        warnings = self.check(step, metrics)
        for text in warnings:
            tqdm.write("LLD WARNING " + text)
        return int(bool(warnings))

    def check(self, step: int, metrics: dict) -> list[str]:
        """The warnings of this step (a list of sentences, empty when all is well)."""
        warnings, series = [], self.history["signals"]
        if metrics.get("reward") is None:          # not a training step: no signal moves
            return warnings
        for signal in dict.fromkeys(c.signal for c in self.rule):
            series.setdefault(signal, []).append(metrics.get(signal))
        if self.rule and all(c.fires(series[c.signal]) for c in self.rule):
            seen = "; ".join(f"{c}: {c.reading(series[c.signal]):.4g}" for c in self.rule)
            record = f"the default rule: {RULE_RECORD}; " if self.rule == RULE else ""
            warnings.append(f"step {step}: {seen} ({record}LLDS guards against the spiral: "
                            "--llds, or a larger --llds-lambda)")
        return warnings


@dataclass(frozen=True)
class Condition:
    """A sign read from one logged signal each step: its level, or its change from its mean over
    the run's first BASELINE steps, averaged over the last `window` steps, or its trend (the
    least-squares slope a step over the last `window` steps), above or below `threshold`. The
    warning's candidates (experiments/spiral/detector.py) and its rule."""
    signal: str
    change: bool
    window: int
    above: bool
    threshold: float
    trend: bool = False

    def reading(self, values: list) -> float | None:
        """The reading at the last of `values`, the signal at each training step so far (None
        where it was not logged); None until there is one (a missing value in the window, or a
        change before the baseline's steps have passed)."""
        last = values[-self.window:]
        if len(last) < self.window or None in last or (self.change and len(values) <= BASELINE):
            return None
        if self.trend:
            return statistics.linear_regression(range(self.window), last).slope
        seen = [v for v in values[:BASELINE] if v is not None] if self.change else [0.0]
        return statistics.fmean(last) - statistics.fmean(seen) if seen else None

    def fires(self, values: list) -> bool:
        x = self.reading(values)
        return x is not None and (x > self.threshold if self.above else x < self.threshold)

    def __str__(self) -> str:
        if self.trend:
            text = f"trend of {self.signal} over {self.window} steps (a step)"
        else:
            text = f"{'change of ' if self.change else ''}{self.signal}"
            text += f" (mean of {self.window} steps)" if self.window > 1 else ""
        return f"{text} {'>' if self.above else '<'} {self.threshold:.4g}"


# The warning's rule (experiments/spiral/design.json: chosen on the spiral study's seeds 0-14 by
# experiments/spiral/detector.py; tests/test_monitor.py checks the two agree) and its record.
RULE = (Condition("ctrl/p_close", change=True, window=2, above=False, threshold=-0.124729),)
RULE_TEXT = " and ".join(map(str, RULE))
RULE_RECORD = ("on the 30 runs it was designed on, it warned 3 of 12 breakdowns 2 or more steps "
               "ahead and fired in 1 of the 18 runs without one; on the 30 held-out runs, "
               "2 of 16 (median lead 4 steps) and 1 of 14")
