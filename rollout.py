"""rollout.py: the Search-R1 environment. Prompts, batched multi-turn generation with search, the
three masks, and the exact-match reward.

Search-R1 (Jin et al., arXiv 2503.09516) lets the policy interleave text with `<search> query
</search>` calls; the environment answers with `<information> top-k passages </information>`, and
the episode ends at `<answer> ... </answer>`. This file runs that loop for a batch at once: each
turn, all active episodes sample together with one KV cache, each row stopping on its own; all
queries of a turn go to the retriever in ONE `.search(queries, topk)` call; the observation (or
the invalid-action message) is appended as forced tokens. Token in, token out: sampled ids are
kept as they are, with their log-probs, never decoded and re-encoded (which can change them).
Output (`Rollout`): right-padded ids and masks, and per-episode results; reward = exact match of
the last `<answer>`, SQuAD-normalised.

Choices and simplifications:
* A sampling loop of its own instead of `model.generate`: stop strings, per-row stopping and the
  exact ids and log-probs are visible here; the KV cache's padding, positions and speed-ups are in
  plumbing/fast_hf.py.
* Search runs in the first `max_turns` turns; one more turn may only answer. A search there, no
  action, or a sampled EOS ends the episode unfinished (the EOS keeps loss 1, so GRPO learns
  whether stopping paid; the original drops it when re-tokenising).
* Forced text is tokenised as inside running text: a string-final "\n\n" is otherwise a token
  SmolLM2 never saw before a tag, and it then stops writing tags. The answer is read from the
  model's own tokens, never from observations (the invalid-action message contains "<answer>").
* SmolLM2-135M-Instruct writes no tags from the zero-shot Search-R1 prompt, so the default is a
  3-shot plain-text prompt ("fewshot"); the exact Search-R1 prompt is `template="search-r1"`.
"""
from __future__ import annotations

import functools
import re
import string
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from plumbing import fast_hf, long_prompts
from plumbing.cli import flag
from plumbing.long_prompts import ON_LONG_PROMPT  # noqa: F401  (--on-long-prompt's choices)
from plumbing.fewshot import FEWSHOT_EXAMPLES, FEWSHOT_INSTRUCTION   # the "fewshot" prompt's text
from plumbing.tokens import answer_token_span, encode_in_text
from retriever import MAX_QUERY_CHARS

# ---- Reward: SQuAD-style normalisation, exact match and token F1 on the last <answer> -----

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop the words a/an/the, collapse whitespace (SQuAD)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def extract_answer(model_text: str) -> str | None:
    """The last complete <answer>...</answer> in `model_text`, stripped; None if there is none."""
    matches = _ANSWER_RE.findall(model_text)
    return matches[-1].strip() if matches else None


def _as_list(golds) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(prediction: str | None, golds) -> float:
    """1.0 if the normalised prediction equals any normalised gold, else 0.0 (None scores 0)."""
    pred = None if prediction is None else normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _as_list(golds)))


def f1_score(prediction: str | None, golds) -> float:
    """SQuAD token F1 between the normalised prediction and each gold; the max over golds."""
    pred, best = normalize_answer(prediction or "").split(), 0.0
    for gold in _as_list(golds):
        ref = normalize_answer(gold).split()
        common = sum((Counter(pred) & Counter(ref)).values())
        if common:       # 2 precision recall / (precision + recall)
            best = max(best, 2 * common / (len(pred) + len(ref)))
    return best


# ---- Prompts and observations -------------------------------------------------------------

# The trained Search-R1 string, typo ("as your want") included.
SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, you "
    "can call a search engine by <search> query </search> and it will return the top searched "
    "results between <information> and </information>. You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, <answer> Beijing "
    "</answer>. Question: {question}\n")

TEMPLATES = ("fewshot", "search-r1")

INVALID_ACTION = ("\nMy previous action is invalid. If I want to search, I should put the query "
                  "between <search> and </search>. If I want to give the final answer, I should "
                  "put the answer between <answer> and </answer>. Let me try again.\n")
_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_STOP_STRINGS = ("</search>", "</answer>")


def format_passages(hits: list[dict]) -> str:
    """Search-R1's passage block, byte for byte: `Doc i(Title: {first line}) {rest}` per hit, one
    per line, the whole block stripped (so a passage without text ends in `)`, not `) `)."""
    lines = []
    for i, hit in enumerate(hits, 1):
        title, _, text = hit["document"]["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines).strip()


def _observation_ids(tokenizer, passages: list[str], max_obs_tokens: int) -> list[list[int]]:
    """Token ids of `\n\n<information>{passages}</information>\n\n` per passage block, each
    capped at max_obs_tokens by cutting the passages, never the closing tag."""
    heads = tokenizer([f"\n\n<information>{p}" for p in passages],
                      add_special_tokens=False).input_ids
    tail = encode_in_text(tokenizer, "</information>\n\n")
    return [head[:max(max_obs_tokens - len(tail), 0)] + tail for head in heads]


def as_question(question: str) -> str:
    """A question as Search-R1 asks it: stripped, ending in '?'."""
    question = question.strip()
    return question if question.endswith("?") else question + "?"


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """`text` as the one user message of the chat template, the assistant's turn opened."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_prompt(question: str, tokenizer, template: str = "fewshot") -> list[int]:
    """Prompt token ids for one question (stripped and ending in '?', as Search-R1). "search-r1":
    the paper's prompt as one user message of the chat template (plain text without one).
    "fewshot": FEWSHOT_EXAMPLES as plain text, whose tags SmolLM2-135M-Instruct follows more
    readily than in a chat."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}: use one of {', '.join(TEMPLATES)}")
    question = as_question(question)
    if template == "search-r1":
        text = SEARCH_R1_TEMPLATE.format(question=question)
        return (chat_prompt_ids(tokenizer, text) if tokenizer.chat_template
                else tokenizer(text).input_ids)
    question_ids = tokenizer(f"Question: {question}\n", add_special_tokens=False)["input_ids"]
    return list(_fewshot_examples_ids(tokenizer)) + question_ids


@functools.lru_cache(maxsize=4)   # the same for every question: tokenised once per tokenizer object
def _fewshot_examples_ids(tokenizer) -> tuple[int, ...]:
    """The "fewshot" prompt before the question: instruction and worked examples, as token ids."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = tokenizer(FEWSHOT_INSTRUCTION)["input_ids"]  # special tokens (e.g. BOS) only here
    for example, steps in FEWSHOT_EXAMPLES:
        ids += encode(f"Question: {example}\n")
        for action, argument, passages in steps:
            if action == "note":
                ids += encode(argument + "\n")
                continue
            ids += encode(f"<{action}> {argument} </{action}>")
            if passages:
                hits = [{"document": {"id": "", "contents": c}} for c in passages]
                ids += _observation_ids(tokenizer, [format_passages(hits)], max_obs_tokens=10**6)[0]
        ids += encode_in_text(tokenizer, "\n\n")
    return tuple(ids)


def prompt_ids(record: dict, tokenizer, template: str) -> list[int]:
    """The prompt an episode starts from: the record's own "prompt_ids" (eval.py's rag and direct
    prompts), else build_prompt(question) in `template`."""
    if "prompt_ids" in record:
        return list(record["prompt_ids"])
    return build_prompt(record["question"], tokenizer, template)


def split_long_prompts(records: list[dict], tokenizer, cfg: RolloutConfig):
    """(records whose prompt fits in cfg.max_prompt_tokens, records whose prompt does not)."""
    return long_prompts.split_long(records, lambda r: len(prompt_ids(r, tokenizer, cfg.template)),
                                   cfg.max_prompt_tokens)


def drop_long_prompts(records: list[dict], tokenizer, cfg: RolloutConfig, on_long: str = "drop",
                      what: str = "questions") -> tuple[list[dict], list[dict]]:
    """Every prompt checked once, at load: over cfg.max_prompt_tokens it is dropped and named
    (on_long "drop") or the run stops ("error"). -> (records kept, records dropped)."""
    return long_prompts.drop_long(records, lambda r: len(prompt_ids(r, tokenizer, cfg.template)),
                                  cfg.max_prompt_tokens, on_long, what, cfg.template)


# ---- Configuration and output -------------------------------------------------------------

@dataclass
class RolloutConfig:
    max_turns: int = flag(3, "search turns; one answer-only turn follows (paper: 3)", ">= 0")
    topk: int = flag(3, "passages per search", ">= 0")
    max_turn_tokens: int = flag(128, "sampled tokens per turn (paper: 500)", ">= 1")
    max_obs_tokens: int = flag(500, "observation cap, closing </information> kept", ">= 1")
    max_prompt_tokens: int = flag(2048, "a longer prompt is an error (dropped at load)", ">= 1")
    max_context: int = flag(4096, "prompt + all appended; beyond it an episode stops", ">= 2")
    temperature: float = flag(1.0, "sampling temperature (ignored when greedy)", "> 0")
    top_p: float = flag(1.0, "nucleus sampling; 1.0 = off", "> 0, <= 1")
    greedy: bool = flag(False, "argmax decoding (evaluation)")
    template: str = flag("fewshot", "'fewshot' (small models) or 'search-r1'", "choice")
    batch_size: int = flag(64, "episodes generated together; more run in several batches", ">= 1")
    bf16: bool = flag(True, "bf16 autocast where the CPU/GPU has bf16 units")


@dataclass
class Rollout:
    """One batch of finished episodes, ready for the loss. episodes[i] keys: id, text (all after
    the prompt, decoded), answer (str or None), golds, queries (the executed searches, in order),
    n_search (their number), n_valid (executed searches + the answer), finished (ended with
    <answer>), reward (= em), em, f1, data_source."""
    input_ids: torch.Tensor       # (B, T) long, right-padded: prompt, turns, observations
    attention_mask: torch.Tensor  # (B, T) long: 1 on every real token, observations included
    loss_mask: torch.Tensor       # (B, T) float: 1 only on model-sampled tokens
    answer_mask: torch.Tensor     # (B, T) float: the final <answer>..</answer>, tags included
    prompt_len: torch.Tensor      # (B,) long
    episodes: list[dict]          # text, answer, golds, n_search, finished, reward, em, ...
    timing: dict = field(default_factory=dict)  # {"generate": s, "retrieval": s}
    decode: Counter = field(default_factory=Counter)  # turn k: ("tokens"|"steps"|"slots", k)
    n_generated: int = 0          # model-sampled tokens in total
    logp: torch.Tensor | None = None  # (B, T): sampling-time log-probs on model tokens, else 0


# ---- Batched generation with one KV cache -------------------------------------------------

# Each token of an episode is one of three kinds; only MODEL tokens get a loss (loss_mask).
PROMPT, MODEL, FORCED = 0, 1, 2     # FORCED: observations and the invalid-action message


def _sample(logits: torch.Tensor, cfg: RolloutConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) float logits -> next tokens (B,) and their log-probs (B,) under log_softmax(logits /
    temperature) (temperature 1 when greedy): the policy train.py's old log-probs recompute, before
    top-p truncation."""
    logp = torch.log_softmax(logits if cfg.greedy else logits / cfg.temperature, dim=-1)
    if cfg.greedy:
        tokens = logits.argmax(-1)
    else:
        probs = torch.softmax(logits / cfg.temperature, dim=-1)
        if cfg.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            outside = sorted_p.cumsum(-1) - sorted_p > cfg.top_p   # keeps at least the top token
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
        tokens = torch.multinomial(probs, 1).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _generate_turn(kv: fast_hf.KVBatch, logits: torch.Tensor, caps: list[int],
                   stops: fast_hf.StopChecker, cfg: RolloutConfig):
    """Sample one turn for every row of `kv` from `logits` (B, V), caps: per-row token budget (>= 1)
    -> per-row sampled ids and their log-probs."""
    n_rows, device, limit = logits.shape[0], logits.device, max(caps)
    tokens = torch.full((n_rows, limit), kv.pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(n_rows, limit, device=device)
    length = torch.zeros(n_rows, dtype=torch.long, device=device)
    cap = torch.tensor(caps, device=device)
    running = torch.ones(n_rows, dtype=torch.bool, device=device)
    for k in range(limit):                      # decode step k: one token for every row
        new, new_logp = _sample(logits, cfg)
        new = torch.where(running, new, kv.pad_id)
        tokens[:, k], logps[:, k] = new, new_logp
        length += running.long()
        stopped = stops.eos[new] | (length >= cap)
        closing = running & stops.closes[new] & ~stopped      # may have closed a tag: decode it
        running &= ~stopped
        # one host sync a decode step (one more after a token with '>'): stop strings are text
        closing, going = torch.stack([closing, running]).tolist()
        for row in (r for r, c in enumerate(closing) if c):
            if stops.tag_closed(tokens[row, :k + 1].tolist()):
                running[row] = going[row] = False
        if not any(going):
            break
        # stopped rows (at this token too) get a masked pad: a turn's last token is never fed
        logits = kv.feed(new[:, None], running[:, None].long())
    lengths = length.tolist()
    return ([t[:n] for t, n in zip(tokens.tolist(), lengths)],
            [p[:n] for p, n in zip(logps.tolist(), lengths)])


# ---- Episodes -----------------------------------------------------------------------------

@dataclass
class _Episode:
    record: dict
    ids: list[int]                # prompt + everything appended so far
    kinds: list[int]              # per token: PROMPT, MODEL or FORCED
    logps: list[float]            # per token: sampling log-prob (0 where kind != MODEL)
    prompt_len: int
    turns: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each model turn
    queries: list[str] = field(default_factory=list)           # the executed searches
    finished: bool = False
    answer_turn: int | None = None

    def append(self, ids: list[int], kind: int, logps: list[float] | None = None) -> None:
        if kind == MODEL:
            self.turns.append((len(self.ids), len(self.ids) + len(ids)))
        self.ids += ids
        self.kinds += [kind] * len(ids)
        self.logps += logps if logps is not None else [0.0] * len(ids)


def _parse_action(tokenizer, ids: list[int], eos: torch.Tensor) -> tuple[str | None, str | None]:
    """A turn's action: ("search", query), ("answer", text), ("eos", None) or (None, None). An empty
    query is an invalid action; a very long one is cut to MAX_QUERY_CHARS, the most our retrieval
    server accepts (Search-R1's server has no such limit; its encoder, like ours, reads a query's
    first 256 tokens)."""
    match = _ACTION_RE.search(tokenizer.decode(ids))
    if match and (match.group(1) == "answer" or match.group(2).strip()):
        return match.group(1), match.group(2).strip()[:MAX_QUERY_CHARS]
    if ids and eos[ids[-1]]:
        return "eos", None
    return None, None


def _observations(tokenizer, retriever, actions, cfg: RolloutConfig, timing: dict) -> dict:
    """All searches of one turn in ONE retriever call -> {row: observation token ids}."""
    searching = [i for i, (kind, _) in enumerate(actions) if kind == "search"]
    if not searching:
        return {}
    start = time.perf_counter()
    hits = retriever.search([actions[i][1] for i in searching], cfg.topk)
    timing["retrieval"] += time.perf_counter() - start
    blocks = [format_passages(h) for h in hits]
    return dict(zip(searching, _observation_ids(tokenizer, blocks, cfg.max_obs_tokens)))


def _run_batch(model, tokenizer, records: list[dict], retriever, cfg: RolloutConfig,
               timing: dict, decode: Counter, progress) -> list[_Episode]:
    """All turns of one batch of episodes -> their final states; progress(text): the turn."""
    prompts = [prompt_ids(r, tokenizer, cfg.template) for r in records]
    # train.py and eval.py drop over-long prompts at load; here one is an error
    long_prompts.refuse_long(records, prompts, cfg.max_prompt_tokens)
    episodes = [_Episode(r, list(p), [PROMPT] * len(p), [0.0] * len(p), len(p))
                for r, p in zip(records, prompts)]
    invalid_ids = encode_in_text(tokenizer, INVALID_ACTION)

    t0 = time.perf_counter()
    kv = fast_hf.KVBatch(model, tokenizer.pad_token_id or 0)
    logits = kv.start(prompts)
    stops = fast_hf.StopChecker(tokenizer, model, logits.shape[-1], logits.device, _STOP_STRINGS)
    active = list(range(len(episodes)))          # episode index of each cache row
    for turn in range(cfg.max_turns + 1):
        can_search = turn < cfg.max_turns
        progress(f"turn {turn + 1}/{cfg.max_turns + 1}, {len(active)} episodes going")
        # 1. Generate one turn for every active row, each stopping on its own.
        caps = [min(cfg.max_turn_tokens, cfg.max_context - len(episodes[e].ids)) for e in active]
        new_ids, new_logps = _generate_turn(kv, logits, caps, stops, cfg)
        steps = max(map(len, new_ids))      # a turn decodes until its longest row stops
        decode.update({("tokens", turn + 1): sum(map(len, new_ids)), ("steps", turn + 1): steps,
                       ("slots", turn + 1): steps * len(new_ids)})    # occupancy: tokens / slots
        timing["generate"] += time.perf_counter() - t0
        # 2. Parse each row's action.
        actions = []
        for e, ids, logps in zip(active, new_ids, new_logps):
            episodes[e].append(ids, MODEL, logps)
            actions.append(_parse_action(tokenizer, ids, stops.eos))
        # 3. Search: all queries of the turn in one retriever call (none in the final turn).
        observations = (_observations(tokenizer, retriever, actions, cfg, timing)
                        if can_search else {})
        # 4. Append observations (or the invalid-action message) to the rows that go on.
        t0 = time.perf_counter()
        going_on, pending = [], []
        for row, (e, (kind, query)) in enumerate(zip(active, actions)):
            ep = episodes[e]
            if kind == "answer":
                ep.finished, ep.answer_turn = True, len(ep.turns) - 1
                continue
            if kind == "eos" or not can_search:    # unfinished, the EOS kept (module docstring)
                continue
            if kind == "search":
                ep.queries.append(query)
            forced = observations.get(row, invalid_ids)
            if len(ep.ids) + len(forced) >= cfg.max_context:  # no room to append and still generate
                continue
            ep.append(forced, FORCED)
            going_on.append(row)
            # the turn's last sampled token was never fed (_generate_turn): it goes in first
            pending.append([new_ids[row][-1]] + forced)
        if not going_on:
            break
        kv.keep_rows(going_on)
        active = [active[i] for i in going_on]
        logits = kv.feed_padded(pending)
    timing["generate"] += time.perf_counter() - t0
    return episodes


def _pad(rows: list[list], value, dtype) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)


@torch.no_grad()  # not inference_mode: under it, autocast's weight cache does not work
def rollout(model, tokenizer, records: list[dict], retriever, cfg: RolloutConfig | None = None,
            progress=None) -> Rollout:
    """Run one episode per record (records: {"id", "question", "golds", "data_source"}, optionally
    "prompt_ids" to bypass the template) in batches of cfg.batch_size. See `Rollout`.
    progress: None, or a function given one line of text per turn (a progress bar's description)."""
    cfg = cfg or RolloutConfig()
    if not records:
        raise ValueError("rollout: no records given")
    if cfg.max_prompt_tokens >= cfg.max_context:
        raise ValueError(f"max_prompt_tokens ({cfg.max_prompt_tokens}) must be below "
                         f"max_context ({cfg.max_context})")
    progress = progress or (lambda text: None)
    timing, decode, episodes = {"generate": 0.0, "retrieval": 0.0}, Counter(), []
    device = next(model.parameters()).device
    n_batches = -(-len(records) // cfg.batch_size)
    for first in range(0, len(records), cfg.batch_size):
        where = f"batch {first // cfg.batch_size + 1}/{n_batches} " if n_batches > 1 else ""
        with fast_hf.autocast(device, cfg.bf16):
            episodes += _run_batch(model, tokenizer, records[first:first + cfg.batch_size],
                                   retriever, cfg, timing, decode, lambda t: progress(where + t))

    pad_id = tokenizer.pad_token_id or 0
    results, answer_rows = [], []
    for ep in episodes:
        answer, answer_row = None, [0.0] * len(ep.ids)
        if ep.answer_turn is not None:
            begin, end = ep.turns[ep.answer_turn]
            answer, span = answer_token_span(tokenizer, ep.ids[begin:end], _ANSWER_RE)
            for i in span:
                answer_row[begin + i] = 1.0
        answer_rows.append(answer_row)
        golds = _as_list(ep.record.get("golds", []))
        em, f1 = exact_match(answer, golds), f1_score(answer, golds)
        results.append({"id": ep.record.get("id"), "text": tokenizer.decode(ep.ids[ep.prompt_len:]),
                        "answer": answer, "golds": golds, "queries": ep.queries,
                        "n_search": len(ep.queries), "n_valid": len(ep.queries) + ep.finished,
                        "finished": ep.finished, "reward": em, "em": em, "f1": f1,
                        "data_source": ep.record.get("data_source", "unknown")})
    return Rollout(
        input_ids=_pad([ep.ids for ep in episodes], pad_id, torch.long),
        attention_mask=_pad([[1] * len(ep.ids) for ep in episodes], 0, torch.long),
        loss_mask=_pad([[float(k == MODEL) for k in ep.kinds] for ep in episodes], 0.0,
                       torch.float32),
        answer_mask=_pad(answer_rows, 0.0, torch.float32),
        prompt_len=torch.tensor([ep.prompt_len for ep in episodes], dtype=torch.long),
        episodes=results, timing=timing, decode=decode,
        n_generated=sum(k == MODEL for ep in episodes for k in ep.kinds),
        logp=_pad([ep.logps for ep in episodes], 0.0, torch.float32),
    )
