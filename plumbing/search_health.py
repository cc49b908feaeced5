"""Is the policy still searching well, do its groups still carry signal? Per-step numbers of a
batch of episodes (rollout.rollout's dicts: "queries", "text", "golds"), named as they are logged:

* frac_reward_zero_std: the fraction of groups whose rewards all tie (TRL's name): their
  advantages are 0, so they give GRPO no gradient.

* search/answer_in_passages: the fraction of executed searches whose passages, as the model saw
  them, hold a gold answer (SQuAD-normalised): reward falling while this holds means the policy
  stopped reading well, not searching well.
* search/unique_queries: distinct first queries per group, averaged (no search counts as one
  more kind): exploration collapsing shows as this falling towards 1.
* lld/shared_first_search: correct/incorrect pairs of a group with the same first query, the
  paper's shared-prefix mechanism.
"""
import collections
import re
import statistics

import torch

_OBSERVATION = re.compile(r"<information>(.*?)</information>", re.DOTALL)


def first_query(episode: dict) -> str | None:
    """The episode's first search query, lower-cased, whitespace collapsed; None without one."""
    return " ".join(episode["queries"][0].lower().split()) if episode["queries"] else None


def shared_first_search(episodes: list[dict], correct: torch.Tensor, group_ids: torch.Tensor) -> float | None:
    """Fraction of (correct, incorrect) response pairs of one group with the same first search query
    (lower-cased, whitespace collapsed); None when no group has both. The paper's mechanism: such pairs
    share a context prefix, and pushing the incorrect one down drags the correct one's likelihood."""
    # per group: pairs = n_correct x n_incorrect, shared = sum over queries of the two counts' product
    # (linear in N; the pairs themselves are N^2: 6.5 M at the paper's 2,560 episodes a step)
    counts = collections.defaultdict(lambda: [collections.Counter(), collections.Counter()])
    for e, c, g in zip(episodes, correct.tolist(), group_ids.tolist()):
        counts[g][0 if c else 1][first_query(e)] += 1
    pairs = sum(sum(right.values()) * sum(wrong.values()) for right, wrong in counts.values())
    shared = sum(n * wrong[q] for right, wrong in counts.values() for q, n in right.items() if q is not None)
    return shared / pairs if pairs else None


def answer_in_passages(episodes: list[dict], normalize) -> float | None:
    """Fraction of the episodes' observations holding a gold answer as a whole-word phrase after
    `normalize` (SQuAD's: rollout.normalize_answer); None when nothing was searched."""
    hits = []
    for e in episodes:
        golds = [g for g in map(normalize, e["golds"]) if g]
        hits += [any(f" {g} " in f" {normalize(obs)} " for g in golds) for obs in _OBSERVATION.findall(e["text"])]
    return statistics.fmean(hits) if hits else None


def unique_queries(episodes: list[dict], group_ids: torch.Tensor) -> float:
    """Distinct first queries per group (None, no search, is one kind), averaged over groups."""
    first = [first_query(e) for e in episodes]
    return statistics.fmean(len({first[i] for i in torch.nonzero(group_ids == g).flatten().tolist()})
                            for g in group_ids.unique())


def search_health(episodes: list[dict], rewards: torch.Tensor, group_ids: torch.Tensor, normalize) -> dict:
    """All of the module docstring's numbers: rewards (N,) float, group_ids (N,) long, normalize the
    answer normaliser (rollout.normalize_answer)."""
    tied = [len(set(rewards[group_ids == g].tolist())) == 1 for g in group_ids.unique()]   # (groups,)
    return {"frac_reward_zero_std": statistics.fmean(tied),
            "search/answer_in_passages": answer_in_passages(episodes, normalize),
            "search/unique_queries": unique_queries(episodes, group_ids),
            "lld/shared_first_search": shared_first_search(episodes, rewards > 0, group_ids)}
