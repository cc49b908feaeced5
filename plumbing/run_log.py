"""A train.py run's log: config.json, machine.json (the CPU, threads, versions), metrics.jsonl (a
line a step, cut back to a checkpoint's step on --resume), sample episodes, the line that
describes the run at start; and --report-to (TRL's name and values): the metrics of metrics.jsonl
also go, under the same names and steps, to TensorBoard (event files in the run folder, so
`tensorboard --logdir runs` lists runs by name) and/or Weights & Biases, with the run's config as
hyper-parameters.

Both are optional dependencies: asking for one that is not installed is one clear error before
any model loads (check_report_to). W&B runs offline when WANDB_MODE says so or no API key is
set, and says where the offline run went and how to upload it. None values (a metric not
measured this step, a non-finite number) are left out, as metrics.jsonl writes them as null.
"""
import dataclasses
import importlib.util
import json
import math
import os
import re
import uuid
from pathlib import Path

import torch

from plumbing import fast_hf

REPORT_TO = ("none", "tensorboard", "wandb")
PACKAGES = {"tensorboard": "tensorboard==2.21.0", "wandb": "wandb==0.31.0"}   # pinned in requirements-test.txt


def targets(report_to: str) -> list[str]:
    """"none" -> []; "tensorboard,wandb" (or "all") -> both; any other name is a ValueError."""
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    if names == ["all"]:
        return list(PACKAGES)
    unknown = [n for n in names if n not in REPORT_TO]
    if unknown or not names:
        raise ValueError(f"report-to must be none, all, or some of tensorboard,wandb (comma-separated), "
                         f"not {report_to!r}")
    return [n for n in names if n != "none"]


def check_report_to(report_to: str) -> None:
    """Before any model loads: every target named and its package installed (ValueError otherwise)."""
    for name in targets(report_to):
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"--report-to {name} needs the {name} package: pip install {PACKAGES[name]}")


class MetricsLog:
    """log(metrics) appends one line to metrics.jsonl and sends the same numbers to every target."""

    def __init__(self, run_dir: Path, report_to: str, config: dict, start_step: int):
        self.run_dir, self.tensorboard, self.wandb = Path(run_dir), None, None
        names = targets(report_to)
        if "tensorboard" in names:
            self.tensorboard = open_tensorboard(self.run_dir, config, start_step)
        if "wandb" in names:
            self.wandb = open_wandb(self.run_dir, config)

    def __call__(self, metrics: dict) -> None:
        log_metrics(self.run_dir, metrics)
        step = metrics["step"]
        scalars = {k: v for k, v in json_safe(metrics).items() if k != "step" and isinstance(v, (int, float))}
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()          # a killed run loses nothing it logged
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        samples = self.run_dir / "samples" / f"step_{step:04d}.txt"     # train.py wrote it just before
        if samples.exists() and (self.tensorboard or self.wandb):
            self.log_samples(step, samples.read_text())

    def log_samples(self, step: int, text: str) -> None:
        """A step's saved episodes: TensorBoard text (samples), a W&B table, one row per episode."""
        if self.tensorboard is not None:
            self.tensorboard.add_text("samples", "    " + text.replace("\n", "\n    "), step)
            self.tensorboard.flush()
        if self.wandb is not None:
            import wandb

            rows = [[step, block if block.startswith("===") else "=== " + block] for block in text.split("\n=== ") if block.strip()]
            self.wandb.log({"samples": wandb.Table(columns=["step", "episode"], data=rows)}, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def open_run_log(run_dir: Path, cfg, step: int, device, n_eval: int) -> MetricsLog:
    """A train.py run starting at `step`: <run>/config.json, the machine and precision it runs in
    (machine.json), its setting in one printed line, and its MetricsLog."""
    config = dataclasses.asdict(cfg)
    (run_dir / "config.json").write_text(json.dumps(config, indent=1))
    log = MetricsLog(run_dir, cfg.report_to, config, step)
    bf16 = fast_hf.bf16_supported(device) and cfg.bf16
    record_machine(run_dir, step, device, bf16)
    print(describe(cfg, device, n_eval, bf16))
    if device.type == "cuda":
        print(f"log-prob attention: {', '.join(fast_hf.LOGPROB_KERNELS)} as the inputs allow, never "
              "cuDNN (fast_hf.without_cudnn_attention)")
    return log


def open_tensorboard(run_dir: Path, config: dict, start_step: int):
    """A SummaryWriter on the run folder with the config as hparams; on a resume, the steps after
    the checkpoint that a killed run had logged are purged, as metrics.jsonl is cut back."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    writer = SummaryWriter(log_dir=str(run_dir), purge_step=start_step + 1 if start_step else None)
    if not start_step:
        writer.add_text("config", "    " + json.dumps(config, indent=1).replace("\n", "\n    "))
        for summary in hparams({k: v for k, v in config.items() if isinstance(v, (bool, int, float, str))}, {}):
            writer.file_writer.add_summary(summary)
    return writer


def open_wandb(run_dir: Path, config: dict):
    """A W&B run named after the run folder, resumed under the same id; offline without a key."""
    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if has_wandb_key() else "offline")
    id_file = run_dir / "wandb-id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "llds-search-r1"), name=run_dir.name, id=run_id,
                     resume="allow", dir=str(run_dir), config=config, mode=mode,
                     settings=wandb.Settings(console="off", quiet=True, silent=True))
    if run.offline:
        where = run.settings.sync_dir
        print(f"W&B offline (WANDB_MODE or no API key): the run goes to {where}; upload it with: wandb sync {where}")
    return run


def has_wandb_key() -> bool:
    netrc = Path(os.environ.get("NETRC", "~/.netrc")).expanduser()
    return bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())


def json_safe(x):
    """Non-finite floats -> None, in nested dicts too, so JSON files stay strict."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    return None if isinstance(x, float) and not math.isfinite(x) else x


def log_metrics(run_dir: Path, metrics: dict) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(json_safe(metrics)) + "\n")


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop log lines of steps after `step` (written by a run killed after its checkpoint)."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        kept = [m for m in metric_lines(run_dir) if m["step"] <= step]
        write_atomic(path, "".join(json.dumps(m) + "\n" for m in kept))


def metric_lines(run_dir: Path) -> list[dict]:
    """metrics.jsonl's lines; a line cut short by a kill while it was written is left out."""
    path, lines = Path(run_dir) / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines


def write_samples(path: Path, records: list[dict], episodes: list[dict], n: int) -> None:
    """A few (n; 0 = none, no file) full episodes as readable text: half correct (when there are), half not."""
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
        blocks.append(f"=== episode {i}  reward {e['reward']:.0f}  searches {e['n_search']}  "
                      f"answer {e['answer']!r}  golds {e['golds']}\nQuestion: {records[i]['question']}\n"
                      f"{e['text']}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(blocks))


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
    write_atomic(path, json.dumps(history, indent=1))


def describe(cfg, device, n_eval: int, bf16: bool) -> str:
    """The one-line summary of a run's setting printed at its start."""
    llds = f"lambda {cfg.llds_lambda:g}, {cfg.llds_gate} gate" if cfg.llds and cfg.llds_lambda else "off"
    where = f"cpu ({cpu_model()})" if device.type == "cpu" else str(device)
    return (f"device {where}, bf16 autocast {bf16}; "
            f"{cfg.prompts_per_step} prompts x {cfg.group_size} rollouts, "
            f"{cfg.prompts_per_step * cfg.group_size // cfg.mini_batch_size} updates per step; "
            f"LLDS {llds}; eval: {n_eval} held-out questions, greedy, {cfg.eval_max_turns} "
            f"search turns, retriever {cfg.retriever} top-{cfg.topk}")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

