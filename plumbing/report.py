"""--report-to (TRL's name and values): the metrics of <run>/metrics.jsonl also go, under the same
names and steps, to TensorBoard (event files in the run folder, so `tensorboard --logdir runs`
lists runs by name) and/or Weights & Biases, with the run's config as hyper-parameters.

Both are optional dependencies: asking for one that is not installed is one clear error before
any model loads (check_report_to). W&B runs offline when WANDB_MODE says so or no API key is
set, and says where the offline run went and how to upload it. None values (a metric not
measured this step, a non-finite number) are left out, as metrics.jsonl writes them as null.
open_run_log starts a train.py run's log files: config.json, machine.json, metrics.jsonl.
"""
import dataclasses
import importlib.util
import json
import os
import uuid
from pathlib import Path

from plumbing import fast_hf
from plumbing.runs import describe, json_safe, log_metrics, record_machine

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
        """A step's saved trajectories: TensorBoard text (samples), a W&B table, one row per trajectory."""
        if self.tensorboard is not None:
            self.tensorboard.add_text("samples", "    " + text.replace("\n", "\n    "), step)
            self.tensorboard.flush()
        if self.wandb is not None:
            import wandb

            rows = [[step, block if block.startswith("===") else "=== " + block] for block in text.split("\n=== ") if block.strip()]
            self.wandb.log({"samples": wandb.Table(columns=["step", "trajectory"], data=rows)}, step=step)

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
