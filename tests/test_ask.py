"""ask.py: an episode printed turn by turn (hand-made episode), the embedded model asked a toy
question in a pipe (a search and an answer, no colour codes), and a bad question in one line."""
import pytest

import ask

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
    ask.main(["Where was Doravin Kelso born?"])
    out = capsys.readouterr().out
    assert "<search>" in out and "Doc 1(Title:" in out and "\nanswer: " in out
    assert "\033[" not in out                                  # a pipe gets plain text


def test_an_empty_question_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        ask.main([""])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
