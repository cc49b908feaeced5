"""The token view (plumbing/token_view.py) of a real tiny run: its per-token numbers add up to the
logged displacement, with its sign, and its page marks what the JSONL says."""
import json
import re
import shutil

import pytest

import train
from conftest import tiny_policy
from test_train import step_lines, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def test_token_changes_sum_to_the_logged_displacement(tmp_path, alternating_rewards):  # noqa: F811
    train.train(tiny_config(tmp_path, steps=2, token_view_every=1, eval_size=0), *tiny_policy())
    lines = step_lines(tmp_path / "run")
    for line in lines:
        rows = [json.loads(l) for l in (tmp_path / "run" / "views" / f"step_{line['step']:04d}.jsonl").open()]
        assert len(rows) == 4 and {r["group"] for r in rows} == {0, 1}
        for r in rows:
            model = [t for t in r["tokens"] if t["kind"] == "model"]
            assert model and all(t["change"] is None for t in r["tokens"] if t["kind"] == "obs")
            # d = before - after: a response's displacement is minus its tokens' summed change
            assert -sum(t["change"] for t in model) == pytest.approx(r["displacement"], abs=1e-5)
            assert all(not t["llds"] for t in r["tokens"] if t["kind"] == "obs" or r["advantage"] < 0)
            assert all(t["change"] < 0 for t in model if t["llds"])     # LLDS penalises falls only
        correct = [r["displacement"] for r in rows if r["reward"] > 0]
        mean = sum(correct) / len(correct)
        assert mean == pytest.approx(line["lld/correct_displacement"], abs=1e-5)
        page = (tmp_path / "run" / "views" / f"step_{line['step']:04d}.html").read_text()
        n_model = sum(t["kind"] == "model" for r in rows for t in r["tokens"])
        assert len(re.findall(r'<span class="model', page)) == n_model
        assert page.count('class="resp correct"') == len(correct)
    index = (tmp_path / "run" / "views" / "index.html").read_text()
    assert 'href="step_0001.html"' in index and 'href="step_0002.html"' in index


def test_the_last_step_has_a_view_between_every_nth_and_the_report_names_its_page(tmp_path, capsys):
    train.train(tiny_config(tmp_path, steps=2, token_view_every=10, eval_size=0), *tiny_policy())
    assert sorted(p.name for p in (tmp_path / "run" / "views").glob("step_*.html")) == ["step_0002.html"]
    page = tmp_path / "run" / "views" / "step_0002.html"
    assert f"each token's change of log-prob over step 2's updates: {page}" in capsys.readouterr().out


def test_no_view_is_written_when_off(tmp_path):
    train.train(tiny_config(tmp_path, steps=1, token_view_every=0, eval_size=0), *tiny_policy())
    assert not (tmp_path / "run" / "views").exists()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Chromium (Debian: apt-get install chromium)")
def test_chromium_draws_what_the_jsonl_says(tmp_path, alternating_rewards):  # noqa: F811
    from bench.view_check import browser_counts, expected_counts, screenshot

    train.train(tiny_config(tmp_path, steps=1, token_view_every=1, eval_size=0), *tiny_policy())
    page = tmp_path / "run" / "views" / "step_0001.html"
    shown = browser_counts(page)
    assert shown == expected_counts(page.with_suffix(".jsonl"))
    assert shown["responses"] == 4 and shown["coloured"] > 0 and shown["grey"] > 0
    screenshot(page, tmp_path / "shot.png", 400, 300)
    assert (tmp_path / "shot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_penalised_tokens_are_the_falls_inside_open_actions_of_preserving_responses():
    from functools import partial

    import torch

    from llds import llds_loss
    from plumbing.token_view import penalised_tokens

    mask = torch.tensor([[1., 1., 0., 1.], [1., 1., 1., 1.]])
    old = torch.zeros(2, 4)
    logp = torch.tensor([[-1.0, 0.5, 0.0, -0.2], [-1.0, -1.0, -1.0, -1.0]])
    # row 0 (A = +1): action 1 = tokens 0-1, net fall 1 - 0.5 > 0: open, token 0 fell; action 2 = token 3 fell.
    # row 1 (A = -1): not preserving, nothing penalised.
    got = penalised_tokens(partial(llds_loss, gate="action"), logp, old, torch.tensor([1.0, -1.0]), mask)
    assert got.tolist() == [[True, False, False, True], [False] * 4]
    # the response gate opens on the whole response's net fall (0.7 > 0): the same tokens here
    response = penalised_tokens(partial(llds_loss, gate="response"), logp, old, torch.tensor([1.0, -1.0]), mask)
    assert response.tolist() == got.tolist()
