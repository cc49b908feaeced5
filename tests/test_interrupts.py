"""Faults a run meets, each ending in one line and losing no completed step: a signal (Ctrl-C,
SIGTERM, SIGHUP) to a real tiny run in a subprocess; a newest checkpoint that cannot be read (cut
short, or another model's); a disk that fills before or while a checkpoint is written (a patched
disk, as this machine may not mount a small tmpfs); an evaluation stopped while writing."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from conftest import tiny_policy
from plumbing import checkpoints, eval_tables, runs
from test_train import step_lines, tiny_config

ROOT = Path(__file__).resolve().parent.parent
RUN = """
import sys, dataclasses
from math import inf
from pathlib import Path
sys.path[:0] = [{root!r}, {tests!r}]
import torch
import train
from conftest import tiny_policy
from plumbing import runs
torch.set_num_threads(1)
cfg = train.Config(**{cfg!r})
with runs.user_errors_exit(Path(cfg.out_dir) / cfg.name):     # what train.main wraps a run in
    train.train(cfg, *tiny_policy())
"""


def steps_done(run_dir: Path) -> list[int]:
    return [l["step"] for l in step_lines(run_dir)] if (run_dir / "metrics.jsonl").exists() else []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_the_run_in_one_line_and_resume_keeps_every_step_once(tmp_path, sig,
                                                                             alternating_rewards):
    cfg = tiny_config(tmp_path, steps=60, ckpt_every=2, eval_size=0)
    code = RUN.format(root=str(ROOT), tests=str(ROOT / "tests"), cfg=cfg.__dict__)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    run = tmp_path / "run"
    deadline = time.time() + 120
    while len(steps_done(run)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(rf"stopped by {signal.Signals(sig).name} after step (\d+); --resume "
                         rf"continues from {re.escape(str(run))}/ckpt-(\d+) \(step (\d+)\)", last)
    assert match, last
    done, ckpt = int(match[1]), int(match[2])
    assert ckpt <= done and ckpt % 2 == 0 and not list(run.glob(".tmp-ckpt-*"))
    train.train(train.Config(**{**cfg.__dict__, "resume": True, "steps": done + 1}), *tiny_policy())
    assert steps_done(run) == list(range(1, done + 2))


def test_after_the_first_signal_a_second_one_kills_and_the_handlers_come_back(tmp_path):
    before, seen = signal.getsignal(signal.SIGINT), []
    with pytest.raises(SystemExit) as e:
        with runs.user_errors_exit(tmp_path):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                seen.append(signal.getsignal(signal.SIGINT))
    assert e.value.code == 128 + signal.SIGTERM and seen == [signal.SIG_DFL]
    assert signal.getsignal(signal.SIGINT) is before


def three_checkpoints(tmp_path, **kw):
    cfg = tiny_config(tmp_path, steps=3, ckpt_every=1, keep_ckpts=2, eval_size=0, **kw)
    train.train(cfg, *tiny_policy())
    return cfg, tmp_path / "run"


def test_a_checkpoint_cut_short_is_named_and_the_one_before_it_used(tmp_path, capsys):
    cfg, run = three_checkpoints(tmp_path)
    weights = run / "ckpt-3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    train.train(train.Config(**{**cfg.__dict__, "resume": True, "steps": 4}), *tiny_policy())
    out = capsys.readouterr().out
    assert f"--resume: {run}/ckpt-3 cannot be used (model.safetensors holds 1,000 bytes where" in out
    assert f"resumed from {run}/ckpt-2 (step 2)" in out and "moments start afresh" in out
    assert steps_done(run) == [1, 2, 3, 4]


def test_a_checkpoint_that_does_not_load_or_is_another_models_is_passed_over(tmp_path, capsys):
    cfg, run = three_checkpoints(tmp_path)
    (run / "ckpt-3" / "manifest.json").unlink()          # as written before manifests
    weights = run / "ckpt-3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    other, _ = tiny_policy(hidden_size=64, intermediate_size=128)
    other.save_pretrained(run / "ckpt-2")                 # another model's weights, sizes too
    (run / "ckpt-2" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="no checkpoint of .* loads"):
        train.train(train.Config(**{**cfg.__dict__, "resume": True, "steps": 4}), *tiny_policy())
    out = capsys.readouterr().out
    assert "ckpt-3 cannot be used (" in out and "ckpt-2 cannot be used (its weights are another" in out


class Disk:
    """shutil.disk_usage with `free` bytes free from the call `from_call` on (before: plenty)."""

    def __init__(self, free, from_call=0):
        self.free, self.from_call, self.calls = free, from_call, 0

    def __call__(self, path):
        self.calls += 1
        free = self.free if self.calls > self.from_call else 10**12
        return shutil._ntuple_diskusage(10**12, 10**12 - free, free)


def test_a_disk_too_full_for_a_checkpoint_stops_in_one_line_and_keeps_the_one_before(
        tmp_path, monkeypatch, capsys):
    cfg = tiny_config(tmp_path, steps=3, ckpt_every=1, eval_size=0)
    run = tmp_path / "run"
    disk = Disk(free=10_000, from_call=1)                 # room for the first checkpoint only
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", disk)
    with pytest.raises(SystemExit) as e:
        with runs.user_errors_exit(run):
            train.train(cfg, *tiny_policy())
    line = str(e.value.code)
    assert line.startswith(f"error: no space left on the disk of {run}: the checkpoint of step 2 "
                           "needs ") and "GiB are free; nothing was written" in line
    assert line.endswith(f"the run continues from {run}/ckpt-1 (step 1) with --resume")
    assert (run / "latest").read_text() == "ckpt-1" and not list(run.glob(".tmp-ckpt-*"))
    monkeypatch.undo()
    train.train(train.Config(**{**cfg.__dict__, "resume": True}), *tiny_policy())
    assert steps_done(run) == [1, 2, 3]


def test_a_disk_that_fills_while_torch_writes_ends_in_one_line(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, steps=2, ckpt_every=1, eval_size=0)
    run, real_save, optimizers = tmp_path / "run", torch.save, []
    disk = Disk(free=10_000, from_call=10**6)

    def fills(obj, path, *args, **kwargs):
        optimizers.extend([path] if str(path).endswith("optimizer.pt") else [])
        if len(optimizers) == 2:                          # the second checkpoint: the disk fills
            disk.from_call = 0
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoints.shutil, "disk_usage", disk)
    monkeypatch.setattr(torch, "save", fills)
    with pytest.raises(SystemExit) as e:
        with runs.user_errors_exit(run):
            train.train(cfg, *tiny_policy())
    assert "the disk filled while the checkpoint of step 2 was written" in str(e.value.code)
    assert (run / "latest").read_text() == "ckpt-1" and not (run / "ckpt-2").exists()
    assert not list(run.glob(".tmp-ckpt-*"))


def test_evaluation_outputs_are_whole_or_absent(tmp_path, monkeypatch):
    result = {"examples": [{"id": "q"}], "all": {}}
    real, calls = os.replace, []

    def dies_on_the_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(eval_tables.os, "replace", dies_on_the_second)
    monkeypatch.setattr(eval_tables, "format_table", lambda r: "table")
    monkeypatch.setattr(eval_tables, "format_header", lambda s: "header")
    with pytest.raises(KeyboardInterrupt):
        eval_tables.write_outputs(tmp_path, {"search": ({}, result)})
    assert (tmp_path / "predictions.jsonl").exists() and not (tmp_path / "results.json").exists()
    monkeypatch.setattr(eval_tables.os, "replace", real)
    eval_tables.write_outputs(tmp_path, {"search": ({}, result)})
    assert json.loads((tmp_path / "results.json").read_text())["search"]["all"] == {}


def test_a_log_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path, capsys):
    cfg, run = three_checkpoints(tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')                      # killed while writing step 4's line
    assert runs.stopped_line(run, "SIGKILL").startswith("stopped by SIGKILL after step 3;")
    train.train(train.Config(**{**cfg.__dict__, "resume": True, "steps": 4}), *tiny_policy())
    assert steps_done(run) == [1, 2, 3, 4]
