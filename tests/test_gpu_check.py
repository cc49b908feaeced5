"""bench/gpu_check.py in its smoke mode on the CPU, on a tiny model it builds: the script a first GPU
run executes runs end to end (train.py's setup, a training step at lr 0 whose ratios, KL, LLDS and
displacement are exactly 0, the held-out evaluation, a checkpoint and the bf16 export), and on the
CPU demo's path the memory plan's peak is within 25% of the measured one, in float32: the process's
RSS above what the plan does not count (libraries, data, index), read from Linux's /proc, so other
processes on the machine do not move it, with glibc unmapping freed blocks so that RSS follows live
tensors. Under bf16 autocast a CPU's RSS also holds oneDNN's shape caches (bounded:
memory.bound_onednn_caches), which the plan leaves out."""
import sys

import pytest

from bench import gpu_check

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def test_gpu_check_smoke_runs_the_gpu_path_end_to_end(capsys):
    out = gpu_check.main(["--smoke"])                                  # the one-gpu-3b preset's settings
    table = capsys.readouterr().out
    assert "measured/plan" in table and "all exactly 0" in table and out["exact"]
    assert out["results"]["checkpoint GiB"] > 0 and out["results"]["export GiB"] > 0
    assert set(out["peaks"]) >= {"setup", "rollout", "logprob", "update", "eval", "checkpoint"}


def test_the_plan_meets_the_measured_peak_on_the_cpu_demos_path():
    out = gpu_check.main(["--smoke", "--preset", "demo", "--no-bf16"])
    measured = max(allocated for name, (allocated, _) in out["peaks"].items() if name != "setup")
    planned = max(out["planned"].values())
    assert out["exact"] and 0.75 <= measured / planned <= 1.25, (out["peaks"], out["planned"])
