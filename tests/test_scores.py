"""plumbing/scores.py pinned by hand: cover-EM, the unbiased pass@k, avg@k / pass@k per source with
bootstrap intervals; and eval.py --samples printing them."""
import math

import pytest

from plumbing.scores import cover_em, pass_at_k, sampled_scores
from rollout import normalize_answer


def test_cover_em_is_a_whole_word_gold_inside_the_normalised_answer():
    n = normalize_answer
    assert cover_em("It flows through the Skultae river.", ["Skultae"], n) == 1.0
    assert cover_em("Gimliora", ["Gimli"], n) == 0.0 and cover_em(None, ["x"], n) == 0.0
    assert cover_em("about 386,000", "386000", n) == 1.0 and cover_em("anything", [""], n) == 0.0


def test_pass_at_k_is_chen_et_al_unbiased_estimator():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)                 # pass@1 = c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))   # 1 - 3/10
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0   # k = n: any sample right


def test_sampled_scores_per_source_macro_and_intervals():
    ex = lambda src, q, em: {"data_source": src, "id": q, "em": em}                # noqa: E731
    # source a: q1 right 2 of 4, q2 right 0 of 4 -> avg 0.25, pass@4 0.5; source b: q3 4 of 4 -> 1, 1
    examples = ([ex("a", "q1", e) for e in (1, 0, 1, 0)] + [ex("a", "q2", 0)] * 4 + [ex("b", "q3", 1)] * 4)
    s = sampled_scores(examples, 4, resamples=200)
    assert s["sources"]["a"]["avg@k"] == 0.25 and s["sources"]["a"]["pass@k"] == 0.5 and s["sources"]["a"]["n"] == 2
    assert s["sources"]["b"]["avg@k"] == 1.0 and s["sources"]["b"]["pass@k_ci"] == [1.0, 1.0]
    assert s["all"]["avg@k"] == pytest.approx(0.625) and s["all"]["pass@k"] == pytest.approx(0.75)   # macro
    low, high = s["sources"]["a"]["pass@k_ci"]
    assert low == 0.0 and high == 1.0                                 # 2 questions, one passing: anything
    assert "avg@k_ci" not in sampled_scores(examples, 4, resamples=0)["all"]
