"""Tests for plumbing/models.py's loading: what load_policy sets so a run's console stays quiet."""
from plumbing import models
from conftest import tiny_policy


def test_a_bpe_tokenizer_loads_without_the_clean_up_warning_and_decodes_the_same(tmp_path, capfd):
    model, tokenizer = tiny_policy()
    tokenizer.clean_up_tokenization_spaces = True     # as the converted SmolLM2 tokenizer declares it
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    text = "a , b . c ' d"                            # what the WordPiece clean-up would change
    _, loaded = models.load_policy(str(tmp_path))
    assert loaded.decode(loaded(text)["input_ids"]) == text and not loaded.clean_up_tokenization_spaces
    assert "clean_up_tokenization_spaces" not in "".join(capfd.readouterr())
    model.save_pretrained(tmp_path / "again")         # as every checkpoint does, mid-run
    assert "Writing model shards" not in capfd.readouterr().err   # load_policy turned transformers' bars off
