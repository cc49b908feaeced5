"""The memory a train.py run will need, from the model's config (no weights loaded) and the run's
flags, before it starts: `python train.py --plan [flags]` prints the table and exits; every run
prints the one-line total and stops at once, naming the flag to change, when it exceeds the device.

What lives when (bytes; P parameters, b = 2 under bf16 autocast else 4, S the longest episode):
  always      weights fp32 4P, AdamW moments 8P, the reference model (kl_coef > 0: bf16 on CUDA
              2P, else 4P), the autocast cache of bf16 weights (2P, bf16 only)
  rollout     KV cache: rollout_batch_size x S x layers x 2 x kv_heads x head_dim x b; at a turn
              boundary up to 0.9 x that again (KVBatch.keep_rows' compact copies live beside the
              old buffers until each layer's next update: the one-GPU review's D2, not yet fixed);
              one step's logits, rollout_batch_size x vocab x 4
  update      gradients 4P, the AdamW step's transient (foreach on CPU: 4P), activations of one
              micro-batch: micro_batch_size x S x layers x (10 H + 4 I) x b (saved for backward;
              with --grad-checkpointing the layer inputs, H x b, plus one layer's full set), and
              the head's checkpointed logit chunks, 3 x 1024 x vocab x 4
S = max_prompt_tokens + (max_turns + 1) x max_turn_tokens + max_turns x max_obs_tokens, at most
max_context: a bound, as real prompts are often shorter.
Peak = always + max(rollout, update): the rollout's KV cache is freed before the update, the
gradients before the rollout. Estimates: no allocator fragmentation, no CUDA context (~0.5 GB),
no Python or torch runtime (~0.3-0.5 GB of RSS on a CPU).
"""
import os
from dataclasses import dataclass

GB = 2**30


@dataclass
class Shape:
    """What the plan reads of an HF config."""
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def of(cls, config) -> "Shape":
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        return cls(vocab=get("vocab_size"), hidden=get("hidden_size"), intermediate=get("intermediate_size"),
                   layers=get("num_hidden_layers"), heads=heads, kv_heads=get("num_key_value_heads") or heads,
                   tied=bool(get("tie_word_embeddings", False)), qkv_bias=get("model_type") == "qwen2")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Llama / Qwen2 / SmolLM parameter count: embedding, per layer attention (Qwen2: q, k, v
        biases), gated MLP and two RMSNorms, the final norm, and the head unless tied."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv + ((h + 2 * kv) if self.qkv_bias else 0)
        layer = attention + 3 * h * self.intermediate + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h


def plan(shape: Shape, cfg, cuda: bool, bf16: bool) -> dict[str, float]:
    """{row: bytes} of the module docstring, with "peak" and "checkpoint on disk"."""
    p, b = shape.parameters(), 2 if bf16 else 4
    layer = 10 * shape.hidden + 4 * shape.intermediate              # saved activations per token per layer
    per_token = (shape.layers * shape.hidden + layer if cfg.grad_checkpointing else shape.layers * layer) * b
    seq = min(cfg.max_context, cfg.max_prompt_tokens + (cfg.max_turns + 1) * cfg.max_turn_tokens
              + cfg.max_turns * cfg.max_obs_tokens)
    rows = {"weights (fp32)": 4 * p, "AdamW moments": 8 * p,
            "reference model": (2 * p if cuda and bf16 else 4 * p) if cfg.kl_coef > 0 else 0,
            "autocast bf16 weights": 2 * p if bf16 else 0,
            "rollout: KV cache": cfg.rollout_batch_size * seq * shape.layers * 2 * shape.kv_heads
            * shape.head_dim * b,
            "rollout: logits": cfg.rollout_batch_size * shape.vocab * 4,
            "rollout: KV copies at turn ends": 0,
            "update: gradients": 4 * p, "update: AdamW step transient": 0 if cuda else 4 * p,
            "update: activations": cfg.micro_batch_size * seq * per_token,
            "update: logit chunks": 3 * 1024 * shape.vocab * 4}
    rows["rollout: KV copies at turn ends"] = int(0.9 * rows["rollout: KV cache"])
    always = sum(v for k, v in rows.items() if ":" not in k)
    phase = {name: sum(v for k, v in rows.items() if k.startswith(name + ":")) for name in ("rollout", "update")}
    return {**rows, "peak": always + max(phase.values()), "checkpoint on disk": 12 * p}


def device_bytes(cuda: bool) -> int:
    """The GPU's memory, or the machine's RAM."""
    if cuda:
        import torch
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def table(rows: dict[str, float], shape: Shape, available: int, where: str) -> str:
    lines = [f"memory plan: {shape.parameters() / 1e6:,.1f}M parameters, {where} {available / GB:.1f} GB"]
    lines += [f"  {name:<30}{value / GB:>9.2f} GB" for name, value in rows.items()]
    return "\n".join(lines)


def too_big(rows: dict[str, float], available: int) -> str | None:
    """None when the peak fits in 90% of the device; else one line naming the flag to change."""
    if rows["peak"] <= 0.9 * available:
        return None
    flag = max([("--rollout-batch-size or --max-context", rows["rollout: KV cache"]),
                ("--micro-batch-size, or --grad-checkpointing", rows["update: activations"]),
                ("--kl-coef 0 (no reference model)", rows["reference model"])], key=lambda f: f[1])[0]
    return (f"the memory plan needs {rows['peak'] / GB:.1f} GB, over 90% of the device's {available / GB:.1f} GB: "
            f"lower {flag} (python train.py --plan ... prints the whole plan)")


def for_run(cfg, device, model=None) -> tuple[dict, Shape, int, str]:
    """The plan of a train.py config on `device` (torch.device): (rows, shape, device bytes, where)."""
    from plumbing import fast_hf
    from plumbing.models import embedded_smollm2, not_a_model_folder

    path = cfg.model or str(embedded_smollm2())
    if model is not None:
        config = model.config
    elif why := not_a_model_folder(path):
        raise ValueError(why)
    else:
        from transformers import AutoConfig
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"--model {cfg.model!r}: no config to plan from ({str(e).splitlines()[0]})") from None
    cuda = device.type == "cuda"
    shape = Shape.of(config)
    rows = plan(shape, cfg, cuda, cfg.bf16 and fast_hf.bf16_supported(device))
    return rows, shape, device_bytes(cuda), "GPU memory" if cuda else "RAM"


def check(cfg, device, model=None) -> None:
    """The one-line summary every run prints at start; ValueError (one line, the flag to change)
    when the plan's peak is over 90% of the device."""
    rows, shape, available, where = for_run(cfg, device, model)
    print(f"memory plan: peak {rows['peak'] / GB:.2f} GB of {available / GB:.1f} GB {where} "
          f"(python train.py --plan for the table)")
    if (line := too_big(rows, available)) is not None:
        raise ValueError(line)


def print_plan(cfg, device) -> str:
    rows, shape, available, where = for_run(cfg, device)
    return table(rows, shape, available, where)
