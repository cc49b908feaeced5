"""experiments/demo_seeds/demo_seeds.py: `make train` as a newcomer meets it, over seeds and both numeric paths.

Each run is a fresh clone of this repository's HEAD with an empty model cache and no pip cache, timed
from `make train` to its last line (install, model conversion, toy world and index included):

    .venv/bin/python experiments/demo_seeds/demo_seeds.py --seeds 0-4 --paths bf16 avx2 --out runs/demo-seeds

Paths: `bf16` is the default run (bf16 autocast where the CPU has AVX512-BF16); `avx2` is the float32
path of AVX2-only CPUs (most laptops), emulated on this CPU: `ARGS="--no-bf16"` with PyTorch's kernels,
MKL and oneDNN held to AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA): the
same cores and clock with the narrower vector units. Runs go one at a time; nothing else should run.
Every run appends one JSON line to <out>/runs.jsonl (a finished run is skipped on a rerun) and the
table over all of them is printed, ready for docs/benchmarks.md.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
PATHS = {"bf16": ({}, ""), "avx2": (AVX2, "--no-bf16")}
EM_LINE = re.compile(r"held-out EM: before ([\d.]+) -> after ([\d.]+) \((\d+) questions: (\d+) turned right, "
                     r"(\d+) turned wrong; sign test p = ([\d.e+-]+)\)")


def cpu_kind() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = re.search(r"Model name:\s*(.+)", info).group(1).strip()
    flags = re.search(r"Flags:\s*(.+)", info).group(1).split()
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{os.cpu_count()}-core {name}, {isa}{', AMX' if 'amx_tile' in flags else ''}"


def one_run(path: str, seed: int, out: Path) -> dict:
    """A fresh clone, a fresh cache, `/usr/bin/time -v make train ARGS=...`; what it printed, parsed."""
    env_extra, args = PATHS[path]
    work = out / f"{path}-s{seed}"
    shutil.rmtree(work, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(work / "repo")], check=True)
    env = {**os.environ, **env_extra, "LLDS_CACHE": str(work / "cache"), "PIP_NO_CACHE_DIR": "1"}
    load_before = os.getloadavg()[0]
    start = time.time()
    done = subprocess.run(["/usr/bin/time", "-v", "make", "train", f"ARGS=--seed {seed} {args}".strip()],
                          cwd=work / "repo", env=env, capture_output=True, text=True)
    wall = time.time() - start
    (work / "make-train.log").write_text(done.stdout + done.stderr)
    em = EM_LINE.search(done.stdout)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    step = re.search(r"of ([\d.]+) s/step", done.stdout)
    row = {"path": path, "seed": seed, "exit": done.returncode, "wall_s": round(wall, 1),
           "load_before": load_before, "load_after": os.getloadavg()[0], "cpu": cpu_kind(),
           "s_per_step": float(step.group(1)) if step else None,
           "peak_rss_gib": round(int(rss.group(1)) / 2**20, 2) if rss else None,
           "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(start)), "commit": git_head(work / "repo")}
    if em:
        before, after, n, right, wrong, p = em.groups()
        row.update(before=float(before), after=float(after), questions=int(n), right=int(right),
                   wrong=int(wrong), p=float(p))
    shutil.rmtree(work / "repo" / ".venv", ignore_errors=True)       # 1.6 GB a run; the log stays
    shutil.rmtree(work / "cache", ignore_errors=True)
    return row


def git_head(repo: Path = ROOT) -> str:
    """The commit a run's clone was made at."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                          text=True).stdout.strip()


def table(rows: list[dict]) -> str:
    head = ("| path | seed | EM before -> after | turned right / wrong | sign test p | wall time | s/step "
            "| peak RSS | load (1-min avg, before / after) | CPU |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    rows = list({(r["path"], r["seed"]): r for r in rows}.values())     # a rerun's row replaces a failed one
    for r in sorted(rows, key=lambda r: (r["path"], r["seed"])):
        em = (f"{r['before']:.3f} -> {r['after']:.3f}", f"{r['right']} / {r['wrong']}", f"{r['p']:.2g}") \
            if "p" in r else ("failed", f"exit {r['exit']}", "-")
        lines.append(f"| {r['path']} | {r['seed']} | {em[0]} | {em[1]} | {em[2]} | {int(r['wall_s'] // 60)} min "
                     f"{int(r['wall_s'] % 60)} s | {r['s_per_step']} | {r['peak_rss_gib']} GiB | "
                     f"{r['load_before']:.2f} / {r['load_after']:.2f} | {r['cpu']} |")
    for path in sorted({r["path"] for r in rows}):
        mine = [r for r in rows if r["path"] == path and "p" in r]
        if mine:
            gains = [r["after"] - r["before"] for r in mine]
            lines.append(f"\n{path}: EM rises by {min(gains):+.3f} to {max(gains):+.3f}; p < 0.05 in "
                         f"{sum(r['p'] < 0.05 and r['after'] > r['before'] for r in mine)} of {len(mine)} seeds; "
                         f"wall time {min(r['wall_s'] for r in mine) / 60:.1f}-{max(r['wall_s'] for r in mine) / 60:.1f} min")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-4", help="seeds, e.g. 0-4 or 3")
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=["bf16", "avx2"])
    parser.add_argument("--out", type=Path, default=Path("runs/demo-seeds"))
    parser.add_argument("--table-only", action="store_true", help="print the table of the runs in --out and exit")
    args = parser.parse_args(argv)
    first, _, last = args.seeds.partition("-")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    rows = [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []
    if not args.table_only:
        for path in args.paths:
            for seed in range(int(first), int(last or first) + 1):
                if any(r["path"] == path and r["seed"] == seed and "p" in r for r in rows):
                    continue
                print(f"{path} seed {seed}: fresh clone, make train ...", flush=True)
                row = one_run(path, seed, args.out.resolve())
                rows.append(row)
                with open(log, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())
