"""bench/gpu_check.py in its smoke mode on the CPU, on a tiny model it builds: the script a first
GPU run executes runs end to end (train.py's setup, two training steps at lr 0 whose ratios, KL,
LLDS and displacement are exactly 0, the passes that must agree, the decode against its floor, the
held-out evaluation, a checkpoint and the bf16 export), keeps every phase that ended in its JSON
report whatever stops it, and records a failing model before running the fallback. On the CPU
demo's path the memory plan's peak is within 25% of the measured one, in float32: the process's
RSS above what the plan does not count (libraries, data, index), read from Linux's /proc, so
other processes on the machine do not move it, with glibc unmapping freed blocks so that RSS
follows live tensors. Under bf16 autocast a CPU's RSS also holds oneDNN's shape caches (bounded:
memory.bound_onednn_caches), which the plan leaves out. `make test` also runs the smoke in a venv
holding only torch, transformers and pytest, as on a lent GPU machine."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from plumbing import memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
ROOT = Path(__file__).resolve().parent.parent
TINY = "qwen2.5-3b-instruct (tiny)"          # the default model's phases, with --smoke


def test_gpu_check_smoke_runs_the_gpu_path_end_to_end(tmp_path, capsys):
    report = tmp_path / "report.json"
    out = gpu_check.main(["--smoke", "--json", str(report), "--dir", str(tmp_path)])
    assert json.loads(report.read_text()) == json.loads(json.dumps(out, default=str))
    phases = out["phases"]
    assert ["machine", "bandwidth"] + [f"{TINY} {p}" for p in (
        "setup", "step 1", "step 2", "passes", "decode", "eval", "checkpoint", "export")] \
        == list(phases)
    assert out["finished"] and out["exact"] and not out["skipped"] and not out["failed"]
    step = phases[f"{TINY} step 2"]
    assert all(step[k] == 0 for k in ("clip_ratio", "ppo_kl", "kl", "llds/loss",
                                      "lld/correct_displacement"))
    # random weights run every row of every turn to its cap: 2 rollout batches x 4 turns x 24
    assert step["occupancy"] == 1.0 and step["decode steps"] == 2 * 4 * 24
    assert 0 < step["logp_diff"] < 0.1 and step["logp_diff ok"]
    passes = phases[f"{TINY} passes"]
    assert passes["old vs update"] == passes["old vs displacement"] == 0
    assert passes["old vs reference"] == passes["old vs update unheld"] == 0
    setup = phases[f"{TINY} setup"]      # a CPU runs flash held off cuDNN or not, grad or not
    kernels = {v for k, v in setup.items() if k.startswith(("held ", "unheld "))}
    assert kernels == {"FLASH_ATTENTION"} and len([k for k in setup if "held " in k]) == 8
    assert phases[f"{TINY} checkpoint"]["GiB"] > 0 and phases[f"{TINY} export"]["GiB"] > 0
    assert list(tmp_path.iterdir()) == [report]                  # every file it wrote is deleted
    assert f"gpu_check {TINY}: lr 0 exact" in capsys.readouterr().out


def test_the_plan_meets_the_measured_peak_on_the_cpu_demos_path(tmp_path):
    out = gpu_check.main(["--smoke", "--preset", "demo", "--no-bf16",
                          "--json", str(tmp_path / "r.json")])
    step, setup = out["phases"][f"{TINY} step 2"], out["phases"][f"{TINY} setup"]
    measured = max(step[f"{p} allocated GiB"] for p in ("rollout", "logprob", "update"))
    planned = max(setup[f"plan {p} GiB"] for p in ("rollout", "update"))
    assert step["exact"] and 0.75 <= measured / planned <= 1.25, (step, setup)


def test_a_run_killed_after_its_first_phase_keeps_it_in_its_report(tmp_path):
    report = tmp_path / "report.json"
    check = subprocess.Popen([sys.executable, "bench/gpu_check.py", "--smoke", "--json",
                              str(report), "--dir", str(tmp_path)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while "machine" not in (json.loads(report.read_text())["phases"] if report.exists()
                                else {}):
            assert time.monotonic() < deadline and check.poll() is None
            time.sleep(0.05)
        os.kill(check.pid, signal.SIGKILL)
    finally:
        check.wait()
    kept = json.loads(report.read_text())
    assert kept["phases"]["machine"]["torch"] == torch.__version__ and not kept["finished"]


def test_the_budget_skips_what_would_not_end_in_time_and_still_writes_the_report(tmp_path):
    out = gpu_check.main(["--smoke", "--budget", "0", "--json", str(tmp_path / "r.json")])
    assert list(out["phases"]) == ["machine", "bandwidth"]
    assert out["skipped"] == {f"{TINY} setup": "no time left"} and out["finished"]
    assert json.loads((tmp_path / "r.json").read_text())["finished"]


def test_a_failing_model_is_recorded_and_the_fallback_runs(tmp_path, monkeypatch):
    real, calls = gpu_check.write_model, []

    def out_of_memory_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args)

    monkeypatch.setattr(gpu_check, "write_model", out_of_memory_once)
    out = gpu_check.main(["--smoke", "--fallback", "--json", str(tmp_path / "r.json")])
    assert out["failed"][TINY]["error"] == "OutOfMemoryError: CUDA out of memory (simulated)"
    fallback = "qwen2.5-0.5b-instruct (tiny)"
    assert out["phases"][f"{fallback} step 2"]["exact"] and f"{fallback} export" in out["phases"]


def test_gpu_check_sets_train_pys_allocator_before_torch_starts(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    memory.configure_allocator(torch.device("cuda"))
    wanted = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    code = ("import os, sys; sys.path.insert(0, '.'); import bench.gpu_check; "
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == [wanted]
    source = (ROOT / "bench" / "gpu_check.py").read_text()
    assert source.index("PYTORCH_CUDA_ALLOC_CONF") < source.index("import torch")


def test_the_training_path_imports_without_the_optional_packages():
    # A lent GPU machine has torch and transformers only: bm25s, PyStemmer, faiss, matplotlib,
    # pyarrow and requests are imported where they are used, never on import of the scripts.
    # (`make test` runs the whole smoke in such a venv.)
    code = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"bm25s", "Stemmer", "faiss", "matplotlib", "pyarrow", "requests"}:
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Absent())
sys.path.insert(0, ".")
import train, eval, rollout, retriever, sft, data, bench.gpu_check
print("imported")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "imported", out.stderr[-2000:]
