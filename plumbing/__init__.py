"""plumbing: the engineering the teaching scripts call in one line, and a reader may skip.

The top-level scripts (llds.py, train.py, rollout.py, retriever.py, eval.py, data.py) hold the
method. Everything here is there to make them fast, robust or convenient, not to explain
anything: each module says what it speeds up or takes care of.

    fast_hf.py    exact speed-ups of Hugging Face internals: a KV cache that grows in place, SDPA
                  sharing K/V heads, the shared-prefix forward, the chunked LM head, the one
                  bf16 autocast check, rollout's batch of episodes sharing one KV cache
    tokens.py     token-level details of forced text and of the answer span
    fewshot.py    the text of the "fewshot" prompt's worked examples
    models.py     loading a policy; converting the embedded SmolLM2 GGUF once into an HF folder;
                  the KL reference copy; tiny models built in code (tests, GPU check)
    memory.py     glibc allocator settings and peak-memory readings
    runs.py       run folders: checkpoints and RNG state, metrics log, samples, prompt sampler,
                  phase timing and what the progress bar says of it, the spiral monitor's
                  warnings, the step's micro-batch means
    report.py     --report-to: metrics.jsonl's numbers also sent to TensorBoard and/or W&B
    plots.py      training curves of one run, or several overlaid
    cli.py        a config dataclass -> argparse flags whose --help is the field comments
    corpus.py     reading and fingerprinting a corpus file, index metadata
    server.py     the hardened HTTP server behind `retriever.py serve`, and the query rules
                  every retriever backend shares
    reports.py    eval.py's tables and output files
    long_prompts.py  prompts over max_prompt_tokens, found and dropped (or refused) at load

Nothing here imports a top-level script (tests/test_layering.py): what a module needs from one
is passed in. The toy world's generator is the experiment's data, so it lives in tasks/.
"""
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models, toy worlds and indexes go ($LLDS_CACHE or ~/.cache/llds)."""
    return Path(os.environ.get("LLDS_CACHE", "~/.cache/llds")).expanduser()
