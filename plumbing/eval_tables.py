"""The report of `python eval.py`: the plain-text table (one row per data source, then the paper's
macro averages), the setting printed above it, and the files of an evaluation folder: results.json
(scores and setting per mode, strict JSON), predictions.jsonl (one line per question and mode) and
results.txt (the printed tables).
"""
import json
import os
from pathlib import Path

from plumbing.run_log import json_safe
from plumbing.scores import format_sampled


def format_table(summary: dict) -> str:
    """Plain-text table: one row per source, then the paper's group averages."""
    lines = [f"{'source':<28}{'N':>6}{'EM':>8}{'F1':>8}{'searches':>10}{'cover-EM':>10}"]

    def row(name, r):
        return f"{name:<28}{r['n']:>6}{r['em']:>8.3f}{r['f1']:>8.3f}{r['searches']:>10.2f}{r['cover_em']:>10.3f}"
    lines += [row(src, r) for src, r in summary["sources"].items()]
    lines.append("-" * len(lines[0]))
    lines += [row(f"avg {group} (macro)", summary[group]) for group in ("general", "multihop", "all")
              if summary[group]["n"]]
    dropped = summary.get("dropped") or []
    if dropped:
        lines.append(f"not scored: {len(dropped)} question{'s' * (len(dropped) > 1)} with a prompt over "
                     f"max_prompt_tokens: {', '.join(map(str, dropped[:10]))}{', ...' * (len(dropped) > 10)}")
    return "\n".join(lines)


def format_header(setting: dict) -> str:
    width = max(len(k) for k in setting)
    return "\n".join(f"{k:>{width}}: {v}" for k, v in setting.items())


def write_outputs(out_dir: Path, runs: dict[str, tuple[dict, dict]]) -> None:
    """runs: {mode: (setting, evaluate() result)} -> results.json ({mode: {"setting", scores}}),
    predictions.jsonl (one line per question and mode) and results.txt (the printed tables)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    scores = {mode: {"setting": setting, **{k: v for k, v in result.items() if k != "examples"}}
              for mode, (setting, result) in runs.items()}
    lines = [json.dumps({"mode": mode, **ex}, ensure_ascii=False) + "\n"
             for mode, (_, result) in runs.items() for ex in result["examples"]]
    tables = "\n\n".join(f"{format_header(setting)}\n\n{format_table(result)}"
                         + (f"\n\n{format_sampled(result['sampled'])}" if "sampled" in result else "")
                         for setting, result in runs.values()) + "\n"
    # each file whole or not at all, results.json last: an interrupted write leaves no half file
    for name, text in (("predictions.jsonl", "".join(lines)), ("results.txt", tables),
                       ("results.json", json.dumps(json_safe(scores), indent=2) + "\n")):
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out_dir / name)
