"""Token-level details of the text rollout.py forces into episodes or reads back out of them."""
import re


def encode_in_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as they come out inside running text (here: followed by a tag).

    Byte-level BPE tokenisers encode a "\n\n" at the very END of a string as one token that in
    pretraining only precedes more whitespace, but as two "\n" tokens before text. SmolLM2 after
    an observation ending in the former writes "\nWhat is the answer..." instead of a tag, so
    forced text is encoded with a letter appended, and that letter's token dropped.
    """
    enc = tokenizer(text + "x", add_special_tokens=False, return_offsets_mapping=True)
    ids = [i for i, (_, end) in zip(enc["input_ids"], enc["offset_mapping"]) if end <= len(text)]
    return ids if tokenizer.decode(ids) == text else tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_token_span(tokenizer, turn_ids: list[int], answer_re: re.Pattern) -> tuple[str | None, list[int]]:
    """(answer, token indices) of the last <answer>..</answer> in a turn's tokens.

    Rule: a token belongs to the span when its decoded characters overlap the span's characters
    (tags included), so the span is widened to whole tokens at both ends.
    """
    text = tokenizer.decode(turn_ids)
    matches = list(answer_re.finditer(text))
    if not matches:
        return None, []
    begin, end = matches[-1].span()
    # each token's character span from the offsets of one re-encoding of the decoded text; a
    # token whose re-encoding differs falls back to decoding every prefix (exact, O(n^2))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] == list(turn_ids):
        starts, ends = [s for s, _ in enc["offset_mapping"]], [e for _, e in enc["offset_mapping"]]
    else:
        ends = [len(tokenizer.decode(turn_ids[:i + 1])) for i in range(len(turn_ids))]
        starts = [0] + ends[:-1]
    return matches[-1].group(1).strip(), [i for i, (s, e) in enumerate(zip(starts, ends))
                                           if s < end and e > begin]
