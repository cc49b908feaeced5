"""Tests for rollout.py: exact token layout and masks with a scripted policy, token-in-token-out
log-probs with a tiny random transformer, and the EM / F1 reward functions.

The tokenizer is character-level (one token per character) and built here, so expected layouts
can be written as plain strings: enc("<search> x </search>") is the turn's exact token list.
"""
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import rollout as ro
from plumbing import runs
from plumbing.models import load_policy

# ----------------------------------------------------------------------------------------------
# Fixtures: char tokenizer, scripted policy, fake retriever
# ----------------------------------------------------------------------------------------------


def char_tokenizer():
    """One token per character; pad = eos (the case load_policy handles for SmolLM2)."""
    vocab = {"<eos>": 0}
    for ch in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>")
    tok.padding_side = "left"
    return tok


TOK = char_tokenizer()
EOS = TOK.eos_token_id


def enc(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptCache:
    """Stands in for DynamicCache: remembers each row's real (unmasked) tokens."""

    def __init__(self, n_rows):
        self.rows = [[] for _ in range(n_rows)]

    def batch_repeat_interleave(self, n):
        self.rows = [list(r) for r in self.rows for _ in range(n)]

    def batch_select_indices(self, index):
        self.rows = [self.rows[i] for i in index.tolist()]


class ScriptedPolicy(torch.nn.Module):
    """A fake HF causal LM whose next tokens are fixed in advance per episode.

    script: {prompt ids (tuple): the expected continuation after the prompt, i.e. model turns
    AND the observations the environment should force}. The environment feeds observations
    itself, so the policy is only asked at model positions; if the environment appended
    anything else, the script would run out of step and the layout assertions would fail.
    It also checks that position ids count real tokens only (the cache holes are invisible).
    """

    def __init__(self, script):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # gives the module a device
        self.script = {tuple(k): list(v) for k, v in script.items()}
        self.n_forward = 0

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True,
                logits_to_keep=0):
        self.n_forward += 1
        cache = past_key_values if isinstance(past_key_values, ScriptCache) else ScriptCache(input_ids.shape[0])
        chunk_mask = attention_mask[:, -input_ids.shape[1]:]
        logits = torch.full((input_ids.shape[0], 1, len(TOK)), -10.0)
        for b, context in enumerate(cache.rows):
            for tok, real, pos in zip(input_ids[b].tolist(), chunk_mask[b].tolist(), position_ids[b].tolist()):
                if real:
                    assert pos == len(context), "position ids must count real tokens only"
                    context.append(tok)
            prompts = [p for p in self.script if tuple(context[:len(p)]) == p]
            if not prompts:  # a prefix shared by all prompts: its prediction is never used
                logits[b, 0, EOS] = 10.0
                continue
            prompt = max(prompts, key=len)
            done = len(context) - len(prompt)
            rest = self.script[prompt]
            logits[b, 0, rest[done] if done < len(rest) else EOS] = 10.0
        return type("Out", (), {"logits": logits, "past_key_values": cache})()


class FakeRetriever:
    """Returns one fixed passage per query, naming the query, and records every call."""

    def __init__(self, text="born in Mire"):
        self.text, self.calls = text, []

    def search(self, queries, topk):
        self.calls.append((list(queries), topk))
        return [[{"document": {"id": q, "contents": f'"{q}"\n{self.text}'}, "score": 1.0}] for q in queries]


def obs(query, text="born in Mire"):
    return f'\n\n<information>Doc 1(Title: "{query}") {text}</information>\n\n'


def run(turns_per_episode, passage="born in Mire", **cfg_kw):
    """Roll out one episode per entry of turns_per_episode: a list of (text, forced) pieces
    with forced=True for what the environment must append. Returns (rollout, expected ids and
    kinds per episode, retriever)."""
    records, script, expected = [], {}, []
    for n, pieces in enumerate(turns_per_episode):
        prompt = enc(f"Q{n}: who?\n")
        records.append({"id": f"q{n}", "question": "unused", "golds": ["Mire"], "data_source": "test",
                        "prompt_ids": prompt})
        ids, kinds = list(prompt), [0] * len(prompt)
        for text, forced in pieces:
            piece = enc(text) if isinstance(text, str) else text
            ids += piece
            kinds += [2 if forced else 1] * len(piece)
        script[tuple(prompt)] = ids[len(prompt):]
        expected.append((ids, kinds, len(prompt)))
    cfg = ro.RolloutConfig(greedy=True, bf16=False, **cfg_kw)
    retriever = FakeRetriever(passage)
    out = ro.rollout(ScriptedPolicy(script), TOK, records, retriever, cfg)
    return out, expected, retriever


def assert_layout(out, row, ids, kinds, prompt_len, answer_text=None):
    """input_ids / attention_mask / loss_mask / answer_mask of one row, position by position."""
    n, width = len(ids), out.input_ids.shape[1]
    assert out.input_ids[row, :n].tolist() == ids
    assert out.input_ids[row, n:].tolist() == [TOK.pad_token_id] * (width - n)
    assert out.attention_mask[row].tolist() == [1] * n + [0] * (width - n)
    assert out.loss_mask[row].tolist() == [float(k == 1) for k in kinds] + [0.0] * (width - n)
    assert int(out.prompt_len[row]) == prompt_len
    answer = [0.0] * width
    if answer_text is not None:  # the span is the last occurrence of answer_text in the row
        text_ids = enc(answer_text)
        start = max(i for i in range(n) if ids[i:i + len(text_ids)] == text_ids)
        answer[start:start + len(text_ids)] = [1.0] * len(text_ids)
    assert out.answer_mask[row].tolist() == answer


# ----------------------------------------------------------------------------------------------
# Layout and masks with the scripted policy
# ----------------------------------------------------------------------------------------------

def test_search_observation_answer():
    pieces = [("<search> kelso </search>", False), (obs("kelso"), True),
              ("so <answer> Mire </answer>", False)]
    out, [(ids, kinds, plen)], retriever = run([pieces])
    assert_layout(out, 0, ids, kinds, plen, answer_text="<answer> Mire </answer>")
    assert retriever.calls == [(["kelso"], 3)]
    ep = out.episodes[0]
    assert (ep["answer"], ep["reward"], ep["em"], ep["f1"]) == ("Mire", 1.0, 1.0, 1.0)
    assert (ep["n_search"], ep["n_valid"], ep["finished"]) == (1, 2, True)
    assert ep["text"] == "".join(text for text, _ in pieces)
    assert out.n_generated == kinds.count(1)
    assert out.timing.keys() == {"generate", "retrieval"}


def test_invalid_action_gets_fixed_message():
    pieces = [("I am not sure</search>", False), (ro.INVALID_ACTION, True), ("<answer> Paris </answer>", False)]
    out, [(ids, kinds, plen)], retriever = run([pieces])
    assert_layout(out, 0, ids, kinds, plen, answer_text="<answer> Paris </answer>")
    assert retriever.calls == []
    ep = out.episodes[0]
    # the message's own "<answer> and </answer>" must never be read as the model's answer
    assert (ep["answer"], ep["reward"], ep["n_valid"], ep["finished"]) == ("Paris", 0.0, 1, True)


def test_eos_in_a_search_turn_ends_the_episode_and_is_trained_on():
    # A sampled EOS ends the episode unfinished; it stays in the episode with loss 1 and
    # nothing is appended (the script would go on, so an appended message would show).
    pieces = [(enc("I am not sure") + [EOS], False)]
    out, [(ids, kinds, plen)], retriever = run([pieces], max_turns=3)
    assert_layout(out, 0, ids, kinds, plen)
    assert out.loss_mask[0, len(ids) - 1] == 1 and out.input_ids[0, len(ids) - 1] == EOS
    assert retriever.calls == []
    ep = out.episodes[0]
    assert (ep["answer"], ep["reward"], ep["n_search"], ep["n_valid"], ep["finished"]) == (None, 0.0, 0, 0, False)


def test_empty_search_query_is_an_invalid_action():
    # Retrievers reject empty queries, so "<search> </search>" must never reach them.
    pieces = [("<search> </search>", False), (ro.INVALID_ACTION, True), ("<answer> Paris </answer>", False)]
    out, [(ids, kinds, plen)], retriever = run([pieces])
    assert_layout(out, 0, ids, kinds, plen, answer_text="<answer> Paris </answer>")
    assert retriever.calls == []
    ep = out.episodes[0]
    assert (ep["n_search"], ep["n_valid"], ep["finished"]) == (0, 1, True)


def test_running_out_of_turns_ends_unfinished():
    # max_turns=1: one search, then a final turn whose <search> is not executed
    pieces = [("<search> a </search>", False), (obs("a"), True), ("<search> b </search>", False)]
    out, [(ids, kinds, plen)], retriever = run([pieces], max_turns=1)
    assert_layout(out, 0, ids, kinds, plen)
    assert retriever.calls == [(["a"], 3)]
    ep = out.episodes[0]
    assert (ep["answer"], ep["reward"], ep["n_search"], ep["n_valid"], ep["finished"]) == (None, 0.0, 1, 1, False)


def test_turn_cap_cuts_generation_and_counts_as_invalid():
    pieces = [("abcde", False), (ro.INVALID_ACTION, True), ("<answ", False)]
    out, [(ids, kinds, plen)], _ = run([pieces], max_turns=1, max_turn_tokens=5)
    assert_layout(out, 0, ids, kinds, plen)
    assert out.episodes[0]["finished"] is False


def test_batch_episodes_finish_at_different_turns():
    episodes = [
        [("<answer> Mire </answer>", False)],                                      # turn 1
        [("<search> b1 </search>", False), (obs("b1"), True),
         ("<search> b2 </search>", False), (obs("b2"), True),
         ("<answer> Mire City </answer>", False)],                                 # turn 3
        [("hmm" + "</search>", False), (ro.INVALID_ACTION, True),
         ("<search> c1 </search>", False), (obs("c1"), True),
         ("<answer>the  mire!</answer>", False)],                                  # turn 3
    ]
    out, expected, retriever = run(episodes, max_turns=3)
    answers = ["<answer> Mire </answer>", "<answer> Mire City </answer>", "<answer>the  mire!</answer>"]
    for row, ((ids, kinds, plen), answer) in enumerate(zip(expected, answers)):
        assert_layout(out, row, ids, kinds, plen, answer_text=answer)
    # one retriever call per turn, holding every query of that turn
    assert retriever.calls == [(["b1"], 3), (["b2", "c1"], 3)]
    assert [e["reward"] for e in out.episodes] == [1.0, 0.0, 1.0]
    assert [e["f1"] for e in out.episodes] == [1.0, pytest.approx(2 / 3), 1.0]
    assert [(e["n_search"], e["n_valid"]) for e in out.episodes] == [(0, 1), (2, 3), (1, 2)]
    assert [e["queries"] for e in out.episodes] == [[], ["b1", "b2"], ["c1"]]


def test_bench_rollout_counts_rows_fed_after_they_stopped():
    from types import SimpleNamespace

    from bench.bench_rollout import live_share
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 0],      # turns of 3 and 1 tokens
                         [0, 1, 0, 0, 0, 0, 0, 0],      # one turn of 1
                         [0, 1, 1, 0, 0, 1, 1, 1]])     # turns of 2 and 3
    # turn 1: 3 + 1 + 2 = 6 tokens in 3 rows x 3 steps; turn 2: 1 + 3 = 4 in 2 rows x 3 steps
    assert live_share(SimpleNamespace(loss_mask=mask.float())) == (10, 15)


def test_long_observation_is_cut_before_the_closing_tag():
    head, tail = "\n\n<information>", "</information>\n\n"
    passage = 'Doc 1(Title: "q") ' + "x" * 200
    cut = head + passage[:40 - len(head) - len(tail)] + tail   # 40 tokens, closing tag intact
    pieces = [("<search> q </search>", False), (cut, True), ("<answer> Mire </answer>", False)]
    out, [(ids, kinds, plen)], _ = run([pieces], passage="x" * 200, max_obs_tokens=40)
    assert len(enc(cut)) == 40
    assert_layout(out, 0, ids, kinds, plen, answer_text="<answer> Mire </answer>")


def test_context_budget_stops_episode_cleanly():
    # prompt 8 + turn 13 = 21 tokens; the observation (> 19 tokens) would pass max_context=40
    pieces = [("<search> q </search>", False)]
    out, [(ids, kinds, plen)], _ = run([pieces], max_context=40, max_prompt_tokens=20)
    assert_layout(out, 0, ids, kinds, plen)
    assert out.input_ids.shape[1] <= 40 and out.episodes[0]["finished"] is False


def test_build_prompt_templates():
    ids = ro.build_prompt("  Who wrote Hamlet ", TOK, "search-r1")
    assert TOK.decode(ids) == ro.SEARCH_R1_TEMPLATE.format(question="Who wrote Hamlet?")
    chat = char_tokenizer()
    chat.chat_template = "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}<a>"
    assert chat.decode(ro.build_prompt("Who?", chat, "search-r1")) == \
        "<u>" + ro.SEARCH_R1_TEMPLATE.format(question="Who?") + "</u><a>"
    fewshot = TOK.decode(ro.build_prompt("Who?", TOK, "fewshot"))
    assert fewshot.startswith(ro.FEWSHOT_INSTRUCTION) and fewshot.endswith("Question: Who?\n")
    question, [(action, query, passages), (note, sentence, _), (answer, gold, _)] = ro.FEWSHOT_EXAMPLES[0]
    (title1, text1), (title2, text2) = (p.split("\n") for p in passages)
    assert (f"Question: {question}\n<{action}> {query} </{action}>\n\n<information>Doc 1(Title: {title1}) "
            f"{text1}\nDoc 2(Title: {title2}) {text2}</information>\n\n{sentence}\n<{answer}> {gold} </{answer}>"
            "\n\nQuestion: ") in fewshot and note == "note"
    with pytest.raises(ValueError, match="template"):
        ro.build_prompt("Who?", TOK, "zero-shot")


def test_long_prompts_are_dropped_at_load_by_their_full_length(capsys):
    # char tokenizer: the prompt is as long as its text, few-shot examples included
    records = [{"id": i, "question": q} for i, q in enumerate(["Who?", "Who was it?", "Where?", "Who is he?"])]
    limit = len(ro.build_prompt("Who is he?", TOK, "fewshot"))    # fits exactly; "Who was it?" is 1 longer
    cfg = ro.RolloutConfig(max_prompt_tokens=limit, max_context=limit + 100)
    kept, dropped = ro.drop_long_prompts(records, TOK, cfg, "drop", "training questions")
    assert [r["id"] for r in kept] == [0, 2, 3] and [r["id"] for r in dropped] == [1]
    assert capsys.readouterr().out == (f"dropped 1 of 4 training questions with a prompt over max_prompt_tokens="
                                       f"{limit} tokens (fewshot template): 1\n")
    with pytest.raises(ValueError, match=r"^1 of 4 questions have a prompt over .*: 1; raise --max-prompt-tokens"):
        ro.drop_long_prompts(records, TOK, cfg, "error")
    with pytest.raises(ValueError, match="no questions left: every prompt is over max_prompt_tokens=10"):
        ro.drop_long_prompts(records, TOK, ro.RolloutConfig(max_prompt_tokens=10), "drop")
    # a record's own prompt_ids (eval.py's rag / direct prompts) is what is measured
    own = [{"id": "a", "question": "Who?", "prompt_ids": [1] * 10}, {"id": "b", "question": "Who?", "prompt_ids": [1] * 11}]
    assert ro.split_long_prompts(own, TOK, ro.RolloutConfig(max_prompt_tokens=10)) == (own[:1], own[1:])
    assert ro.drop_long_prompts([], TOK, cfg) == ([], [])
    with pytest.raises(ValueError, match="on-long-prompt must be one of drop, error"):
        ro.drop_long_prompts(records, TOK, cfg, "skip")


def search_r1_passages2string(retrieval_result):
    """Search-R1's own code (search_r1/llm_agent/generation.py, _passages2string), and the
    .strip() its execute_predictions applies before wrapping the block in <information>."""
    format_reference = ''
    for idx, doc_item in enumerate(retrieval_result):
        content = doc_item['document']['contents']
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        format_reference += f"Doc {idx+1}(Title: {title}) {text}\n"
    return format_reference.strip()


@pytest.mark.parametrize("contents", [
    ['"Paris"\nParis is the capital.\nIt is big.', '"Lyon"\nLyon is a city.'],
    ['"Paris"\nParis is the capital.', '"Cars"'],                # last passage without text
    ['"A"\ntext ends in a space ', '  "B"\n\n'],                # whitespace at both ends
])
def test_format_passages_matches_search_r1_byte_for_byte(contents):
    hits = [{"document": {"id": str(i), "contents": c}, "score": 1.0} for i, c in enumerate(contents)]
    assert ro.format_passages(hits) == search_r1_passages2string(hits)
    if contents[1] == '"Cars"':
        assert ro.format_passages(hits).endswith('Doc 2(Title: "Cars")')


# ----------------------------------------------------------------------------------------------
# Token in, token out: a tiny random transformer
# ----------------------------------------------------------------------------------------------

def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=EOS, pad_token_id=EOS)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("prompts", [["Q: a?\n", "Q: bbbbbb?\n", "Q: cc?\n"],   # shared prefix "Q: "
                                     ["a?\n", "What is bbbbbb?\n"]])           # none: left padding first
def test_recomputed_logprobs_match_sampling_time(prompts):
    model = tiny_llama()
    records = [{"id": str(i), "question": "", "golds": ["x"], "data_source": "t", "prompt_ids": enc(p)}
               for i, p in enumerate(prompts)]
    cfg = ro.RolloutConfig(max_turns=2, max_turn_tokens=12, temperature=0.7, top_p=0.9, bf16=False)
    torch.manual_seed(1)
    out = ro.rollout(model, TOK, records, FakeRetriever(), cfg)
    assert out.loss_mask.sum() > 0 and (out.attention_mask - out.loss_mask).sum() > out.prompt_len.sum()
    with torch.no_grad():
        logits = model(input_ids=out.input_ids, attention_mask=out.attention_mask).logits
    # Recorded at the sampling temperature: what train.py's old-log-prob pass recomputes.
    recomputed = torch.log_softmax(logits[:, :-1].float() / 0.7, -1).gather(-1, out.input_ids[:, 1:, None])[..., 0]
    mask = out.loss_mask[:, 1:]
    assert torch.isfinite(out.logp).all()
    torch.testing.assert_close(recomputed * mask, out.logp[:, 1:] * mask, atol=2e-5, rtol=0)
    assert (out.logp * (1 - out.loss_mask)).abs().sum() == 0


def test_shared_prefix_cache_gives_the_logits_of_per_row_copies():
    """KVBatch keeps the prompts' common prefix once (SharedPrefixLayer); decode steps attend to
    it with one product for all rows. Same logits as copying it into every row, through holes
    (a row fed a masked pad), chunks of different lengths and dropped rows; and the cache really
    holds one copy."""
    from plumbing import fast_hf
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    fast_hf.use_fast_attention(model)
    prompts = [list(range(1, 21)) + list(range(30, 30 + k)) for k in (1, 3, 5)]

    def feeds(kv):
        yield kv.start(prompts)
        yield kv.feed(torch.tensor([[3], [4], [5]]), torch.tensor([[1], [0], [1]]))
        yield kv.feed_padded([[1, 2], [3, 4, 5, 6], [7]])
        kv.keep_rows([0, 2])
        yield kv.feed(torch.tensor([[8], [9]]), torch.ones(2, 1, dtype=torch.long))

    with torch.no_grad():
        shared = fast_hf.KVBatch(model, 0)
        shared_logits = list(feeds(shared))
        copied = fast_hf.KVBatch(model, 0)
        copied.model = type("NoSharing", (), {"config": None, "__call__": lambda self, **kw: model(**kw)})()
        copied_logits = list(feeds(copied))
    layer = shared.cache.layers[0]
    assert type(layer) is fast_hf.SharedPrefixLayer and layer.prefix[0].shape[0] == 1
    assert type(copied.cache.layers[0]) is fast_hf.GrowingLayer
    for a, b in zip(shared_logits, copied_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------
# Reward functions
# ----------------------------------------------------------------------------------------------

def test_normalize_answer():
    assert ro.normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert ro.normalize_answer("An apple, a pear") == "apple pear"
    assert ro.normalize_answer("Theatre\tof\nthe Absurd") == "theatre of absurd"   # 'the' only as a word
    assert ro.normalize_answer("U.S.A.") == "usa"


def test_exact_match_and_f1():
    assert ro.exact_match("the Mire", ["Paris", "mire"]) == 1.0
    assert ro.exact_match("Mire City", ["mire"]) == 0.0
    assert ro.exact_match(None, ["mire"]) == 0.0
    assert ro.exact_match("Mire", "mire.") == 1.0                  # a single gold string works too
    assert ro.f1_score("the big red dog", ["red dog"]) == pytest.approx(0.8)  # P 2/3, R 1
    assert ro.f1_score("red dog", ["cat", "a red dog", "dog"]) == 1.0          # max over golds
    assert ro.f1_score("cat", ["dog"]) == 0.0
    assert ro.f1_score(None, ["dog"]) == 0.0


def test_extract_answer():
    assert ro.extract_answer("no tags here") is None
    assert ro.extract_answer("<answer> unfinished") is None
    assert ro.extract_answer("<answer> a </answer> then <answer>\n b c \n</answer>") == "b c"
    assert ro.extract_answer("<answer> a </answer> <answer> b") == "a"   # last COMPLETE one


# ----------------------------------------------------------------------------------------------
# The real embedded model
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_two_episode_rollout():
    model, tokenizer = load_policy()
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert tokenizer.eos_token == "<|im_end|>"
    records = [{"id": "a", "question": "In which city was Doravin Kelso born?", "golds": ["Mirefield"],
                "data_source": "t"},
               {"id": "b", "question": "Who founded Quellmar Foods?", "golds": ["Anselm Ruddy"], "data_source": "t"}]
    cfg = ro.RolloutConfig(greedy=True, max_turns=1, max_turn_tokens=32)
    out = ro.rollout(model, tokenizer, records, FakeRetriever("Doravin Kelso was born in Mirefield."), cfg)
    assert out.input_ids.shape[0] == 2 and out.n_generated > 0
    assert (out.loss_mask <= out.attention_mask).all() and (out.answer_mask <= out.loss_mask).all()
    assert all(e["n_search"] >= 1 for e in out.episodes)   # the few-shot prompt gets well-formed searches
    # forced text ends in "\n", "\n" as inside running text, not in the rare end-of-string "\n\n" token
    tail = ro._observation_ids(tokenizer, ["x"], 100)[0][-2:]
    assert tokenizer.convert_ids_to_tokens(tail) == ["\u010a", "\u010a"]



def test_the_decode_occupancy_per_turn_counts_rows_still_running():
    # Turn 1: three rows sample 23, 33 and 18 tokens (a search, a search, an answer): the turn
    # decodes 33 steps for 3 rows. Turn 2: the two searching rows answer in 23 and 18 tokens.
    first = ["<search> Mire </search>", "<search> a longer query </search>", "<answer>x</answer>"]
    second = ["<answer> Mire </answer>", "<answer>y</answer>"]
    assert [len(t) for t in first + second] == [23, 33, 18, 23, 18]
    out, _, _ = run([[(first[0], False), (obs("Mire"), True), (second[0], False)],
                     [(first[1], False), (obs("a longer query"), True), (second[1], False)],
                     [(first[2], False)]], max_turns=2)
    decode = out.decode
    assert decode[("steps", 1)] == 33 and decode[("slots", 1)] == 3 * 33
    assert decode[("tokens", 1)] == 23 + 33 + 18
    assert decode[("steps", 2)] == 23 and decode[("tokens", 2)] == 23 + 18
    metrics = runs.Phases().timing(out)
    assert metrics["rollout/occupancy_turn1"] == (23 + 33 + 18) / (3 * 33)
    assert metrics["rollout/occupancy_turn2"] == (23 + 18) / (2 * 23)
    assert metrics["rollout/occupancy"] == (23 + 33 + 18 + 23 + 18) / (3 * 33 + 2 * 23)
    assert metrics["rollout/decode_steps"] == 33 + 23
