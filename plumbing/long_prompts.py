"""Prompts over max_prompt_tokens, found once when the data is loaded (veRL's
filter_overlong_prompts does the same), so that no run meets one hours in. The prompt length
comes from the caller (rollout.py's own prompt builder), so this module knows no template.
refuse_long is rollout()'s own check, for a prompt that was not left out at load."""
from tqdm import tqdm

ON_LONG_PROMPT = ("drop", "error")   # what drop_long does with a prompt over the limit


def split_long(records: list[dict], length, limit: int) -> tuple[list[dict], list[dict]]:
    """(records with length(r) <= limit, the others), in order."""
    fits = [length(r) <= limit for r in tqdm(records, desc="check prompt lengths", unit="q",
                                             disable=len(records) < 20_000)]
    return [r for r, ok in zip(records, fits) if ok], [r for r, ok in zip(records, fits) if not ok]


def refuse_long(records: list[dict], prompts: list[list[int]], limit: int) -> None:
    """A ValueError naming the first record whose prompt (token ids) is over the limit."""
    for r, ids in zip(records, prompts):
        if len(ids) > limit:
            raise ValueError(f"prompt of record {r.get('id')!r} has {len(ids)} tokens > max_prompt_tokens="
                             f"{limit}; leave it out first (drop_long_prompts) or raise the limit")


def drop_long(records: list[dict], length, limit: int, on_long: str, what: str, template: str):
    """-> (records kept, records dropped). on_long "drop": one printed line says how many were
    dropped and which ids; "error": a ValueError naming them. Nothing left: a ValueError."""
    if on_long not in ON_LONG_PROMPT:
        raise ValueError(f"on-long-prompt must be one of {', '.join(ON_LONG_PROMPT)}, not {on_long!r}")
    kept, long = split_long(records, length, limit)
    if long:
        ids = ", ".join(str(r.get("id")) for r in long[:10]) + (", ..." if len(long) > 10 else "")
        over = f"a prompt over max_prompt_tokens={limit} tokens ({template} template): {ids}"
        if on_long == "error":
            raise ValueError(f"{len(long)} of {len(records)} {what} have {over}; raise --max-prompt-tokens, "
                             "remove them, or pass --on-long-prompt drop")
        print(f"dropped {len(long)} of {len(records)} {what} with {over}")
    if records and not kept:
        raise ValueError(f"no {what} left: every prompt is over max_prompt_tokens={limit}; raise --max-prompt-tokens")
    return kept, long
