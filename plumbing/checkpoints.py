"""Checkpoints: <run>/ckpt-<step>/ written whole or not at all (a manifest of every file's size
last, then the `latest` pointer), the newest one that loads found again by --resume, RNG states,
the bf16 export, and the model folder eval.py and ask.py find in a run. A LoRA run's checkpoint
holds its adapter alone (peft's files), and its export the adapter merged."""
import contextlib
import copy
import errno
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from plumbing.models import is_model_folder
from plumbing.run_log import truncate_metrics, write_atomic


def checkpoint_step(ckpt: Path) -> int:
    return int(ckpt.name.split("-")[1])


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints that were completed (state.json): the one `latest` names first, then
    the others, newest first."""
    run_dir = Path(run_dir)
    done = sorted((p for p in run_dir.glob("ckpt-*") if (p / "state.json").exists()),
                  key=checkpoint_step, reverse=True)
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


def resume_hint(run_dir: Path) -> str:
    """' ; continue from <ckpt> (step N) with --resume' when the run has a checkpoint, else ''."""
    ckpt = find_checkpoint(run_dir) if Path(run_dir).is_dir() else None
    if ckpt is None:
        return ""
    return f"; the run continues from {ckpt} (step {checkpoint_step(ckpt)}) with --resume"


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
    write_atomic(run_dir / "latest", final.name)
    kept = sorted(run_dir.glob("ckpt-*"), key=checkpoint_step)
    for old in kept[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for older in kept[-keep:-1]:
        (older / "optimizer.pt").unlink(missing_ok=True)
    return final


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


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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
        write_atomic(tmp / "config.json", json.dumps({**config, "dtype": "bfloat16"}, indent=2) + "\n")
    return folder



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
