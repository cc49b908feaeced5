"""The LLD lab's setting: a small Llama-style model, its own tokenizer, and the noisy scripted
searcher whose episodes warm-start it (sft.py), before plain GRPO and GRPO + LLDS (train.py).

Why a lab: the paper's death spiral needs a policy that has already learned (groups that carry
signal), T = 1 sampling, correct and incorrect responses that share a prefix, several updates per
rollout batch and hundreds of small steps. A 135M model cannot take hundreds of steps on a 2-core
CPU; a ~1M-parameter model of the same architecture family can, on the same code path (rollout
with BM25 search over the toy world, loss masks, train.py, llds.py). experiments/lab/prereg.md fixes
everything here before any RL run.

* Questions: the toy world's single-hop training questions (toy_nq), split by the entity they ask
  about into an SFT half and an RL half (no entity in both); held-out: the toy world's test split
  (other countries, so unseen names).
* The scripted searcher (`noisy_searcher`, tasks/searcher.py) writes `<search> name </search>`, reads the returned
  passages with the toy world's own templates, and answers `<answer> value </answer>`. Its
  mistakes are drawn from MIXTURE: a wrong first query (the surname only, or the question's other
  words), and a wrong answer (the asked relation of a retrieved distractor, or
  another fact of the right passage). Many of its wrong episodes therefore share the correct
  episode's first search, as in the paper (about half of its incorrect responses do).
* Tokenizer: byte-level BPE of VOCAB_SIZE tokens trained here on the corpus, the questions and
  the prompt text (as nanochat trains its own); the model: LlamaForCausalLM from MODEL_SHAPE,
  randomly initialised with a fixed seed, then pretrained (`pretrain`: next-token loss on every
  token of the passages and questions) so that it brings a language prior, above all copying a
  name from its context, to SFT. Without it the SFT model memorised its training names and
  never copied a new one (sampled held-out EM 0.001 after 1,428 SFT steps). All of it is built
  once into the cache (`build_lab`), never committed.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tasks.searcher import MIXTURE, noisy_searcher  # noqa: F401  (the lab's SFT script)
from tasks.toy_world import parse_question, write_jsonl

LAB_VERSION = 2  # bump when anything below changes, so cached lab folders are rebuilt

VOCAB_SIZE = 2048
MODEL_SHAPE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=384, tie_word_embeddings=True, max_position_embeddings=1024)
MODEL_SEED = 0
PRETRAIN_WORLDS = (1, 2, 3, 4)  # toy worlds of other seeds: the lab's templates, none of its names or facts
PRETRAIN_STEPS = 2500          # language-model steps on the corpus before SFT (pretrain)

# The registered design (experiments/lab/prereg.md), here because the runner (lab_runs.py) and the
# analysis (lab_study.py) both read it. The pilot's grid: lr x updates per rollout batch (§4).
PILOT_LRS, PILOT_UPDATES = (1e-5, 3e-5, 1e-4), (4, 10)
# The registered models (§1-2): built in float32 on ONE thread, the only way to get these bytes.
REGISTERED = {"base": "e40b6e570dfe4ec12706bd330399e695b14dfb0e5d643f06445e6bcfbe054979",
              "sft": "da805fefc147bb83594564f88d6fc2f440e68b45d983143ff4669f5009706ed9"}


# ---- Questions, tokenizer and model ---------------------------------------------------------

def _half(question: str) -> str:
    """"sft" or "rl", by a hash of the entity the question asks about (the same on every machine)."""
    name = parse_question(question)[0]
    return "sft" if hashlib.sha256(name.encode()).digest()[0] % 2 == 0 else "rl"


def write_question_sets(world_dir: Path, out_dir: Path) -> None:
    """out_dir/{sft,rl}/{train,test}.jsonl: toy_nq training questions split by entity; test is the
    toy world's toy_nq test split for both (held-out EM of the RL runs; held-out loss of SFT)."""
    rows = {s: [json.loads(line) for line in open(world_dir / f"{s}.jsonl", encoding="utf-8")]
            for s in ("train", "test")}
    single = {s: [r for r in rs if r["data_source"] == "toy_nq"] for s, rs in rows.items()}
    for half in ("sft", "rl"):
        (out_dir / half).mkdir(parents=True, exist_ok=True)
        write_jsonl(out_dir / half / "train.jsonl", [r for r in single["train"] if _half(r["question"]) == half])
        write_jsonl(out_dir / half / "test.jsonl", single["test"])


def add_other_worlds(sft_dir: Path, lab_world: Path, other_worlds: list[Path]) -> None:
    """Widen the SFT set with the toy_nq training questions of other toy worlds (other names, the
    same templates) and search them all in one corpus, sft_dir/corpus.jsonl (every world's passages,
    renumbered). The lab's RL and held-out questions stay its own world's; a question about a name
    that is also a title of the lab's world is left out."""
    def rows(path):
        return [json.loads(line) for line in open(path, encoding="utf-8")]
    corpus = [r["contents"] for w in [lab_world, *other_worlds] for r in rows(w / "corpus.jsonl")]
    lab_titles = {r["contents"].partition("\n")[0].strip('"') for r in rows(lab_world / "corpus.jsonl")}
    extra = [r for w in other_worlds for r in rows(w / "train.jsonl")
             if r["data_source"] == "toy_nq" and parse_question(r["question"])[0] not in lab_titles]
    write_jsonl(sft_dir / "train.jsonl", rows(sft_dir / "train.jsonl") + extra)
    write_jsonl(sft_dir / "corpus.jsonl", [{"id": str(i), "contents": c} for i, c in enumerate(corpus)])


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE trained on `texts` (GPT-2's pre-tokenizer), EOS "<eos>" = pad, no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<eos>")
    tokenizer.padding_side = "left"
    return tokenizer


def tokenizer_texts(world_dir: Path, prompt_texts: list[str]) -> list[str]:
    """What the tokenizer learns from: every passage, every question, and the prompt and tag texts
    (repeated as often as the episodes repeat them)."""
    corpus = [json.loads(line)["contents"] for line in open(world_dir / "corpus.jsonl", encoding="utf-8")]
    questions = [json.loads(line)["question"] for s in ("train", "test")
                 for line in open(world_dir / f"{s}.jsonl", encoding="utf-8")]
    return corpus + questions + prompt_texts * (len(questions) // max(len(prompt_texts), 1))


def random_model(vocab_size: int, eos_id: int, shape: dict = MODEL_SHAPE, seed: int = MODEL_SEED):
    """LlamaForCausalLM of `shape`, randomly initialised from `seed`, fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, **shape)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def pretrain(model, tokenizer, texts: list[str], steps: int = PRETRAIN_STEPS, seed: int = MODEL_SEED,
             batch: int = 16, length: int = 256, lr: float = 3e-3) -> list[float]:
    """Next-token loss on EVERY token of `texts` (the corpus and the questions), packed into rows of
    `length` tokens: the language prior a pretrained model brings, at toy scale. The passages repeat
    their title in their first sentence, which is where a model learns to copy a name from its
    context. AdamW, cosine decay; returns the loss of each step."""
    import math

    import torch

    ids = [i for t in texts for i in tokenizer(t + tokenizer.eos_token, add_special_tokens=False)["input_ids"]]
    rows = torch.tensor(ids[:len(ids) // length * length]).view(-1, length)                 # (R, length)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * (0.55 + 0.45 * math.cos(math.pi * step / steps))
        x = rows[torch.randint(len(rows), (batch,), generator=generator)]
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def lab_dir() -> Path:
    import plumbing

    return plumbing.cache_dir() / "lab" / f"v{LAB_VERSION}"


def build_lab() -> Path:
    """The lab's folder, built once: init/ (the random model + tokenizer), base/ (init pretrained on the
    corpus: the model sft.py warm-starts; HF folders both), sft/ and rl/ (question sets), corpus.jsonl
    (the toy world's passages). Deterministic: the same bytes on every machine."""
    import os
    import shutil
    import tempfile

    import data
    import rollout

    target = lab_dir()
    if (target / "base" / "config.json").exists():
        return target
    shutil.rmtree(target, ignore_errors=True)              # a build that was killed half-way
    world = data.toy_world()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
    write_question_sets(world, tmp)
    add_other_worlds(tmp / "sft", world, [data.toy_world(seed) for seed in PRETRAIN_WORLDS])
    shutil.copy(world / "corpus.jsonl", tmp / "corpus.jsonl")   # --corpus of every lab run
    fixed = [rollout.SEARCH_R1_TEMPLATE.split("{question}")[0], rollout.INVALID_ACTION,
             "<search> x </search>\n\n<information>Doc 1(Title: \"X\") y\nDoc 2(Title: \"X\") y\n"
             "Doc 3(Title: \"X\") y</information>\n\n<answer> x </answer>"]
    texts = tokenizer_texts(world, fixed)
    tokenizer = train_tokenizer(texts)
    model = random_model(len(tokenizer), tokenizer.eos_token_id)
    model.save_pretrained(tmp / "init")
    tokenizer.save_pretrained(tmp / "init")
    other_worlds = [t for seed in PRETRAIN_WORLDS for t in tokenizer_texts(data.toy_world(seed), [])]
    losses = pretrain(model, tokenizer, other_worlds)
    model.eval().save_pretrained(tmp / "base")
    tokenizer.save_pretrained(tmp / "base")
    (tmp / "base" / "pretrain_loss.json").write_text(json.dumps(losses[::50] + losses[-1:]))
    try:  # atomic: another process may be building the same lab at the same time
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(build_lab())
