"""Scores beside exact match, as peers report them: cover-EM, and k sampled answers per question
scored as avg@k and pass@k with bootstrap 95% intervals over questions (eval.py --samples k,
train.py's eval/pass@k)."""
import collections
import math

import numpy as np


def cover_em(prediction: str | None, golds, normalize) -> float:
    """1.0 if a gold appears in the prediction as whole words, both through `normalize` (SQuAD's:
    rollout.normalize_answer) ("cover exact match", reported by some Search-R1 follow-ups), else 0.0."""
    if prediction is None:
        return 0.0
    text = f" {normalize(prediction)} "
    return float(any(g and f" {g} " in text for g in map(normalize, [golds] if isinstance(golds, str) else golds)))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of Chen et al. (2021): 1 - C(n-c, k) / C(n, k), from n samples of which
    c are correct (k <= n); with k = n it is 1 when any sample is correct."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def per_question(examples: list[dict]) -> dict[str, dict[tuple, list[float]]]:
    """{data_source: {(source, id): [em of each sample]}}, in first-seen order."""
    out = collections.defaultdict(dict)
    for ex in examples:
        out[ex["data_source"]].setdefault((ex["data_source"], ex["id"]), []).append(float(ex["em"]))
    return out


def _scores(samples: list[list[float]], k: int) -> np.ndarray:
    """(questions, 2): avg@k and pass@k of each question."""
    return np.array([[sum(s) / len(s), pass_at_k(len(s), int(sum(s)), min(k, len(s)))] for s in samples])


def sampled_scores(examples: list[dict], k: int, resamples: int = 1000, seed: int = 0) -> dict:
    """avg@k and pass@k per data source and their macro average ("all"), each with a 95% percentile
    bootstrap interval (questions resampled with replacement within each source; none if resamples=0)."""
    rng = np.random.default_rng(seed)
    by_source = {src: _scores(list(qs.values()), k) for src, qs in sorted(per_question(examples).items())}
    boot = {src: np.stack([s[rng.integers(0, len(s), len(s))].mean(0) for _ in range(resamples)] or [s.mean(0)])
            for src, s in by_source.items()}                                             # (resamples, 2)

    def row(point, draws):
        low, high = np.percentile(draws, [2.5, 97.5], axis=0)
        ci = {"avg@k_ci": [low[0], high[0]], "pass@k_ci": [low[1], high[1]]} if resamples else {}
        return {"avg@k": point[0], "pass@k": point[1], **ci}

    rows = {src: {"n": len(s), **row(s.mean(0), boot[src])} for src, s in by_source.items()}
    macro = row(np.mean([s.mean(0) for s in by_source.values()], 0), np.mean(list(boot.values()), 0))
    return {"k": k, "sources": rows, "all": {"n": sum(len(s) for s in by_source.values()), **macro}}


def format_sampled(scores: dict) -> str:
    """Plain-text table of sampled_scores(...)."""
    k = scores["k"]
    lines = [f"{'source':<28}{'N':>6}{f'avg@{k}':>10}{'95% CI':>16}{f'pass@{k}':>10}{'95% CI':>16}"]
    for name, r in [*scores["sources"].items(), ("all (macro)", scores["all"])]:
        ci = lambda key: f"{r[key][0]:.3f}-{r[key][1]:.3f}"                            # noqa: E731
        lines.append(f"{name:<28}{r['n']:>6}{r['avg@k']:>10.3f}{ci('avg@k_ci'):>16}{r['pass@k']:>10.3f}{ci('pass@k_ci'):>16}")
    return "\n".join(lines)
