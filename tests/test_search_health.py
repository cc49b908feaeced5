"""Search-health metrics (plumbing/search_health.py), pinned by hand-worked batches."""
import torch

from plumbing.search_health import answer_in_passages, shared_first_search, unique_queries
from rollout import normalize_answer


def test_shared_first_search_counts_correct_incorrect_pairs_of_a_group():
    q = lambda *queries: {"queries": list(queries)}                                       # noqa: E731
    episodes = [q("Talia  Wrenn", "x"), q("talia wrenn"), q("Orvale"), q(),             # group 0
                q("a"), q("a"),                                                          # group 1
                q("b"), q("c")]                                                          # group 2
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 1, 0]).bool()
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    # group 0: pairs (0,1) same, (0,2) differ, (0,3) no search; group 1: no incorrect;
    # group 2: (6,7) differ -> 1 of 4 pairs
    assert shared_first_search(episodes, correct, groups) == 0.25
    assert shared_first_search(episodes[4:6], correct[4:6], groups[4:6]) is None
    # distinct first queries: group 0 {talia wrenn, orvale, none} = 3, group 1 {a} = 1, group 2 {b, c} = 2
    assert unique_queries(episodes, groups) == 2.0


def test_answer_in_passages_counts_each_observation_once_by_normalised_whole_words():
    obs = lambda *texts: "".join(f"<search> q </search><information>{t}</information>" for t in texts)  # noqa: E731
    episodes = [
        {"golds": ["The Skultae"], "text": obs('Doc 1(Title: "X") the skultae river.', "Doc 1 nothing")},  # 1 of 2
        {"golds": ["Gimli"], "text": obs("Gimliora is a city.")},      # a longer word only: not a hit
        {"golds": ["386,000", ""], "text": obs("about 386000 inhabitants") + "<answer> x </answer>"},  # 1 of 1
        {"golds": ["Velboford"], "text": "<answer> Velboford </answer>"},   # no search: not counted
    ]
    assert answer_in_passages(episodes, normalize_answer) == 2 / 4
    assert answer_in_passages(episodes[3:], normalize_answer) is None
