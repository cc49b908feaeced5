"""The statistics of the spiral study, by hand (numpy and the standard library only).

- Kaplan-Meier: the fraction of runs not yet broken down after each step, with a pointwise 95%
  band from Greenwood's variance on the log(-log S) scale (as lifelines draws it).
- The log-rank test of two arms' survival curves (chi-square, 1 degree of freedom).
- Fisher's exact test (two-sided) of breakdowns x / N against y / M.
- A percentile bootstrap interval of a paired mean difference.

A run is (time, event): `time` the breakdown's onset step when event is True, else the last step
it ran (censored: it had not broken down when it ended).
"""
import math

import numpy as np

Z95 = 1.959963984540054


def kaplan_meier(times, events) -> list[dict]:
    """One row per distinct event time t: at_risk (runs with time >= t), events at t, survival
    S(t) and its 95% band (low, high), all of S's drops in order."""
    times, events = np.asarray(times), np.asarray(events, dtype=bool)
    rows, s, greenwood = [], 1.0, 0.0
    for t in np.unique(times[events]):
        n, d = int((times >= t).sum()), int((events & (times == t)).sum())
        s *= 1.0 - d / n
        greenwood = greenwood + d / (n * (n - d)) if n > d else math.inf
        rows.append({"time": int(t), "at_risk": n, "events": d, "survival": s,
                     **_band(s, greenwood)})
    return rows


def _band(s: float, greenwood: float) -> dict:
    # exp(+-z sd) on log(-log S), sd = sqrt(greenwood) / |log S|; no band at S = 0 or 1
    if s <= 0.0 or s >= 1.0 or not math.isfinite(greenwood):
        return {"low": s, "high": s} if s >= 1.0 else {"low": 0.0, "high": 0.0}
    sd = math.sqrt(greenwood) / abs(math.log(s))
    return {"low": s ** math.exp(Z95 * sd), "high": s ** math.exp(-Z95 * sd)}


def log_rank(times_a, events_a, times_b, events_b) -> dict:
    """The log-rank test that two arms break down at the same rate: observed and expected events
    of arm a summed over the distinct event times -> {chi2, p, observed_a, expected_a}."""
    times = np.concatenate([times_a, times_b])
    events = np.concatenate([events_a, events_b]).astype(bool)
    in_a = np.arange(len(times)) < len(times_a)
    observed = expected = variance = 0.0
    for t in np.unique(times[events]):
        risk = times >= t
        n, n_a = risk.sum(), (risk & in_a).sum()
        d, d_a = (events & (times == t)).sum(), (events & (times == t) & in_a).sum()
        observed, expected = observed + d_a, expected + d * n_a / n
        if n > 1:
            variance += d * (n_a / n) * (1 - n_a / n) * (n - d) / (n - 1)
    chi2 = (observed - expected) ** 2 / variance if variance > 0 else 0.0
    return {"chi2": float(chi2), "p": math.erfc(math.sqrt(chi2 / 2)),
            "observed_a": float(observed), "expected_a": float(expected)}


def fisher_exact(x: int, n: int, y: int, m: int) -> float:
    """Two-sided p of Fisher's exact test on the table [[x, n - x], [y, m - y]]: the summed
    probability of every table with the same margins no likelier than the observed one."""
    total, k = n + m, x + y

    def prob(a: int) -> float:
        return math.comb(n, a) * math.comb(m, k - a) / math.comb(total, k)

    observed = prob(x)
    tables = range(max(0, k - m), min(k, n) + 1)
    return min(1.0, sum(prob(a) for a in tables if prob(a) <= observed * (1 + 1e-7)))


def paired_bootstrap(a, b, resamples: int = 10_000, seed: int = 0) -> dict:
    """Mean of b - a over pairs and its 95% percentile bootstrap interval (numpy
    default_rng(seed), pairs resampled with replacement)."""
    diff = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), (resamples, len(diff)))].mean(1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"mean": float(diff.mean()), "low": float(low), "high": float(high), "pairs": len(diff)}
