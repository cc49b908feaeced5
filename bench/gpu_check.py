"""bench/gpu_check.py: what the first run on a GPU must answer, in one run (about 5 minutes for
Qwen2.5-3B on an H200, estimated), with no weights travelling and no network.

Everything runs train.py's own code on a model folder written here: Qwen2.5's architecture from
bench/configs/<model>/config.json with RANDOM weights (speed and memory are the real model's; the
text is noise), saved in bf16 with a byte-level tokenizer given a chat template (so the preset's
search-r1 prompt is built: ~4x as many tokens as with Qwen's tokenizer), the toy world's questions
and an in-process BM25. Random weights never close a tag, so every turn runs to the preset's cap
(500 tokens) and every observation is the invalid-action text; they never answer right either, so
rewards alternate within each group, which makes the clip, LLDS and the displacement of correct
responses live.

1. setup(): load_policy of the folder, the memory plan's line, the reference copy (bf16 linear
   weights on CUDA), placement with gradient checkpointing, fused AdamW.
2. One training step at lr 0 whose rollout is one batch of the preset's rollout_batch_size rows,
   two mini-batches of the preset's micro-batches, displacement on. The weights never move, so
   clip_ratio, ppo_kl, kl, llds/loss and lld/displacement_correct must be exactly 0: the old pass
   (no grad, eval) and the update pass (grad, train, checkpointing) must agree bit for bit on
   CUDA's kernels, as they do on a CPU (tests/test_train.py).
3. The held-out evaluation (eval.heldout_eval) of 4 questions, 1 search turn.
4. A checkpoint (runs.save_checkpoint) and the bf16 export (runs.export_bf16), timed, with sizes.
Per phase: the peak of allocated and reserved memory, against the memory plan for these episodes as
they ran (without AdamW's moments in the rollout: the first update creates them); decode tokens per
second. One table at the end. On a CPU (--smoke) memory is RSS above what the plan does not count
(libraries, data, index), with glibc unmapping every freed block over 64 KiB so that RSS follows
the live tensors, and the step runs twice, the second measured: a CPU's first step grows the
process by runtime caches the plan does not count either.

    python bench/gpu_check.py             # one GPU: Qwen2.5-3B, the one-gpu-3b preset for the card's memory
    python bench/gpu_check.py --model qwen2.5-0.5b-instruct --preset one-gpu-0.5b-80gb
    python bench/gpu_check.py --smoke     # a tiny config on the CPU, short turns (tests/test_gpu_check.py)

Its files (for 3B: the model 6 GB, the checkpoint 35 GB, the export 6 GB) go to a temporary folder
under $TMPDIR (default /tmp): point it at a disk with 50 GB free.
"""
import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rollout  # noqa: E402
import train  # noqa: E402
from eval import heldout_eval  # noqa: E402
from plumbing import fast_hf, memory, memory_plan, models, runs  # noqa: E402
from plumbing.tokens import encode_in_text  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
# ChatML, as Qwen2.5's template writes a user turn and the assistant's start.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The smoke test's model: Qwen2.5's architecture at a size a CPU test runs in seconds.
TINY = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=256, intermediate_size=1024,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
            tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1e6)
CHECKED = ("clip_ratio", "ppo_kl", "kl", "llds/loss", "lld/displacement_correct")
GIB = 2**30


def write_model(folder: Path, config: dict, device: torch.device) -> None:
    """A random model of `config` saved in bf16 with the byte tokenizer (and a chat template)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()                      # so the reserved memory measured later is the run's
    tokenizer = models.byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


class PhasePeaks:
    """Peak memory per phase of train_step (its `show` callback hears each phase start) and of the
    phases measured here: {name: (allocated, reserved)} in bytes, above `base` (the memory before
    setup: 0 on a fresh GPU, the runtime's RSS on a CPU)."""

    NAMES = ("rollout", "logprob", "update", "view")

    def __init__(self, device: torch.device):
        self.device, self.peaks, self.current = device, {}, None
        memory.release_memory()
        self.base = memory.memory_now(device)

    def rebase(self, expected: int) -> None:
        """From here on, measure above the memory now less `expected`, the plan's share of it (so a
        CPU's RSS of libraries, data and index, which the plan does not count, drops out)."""
        memory.release_memory()
        self.base = memory.memory_now(self.device) - expected

    def start(self, name: str) -> None:
        self.stop()
        self.current = name
        memory.release_memory()                       # so a CPU's RSS starts from what is live
        memory.reset_peak(self.device)

    def stop(self) -> None:
        if self.current is not None:
            allocated, reserved = (x - self.base for x in memory.phase_peak(self.device))
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-3b-instruct", help="a config folder in bench/configs")
    parser.add_argument("--preset", help="a train.py preset, or demo for train.py's defaults (the CPU demo's path) "
                                         "(default: one-gpu-<size>-<80gb|141gb> for the card)")
    parser.add_argument("--smoke", action="store_true", help="a tiny config on the CPU (what the tests run)")
    parser.add_argument("--turn-tokens", type=int, help="tokens per turn (default: the preset's, 500)")
    parser.add_argument("--rows", type=int, help="rollout rows of the step (default: the preset's rollout batch)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    args = parser.parse_args(argv)

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    config = TINY if args.smoke else json.loads((CONFIGS / args.model / "config.json").read_text())
    size = args.model.split("-")[1]                  # qwen2.5-3b-instruct -> 3b
    card = "141gb" if device.type == "cuda" and memory_plan.device_bytes(True) > 100 * GIB else "80gb"
    preset = args.preset or f"one-gpu-{size}-{card}"
    base = train.Config(**train.PRESETS.get(preset, {}) if preset != "demo" else {})
    n_prompts = max(2, (args.rows or (10 if args.smoke else base.rollout_batch_size)) // base.group_size // 2 * 2)
    rows = n_prompts * base.group_size                # even: two mini-batches
    turn = args.turn_tokens or (24 if args.smoke else base.max_turn_tokens)
    timing, results = {}, {}
    with tempfile.TemporaryDirectory() as tmp, memory.rss_follows_live_tensors(device):
        tmp = Path(tmp)
        peaks = PhasePeaks(device)
        start = time.perf_counter()
        write_model(tmp / "model", config, device)
        cfg = dataclasses.replace(
            base, name="gpu_check", out_dir=str(tmp), model=str(tmp / "model"), data="toy", eval_data="",
            retriever="bm25", corpus="", index="", device=device.type, bf16=args.bf16,
            max_turn_tokens=turn, max_prompt_tokens=2048, steps=1, lr=0.0, warmup_ratio=0.0,
            prompts_per_step=n_prompts, mini_batch_size=rows // 2,
            rollout_batch_size=rows, displacement_every=1, token_view_every=0, samples_per_step=0,
            eval_size=4, eval_max_turns=1, ckpt_every=0, report_to="none")
        peaks.start("setup")
        run = train.setup(cfg)
        peaks.stop()
        timing["setup"] = time.perf_counter() - start

        # The plan for these episodes as they ran: observations are the invalid-action text.
        obs = len(encode_in_text(run.tokenizer, rollout.INVALID_ACTION)) + 1
        lengths = memory_plan.prompt_lengths(rollout.prompt_ids(r, run.tokenizer, cfg.template)
                                             for r in run.train_records + run.eval_records)
        as_run = dataclasses.replace(cfg, max_obs_tokens=obs, eval_size=0)
        shape = memory_plan.Shape.of(run.model.config)
        bf16 = args.bf16 and fast_hf.bf16_supported(device)
        plan = memory_plan.plan(shape, as_run, device.type == "cuda", bf16, lengths)
        plan_eval = memory_plan.plan(shape, dataclasses.replace(as_run, prompts_per_step=cfg.eval_size, group_size=1,
                                                                max_turns=cfg.eval_max_turns), device.type == "cuda",
                                     bf16, lengths)
        peaks.rebase(plan["weights (fp32)"] + plan["reference model"])   # what setup() built
        warm_up = device.type == "cpu"
        planned = {"rollout": plan["always"] - plan["AdamW moments"] * (not warm_up) + plan["rollout total"],
                   "update": plan["always"] + plan["update total"],
                   "eval": plan_eval["always"] + plan_eval["rollout total"]}

        sampler = runs.PromptSampler(run.train_records, cfg.seed)
        real_rollout = rollout.rollout
        rollout.rollout = alternating_rewards(real_rollout)
        try:
            for step in (1, 2) if warm_up else (1,):
                start = time.perf_counter()
                peaks.peaks = {k: v for k, v in peaks.peaks.items() if k == "setup"}
                metrics = train.train_step(step, cfg, run, sampler, show=peaks.show)
                peaks.stop()
                timing["step"] = time.perf_counter() - start
        finally:
            rollout.rollout = real_rollout
        results.update({k: metrics[k] for k in CHECKED + ("timing/rollout", "timing/logprob", "timing/update")})
        results["decode tokens/s"] = metrics["rollout_tokens_per_s"]

        start = time.perf_counter()
        peaks.start("eval")
        held_out = heldout_eval(run.model, run.tokenizer, run.eval_records, run.retriever,
                                train.rollout_config(cfg, greedy=True, max_turns=cfg.eval_max_turns))
        peaks.stop()
        timing["eval"] = time.perf_counter() - start
        results["eval/em"] = held_out["eval/em"]

        peaks.start("checkpoint")
        start = time.perf_counter()
        ckpt = runs.save_checkpoint(run.dir, 1, run.model, run.tokenizer, run.optimizer, state={}, keep=1)
        timing["checkpoint"] = time.perf_counter() - start
        start = time.perf_counter()
        export = runs.export_bf16(run.dir / "model-bf16", run.model, run.tokenizer)
        timing["export"] = time.perf_counter() - start
        peaks.stop()
        results["checkpoint GiB"], results["export GiB"] = folder_bytes(ckpt) / GIB, folder_bytes(export) / GIB
    return report(device, preset, shape, cfg, rows, turn, peaks.peaks, planned, timing, results)


def report(device, preset, shape, cfg, rows, turn, peaks, planned, timing, results) -> dict:
    """Print the one table and return everything measured."""
    cuda = device.type == "cuda"
    where = torch.cuda.get_device_name(device) if cuda else "CPU (RSS above the start)"
    lines = [f"gpu_check: {shape.parameters() / 1e6:,.1f}M parameters (random), preset {preset}, {rows} rollout rows, "
             f"{cfg.max_turns + 1} turns of {turn} tokens, micro-batch {cfg.micro_batch_size}, on {where}",
             f"{'phase':<12}{'seconds':>9}{'allocated GiB':>15}{'reserved GiB':>14}{'plan GiB':>10}{'measured/plan':>15}"]
    seconds = {"rollout": results.pop("timing/rollout"), "logprob": results.pop("timing/logprob"),
               "update": results.pop("timing/update"), **timing}
    for name in ("setup", "rollout", "logprob", "update", "eval", "checkpoint"):
        allocated, reserved = peaks.get(name, (0, 0))
        plan = planned.get(name)
        ratio = f"{allocated / plan:>15.2f}" if plan else f"{'-':>15}"
        lines.append(f"{name:<12}{seconds.get(name, 0):>9.1f}{allocated / GIB:>15.2f}{reserved / GIB:>14.2f}"
                     f"{(plan or 0) / GIB:>10.2f}{ratio}")
    exact = all(results[k] == 0 or (k == "kl" and cfg.kl_coef == 0) for k in CHECKED)   # kl: None without a reference
    lines += ["lr 0: " + ", ".join(f"{k} {results[k]!r}" for k in CHECKED)
              + (": all exactly 0" if exact else ": NOT all exactly 0 (the old and update passes differ)"),
              f"decode {results['decode tokens/s']:.0f} tokens/s at {rows} rows; checkpoint {results['checkpoint GiB']:.2f} GiB "
              f"in {timing['checkpoint']:.1f} s; bf16 export {results['export GiB']:.2f} GiB in {timing['export']:.1f} s"]
    print("\n".join(lines), flush=True)
    return {"peaks": peaks, "planned": planned, "seconds": seconds, "results": results, "exact": exact}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
