"""The noisy scripted searcher: the demonstrations sft.py warm-starts a policy on (`--script
noisy`, the LLD lab's recipe: experiments/lab/prereg.md).

It writes `<search> name </search>`, reads the returned passages with the toy world's own
templates, and answers `<answer> value </answer>`. Its mistakes are drawn from MIXTURE: a wrong
first query (the surname only, or the question's other words), and a wrong answer (the asked
relation of a retrieved distractor, or another fact of the right passage). Many of its wrong
episodes therefore share the correct episode's first search, as in the paper.
"""
from __future__ import annotations

import random
import re

from tasks.toy_world import parse_question, read_facts

# How the scripted searcher errs: fixed before any RL run (experiments/lab/prereg.md).
MIXTURE = {
    "search_right": 0.85,      # first query = the asked entity's full name
    "wrong_query": {"surname": 1 / 2, "question_words": 1 / 2},   # (a name with one vowel changed taught
    #                                                                     the model to garble the names it copies)
    "answer_right": 0.70,      # answer = the asked relation, read from the passage titled with the asked name
    "wrong_answer": {"distractor_same_relation": 0.6, "right_doc_other_fact": 0.4},
}
_QUESTION_LINE = re.compile(r"Question: (.+?\?)\n")
_INFORMATION = re.compile(r"<information>(.*?)</information>", re.DOTALL)
_PASSAGE = re.compile(r'Doc \d+\(Title: (".*?")\) (.*)')


# ---- The noisy scripted searcher ------------------------------------------------------------

def _wrong_query(name: str, question: str, rng: random.Random) -> str:
    kind = rng.choices(list(MIXTURE["wrong_query"]), weights=list(MIXTURE["wrong_query"].values()))[0]
    words = name.split()
    if kind == "surname" and len(words) > 1:
        return words[-1]
    return " ".join(question.replace(name, " ").rstrip("?").split())   # a one-word name: its question's words


def _answer(name: str, relation: str, passages: list[str], rng: random.Random) -> str:
    facts = read_facts(passages)
    right = facts.get(name, {}).get(relation)
    if right is not None and rng.random() < MIXTURE["answer_right"]:
        return right
    wrong = {"distractor_same_relation": [f[relation] for t, f in facts.items() if t != name and relation in f],
             "right_doc_other_fact": [v for k, v in facts.get(name, {}).items() if k != relation]}
    kinds = [k for k in MIXTURE["wrong_answer"] if wrong[k]]
    if not kinds:       # nothing of the kind retrieved: any fact of a retrieved passage, else a title
        values = [v for f in facts.values() for v in f.values()] or [p.partition("\n")[0].strip('"') for p in passages]
        return rng.choice(values) if values else "unknown"
    kind = rng.choices(kinds, weights=[MIXTURE["wrong_answer"][k] for k in kinds])[0]
    return rng.choice(wrong[kind])


def noisy_searcher(context: str, rng: random.Random) -> str | None:
    """The next turn of the scripted searcher, from the episode's text so far (plumbing/scripted.py
    calls it): a search of the asked name (or a MIXTURE mistake) first, then an answer read from
    the last observation. None before the question is complete (a shared prompt prefix)."""
    questions = _QUESTION_LINE.findall(context)       # the few-shot prompt's examples come first
    parsed = parse_question(questions[-1]) if questions else None
    if parsed is None:
        return None
    name, _, chain, _ = parsed
    after = context[context.rfind("Question: " + questions[-1]):]
    observations = _INFORMATION.findall(after)
    if not observations:
        query = name if rng.random() < MIXTURE["search_right"] else _wrong_query(name, questions[-1], rng)
        return f"<search> {query} </search>"
    passages = [f"{m[1]}\n{m[2]}" for m in map(_PASSAGE.match, observations[-1].strip().split("\n")) if m]
    return f"<answer> {_answer(name, chain[0], passages, rng)} </answer>"
