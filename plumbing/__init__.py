"""plumbing: the engineering the teaching scripts call in one line, and a reader may skip.

The top-level scripts (llds.py, train.py, rollout.py, retriever.py, eval.py, data.py, monitor.py)
hold the method. Everything here is there to make them fast, robust or convenient, not to explain
anything: each module says what it speeds up or takes care of.

    fast_hf.py    exact speed-ups of Hugging Face internals: a KV cache that grows in place, one
                  model's attention with SDPA sharing K/V heads, the shared prompt prefix run once
                  (prefix_once), the LM head in checkpointed chunks, the one bf16 autocast check,
                  rollout's batch of episodes sharing one KV cache
    tokens.py     token-level details of forced text and of the answer span
    fewshot.py    the text of the "fewshot" prompt's worked examples, and of eval.py's rag / direct prompts
    models.py     loading a policy (families it cannot run refused first); converting the embedded
                  SmolLM2 GGUF once into an HF folder; LoRA adapters (peft) and the KL reference
                  (a copy, or the adapter off); the policy placed for training; tiny models of each
                  family built in code
    memory.py     allocator settings (CUDA's, glibc's, oneDNN's caches) and peak-memory readings
    runs.py       the run around the step: what setup() returns (Run), the device, the run's
                  folder and name, seeds, AdamW, a signal or user error in one line, phase timing
                  and the progress bar, the step's logged means of its micro-batch values
    checkpoints.py  checkpoints written whole and found again by --resume, RNG state, the bf16
                  export, the model folder eval.py and ask.py find in a run
    run_log.py    a train.py run's log files (config.json, machine.json, metrics.jsonl, samples);
                  --report-to: metrics.jsonl's numbers also sent to TensorBoard and/or W&B
    summary.py    the lines a run ends with: EM before and after, the sign test, the verdict
    sampler.py    the prompt sampler, reshuffled each epoch, resumable
    search_health.py  per-step health of search and groups: answer in passages, unique queries,
                  tied groups, correct/incorrect pairs sharing the first search
    token_view.py the token-level view of a step (views/*.html, *.jsonl) and its index page
    dynamic_sampling.py  --drop-tied-groups: the redrawn groups' rows swapped into a rollout
    minibatches.py  --verl-minibatches: the rows in the mini-batch order of the authors' trainer
    scores.py     cover-EM, pass@k, avg@k / pass@k with bootstrap intervals
    memory_plan.py  --plan: what a run will hold in memory, from the model's config
    presets.py    train.py's --preset settings: the paper's, one GPU's, the LLD lab's
    plots.py      training curves of one run, or several overlaid
    metrics_file.py  a run's metrics.jsonl read back, older runs' metric names and signs mapped
                  to today's
    cli.py        `flag()` config fields -> argparse flags with their --help and values held to
                  each field's declared range; the fields two config classes share; one-line
                  parser errors
    corpus.py     a corpus file memory-mapped (parsed once), its fingerprint, index metadata
    bm25_index.py BM25's index built a chunk of passages at a time, and its search over postings
    dense_index.py  faiss indexes filled as passages are encoded, read memory-mapped, moved to a
                  GPU; an encoder folder's pooling and prompts
    server.py     the hardened HTTP server behind `retriever.py serve` (concurrent requests
                  batched into one search), and the query rules every retriever backend shares
    retriever_cli.py  `retriever.py index | search | serve`: the flags and what each command runs
    eval_tables.py  eval.py's tables and output files
    long_prompts.py  prompts over max_prompt_tokens, found and dropped (or refused) at load, or
                  refused by rollout()
    scripted.py   a Python function that writes each model turn, dressed as an HF causal LM so
                  that rollout() drives it (sft.py's demonstrations)

Nothing here imports a top-level script (tests/test_layering.py): what a module needs from one
is passed in. The toy world's generator is the experiment's data, so it lives in tasks/.
"""
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models, toy worlds and indexes go ($LLDS_CACHE or ~/.cache/llds)."""
    return Path(os.environ.get("LLDS_CACHE", "~/.cache/llds")).expanduser()
