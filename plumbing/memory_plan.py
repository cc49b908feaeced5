"""The memory a train.py run will need, and its time per step on a GPU, from the model's config
(no weights loaded) and the run's flags: `python train.py --plan [flags]` prints the table and
exits; every run prints the one-line peak at start, planned with its real prompts, and stops at
once, naming the flag to change, when the peak is over 90% of the device.

Bytes; P parameters (P_lin: those only linear layers use, a tied head excluded), b = 2 under bf16
autocast else 4, H hidden, I intermediate, L layers, kv = kv_heads x head_dim, V vocabulary:
  always      weights fp32 4P, AdamW moments 8P, the reference model (kl_coef > 0; on a GPU under
              bf16 2 P_lin + 4 (P - P_lin), else 4P), autocast's bf16 copies of the weights
              linear layers use (2 x those, bf16 only)
  rollout     per rollout batch of B rows (training's, or the held-out evaluation's at its own
              turns): the KV cache, (B x (S - prefix + 256 spare) + prefix + 256) x L x kv x
              (key bytes + b): keys keep RoPE's fp32 on a CPU, the compute dtype on a GPU; the few-
              shot prefix all prompts share is stored once; one layer's copy at a turn end or when
              the spare runs out; one chunk's forward (a prompt's rest or an observation, c tokens):
              B x c x (3 I x b + 4 H x 4), its attention mask B x c x S x b, on a GPU HF's repeat of
              keys and values to all heads, B x heads x S x head_dim x b x 2; sampling B x V x 12
  update      gradients 4P; then either a micro-batch's activations and the head's checkpointed
              logit chunks (min(1024, its model tokens) x V x 4 x 5, or x 6 in fp32: measured), or
              the AdamW step's transient after them (foreach on a CPU: 4P; fused on CUDA: 0).
              Activations per token and layer, counted from what autograd saves in a Qwen2 / Llama
              layer: 4 x (8 H + 2 kv + 4 I) in fp32, 4 x 4 H + 2 x (7 H + 2 kv + 4 I) under bf16
              autocast, and the attention mask, T x S x b per row (a copy per layer). Every layer's
              set is saved, plus as much again for the layer whose backward runs; with
              --grad-checkpointing the fp32 layer inputs, 4 H per token and layer, and twice one
              layer's set (its recomputation and its backward)
S: the longest episode, longest prompt + (turns + 1) x max_turn_tokens + turns x max_obs_tokens, at
most max_context. A run plans with its longest prompt and the prefix all its prompts share (both
known after load); --plan reads them too (tokenising only) when the data is there, else it takes
max_prompt_tokens and no shared prefix (a bound). On a GPU the device's memory is what is free
plus what the run holds: another process on the card is named, not planned for; without a GPU,
`--plan --preset one-gpu-<size>-<card>` plans for the card the preset is sized for (CARD_GIB), from
bench/configs/ where the model is not downloaded. Without checkpointing the update runs the shared
prefix once per mini-batch (PrefixStore): its rows hold (S - prefix) tokens each, plus the prefix's
keys and values copied per row.
Peak = always + max(rollout, update): the rollout's KV cache is freed before the update, the
gradients before the rollout. Not counted: allocator fragmentation, the CUDA context (~0.5 GiB),
the Python and torch runtime (~0.3-0.5 GiB of RSS on a CPU), the retriever's index, a CPU's oneDNN
shape caches under bf16 (bounded: memory.bound_onednn_caches).

LoRA (--lora-rank r, plumbing/models.py with_lora): only the adapters train, r x (in + out) on each
of a layer's 7 linear layers (q, k, v, o, gate, up, down): P_lora = L x r x (9 H + 2 kv + 3 I). The
rows of the trained weights count P_lora instead of P: fp32 4, AdamW moments 8, gradients 4, the
CPU's AdamW transient 4, a checkpoint 12 bytes each. The frozen base is held as a reference copy
would be (on a GPU under bf16 autocast its linear weights in bf16, models.frozen_linears_in_bf16;
else fp32), and it is the reference, its adapter switched off: no copy, whatever kl_coef. Autocast
caches bf16 copies only of weights that train: 2 P_lora, plus a bf16 copy of each frozen weight a
linear layer reads in fp32 (a GPU's tied head; on a CPU under bf16 the whole base), made again at
each product and kept by autograd until the micro-batch's backward (counted as held throughout).
Activations: for a frozen linear layer autograd keeps only its weight (no weight gradient, so not
its input), but the backward still runs through every frozen layer to reach the adapters below
it, so attention, MLP and norms keep what passes a gradient back; each adapter's A keeps its input
(the linear layer's input, the tensor full fine-tuning keeps) and B its rank-r input, while the
RMSNorms stop keeping their normalised input (read only by their weights' gradients). Per token
and layer: 4 x (6 H + 2 kv + 4 I + 7 r) in fp32; 4 x 2 H + 2 x (8 H + 2 kv + 4 I + 7 r) under bf16
autocast, where A keeps its own bf16 copy of o's input (peft casts the attention's bf16 output to
the adapter's fp32 and autocast casts it back). Both measured with saved-tensor hooks
(tests/test_memory_plan.py). The CPU demo at rank 32, one step without evaluation, float32 (2-core
AMD EPYC, AVX2): peak RSS 4.98 GiB, 1.16x that run's plan (4.31) and 1.06x the demo's (4.69); its
live tensors peak at 3.16 GiB, as full fine-tuning's at 4.64 against 5.93: episodes are planned at
their longest, and glibc's heap keeps freed blocks (memory.reuse_freed_memory).

The time per step (`step_seconds`) is an estimate with stated assumptions, see its docstring.
"""
import math
import os
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
SPARE = 256                          # fast_hf.GrowingLayer's spare positions
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "bench" / "configs"   # the presets' models


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
    head_size: int | None = None   # config.head_dim where a family sets it (Qwen3, Gemma 3)
    norms: int = 2                 # RMSNorms of width H a layer (Gemma 3: 4)
    qk_norm: bool = False          # a norm of width head_dim on q and on k (Qwen3, Gemma 3)

    @classmethod
    def of(cls, config) -> "Shape":
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        heads, kind = get("num_attention_heads"), get("model_type")
        return cls(vocab=get("vocab_size"), hidden=get("hidden_size"), intermediate=get("intermediate_size"),
                   layers=get("num_hidden_layers"), heads=heads, kv_heads=get("num_key_value_heads") or heads,
                   tied=bool(get("tie_word_embeddings", False)), qkv_bias=kind == "qwen2",
                   head_size=get("head_dim"), norms=4 if kind in ("gemma3", "gemma3_text") else 2,
                   qk_norm=kind in ("qwen3", "gemma3", "gemma3_text"))

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_parameters(self) -> int:
        """Attention (Qwen2: q, k, v biases) and gated MLP of one layer: all linear."""
        h, kv, q = self.hidden, self.kv, self.q
        return 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.qkv_bias else 0) + 3 * h * self.intermediate

    def parameters(self) -> int:
        """Llama / Qwen2 / SmolLM parameter count: embedding, the layers with two RMSNorms each,
        the final norm, and the head unless tied."""
        norms = self.norms * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return (self.vocab * self.hidden * (1 if self.tied else 2)
                + self.layers * (self.layer_parameters() + norms) + self.hidden)

    def linear_only(self) -> int:
        """Parameters only linear layers use: the layers' projections, and an untied head."""
        return self.layers * self.layer_parameters() + (0 if self.tied else self.vocab * self.hidden)

    def linear_used(self) -> int:
        """Parameters linear layers use, a tied head included: autocast's bf16 copies, and the FLOPs."""
        return self.linear_only() + (self.vocab * self.hidden if self.tied else 0)

    def lora_parameters(self, rank: int) -> int:
        """LoRA's adapters, r x (in + out) on each linear layer of a layer (peft's "all-linear": not
        the head): q and o H -> H, k and v H -> kv, gate and up H -> I, down I -> H."""
        h, kv, i, q = self.hidden, self.kv, self.intermediate, self.q
        return self.layers * rank * (2 * (h + q) + 2 * (h + kv) + 2 * (h + i) + (i + h))


def prompt_lengths(prompts) -> tuple[int, int]:
    """(longest, shared): the longest prompt's tokens and the leading tokens all prompts share, from
    an iterable of token-id lists (read once, so a generator over a large dataset is fine)."""
    longest, first, shared = 0, None, 0
    for ids in prompts:
        longest = max(longest, len(ids))
        if first is None:
            first, shared = ids, len(ids)
        else:
            shared = next((i for i, (a, b) in enumerate(zip(first[:shared], ids)) if a != b), min(shared, len(ids)))
    return longest, shared


def plan(shape: Shape, cfg, cuda: bool, bf16: bool, prompts: tuple[int, int] | None = None) -> dict[str, float]:
    """{row: bytes} of the module docstring, with each phase's total, "peak" and "checkpoint on disk".
    prompts: (longest, shared) of prompt_lengths, or None for the bound (max_prompt_tokens, 0)."""
    p, lin, b = shape.parameters(), shape.linear_only(), 2 if bf16 else 4
    h, i, layers, kv, vocab = shape.hidden, shape.intermediate, shape.layers, shape.kv, shape.vocab
    rank = cfg.lora_rank
    trained = shape.lora_parameters(rank) if rank else p
    frozen = 2 * lin + 4 * (p - lin) if cuda and bf16 else 4 * p    # a reference, or LoRA's base
    longest, shared = prompts or (cfg.max_prompt_tokens, 0)
    shared = min(shared, longest - 1)                 # KVBatch.start runs each row's last token itself

    def episode(turns: int) -> int:
        return min(cfg.max_context, longest + (turns + 1) * cfg.max_turn_tokens + turns * cfg.max_obs_tokens)

    def rollout(rows: int, s: int) -> dict[str, int]:
        kv_cache = (rows * (s - shared + SPARE) + shared + SPARE) * layers * kv * ((b if cuda else 4) + b)
        chunk = max(longest - shared, cfg.max_obs_tokens + 1)
        return {"rollout: KV cache": kv_cache, "rollout: one layer's copy": kv_cache // layers,
                "rollout: a chunk's forward": rows * chunk * (3 * i * b + 4 * h * 4 + s * b)
                                              + (rows * shape.heads * shape.head_dim * s * b * 2 if cuda else 0),
                "rollout: sampling": rows * vocab * 12}

    s = episode(cfg.max_turns)
    train_rows = min(cfg.rollout_batch_size, cfg.prompts_per_step * cfg.group_size)
    phases = [rollout(train_rows, s)]
    if cfg.eval_size:
        phases.append(rollout(min(cfg.rollout_batch_size, cfg.eval_size), episode(cfg.eval_max_turns)))
    rollout_rows = max(phases, key=lambda r: sum(r.values()))

    micro = min(cfg.micro_batch_size, cfg.mini_batch_size)
    if not rank:
        per_layer = (4 * (8 * h + 2 * kv + 4 * i) if b == 4
                     else 4 * 4 * h + 2 * (7 * h + 2 * kv + 4 * i))
    elif b == 4:                                   # LoRA: no norm inputs; B's rank-r inputs
        per_layer = 4 * (6 * h + 2 * kv + 4 * i + 7 * rank)
    else:                                          # and A's bf16 copy of o's input
        per_layer = 4 * 2 * h + 2 * (8 * h + 2 * kv + 4 * i + 7 * rank)
    if cfg.grad_checkpointing:                     # layer inputs (the fp32 residual); one layer recomputed, its grads
        activations = micro * s * (layers * 4 * h + 2 * per_layer) + 2 * micro * s * s * b
    else:                                          # every layer's set, and as much again for one layer's grads
        prefix_once = shared if micro > 1 else 0   # PrefixStore: the prefix runs for one row per mini-batch
        rest = micro * (s - prefix_once)
        activations = ((layers + 1) * (rest * per_layer + rest * s * b + micro * prefix_once * 2 * kv * b)
                       + prefix_once * layers * per_layer)
    head_rows = min(1024, micro * (cfg.max_turns + 1) * cfg.max_turn_tokens)    # model tokens of a chunk
    # autocast's bf16 copies of the weights linear layers read in fp32: all, or with LoRA the
    # adapters and, of the frozen base, a GPU's tied head (the rest is bf16 there) or a CPU's all
    in_fp32 = shape.linear_used() - (lin if rank and cuda else 0) + (trained if rank else 0)
    reference = frozen if cfg.kl_coef > 0 and not rank else 0       # LoRA: the base, adapter off
    rows = {"weights (fp32)": 4 * trained, "frozen base (LoRA)": frozen if rank else 0,
            "AdamW moments": 8 * trained, "reference model": reference,
            "autocast bf16 weights": 2 * in_fp32 if bf16 else 0, **rollout_rows,
            "update: gradients": 4 * trained, "update: activations": activations,
            "update: logit chunks": head_rows * vocab * 4 * (5 if bf16 else 6),
            "update: AdamW step transient": 0 if cuda else 4 * trained}
    always = sum(x for k, x in rows.items() if ":" not in k)
    totals = {"rollout": sum(x for k, x in rows.items() if k.startswith("rollout:")),
              "update": rows["update: gradients"] + max(rows["update: activations"] + rows["update: logit chunks"],
                                                        rows["update: AdamW step transient"])}
    return {**rows, "always": always, "rollout total": totals["rollout"], "update total": totals["update"],
            "peak": always + max(totals.values()), "checkpoint on disk": 12 * trained,
            "episode tokens": s}


# Cards the time estimate knows: (dense bf16 TFLOPS, memory TB/s), from their data sheets.
CARDS = {"H100 80GB": (989, 3.35), "H200 141GB": (989, 4.8), "A100 80GB": (312, 2.0),
         "RTX A6000 48GB": (155, 0.768), "RTX 4090 24GB": (165, 1.008)}
# What torch reports of a card of each size a one-GPU preset is sized for (GiB, rounded down), and
# the card its time is estimated on.
CARD_GIB = {"24gb": 23.5, "48gb": 47.5, "80gb": 79.0, "141gb": 139.0}
TIMED_ON = {"24gb": "RTX 4090 24GB", "48gb": "RTX A6000 48GB", "80gb": "H100 80GB",
            "141gb": "H200 141GB"}


def step_seconds(shape: Shape, cfg, card: str, mfu: float = 0.35,
                 launch_ms_per_layer: float = 0.9) -> dict:
    """An estimate of one training step's seconds on `card`, with these assumptions:
    - every turn of a rollout batch runs to max_turn_tokens (a batch lasts as long as its longest
      row), so a step decodes ceil(N / rollout_batch_size) x (max_turns + 1) x max_turn_tokens steps;
    - a decode step takes the larger of eager PyTorch's kernel launches, `launch_ms_per_layer` per
      layer (about 100 kernels a layer; LoRA's 7 unmerged adapters add about 5 each: the input's
      cast, A, B, the scale, the sum), and its memory traffic at the card's bandwidth: the bf16
      weights once plus the KV cache of the batch at half the episode, read 5 times (the float32
      attention of fast_hf reads keys and values, writes and reads their fp32 copies);
    - the training passes run at `mfu` of the card's dense bf16 FLOPS: 2 x linear parameters
      (LoRA's adapters included) x tokens per forward, plus attention 2 x L x S x H per token, over
      N episodes of S tokens each (the plan's longest episode: an upper bound); forward + backward
      = 3 forwards (LoRA: 2, no weight gradients for the frozen base; the adapters' own, 2% of a
      forward at rank 32, left out), +1 with gradient checkpointing; the old-log-prob pass (all
      mini-batches but the first), the reference (kl_coef > 0) and the displacement pass every
      displacement_every steps, 1 each;
    - no retrieval time, no held-out evaluation, no checkpoint writes.
    -> {"rollout": s, "training": s, "step": s}"""
    tflops, tbps = CARDS[card]
    n = cfg.prompts_per_step * cfg.group_size
    s = plan(shape, cfg, cuda=True, bf16=True)["episode tokens"]
    rows = min(cfg.rollout_batch_size, n)
    linear = shape.linear_used() + shape.lora_parameters(cfg.lora_rank)
    kv_half = rows * s / 2 * shape.layers * shape.kv * 4          # bf16 keys and values
    launches = launch_ms_per_layer * (1.35 if cfg.lora_rank else 1) * shape.layers
    decode_ms = max(launches, (2 * linear + 5 * kv_half) / (tbps * 1e9))
    decode_steps = math.ceil(n / cfg.rollout_batch_size) * (cfg.max_turns + 1) * cfg.max_turn_tokens
    forward = n * s * (2 * linear + 2 * shape.layers * s * shape.hidden)
    passes = (3 - (cfg.lora_rank > 0) + cfg.grad_checkpointing + (1 - cfg.mini_batch_size / n)
              + (cfg.kl_coef > 0) + (1 / cfg.displacement_every if cfg.displacement_every else 0))
    training = forward * passes / (mfu * tflops * 1e12)
    rollout = decode_steps * decode_ms / 1e3
    return {"rollout": rollout, "training": training, "step": rollout + training}


def device_bytes(cuda: bool) -> int:
    """What the run may use: on a GPU its free memory plus what this process already holds (another
    process on the card, a retriever's encoder say, is not the run's); the machine's RAM."""
    if cuda:
        import torch
        return torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def held_by_others(cuda: bool) -> str:
    """", X GiB held by other processes" when another process holds memory on the GPU, else ""."""
    if not cuda:
        return ""
    import torch
    others = torch.cuda.mem_get_info()[1] - device_bytes(True)
    return f", {others / GIB:.1f} GiB held by other processes" if others > GIB / 2 else ""


def table(rows: dict[str, float], shape: Shape, available: int, where: str, prompts, cfg) -> str:
    what = (f"longest prompt {prompts[0]} tokens, {prompts[1]} shared" if prompts else
            f"prompts not read: max_prompt_tokens {cfg.max_prompt_tokens} and no shared prefix (a bound)")
    lines = [f"memory plan: {shape.parameters() / 1e6:,.1f}M parameters, {where}"
             f"{f' {available / GIB:.1f} GiB' if available else ' with bf16 units'}; "
             f"episodes up to {rows['episode tokens']} tokens ({what})"]
    lines += [f"  {name:<30}{value / GIB:>9.2f} GiB" for name, value in rows.items() if name != "episode tokens"]
    lines += [f"  time per step, est. on {card:<14}{t['step'] / 60:>6.1f} min (rollout "
              f"{t['rollout'] / 60:.1f}, training {t['training'] / 60:.1f}; assumptions: "
              "plumbing/memory_plan.py step_seconds)"
              for card in CARDS for t in [step_seconds(shape, cfg, card)]]
    return "\n".join(lines)


def too_big(rows: dict[str, float], available: int) -> str | None:
    """None when the peak fits in 90% of the device; else one line naming the flag to change."""
    if rows["peak"] <= 0.9 * available:
        return None
    flag = max([("--rollout-batch-size or --max-context", rows["rollout total"]),
                ("--micro-batch-size, or --grad-checkpointing", rows["update: activations"]),
                ("--kl-coef 0 (no reference model)", rows["reference model"])], key=lambda f: f[1])[0]
    return (f"the memory plan needs {rows['peak'] / GIB:.1f} GiB, over 90% of the device's {available / GIB:.1f} GiB: "
            f"lower {flag} (python train.py --plan ... prints the whole plan)")


def for_run(cfg, device, model=None, prompts=None, card=None) -> tuple[dict, Shape, int, str]:
    """The plan of a train.py config on `device` (torch.device): (rows, shape, device bytes, where).
    card: a CARD_GIB key, the memory planned against where `device` is a GPU this machine lacks."""
    from plumbing import fast_hf

    config = model.config if model is not None else model_config(cfg)
    import torch

    cuda, shape = device.type == "cuda", Shape.of(config)
    if cuda and not torch.cuda.is_available():       # --plan --device cuda on a machine without one
        rows = plan(shape, cfg, True, cfg.bf16, prompts)
        if card:
            where = f"GPU memory (a {card} card's; no GPU here)"
            return rows, shape, int(CARD_GIB[card] * GIB), where
        return rows, shape, 0, "no GPU here: planned for one"
    rows = plan(shape, cfg, cuda, cfg.bf16 and fast_hf.bf16_supported(device), prompts)
    return rows, shape, device_bytes(cuda), ("GPU memory" if cuda else "RAM") + held_by_others(cuda)


def model_path(cfg) -> str:
    from plumbing.models import embedded_smollm2, not_a_model_folder

    path = cfg.model or str(embedded_smollm2())
    if why := not_a_model_folder(path):
        raise ValueError(why)
    return path


def model_config(cfg):
    """The model's HF config, from its folder or the HF cache; for a model not downloaded yet, the
    copy in bench/configs/ where one is shipped (the presets' models), so a plan can come first."""
    from transformers import AutoConfig
    path = model_path(cfg)                  # a local path that holds no model ends here, one line
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        shipped = SHIPPED_CONFIGS / path.split("/")[-1].lower()
        if (shipped / "config.json").is_file():
            print(f"--model {cfg.model} is not downloaded: planning from "
                  f"bench/configs/{shipped.name}")
            return AutoConfig.from_pretrained(shipped)
        raise ValueError(f"--model {cfg.model!r}: no config to plan from ({str(e).splitlines()[0]})") from None


def start_line(rows: dict, available: int, where: str) -> str:
    of = f"of {available / GIB:.1f} GiB {where}" if available else f"({where})"
    return f"memory plan: peak {rows['peak'] / GIB:.2f} GiB {of}, episodes up to {rows['episode tokens']} tokens"


def check(cfg, device, model, prompts) -> None:
    """The one-line summary every run prints at start, planned with its prompts (an iterable of
    token-id lists); ValueError (one line, the flag to change) when the peak is over 90% of the device."""
    rows, shape, available, where = for_run(cfg, device, model, prompt_lengths(prompts))
    print(start_line(rows, available, where) + " (python train.py --plan for the table)")
    if available and (line := too_big(rows, available)) is not None:
        raise ValueError(line)


def print_plan(cfg, device, questions=None, preset=None) -> str:
    """The plan's table, from the prompts the run will read when train.questions(cfg, tokenizer)
    can read them (tokenising only; then its peak is the one the run's start line prints), else
    from the bound. preset: the name --preset gave; a GPU preset is planned on a GPU (unless
    --device cpu), against the card it is sized for where this machine has none."""
    import torch

    from plumbing.presets import CARD, GPU_PRESETS

    if preset in GPU_PRESETS and cfg.device != "cpu":
        device = torch.device("cuda")
    prompts, why = None, "no reader"
    if questions is not None:
        from plumbing.models import load_tokenizer
        try:
            tokenizer = load_tokenizer(model_path(cfg))
            prompts = prompt_lengths(questions(cfg, tokenizer)[-1])
        except (OSError, ValueError) as e:        # FileNotFoundError is an OSError
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
    rows, shape, available, where = for_run(cfg, device, prompts=prompts, card=CARD.get(preset))
    table_ = table(rows, shape, available, where, prompts, cfg)
    note = "" if prompts else f"\n(the prompts were not read: {why})"
    return start_line(rows, available, where) + "\n" + table_ + note
