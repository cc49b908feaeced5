"""Run folders: what train.py's setup() prepares (Run), checkpoints (atomic, resumable) and the
model folder eval.py finds in them, RNG state, the metrics log, sample trajectories, the prompt
sampler, a micro-batch's rows, the step's means of its micro-batch metrics and its timing, the
one-line exit of a user error. Nothing here changes what is computed."""
import contextlib
import copy
import errno
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from plumbing.memory import release_memory
from plumbing.models import is_model_folder


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
    steps = [l for l in _metric_lines(run_dir) if "reward" in l]
    done = f"stopped by {name}" + (f" after step {steps[-1]['step']}" if steps else "")
    ckpt = find_checkpoint(run_dir) if Path(run_dir).is_dir() else None
    if ckpt is None:
        return f"{done}; there is no checkpoint to resume from: start it again"
    return f"{done}; --resume continues from {ckpt} (step {_step(ckpt)})"


def _metric_lines(run_dir: Path) -> list[dict]:
    """metrics.jsonl's lines; a line cut short by a kill while it was written is left out."""
    path, lines = Path(run_dir) / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines


def _step(ckpt: Path) -> int:
    return int(ckpt.name.split("-")[1])


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


def json_safe(x):
    """Non-finite floats -> None, in nested dicts too, so JSON files stay strict."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    return None if isinstance(x, float) and not math.isfinite(x) else x


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints that were completed (state.json): the one `latest` names first, then
    the others, newest first."""
    run_dir = Path(run_dir)
    done = sorted((p for p in run_dir.glob("ckpt-*") if (p / "state.json").exists()),
                  key=_step, reverse=True)
    pointer = run_dir / "latest"
    named = run_dir / pointer.read_text().strip() if pointer.exists() else None
    return sorted(done, key=lambda p: p != named)


def find_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names; if that is missing, the highest complete ckpt-<step>."""
    return next(iter(checkpoints(run_dir)), None)


def resolve_model(path: str | None) -> str | None:
    """eval.py's --model: a train.py checkpoint may be given at any level: the HF folder
    (config.json), a ckpt-<step> folder holding model/, or a run folder (the checkpoint its
    `latest` names, as train.py resumes from). Anything that is not a folder (None = embedded
    default, a hub name) passes through."""
    if path is None or not Path(path).is_dir():
        return path
    p = find_checkpoint(Path(path)) or Path(path)  # a run folder's own config.json is train.py's
    if is_model_folder(p / "model"):
        p = p / "model"
    if not is_model_folder(p):
        raise ValueError(f"{path}: no model here (expected an HF model folder with config.json, "
                         "a ckpt-<step> folder with model/, or a run folder with ckpt-* inside)")
    return str(p)


class PromptSampler:
    """Endless prompts, reshuffled every epoch from the seed; (epoch, pos) is its whole state."""

    def __init__(self, records: list[dict], seed: int, epoch: int = 0, pos: int = 0):
        if not records:   # next() would wait forever for a prompt
            raise ValueError("no training questions to sample prompts from")
        if pos >= len(records):   # the data shrank since the checkpoint: start the next epoch
            epoch, pos = epoch + 1, 0
        self.records, self.seed, self.epoch, self.pos = records, seed, epoch, pos

    def _order(self) -> list[int]:
        order = list(range(len(self.records)))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            order = self._order()
            take = order[self.pos:self.pos + n - len(out)]
            out += [self.records[i] for i in take]
            self.pos += len(take)
            if self.pos == len(order):
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}


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


def log_metrics(run_dir: Path, metrics: dict) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(json_safe(metrics)) + "\n")


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop log lines of steps after `step` (written by a run killed after its checkpoint)."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        kept = [m for m in _metric_lines(run_dir) if m["step"] <= step]
        _write_atomic(path, "".join(json.dumps(m) + "\n" for m in kept))


def write_samples(path: Path, records: list[dict], episodes: list[dict], n: int) -> None:
    """A few (n; 0 = none, no file) full trajectories as readable text: half correct (when there are), half not."""
    if not n:
        return
    correct = [i for i, e in enumerate(episodes) if e["reward"] > 0]
    wrong = [i for i, e in enumerate(episodes) if e["reward"] <= 0]
    chosen = correct[:n // 2]
    chosen += wrong[:n - len(chosen)]
    chosen += correct[len(correct[:n // 2]):][:n - len(chosen)]
    blocks = []
    for i in sorted(chosen):
        e = episodes[i]
        blocks.append(f"=== trajectory {i}  reward {e['reward']:.0f}  searches {e['n_search']}  "
                      f"answer {e['answer']!r}  golds {e['golds']}\nQuestion: {records[i]['question']}\n"
                      f"{e['text']}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(blocks))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, state: dict, keep: int) -> Path:
    """<run>/ckpt-<step>/: HF model (with LoRA: the adapter alone, as peft saves it) + tokenizer,
    optimizer, RNG states, state.json (step, data position, counters, monitor history), written
    whole or not at all (written_whole), then the
    `latest` pointer is replaced: a kill at any moment leaves the previous checkpoint intact.
    Only after that, older checkpoints go: the `keep` - 1 newest of them keep their weights but lose
    their optimizer state (2/3 of a checkpoint's size)."""
    final = run_dir / f"ckpt-{step}"
    need = tensor_bytes(p for p in model.parameters() if p.requires_grad) + tensor_bytes(
        t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    with written_whole(final, need + 2**24, f"the checkpoint of step {step}") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}))
    _write_atomic(run_dir / "latest", final.name)
    kept = sorted(run_dir.glob("ckpt-*"), key=_step)
    for old in kept[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for older in kept[-keep:-1]:
        (older / "optimizer.pt").unlink(missing_ok=True)
    return final


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def written_whole(final: Path, need: int, what: str, manifest: bool = True):
    """A temp folder beside `final` to write `what` into: on success (and with `manifest`) a
    manifest of every file's size is written last and the folder renamed to `final` (replacing
    it); on any failure it is removed. Not begun when the disk has less than `need` bytes free; a disk that fills during
    the write (torch.save says "unexpected pos") ends as OSError ENOSPC, one line for the user."""
    free = shutil.disk_usage(final.parent).free
    if free < need:
        raise OSError(errno.ENOSPC, f"{what} needs {need / 2**30:.2f} GiB and "
                      f"{free / 2**30:.2f} GiB are free; nothing was written", str(final.parent))
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-ckpt-", dir=final.parent))
    try:
        yield tmp
        if manifest:
            sizes = {str(f.relative_to(tmp)): f.stat().st_size for f in tmp.rglob("*") if f.is_file()}
            (tmp / "manifest.json").write_text(json.dumps(sizes, indent=1))
        if final.exists():                            # the same step saved again after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, RuntimeError) and shutil.disk_usage(final.parent).free < need:
            raise OSError(errno.ENOSPC, f"the disk filled while {what} was written; nothing of "
                          "it was kept", str(final.parent)) from None
        raise


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with a checkpoint's files against the sizes its manifest recorded, or None
    (optimizer.pt may be gone: older checkpoints drop it by design)."""
    manifest = path / "manifest.json"
    if not manifest.exists():
        return None                                   # written before manifests: loading tells
    for name, size in json.loads(manifest.read_text()).items():
        f = path / name
        if not f.exists() and name != "optimizer.pt":
            return f"{name} is missing"
        if f.exists() and f.stat().st_size != size:
            return f"{name} holds {f.stat().st_size:,} bytes where {size:,} were written"
    return None


def export_bf16(folder: Path, model, tokenizer) -> Path:
    """The model's weights alone, in bf16, as an HF folder whose config says bfloat16 (eval.py
    --model, or any tool's from_pretrained): 2 bytes a parameter where a checkpoint holds 12 (fp32
    weights and AdamW's moments). Copied to the CPU tensor by tensor; tied weights stay one tensor;
    written into a temp folder and renamed, as checkpoints are. A LoRA policy is exported with its
    adapter merged into a copy of its weights: a plain model of the base's architecture."""
    if hasattr(model, "peft_config"):
        model = copy.deepcopy(model).merge_and_unload()
    copies, state = {}, {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in copies:
            copies[key] = tensor.to(device="cpu", dtype=torch.bfloat16)
        state[name] = copies[key]
    folder = Path(folder)
    need = tensor_bytes(copies.values()) + 2**24
    with written_whole(folder, need, "the bf16 export", manifest=False) as tmp:
        model.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        _write_atomic(tmp / "config.json", json.dumps({**config, "dtype": "bfloat16"}, indent=2) + "\n")
    return folder


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore weights, optimizer and RNG states in place; returns state.json. Another model's
    weights are refused before any is copied; a checkpoint without optimizer.pt (an older one)
    leaves AdamW's moments fresh, and says so. A LoRA policy loads the adapter it saved."""
    if hasattr(model, "peft_config"):
        saved, ours = lora_weights(path, model)
    else:
        saved = type(model).from_pretrained(path, dtype=torch.float32).state_dict()
        ours = model.state_dict()
    if saved.keys() != ours.keys() or any(saved[k].shape != ours[k].shape for k in ours):
        raise ValueError("its weights are another model's")
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict
        set_peft_model_state_dict(model, saved)
    else:
        model.load_state_dict(saved)
    if (path / "optimizer.pt").exists():
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    else:
        print(f"{path} has no optimizer state (an older checkpoint): AdamW's moments start afresh")
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / "state.json").read_text())


def lora_weights(path: Path, model) -> tuple[dict, dict]:
    """(the adapter a checkpoint holds, the model's own), in peft's saved names."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    if not (path / "adapter_model.safetensors").exists():
        raise ValueError("it holds full weights and this run trains LoRA (--lora-rank)")
    return load_file(path / "adapter_model.safetensors"), get_peft_model_state_dict(model)


def sign_test(before: dict, after: dict) -> dict | None:
    """The same questions before and after: how many turned right, how many wrong, and the exact
    two-sided sign test of those changes (p: how often training that changed nothing would split
    the changed questions at least this unevenly). None without per-question results."""
    pairs = list(zip(before.get("eval/correct", []), after.get("eval/correct", [])))
    if not pairs:
        return None
    right, wrong = sum(a < b for a, b in pairs), sum(a > b for a, b in pairs)
    n = right + wrong
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(min(right, wrong) + 1)) / 2 ** n) if n else 1.0
    return {"questions": len(pairs), "right": right, "wrong": wrong, "p": p}


def paired_change(before: dict, after: dict) -> str:
    """' (N questions: R turned right, W turned wrong; sign test p = P)', or '' without per-question results."""
    t = sign_test(before, after)
    return f" ({t['questions']} questions: {t['right']} turned right, {t['wrong']} turned wrong; " \
           f"sign test p = {t['p']:.2g})" if t else ""


def verdict(test: dict) -> str:
    """What a sign test says, in words a newcomer can act on."""
    if test["p"] >= 0.05:
        return (f"within noise (p = {test['p']:.2g} >= 0.05): a change this size comes up by chance; more steps "
                "(--steps) or more held-out questions (--eval-size) would tell")
    if test["right"] > test["wrong"]:
        return f"beyond noise (p = {test['p']:.2g} < 0.05): the policy learned"
    return f"EM fell beyond noise (p = {test['p']:.2g} < 0.05): training hurt; try a smaller --lr"


def final_report(run_dir: Path, summary: dict) -> str:
    """Final report: EM before/after and whether the change is beyond noise, where the curves and
    views are, where the time went, peak memory."""
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l]
    steps = [l for l in lines if "reward" in l]
    parts = ["rollout", "logprob", "update"]
    total = {p: sum(l[f"timing/{p}"] for l in steps) for p in parts + ["step"]}
    text = [f"run {run_dir}: {len(steps)} steps logged; reward, displacement of correct responses, entropy "
            f"and grad norm per step in {run_dir / 'curves.png'}"]
    if (run_dir / "views" / "index.html").exists():
        text.append(f"each token's change of likelihood, step by step: {run_dir / 'views' / 'index.html'}")
    if summary["before"] and summary["after"]:
        text.append(f"held-out EM: before {summary['before']['eval/em']:.3f} -> after "
                    f"{summary['after']['eval/em']:.3f}{paired_change(summary['before'], summary['after'])}")
        test = sign_test(summary["before"], summary["after"])
        if test:
            text.append("  " + verdict(test))
    if total["step"] > 0:
        text.append("step time: " + ", ".join(f"{p} {total[p] / total['step']:.0%}" for p in parts)
                    + f" of {total['step'] / len(steps):.1f} s/step")
    if summary.get("peak_memory_gb"):
        text.append(f"peak memory {summary['peak_memory_gb']:.2f} GiB (allocated on a GPU, process RSS on a CPU)")
    return "\n".join(text)


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


def resume_hint(run_dir: Path) -> str:
    """' ; continue from <ckpt> (step N) with --resume' when the run has a checkpoint, else ''."""
    ckpt = find_checkpoint(run_dir) if Path(run_dir).is_dir() else None
    return f"; the run continues from {ckpt} (step {_step(ckpt)}) with --resume" if ckpt else ""


def start_or_resume(run_dir: Path, model, optimizer, resume: bool) -> dict:
    """A fresh run's state, or (resume) the newest checkpoint that loads, loaded into model and
    optimizer (RNG states too) with the metrics log cut back to its step; a checkpoint whose files
    fail their manifest or fail to load is named in one line and the one before it tried. ->
    {"step", "skipped_steps", "evals", "sampler", "monitor"}."""
    fresh = {"step": 0, "skipped_steps": 0, "evals": {}, "sampler": {}, "monitor": None}
    found = checkpoints(run_dir) if resume else []
    if resume and not found:
        print(f"--resume: no checkpoint in {run_dir}, starting from step 0")
        truncate_metrics(run_dir, -1)
    for ckpt in found:
        problem = checkpoint_problem(ckpt)
        if problem is None:
            try:
                state = load_checkpoint(ckpt, model, optimizer)
            except Exception as e:                      # truncated, unreadable, another model's
                problem = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if problem is None:
            truncate_metrics(run_dir, state["step"])
            print(f"resumed from {ckpt} (step {state['step']})")
            return {**fresh, **state}
        print(f"--resume: {ckpt} cannot be used ({problem}); trying the checkpoint before it")
    if found:
        raise ValueError(f"no checkpoint of {run_dir} loads (above: why); start a new run with "
                         f"--name, or delete {run_dir} to start this one again")
    return fresh


def postfix(m: dict) -> dict:
    """The progress bar's short view of a step's metrics."""
    def fmt(v):
        return "-" if v is None else f"{v:.3g}"
    return {"reward": fmt(m["reward"]), "logp_c": fmt(m["lld/logp_correct"]),
            "disp_c": fmt(m["lld/correct_displacement"]), "gnorm": fmt(m["grad_norm"]),
            "llds": fmt(m["llds/loss"]), "ent": fmt(m["entropy"]), "search": fmt(m["searches"]),
            "step_s": f"{m['timing/step']:.0f}"}


def cpu_model() -> str:
    """The CPU's model name and its bf16 instruction sets, e.g. "AMD EPYC 7B13 (avx2)"."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform
        return platform.processor() or "unknown"
    name = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = set(re.search(r"^flags\s*:\s*(.*)$", info, re.M).group(1).split()) if "flags" in info else set()
    kinds = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{name.group(1).strip() if name else 'unknown'} ({', '.join(kinds) or 'no avx2'})"


def record_machine(run_dir: Path, step: int, device, bf16: bool) -> None:
    """Append to <run>/machine.json where (CPU, threads) and in which precision the steps
    from `step` on run: runs of different precision must never be pooled."""
    path = run_dir / "machine.json"
    history = json.loads(path.read_text()) if path.exists() else []
    history = [h for h in history if h["from_step"] < step]
    history.append({"from_step": step, "device": str(device), "bf16_autocast": bool(bf16),
                    "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None})
    _write_atomic(path, json.dumps(history, indent=1))


def describe(cfg, device, n_eval: int, bf16: bool) -> str:
    """The one-line summary of a run's setting printed at its start."""
    llds = f"lambda {cfg.llds_lambda:g}, {cfg.llds_gate} gate" if cfg.llds and cfg.llds_lambda else "off"
    where = f"cpu ({cpu_model()})" if device.type == "cpu" else str(device)
    return (f"device {where}, bf16 autocast {bf16}; "
            f"{cfg.prompts_per_step} prompts x {cfg.group_size} rollouts, "
            f"{cfg.prompts_per_step * cfg.group_size // cfg.mini_batch_size} optimizer steps per step; "
            f"LLDS {llds}; eval: {n_eval} held-out questions, greedy, {cfg.eval_max_turns} "
            f"search turns, retriever {cfg.retriever} top-{cfg.topk}")


def micro_metrics(share: float, pg, pg_stats: dict, kl, lld, lld_stats: dict) -> dict:
    """One micro-batch's part of its mini-batch's logged values: the losses (already divided by
    the mini-batch's normaliser) as they are, token means weighted by `share`, the micro-batch's
    part of the mini-batch's tokens. Summed over the micro-batches: the mini-batch's values."""
    weighted = {**pg_stats, **{k: lld_stats[k] for k in ("llds/active_token_frac",
                                                         "llds/active_action_frac")}}
    return {"pg_loss": pg.item(), "kl": kl.item(), "llds/loss": lld.item(),
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
