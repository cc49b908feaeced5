"""The run around train.py's step: what setup() returns (Run), the device, the run's folder and
name, seeds, AdamW as each device wants it, a signal or a user error ending in one line, the
step's phase timing and what the progress bar says of it, and the step's logged means of its
micro-batch values. Nothing here changes what is computed."""
import contextlib
import errno
import math
import random
import re
import shutil
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from plumbing.checkpoints import checkpoint_step, find_checkpoint, resume_hint
from plumbing.memory import release_memory
from plumbing.run_log import metric_lines


@dataclass
class Run:
    """What train.py's setup() prepares for one run."""
    device: torch.device
    dir: Path                          # <out_dir>/<name>
    train_records: list[dict]          # the training questions whose prompt fits
    eval_records: list[dict]           # the fixed held-out subset
    retriever: object                  # anything with .search(queries, topk)
    model: torch.nn.Module             # the policy, fp32 weights
    tokenizer: object
    ref: torch.nn.Module | None        # the frozen initial policy of the KL term; None when kl_coef is 0
    optimizer: torch.optim.Optimizer


def pick_device(name: str) -> torch.device:
    """--device auto, cuda or cpu -> the device (auto: cuda when torch sees a GPU)."""
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


class Stopped(Exception):
    """SIGTERM or SIGHUP asked the program to stop (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def user_errors_exit(run_dir: Path):
    """A user's error (bad path, flag or data) ends the program in one line, "error: ..."; so do a
    lost retriever (ConnectionError mid-run) and a full disk, which also say which checkpoint
    --resume continues from. Ctrl-C, SIGTERM and SIGHUP stop it at once with one line naming the
    signal, the last completed step and that checkpoint; a second signal kills at once."""
    def stop(signum, frame):
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS} if main_thread else {}
    try:
        yield
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    except ConnectionError as e:
        raise SystemExit(f"error: {e}{resume_hint(run_dir)}") from None
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise SystemExit(f"error: no space left on the disk of {e.filename or run_dir}: "
                         f"{e.strerror}{resume_hint(run_dir)}") from None
    except (KeyboardInterrupt, Stopped) as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        sys.stderr.write(f"\n{stopped_line(run_dir, signal.Signals(signum).name)}\n")
        raise SystemExit(128 + signum) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


def stopped_line(run_dir: Path, name: str) -> str:
    """'stopped by SIGTERM after step 7; --resume continues from <ckpt> (step 5)', or what to do
    when no checkpoint exists yet."""
    steps = [l for l in metric_lines(run_dir) if "reward" in l]
    done = f"stopped by {name}" + (f" after step {steps[-1]['step']}" if steps else "")
    ckpt = find_checkpoint(run_dir) if Path(run_dir).is_dir() else None
    if ckpt is None:
        return f"{done}; there is no checkpoint to resume from: start it again"
    return f"{done}; --resume continues from {ckpt} (step {checkpoint_step(ckpt)})"


def adamw(params, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the parameters that train (all, or LoRA's adapters), fused on CUDA (no full fp32
    transient: 12.3 GB at 3B, and faster); foreach on a CPU, where it gives the per-tensor loop's
    numbers bit for bit (tested) 3x faster, and fused does not."""
    cuda = device.type == "cuda"
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr,
                             weight_decay=weight_decay, fused=cuda, foreach=not cuda)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Phases:
    """Wall time per phase of a step (`with phases("rollout"): ...`, summed per name in
    `phases.seconds`); after each phase the freed memory goes back to the OS (release_memory).
    show(text), e.g. a progress bar's set_description_str, is told which phase runs, and
    `phases.note(text)` / `phases.each(items, what)` say where inside it the phase is."""

    def __init__(self, show=None):
        self.seconds, self.current = {}, ""
        self.show = show or (lambda text: None)

    def note(self, text: str) -> None:
        self.show(f"{self.current} {text}")

    def each(self, name: str, items: list, what: str):
        """The items, iterated as the phase `name`, noting "<what> i/n" before each."""
        with self(name):
            for i, item in enumerate(items):
                self.note(f"{what} {i + 1}/{len(items)}")
                yield item

    @contextlib.contextmanager
    def __call__(self, name: str, release: bool = True):
        self.current = name
        self.show(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            if release:
                release_memory()

    def timing(self, out) -> dict:
        """The step's timing/<phase> and timing/step seconds; timing/retrieval (inside the rollout
        `out`), its sampled tokens per second of generation, its decode steps, and the occupancy of
        its decode (sampled tokens / (rows x decode steps): a turn decodes every row until its
        longest row stops), in all and per turn."""
        decode = out.decode
        turns = sorted({k for what, k in decode if what == "slots"})
        return {**{f"timing/{k}": v for k, v in self.seconds.items()}, "timing/retrieval": out.timing["retrieval"],
                "timing/step": sum(self.seconds.values()),
                "rollout_tokens_per_s": out.n_generated / max(out.timing["generate"], 1e-9),
                "rollout/decode_steps": sum(decode[("steps", k)] for k in turns),
                "rollout/occupancy": (sum(decode[("tokens", k)] for k in turns)
                                      / max(sum(decode[("slots", k)] for k in turns), 1)),
                **{f"rollout/occupancy_turn{k}": decode[("tokens", k)] / max(decode[("slots", k)], 1)
                   for k in turns}}


def run_name(out_dir, name: str, resume: bool) -> str:
    """The run's folder name: `name` when given; else "demo", or when that is taken the first free
    "demo-N" (with resume: the newest of them), so that a plain `make train` always starts a run."""
    if name:
        return name
    number = {p.name: int(p.name[5:] or 1) for p in Path(out_dir).glob("demo*")
              if p.is_dir() and re.fullmatch(r"demo(-\d+)?", p.name)}
    newest = max(number, key=number.get, default=None)
    if resume or newest is None:
        return newest or "demo"
    return f"demo-{number[newest] + 1}"


def prepare_run_dir(run_dir: Path, resume: bool) -> Path:
    """Create <out_dir>/<name>; refuse to overwrite a run unless resuming; drop temp folders
    left by a run killed while checkpointing."""
    if run_dir.exists() and not resume and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} already exists: pass --resume to continue it, or --name for a new run")
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob(".tmp-ckpt-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return run_dir


def postfix(m: dict) -> dict:
    """The progress bar's short view of a step's metrics."""
    def fmt(v):
        return "-" if v is None else f"{v:.3g}"
    return {"reward": fmt(m["reward"]), "logp_c": fmt(m["lld/logp_correct"]),
            "disp_c": fmt(m["lld/correct_displacement"]), "gnorm": fmt(m["grad_norm"]),
            "llds": fmt(m["llds/loss"]), "ent": fmt(m["entropy"]), "search": fmt(m["searches"]),
            "step_s": f"{m['timing/step']:.0f}"}


def micro_metrics(share: float, pg, pg_stats: dict, kl, llds_term, llds_stats: dict) -> dict:
    """One micro-batch's part of its mini-batch's logged values: the losses (already divided by
    the mini-batch's normaliser) as they are, token means weighted by `share`, the micro-batch's
    part of the mini-batch's tokens. Summed over the micro-batches: the mini-batch's values."""
    weighted = {**pg_stats, **{k: llds_stats[k] for k in ("llds/active_token_frac",
                                                          "llds/active_action_frac")}}
    return {"pg_loss": pg.item(), "kl": kl.item(), "llds/loss": llds_term.item(),
            **{k: v * share for k, v in weighted.items()}}


def update_stats(sums: dict, norms: list[float], n_minibatches: int, kl: bool) -> dict:
    """The step's logged values: each micro_metrics value summed over the step, over the number of
    mini-batches (kl None without a reference model); the mean finite gradient norm, and a max in
    which a non-finite norm wins (max([1.0, nan]) is 1.0 in Python): the monitor must see it;
    grad_zero 1.0 when every norm was exactly 0 (every group tied: nothing to learn from)."""
    finite = [x for x in norms if math.isfinite(x)]
    return {**{k: v / n_minibatches for k, v in sums.items()}, **({} if kl else {"kl": None}),
            "grad_norm": statistics.fmean(finite) if finite else float("nan"),
            "grad_norm_max": max(norms, key=lambda x: x if math.isfinite(x) else math.inf),
            "grad_norm_nonfinite": len(norms) - len(finite), "grad_zero": float(all(n == 0 for n in norms))}
