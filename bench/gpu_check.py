"""bench/gpu_check.py: what the first run on a GPU must answer, in one command that keeps whatever
it measured, with no weights travelling, no network and nothing installed but torch and
transformers (with their own dependencies).

Everything runs train.py's own code on a model folder written here: Qwen2.5's architecture from
bench/configs/<model>/config.json with RANDOM weights (speed and memory are the real model's; the
text is noise), saved in bf16 with a byte-level tokenizer given a chat template (so the preset's
search-r1 prompt is built: ~4x as many tokens as with Qwen's tokenizer), the toy world's questions,
and searches answered from memory (random weights never close a tag, so none is ever sent: every
turn runs to its cap and every observation is the invalid-action text). Rewards are made to
alternate within each group, which makes the clip, LLDS and the displacement of correct responses
live. The phases, each printed and written to the JSON report (--json) as soon as it ends:

1. machine: torch, CUDA, cuDNN, transformers, driver, GPU, free GPU memory, free disk, the CUDA
   allocator's settings (train.py's, set here before torch starts);
2. bandwidth: one large device-to-device copy, GB/s (the decode's floor is bytes / this);
3. setup: train.setup (load, memory plan, reference copy, placement, fused AdamW); the attention
   kernel of a training call, with a mask and without, with grad and without, as the log-prob
   passes hold it (never cuDNN: fast_hf.without_cudnn_attention) and as PyTorch would pick it;
4. step 1, step 2: training steps at lr 0, each of two rollout batches (the preset's rollout batch
   size) and two mini-batches; per phase seconds and peak memory against the memory plan, decode
   tokens/s, decode steps, occupancy, rollout/logp_diff (decode against forward; bf16 noise is
   ~0.01-0.05, a position or cache bug >= 0.1). The weights never move, so clip_ratio, ppo_kl, kl,
   llds/loss and lld/correct_displacement must be exactly 0. Step 2 is the one to read (step 1
   includes kernel selection, autocast caches and allocator growth);
5. passes: the largest |log-prob difference| between the passes that must agree at equal weights:
   old (no grad) vs update (grad, train mode), old vs displacement (no grad twice), old vs the
   reference copy, and old vs update with the attention kernel left to PyTorch (is the hold
   needed?);
6. decode: step 2's milliseconds per decode step against the bytes it must read (bf16 weights and
   the KV cache) at the measured bandwidth, and host syncs per decode step (CUDA's sync debug mode);
7. eval: the held-out evaluation of 4 questions, 1 search turn;
8. checkpoint, export: checkpoints.save_checkpoint and checkpoints.export_bf16, timed, sized, deleted at once.

A phase that would not finish inside --budget seconds is skipped, named, and the report still
written. A model that fails (an OOM, say) is recorded with its error, and the fallback
(Qwen2.5-0.5B, its one-GPU preset) runs in the time left; a failing phase after the steps is
recorded and the next one runs. Files go to --dir (default $TMPDIR), checked for space before each
write; the model folder is deleted once loaded. Exit status 0 when nothing failed and lr 0 was
exact, else 1.

On a lent GPU machine that stops a command at 600 s, from the repository root, with nothing
installed and no file carried beyond the tree:

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --json $OUT/gpu_check.json --budget 540

($OUT: a folder that comes back; the report holds every phase that ended.) Elsewhere:

    python bench/gpu_check.py --model qwen2.5-0.5b-instruct --preset one-gpu-0.5b-80gb
    python bench/gpu_check.py --smoke     # a tiny config on the CPU (tests/test_gpu_check.py)
"""
import os

# train.py's CUDA allocator settings (memory.configure_allocator), before torch can start CUDA:
# the allocator reads them once, so set later they would not hold for what is measured here.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "bench" / "configs"
# ChatML, as Qwen2.5's template writes a user turn and the assistant's start.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
# The smoke test's model: Qwen2.5's architecture at a size a CPU test runs in seconds.
TINY = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=256,
            intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True,
            max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1e6)
FALLBACK = "qwen2.5-0.5b-instruct"
CHECKED = ("clip_ratio", "ppo_kl", "kl", "llds/loss", "lld/correct_displacement")
GIB = 2**30


class Report:
    """The JSON report: each phase's numbers printed and the whole file replaced (written beside,
    then renamed) as soon as the phase ends, so that a run killed at any point keeps every phase
    that ended. `left()`: seconds of the budget still free."""

    def __init__(self, path: Path, budget: float):
        self.path, self.budget, self.start = path, budget, time.perf_counter()
        self.data = {"phases": {}, "skipped": {}, "failed": {}, "finished": False}
        self.write()

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def phase(self, name: str, values: dict) -> dict:
        self.data["phases"][name] = values
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in values.items())
        print(f"[{time.perf_counter() - self.start:5.0f} s] {name}: {shown}", flush=True)
        self.write()
        return values

    def skip(self, name: str, why: str) -> None:
        self.data["skipped"][name] = why
        print(f"[{time.perf_counter() - self.start:5.0f} s] {name}: skipped ({why})", flush=True)
        self.write()

    def guarded(self, name: str, seconds: float, measure) -> None:
        """measure() -> the phase's values, when `seconds` are left; a failure is recorded."""
        if self.left() < seconds:
            self.skip(name, f"{self.left():.0f} s left, {seconds:.0f} s needed")
            return
        try:
            self.phase(name, measure())
        except Exception as e:           # the phases after it still run
            self.fail(name, e)

    def fail(self, name: str, error: BaseException) -> None:
        lines = traceback.format_exception(error)
        self.data["failed"][name] = {"error": f"{type(error).__name__}: {error}"[:2000],
                                     "where": "".join(lines[-6:])[-3000:]}
        print(f"[{time.perf_counter() - self.start:5.0f} s] {name} FAILED: "
              f"{type(error).__name__}: {str(error)[:300]}", flush=True)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(self.path.name + ".part")
        part.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(part, self.path)


def machine(device: torch.device, folder: Path) -> dict:
    """Versions and room: what a failure on another machine is first compared against."""
    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "allocator config": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "cpu threads": torch.get_num_threads()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError as e:
        info["transformers"] = f"not importable: {e}"
    for name in ("bm25s", "Stemmer", "faiss", "matplotlib", "pyarrow", "requests"):
        info[f"has {name}"] = _importable(name)
    for where in {str(folder), "/dev/shm"}:
        if Path(where).exists():
            info[f"free disk {where} GiB"] = shutil.disk_usage(where).free / GIB
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        info.update({"gpu": torch.cuda.get_device_name(), "gpu memory GiB": total / GIB,
                     "gpu free GiB": free / GIB,
                     "capability": ".".join(map(str, torch.cuda.get_device_capability())),
                     "allocator": torch.cuda.memory.get_allocator_backend()})
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            info["driver"] = f"nvidia-smi failed: {e}"
    else:
        from plumbing.run_log import cpu_model
        info["cpu"] = cpu_model()
    return info


def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def bandwidth(device: torch.device) -> dict:
    """One large copy, device memory to device memory (read + write counted): GB/s."""
    n = (2 * GIB) if device.type == "cuda" else 256 * 2**20
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    _sync(device)
    start, repeats = time.perf_counter(), 10
    for _ in range(repeats):
        y.copy_(x)
    _sync(device)
    seconds = (time.perf_counter() - start) / repeats
    del x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()          # so the reserved memory measured later is the run's
    return {"copy GiB": n / GIB, "GB/s": 2 * n / seconds / 1e9}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class FixedPassages:
    """A retriever answering every query with the same passages, from memory (no index, no
    package): the check measures the policy's path, not retrieval."""

    def search(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        hit = {"document": {"id": "0", "contents": "Nothing\nA fixed passage."}, "score": 0.0}
        return [[hit] * topk for _ in queries]


def write_model(folder: Path, config: dict, device: torch.device) -> None:
    """A random model of `config` saved in bf16 with the byte tokenizer (and a chat template)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    from plumbing import models

    logging.disable_progress_bar()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config),
                                                 dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()          # so the reserved memory measured later is the run's
    tokenizer = models.byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


class PhasePeaks:
    """Peak memory per phase of train_step (its `show` callback hears each phase start) and of the
    phases measured here: {name: (allocated, reserved)} in bytes, above `base` (the memory before
    setup: 0 on a fresh GPU, the runtime's RSS on a CPU)."""

    NAMES = ("rollout", "logprob", "update", "view")

    def __init__(self, device: torch.device):
        from plumbing import memory
        self.memory, self.device, self.peaks, self.current = memory, device, {}, None
        memory.release_memory()
        self.base = memory.memory_now(device)

    def rebase(self, expected: int) -> None:
        """From here on, measure above the memory now less `expected`, the plan's share of it (so a
        CPU's RSS of libraries, data and index, which the plan does not count, drops out)."""
        self.memory.release_memory()
        self.base = self.memory.memory_now(self.device) - expected

    def start(self, name: str) -> None:
        self.stop()
        self.current = name
        self.memory.release_memory()                # so a CPU's RSS starts from what is live
        self.memory.reset_peak(self.device)

    def stop(self) -> None:
        if self.current is not None:
            allocated, reserved = (x - self.base for x in self.memory.phase_peak(self.device))
            old = self.peaks.get(self.current, (0, 0))
            self.peaks[self.current] = (max(old[0], allocated), max(old[1], reserved))
        self.current = None

    def show(self, text: str) -> None:
        if text in self.NAMES:
            self.start(text)


def alternating_rewards(rollout_fn):
    """rollout.rollout with every other episode marked correct (random weights never are)."""
    def marked(*args, **kwargs):
        out = rollout_fn(*args, **kwargs)
        for i, episode in enumerate(out.episodes):
            episode["reward"] = float(i % 2 == 0)
        return out
    return marked


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def room_for(folder: Path, need: int) -> str | None:
    """None when `folder`'s disk has `need` bytes free and 10% more, else why not."""
    free = shutil.disk_usage(folder).free
    return None if free > 1.1 * need else f"{need / GIB:.1f} GiB needed, {free / GIB:.1f} free"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-3b-instruct",
                        help="a config folder in bench/configs")
    parser.add_argument("--preset", help="a train.py preset, or demo for train.py's defaults (the "
                        "CPU demo's path) (default: one-gpu-<size>-<80gb|141gb> for the card)")
    parser.add_argument("--smoke", action="store_true", help="a tiny config on the CPU (the tests)")
    parser.add_argument("--turn-tokens", type=int,
                        help="tokens per turn (default: 128 on a GPU, 24 with --smoke)")
    parser.add_argument("--rows", type=int, help="rollout rows a step (default: two of the "
                        "preset's rollout batches; 10 with --smoke)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="bf16 autocast")
    parser.add_argument("--json", type=Path, help="the report, rewritten after every phase "
                        "(default: $OUT/gpu_check.json when $OUT is set, else runs/gpu_check.json)")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds: a phase that would end later is skipped")
    parser.add_argument("--dir", type=Path, help="where the model, checkpoint and export are "
                        "written, each deleted once measured (default: $TMPDIR)")
    parser.add_argument("--fallback", action=argparse.BooleanOptionalAction,
                        help=f"when the model fails, run {FALLBACK} with its one-GPU preset "
                        "(default: on a GPU)")
    args = parser.parse_args(argv)

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "runs"
    report = Report(args.json or out_dir / "gpu_check.json", args.budget)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=args.dir))
    try:
        report.phase("machine", machine(device, work))
        report.phase("bandwidth", bandwidth(device))
        from plumbing import memory, memory_plan        # here: the versions are written first
        card = ("141gb" if device.type == "cuda" and memory_plan.device_bytes(True) > 100 * GIB
                else "80gb")
        attempts = [(args.model, args.preset)]
        fallback = args.fallback if args.fallback is not None else device.type == "cuda"
        if fallback and args.model != FALLBACK:
            attempts.append((FALLBACK, None))
        for model, preset in attempts:
            try:
                with memory.rss_follows_live_tensors(device):
                    check_model(model, preset or f"one-gpu-{model.split('-')[1]}-{card}", args,
                                device, work, report)
                break
            except Exception as e:          # an OOM, a kernel without support, an import, ...
                report.fail(phase_prefix(model, args), e)
            # out of the except block, its traceback (and the model its frames hold) is gone
            for path in work.iterdir():
                shutil.rmtree(path, ignore_errors=True)
            memory.release_memory()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        report.data["finished"] = True
        report.data["seconds"] = time.perf_counter() - report.start
        report.write()
    return report.data


def check_model(model_name: str, preset: str, args, device: torch.device, work: Path,
                report: Report) -> None:
    """Phases 3-8 for one model: each recorded under "<model> <phase>" as it ends."""
    import rollout
    import train
    from eval import heldout_eval
    from plumbing import checkpoints, fast_hf, memory_plan
    from plumbing.sampler import PromptSampler
    from plumbing.tokens import encode_in_text

    tag = phase_prefix(model_name, args)
    config = TINY if args.smoke else json.loads((CONFIGS / model_name / "config.json").read_text())
    base = train.Config(**train.PRESETS.get(preset, {}) if preset != "demo" else {})
    batch = base.rollout_batch_size if not args.smoke else 5
    rows = args.rows or (10 if args.smoke else 2 * batch)
    # two mini-batches, each split 4 ways in the authors' order (too many rows for --smoke)
    verl = base.verl_minibatches and not args.smoke
    step = 8 if verl else 2
    n_prompts = max(step, rows // base.group_size // step * step)
    rows = n_prompts * base.group_size
    turn = args.turn_tokens or (24 if args.smoke else 128)
    shape = memory_plan.Shape.of(_config_object(config))
    if report.left() <= 0:
        report.skip(f"{tag} setup", "no time left")
        return
    if why := room_for(work, 2 * shape.parameters()):
        raise OSError(f"no room for the model folder: {why}")
    peaks = PhasePeaks(device)

    # 3. setup
    start = time.perf_counter()
    write_model(work / "model", config, device)
    cfg = dataclasses.replace(
        base, name="gpu_check", out_dir=str(work), model=str(work / "model"), data="toy",
        eval_data="", retriever="bm25", corpus="", index="", device=device.type, bf16=args.bf16,
        max_turn_tokens=turn, max_prompt_tokens=2048, steps=2, lr=0.0, warmup_ratio=0.0,
        prompts_per_step=n_prompts, mini_batch_size=rows // 2, verl_minibatches=verl,
        rollout_batch_size=min(batch, rows), displacement_every=1, token_view_every=0,
        samples_per_step=0, eval_size=4, eval_max_turns=1, ckpt_every=0, report_to="none")
    peaks.start("setup")
    real_open = train.retriever.open_retriever
    train.retriever.open_retriever = lambda *a, **k: FixedPassages()
    try:
        run = train.setup(cfg)
    finally:
        train.retriever.open_retriever = real_open
    peaks.stop()
    shutil.rmtree(work / "model")                     # loaded: its disk is free for the checkpoint
    # The plan for these episodes as they ran: observations are the invalid-action text.
    obs = len(encode_in_text(run.tokenizer, rollout.INVALID_ACTION)) + 1
    lengths = memory_plan.prompt_lengths(rollout.prompt_ids(r, run.tokenizer, cfg.template)
                                         for r in run.train_records + run.eval_records)
    as_run = dataclasses.replace(cfg, max_obs_tokens=obs, eval_size=0)
    cuda, bf16 = device.type == "cuda", args.bf16 and fast_hf.bf16_supported(device)
    plan = memory_plan.plan(shape, as_run, cuda, bf16, lengths)
    plan_eval = memory_plan.plan(shape, dataclasses.replace(
        as_run, prompts_per_step=cfg.eval_size, group_size=1, max_turns=cfg.eval_max_turns),
        cuda, bf16, lengths)
    peaks.rebase(plan["weights (fp32)"] + plan["reference model"])   # what setup() built
    planned = {"rollout": plan["always"] + plan["rollout total"],
               "update": plan["always"] + plan["update total"],
               "eval": plan_eval["always"] + plan_eval["rollout total"]}
    report.phase(f"{tag} setup", {
        "seconds": time.perf_counter() - start, "parameters M": shape.parameters() / 1e6,
        "preset": preset, "rows": rows, "rollout batch": cfg.rollout_batch_size,
        "turns": cfg.max_turns + 1, "turn tokens": turn, "micro-batch": cfg.micro_batch_size,
        "longest prompt": lengths[0], "shared prefix": lengths[1],
        **attention_choice(device, shape, cfg.micro_batch_size),
        "allocated GiB": peaks.peaks["setup"][0] / GIB,
        "reserved GiB": peaks.peaks["setup"][1] / GIB,
        **{f"plan {k} GiB": v / GIB for k, v in planned.items()}})

    # 4. two steps at lr 0
    sampler = PromptSampler(run.train_records, cfg.seed)
    real_rollout, real_monitor, seen = rollout.rollout, train.monitor_step, {}

    def monitor(step, cfg_, run_, out, records, batch_, minibatches, phases):
        seen.update(batch=batch_, minibatches=minibatches)
        return real_monitor(step, cfg_, run_, out, records, batch_, minibatches, phases)

    rollout.rollout, train.monitor_step = alternating_rewards(real_rollout), monitor
    metrics, seconds = None, 0.0
    try:
        for step in (1, 2):
            if report.left() <= 1.3 * seconds:
                report.skip(f"{tag} step {step}", f"{report.left():.0f} s left, the step before "
                            f"took {seconds:.0f} s")
                break
            start = time.perf_counter()
            peaks.peaks = {k: v for k, v in peaks.peaks.items() if k == "setup"}
            metrics = train.train_step(step, cfg, run, sampler, show=peaks.show)
            peaks.stop()
            seconds = time.perf_counter() - start
            step_values = {"seconds": seconds, **step_report(metrics, peaks.peaks, planned)}
            report.phase(f"{tag} step {step}", step_values)
    finally:
        rollout.rollout, train.monitor_step = real_rollout, real_monitor
    if metrics is None:
        return

    # 5-8: from here a phase that fails is recorded, and the next one runs
    report.guarded(f"{tag} passes", 1.5 * metrics["timing/logprob"] + 10, lambda: pass_pairs(
        train, run, cfg, seen["batch"], seen["minibatches"]))
    report.guarded(f"{tag} decode", 10, lambda: decode_floor(
        step_values, shape, lengths, cfg, report.data["phases"]["bandwidth"]["GB/s"], device,
        sync_count(run, cfg, device, train)))

    def evaluate():
        start = time.perf_counter()
        peaks.start("eval")
        held_out = heldout_eval(run.model, run.tokenizer, run.eval_records, run.retriever,
                                train.rollout_config(cfg, greedy=True, max_turns=1))
        peaks.stop()
        return {"seconds": time.perf_counter() - start, "em": held_out["eval/em"],
                "allocated GiB": peaks.peaks["eval"][0] / GIB, "plan GiB": planned["eval"] / GIB}

    report.guarded(f"{tag} eval", 0.5 * metrics["timing/rollout"] + 10, evaluate)
    # checkpoint and export, each deleted once measured (the disk writes 500 MB/s at worst)
    for name, need, write in [
            ("checkpoint", 12 * shape.parameters(), lambda: checkpoints.save_checkpoint(
                run.dir, 1, run.model, run.tokenizer, run.optimizer, state={}, keep=1)),
            ("export", 2 * shape.parameters(), lambda: checkpoints.export_bf16(
                run.dir / "model-bf16", run.model, run.tokenizer))]:
        if why := room_for(work, need):
            report.skip(f"{tag} {name}", why)
        else:
            report.guarded(f"{tag} {name}", need / 500e6 + 5, lambda: written(write))
    summary(report, tag)


def phase_prefix(model_name: str, args) -> str:
    """What a model's phases are named by: "qwen2.5-3b-instruct", or "... (tiny)" with --smoke."""
    return model_name + " (tiny)" * args.smoke


def _config_object(config: dict):
    from transformers import AutoConfig
    return AutoConfig.for_model(**config)


def attention_choice(device: torch.device, shape, micro: int) -> dict:
    """The SDPA kernel of a training micro-batch's attention, with grad and without, as the log-prob
    passes run it (fast_hf.without_cudnn_attention) and as PyTorch would pick it unheld: a call with
    a mask (right padding; HF repeats K/V) and one without (the shared prefix; K/V heads shared)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from plumbing.fast_hf import LOGPROB_KERNELS
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    choice = {}
    for held, grad, masked in [(h, g, m) for h in (True, False) for g in (False, True)
                               for m in (True, False)]:
        name = (f"{'held' if held else 'unheld'} {'grad' if grad else 'no grad'} "
                f"{'mask' if masked else 'no mask'}")
        try:
            q = torch.zeros(micro, shape.heads, 512, shape.head_dim, device=device, dtype=dtype,
                            requires_grad=grad)
            kv_heads = shape.heads if masked else shape.kv // shape.head_dim
            k = torch.zeros(micro, kv_heads, 512, shape.head_dim, device=device, dtype=dtype,
                            requires_grad=grad)
            mask = torch.ones(micro, 1, 512, 512, dtype=torch.bool, device=device).tril()
            kernels = [getattr(SDPBackend, n) for n in LOGPROB_KERNELS]
            with sdpa_kernel(kernels) if held else contextlib.nullcontext():
                picked = torch._fused_sdp_choice(q, k, k, mask if masked else None, 0.0,
                                                 not masked, scale=None, enable_gqa=not masked)
            choice[name] = SDPBackend(picked).name
        except Exception as e:          # a private function: a diagnosis, never a failure
            choice[name] = f"probe failed: {type(e).__name__}: {e}"[:200]
    return choice


def step_report(metrics: dict, peaks: dict, planned: dict) -> dict:
    values = {k: metrics[k] for k in CHECKED}
    values["exact"] = all(metrics[k] == 0 or (k == "kl" and metrics[k] is None) for k in CHECKED)
    values.update({f"{k} seconds": metrics[f"timing/{k}"]
                   for k in ("rollout", "logprob", "update")})
    values.update({"decode tokens/s": metrics["rollout_tokens_per_s"],
                   "decode steps": metrics["rollout/decode_steps"],
                   "occupancy": metrics["rollout/occupancy"],
                   "logp_diff": metrics["rollout/logp_diff"],
                   "logp_diff ok": metrics["rollout/logp_diff"] < 0.1})
    for name in ("rollout", "logprob", "update"):
        allocated, reserved = peaks.get(name, (0, 0))
        values[f"{name} allocated GiB"], values[f"{name} reserved GiB"] = (allocated / GIB,
                                                                            reserved / GIB)
        if name in planned:
            values[f"{name} measured/plan"] = allocated / planned[name]
    return values


def pass_pairs(train, run, cfg, batch: dict, minibatches: list) -> dict:
    """max |difference| of the log-probs of the first mini-batch's tokens between passes that must
    agree at equal weights (lr 0): old (logprob_pass: no grad) against the update's pass (grad,
    train mode, attention held off cuDNN), against it with the attention left to PyTorch, against
    the displacement's pass (no grad again) and against the reference copy."""
    from plumbing import fast_hf
    mini, model = minibatches[:1], run.model
    rows = torch.cat(mini[0])
    mask = batch["loss_mask"][rows].bool()
    old = batch["old_logp"][rows]

    def largest(logp) -> float:
        return float((logp[rows] - old).abs()[mask].max()) if mask.any() else 0.0

    def grad_pass(token_logprobs) -> torch.Tensor:
        logp = torch.zeros(batch["loss_mask"].shape)
        model.train()
        with torch.enable_grad(), fast_hf.prefix_once(model, batch["input_ids"],
                                                      batch["attention_mask"],
                                                      not cfg.grad_checkpointing) as policy:
            for micro in mini[0]:
                mb = train.micro_batch(batch, micro, run.device)
                with fast_hf.autocast(run.device, cfg.bf16):
                    lp, _ = token_logprobs(policy, mb["input_ids"], mb["attention_mask"],
                                           mb["loss_mask"], cfg.temperature)
                (lp * mb["loss_mask"]).sum().backward()    # frees the graph, as the update does
                logp[micro, :lp.shape[1]] = lp.detach().float().cpu()
        model.zero_grad(set_to_none=True)
        model.eval()
        return logp

    start = time.perf_counter()
    values = {"old vs update": largest(grad_pass(train.token_logprobs)),
              "old vs update unheld": largest(grad_pass(train.token_logprobs.__wrapped__)),
              "old vs displacement": largest(train.logprob_pass(model, batch, mini, cfg,
                                                                run.device)[0])}
    if "ref_logp" in batch:
        values["old vs reference"] = largest(batch["ref_logp"])
    values["exact"] = values["old vs update"] == values["old vs displacement"] == 0.0
    values["seconds"] = time.perf_counter() - start
    return values


def sync_count(run, cfg, device: torch.device, train) -> float | None:
    """Host syncs per decode step of a short rollout (8 rows, one 16-token turn), counted by
    CUDA's sync debug mode; None on a CPU (nothing to sync with)."""
    if device.type != "cuda":
        return None
    import rollout
    records = run.train_records[:8]
    short = train.rollout_config(cfg, max_turns=0, max_turn_tokens=16, batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = rollout.rollout(run.model, run.tokenizer, records, run.retriever, short)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    steps = sum(v for (what, _), v in out.decode.items() if what == "steps")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs / max(steps, 1)


def decode_floor(step: dict, shape, lengths, cfg, gb_per_s: float, device, syncs) -> dict:
    """Milliseconds per decode step (the rollout's seconds over its decode steps: prefill and
    observation chunks included, so an upper bound) against the bytes a decode step must read at
    least: the bf16 weights the layers use and both rollout batch's KV caches (bf16 keys and
    values; a CPU keeps float32 keys) at the episodes' mean width, at the measured bandwidth."""
    ms = 1e3 * step["rollout seconds"] / max(step["decode steps"], 1)
    longest, shared = lengths
    episode = longest + (cfg.max_turns + 1) * cfg.max_turn_tokens
    mean_width = (longest + episode) / 2 - shared
    kv_bytes = 2 + (2 if device.type == "cuda" else 4)
    weights = 2 * shape.linear_used()
    cache = cfg.rollout_batch_size * mean_width * shape.layers * shape.kv * kv_bytes
    floor_ms = (weights + cache) / (gb_per_s * 1e9) * 1e3
    return {"ms per decode step": ms, "floor ms (bytes / bandwidth)": floor_ms,
            "times the floor": ms / floor_ms, "GB read per step, est.": (weights + cache) / 1e9,
            "host syncs per decode step": syncs}


def written(write) -> dict:
    """Time `write()` (-> the folder it wrote), size the folder and delete it."""
    start = time.perf_counter()
    folder = write()
    seconds = time.perf_counter() - start
    size = folder_bytes(folder)
    shutil.rmtree(folder)
    return {"seconds": seconds, "GiB": size / GIB}


def summary(report: Report, tag: str) -> None:
    """The measured numbers a reader looks for first, in one block."""
    phases = report.data["phases"]
    step = phases.get(f"{tag} step 2") or phases.get(f"{tag} step 1", {})
    passes = phases.get(f"{tag} passes", {})
    exact = step.get("exact") and passes.get("exact", True)
    lines = [f"gpu_check {tag}: lr 0 " + ("exact (every checked value exactly 0)" if exact else
                                         "NOT exact: see the passes phase"),
             f"  decode {step.get('decode tokens/s', 0):.0f} tokens/s, occupancy "
             f"{step.get('occupancy', 0):.2f}, logp_diff {step.get('logp_diff', 0):.4f}"]
    print("\n".join(lines), flush=True)
    report.data["exact"] = bool(exact)
    report.write()


if __name__ == "__main__":
    measured = main()
    sys.exit(0 if measured.get("exact") and not measured["failed"] else 1)   # 1: read the report
