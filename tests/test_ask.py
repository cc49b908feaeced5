"""ask.py: an episode printed turn by turn (hand-made episode), the embedded model asked a toy
question in a pipe (a search and an answer, no colour codes), and a bad question in one line."""
import json
import re
from pathlib import Path

import pytest

import ask
import data
from retriever import open_retriever
from tasks.toy_world import NAME_RE

ROOT = Path(__file__).resolve().parents[1]

EPISODE = {"text": "I should look it up. <search> Kelso </search>\n\n<information>Doc 1(Title: "
                   "\"Velboford\") Velboford is a city.\nDoc 2(Title: \"X\") " + "y" * 200
                   + "</information>\n\n<answer> Velboford </answer>",
           "answer": "Velboford", "finished": True}


def test_an_episode_turn_by_turn_plain_and_coloured():
    assert ask.show(EPISODE, colour=False).splitlines() == [
        "I should look it up. <search> Kelso </search>",
        "    Doc 1(Title: \"Velboford\") Velboford is a city.",
        "    " + ("Doc 2(Title: \"X\") " + "y" * 200)[:96],
        "<answer> Velboford </answer>",
        "answer: Velboford"]
    coloured = ask.show(EPISODE, colour=True)
    assert "\033[1;34m<search> Kelso </search>\033[0m" in coloured
    assert "\033[1;32manswer: Velboford\033[0m" in coloured
    assert ask.show({**EPISODE, "answer": None}, colour=False).endswith("\nno answer")


@pytest.mark.slow
def test_the_embedded_model_searches_and_answers_a_toy_question(capsys):
    ask.main([data.example_question()["question"]])
    out = capsys.readouterr().out
    assert "<search>" in out and "Doc 1(Title:" in out and "\nanswer: " in out
    assert "\033[" not in out                                  # a pipe gets plain text


def test_an_empty_question_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        ask.main([""])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_the_docs_example_question_is_the_worlds_and_its_search_finds_the_answer():
    example = data.example_question()
    question, gold = example["question"], example["golds"][0]
    for page in ("Makefile", "README.md", "ask.py"):
        asked = re.findall(r'ask\.py \\?"([^"\\]+)\\?"', (ROOT / page).read_text())
        assert asked and set(asked) == {question}, page
    person = re.search(f"Where was ({NAME_RE}) born", question).group(1)
    corpus = [json.loads(line)["contents"] for line in
              (data.toy_world() / "corpus.jsonl").read_text().splitlines()]
    assert any(p.startswith(f'"{person}"') and gold in p for p in corpus)     # its own passage
    # the search a trained agent makes, the person's name, finds the passage that holds the answer
    top = open_retriever("bm25", corpus=str(data.toy_world() / "corpus.jsonl")).search([person], 1)
    found = top[0][0]["document"]["contents"]
    assert found.startswith(f'"{person}"') and gold in found
