"""Speed-ups of Hugging Face internals. Each gives the numbers of the plain path (tested) or
the same math with other rounding, said where it is so:

* `autocast`: the one bf16 check: autocast on CUDA and on CPUs with native bf16 units;
* `use_fast_attention`: one model's attention with SDPA's own grouped-query attention instead of
  HF repeating K/V heads, and decode-step attention in float32 under CPU bf16 autocast (other
  rounding), in the cache's dtype on a GPU (`decode_attention`, other rounding);
* `without_cudnn_attention`: train.py's log-prob passes without cuDNN's attention, so that a call
  runs the same kernel with and without grad;
* `new_cache`: a KV cache whose layers grow in place instead of being copied by torch.cat, its
  sliding-window layers (Gemma 3) included: `KVBatch` masks their window by positions;
* `share_rows`: a rollout's few-shot prefix kept once in the cache for all rows; a decode step
  attends to it with one product for all rows (float32; other rounding than B copies);
* `prefix_once`: the model for train.py's log-probs, the prompt prefix all rows share run once
  per context (a pass, or a mini-batch's update) and with grad its backward once on leaving it
  (the gradient summed in another order);
* `in_checkpointed_chunks`: train.py's `head_logprobs` a chunk of rows at a time;
* `KVBatch`, `StopChecker`: rollout.py's batch of episodes sharing one KV cache with holes,
  and its per-row stop check that decodes only when a token could close a tag.
"""
import contextlib
import functools
import types
import weakref

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


def bf16_supported(device: torch.device) -> bool:
    """bf16 units: CUDA GPUs that have them (not emulated: a V100 or T4 says yes to torch's default
    check and then runs bf16 slowly), CPUs with AVX512-BF16 / AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()


def autocast(device: torch.device, enabled: bool = True):
    """A bf16 autocast region where the hardware has bf16 units, else a region that changes nothing.

    Opened once around a whole phase under no_grad (not inference_mode), autocast caches the bf16
    copies of the weights for the region instead of re-casting all weights at every decode step
    (measured on CPU: 2-3x faster decode than float32 at batch 16).
    """
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled and bf16_supported(device))


FAST_ATTENTION = "sdpa_shared_prefix"     # the attention implementation use_fast_attention sets


# The SDPA kernels train.py's log-prob passes may run: all but cuDNN's (without_cudnn_attention).
LOGPROB_KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def without_cudnn_attention(f):
    """Decorator: f(model, ...) with SDPA held to LOGPROB_KERNELS, so that a call runs the same
    kernel in every log-prob pass of train.py (old, reference, update, displacement), which at
    equal weights must agree bit for bit. Left to choose, recent PyTorch prefers cuDNN's attention
    on an H100/H200, and cuDNN builds other graphs with grad than without, which need not agree.
    Among the others PyTorch chooses by the inputs alone: flash where there is no mask (bf16),
    memory-efficient with one (it takes any mask; under grad it only adds its log-sum-exp output),
    math where neither can run; never by grad mode (except flash at head dims over 192 on sm86/89:
    not these models). A CPU runs flash here, the kernel it picks anyway (the same numbers, tested)."""
    @functools.wraps(f)
    def held(*args, **kwargs):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([getattr(SDPBackend, name) for name in LOGPROB_KERNELS]):
            return f(*args, **kwargs)
    return held


def use_fast_attention(model) -> None:
    """Switch `model`, and only it, to this module's attention (registered under its own name, so
    no other model's "sdpa" changes): HF's SDPA attention, with on CPU tensors

    * K/V heads shared by SDPA itself (enable_gqa) instead of HF repeating them (3x for SmolLM2)
      whenever an attention mask is given, which is always in rollouts (the cache has holes): the
      same numbers, faster;
    * a decode step (one query token) under bf16 autocast in float32: under autocast SDPA casts the
      query and the WHOLE key/value cache to bf16 at every step, and the CPU bf16 kernel is slower
      at one query token than float32 (other rounding). Prefill and training are unchanged;

    and on any device, keys tagged by a `SharedPrefixLayer` attended with the shared prefix, in one
    product for all rows at a decode step (`decode_attention`). Without this call rollout()
    computes the same with a plain cache (share_rows copies the prefix per row). On a GPU every
    decode step runs `decode_attention` in the cache's dtype, K/V neither repeated nor copied, and
    its mask is built without HF's test for an all-ones mask (`_mask`), a host sync per step."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not hasattr(model, "set_attn_implementation"):       # not an HF model: its own attention
        return
    AttentionInterface.register(FAST_ATTENTION, _attention)
    AttentionMaskInterface.register(FAST_ATTENTION, _mask)
    model.set_attn_implementation(FAST_ATTENTION)


def _mask(*args, q_length: int, device="cpu", **kwargs):
    """HF's sdpa_mask; at a GPU's decode step (one query token) without the shortcut that returns
    no mask when the 2-D mask is all ones: deciding it reads a GPU value on the host at every step.
    An all-True mask gives the same attention."""
    from transformers.masking_utils import sdpa_mask

    if q_length == 1 and torch.device(device).type not in FLOAT32_ATTENTION:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, q_length=q_length, device=device, **kwargs)


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    prefix = getattr(key, "shared_prefix", None)           # set by SharedPrefixLayer.update
    if query.shape[-2] == 1 and (prefix is not None or query.device.type not in FLOAT32_ATTENTION):
        prefix = prefix or (None, None)
        return decode_attention(query, key, value, attention_mask, kwargs["scaling"], *prefix)
    if prefix is not None:       # many query tokens (an observation): SDPA on copies of the prefix
        key, value = (torch.cat([p.expand(len(t), -1, -1, -1), t], dim=-2)
                      for p, t in zip(prefix, (key, value)))
    if query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    forward = _cpu_sdpa if key.shape[-1] == value.shape[-1] else sdpa_attention_forward
    if query.shape[-2] == 1 and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return forward(module, query, key, value, attention_mask, **kwargs)


def _cpu_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
              is_causal=None, **kwargs):
    """HF's sdpa_attention_forward with SDPA's own grouped-query attention also under a mask."""
    q_length, kv_length = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if is_causal and kv_length > q_length:          # as HF: a causal mask aligned at the top left
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=is_causal, enable_gqa=getattr(module, "num_key_value_groups", 1) > 1)
    return out.transpose(1, 2).contiguous(), None


# Devices whose decode-step attention runs in float32 (use_fast_attention): their caches keep
# the float32 keys RoPE gives under autocast, as a bf16 copy would be cast back at every step.
FLOAT32_ATTENTION = ("cpu",)


class GrowingLayer(DynamicLayer):
    """A KV-cache layer that writes new positions into spare room instead of `torch.cat`.

    DynamicLayer concatenates, i.e. copies the whole cache at every decode step (on CPU at 16
    rows x 900 tokens: 15 ms per layer and tensor, more than the layer's matmuls). Here the
    buffer keeps `_SPARE` free positions and is only re-allocated when they run out; keys/values
    are views of it. Row selection (batch_select_indices) replaces the buffers by their kept rows.

    Keys are stored in the values' dtype (the compute dtype) on a GPU: under bf16 autocast over
    fp32 weights, RoPE (q * cos, cos in the fp32 residual's dtype) turns bf16 keys into fp32, so
    a plain cache holds fp32 keys beside bf16 values (1.5x the memory), which SDPA casts back to
    bf16 anyway: the same attention numbers. A CPU (FLOAT32_ATTENTION) keeps them in float32.
    """

    _SPARE = 256

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
        buffers = getattr(self, "buffers", None)
        if (buffers is None or buffers[0].data_ptr() != self.keys.data_ptr()
                or buffers[0].shape[0] != key_states.shape[0] or n + new > buffers[0].shape[-2]):
            key_dtype = key_states.dtype if key_states.device.type in FLOAT32_ATTENTION else value_states.dtype
            buffers = []
            for old, states, dtype in ((self.keys, key_states, key_dtype), (self.values, value_states, None)):
                buffer = states.new_empty(*states.shape[:2], n + new + self._SPARE, states.shape[-1], dtype=dtype)
                buffer[:, :, :n] = old[:, :, :n] if n else 0
                buffers.append(buffer)
            self.buffers = buffers
        for buffer, states in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, n:n + new] = states
        self.keys, self.values = (buffer[:, :, :n + new] for buffer in self.buffers)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices`: each buffer is replaced by its kept rows (spare room included),
        so the full-batch buffers are freed layer by layer at a turn boundary, not kept beside
        the copies until each layer's next update (up to ~1.9x the cache for a moment)."""
        buffers = getattr(self, "buffers", None)
        if buffers is not None and self.keys.dim() == 4 and buffers[0].data_ptr() == self.keys.data_ptr():
            n = self.keys.shape[-2]
            self.buffers = [buffer[indices] for buffer in buffers]
            self.keys, self.values = (buffer[:, :, :n] for buffer in self.buffers)
        else:                                          # the keys were replaced by a plain cache method
            self.buffers = None
            super().batch_select_indices(indices)


class SharedPrefixLayer(GrowingLayer):
    """A GrowingLayer behind a prefix that all rows share, stored once: prefix keys/values
    (1, kv_heads, P, d), then each row's own positions (B, kv_heads, S, d) growing in place.

    HF's attention receives only the rows' own keys/values, tagged with the prefix, which the
    attention of `use_fast_attention` reads (`decode_attention`). At 32 rows and
    a 460-token prefix a decode step reads the prefix's keys/values once instead of 32 times.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, n_rows: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.prefix = (keys, values)
        self.keys = self.values = keys.new_empty(n_rows, keys.shape[1], 0, keys.shape[-1])

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        keys.shared_prefix = self.prefix
        return keys, values

    def get_seq_length(self) -> int:
        return self.prefix[0].shape[-2] + self.keys.shape[-2]


def decode_attention(query, key, value, mask, scaling, prefix_key=None, prefix_value=None):
    """One decode step's attention over [the prefix all rows share, if any; each row's own keys].

    query (B, Hq, 1, d); key, value (B, Hkv, S, d); prefix_key, prefix_value (1, Hkv, P, d) or
    None; mask None or (B, 1, 1, P + S), bool (True = attend) or additive. Query head h reads kv
    head h // (Hq / Hkv), as HF's repeat_kv, by grouping the queries: K/V are never repeated.
    The products run in the cache's dtype (bf16 on a GPU: K/V are read, never copied to float32)
    and the softmax in float32; on FLOAT32_ATTENTION devices (a CPU) all of it in float32.
    -> ((B, 1, Hq, d), None), as HF's sdpa."""
    n, heads, _, dim = query.shape
    kv_heads, p = key.shape[1], 0 if prefix_key is None else prefix_key.shape[-2]
    dtype = torch.float32 if query.device.type in FLOAT32_ATTENTION else value.dtype
    with torch.autocast(query.device.type, enabled=False):
        q = query.to(dtype).view(n, kv_heads, -1, dim)                       # (B, Hkv, g, d)
        scores = q @ key.to(dtype).transpose(2, 3)                          # (B, Hkv, g, S)
        if p:    # all rows' queries against the one prefix in one product: (Hkv, B*g, P)
            on_prefix = q.transpose(0, 1).reshape(kv_heads, -1, dim) @ prefix_key[0].to(dtype).mT
            scores = torch.cat([on_prefix.view(kv_heads, n, -1, p).transpose(0, 1), scores], -1)
        scores = scores.float() * scaling                                   # (B, Hkv, g, P+S)
        if mask is not None:
            scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                      else scores + mask)
        probs = torch.softmax(scores, dim=-1).to(dtype)
        out = probs[..., p:] @ value.to(dtype)                              # (B, Hkv, g, d)
        if p:
            on_prefix = probs[..., :p].transpose(0, 1).reshape(kv_heads, -1, p)   # (Hkv, B*g, P)
            from_prefix = on_prefix @ prefix_value[0].to(dtype)                   # (Hkv, B*g, d)
            out = out + from_prefix.view(kv_heads, n, -1, dim).transpose(0, 1)
    return out.reshape(n, 1, heads, dim).to(query.dtype), None


def share_rows(cache, n_rows: int, model) -> None:
    """Make the one-row cache (the prompt prefix) the start of `n_rows` rows: stored once when
    the cache and the model's attention allow it (`SharedPrefixLayer`), else copied per row."""
    layers = getattr(cache, "layers", None)
    if (getattr(getattr(model, "config", None), "_attn_implementation", None) == FAST_ATTENTION and layers
            and all(type(layer) is GrowingLayer for layer in layers)):
        cache.layers = [SharedPrefixLayer(layer.keys, layer.values, n_rows) for layer in layers]
    else:
        cache.batch_repeat_interleave(n_rows)


def new_cache(model):
    """A DynamicCache for `model` whose layers grow in place, keeping every column (a sliding-window
    layer's too: KVBatch masks the window); None lets the model choose."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)
                    else layer for layer in cache.layers]
    return cache


def attention_layers(config) -> tuple[list[str], int | None]:
    """HF's attention type of each layer of a model with `config` ("full_attention",
    "sliding_attention", ...) and the sliding window (None when no layer has one)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return types, kwargs.get("sliding_window")


def shared_prefix_len(input_ids, attention_mask) -> int:
    """Length of the leading columns every row has identical and attended (the few-shot prompt)."""
    same = ((input_ids == input_ids[:1]) & (attention_mask == 1)).all(0)            # (T,)
    return int(same.long().cumprod(0).sum())


class PrefixStore:
    """The few-shot prefix's last hidden states and keys/values, run once per `prefix_once` context
    at fixed weights and reused by every micro-batch: the very tensors a forward would give, so
    every forward number is the same. Built from the step's rows (input_ids, attention_mask (N, T)),
    it holds only the prefix ALL of them share: a micro-batch of one question's rows would otherwise
    run (and, with grad, keep) its own longer prefix. Every pass of a step builds it from the same
    rows, so each micro-batch splits at the same column in all of them, which keeps old and update
    log-probs equal bit for bit.

    With grad, each micro-batch's backward stops at leaves that collect the prefix's gradient, and
    `backward()` runs the prefix's own backward once with their sum: the same gradient as a backward
    through the prefix per micro-batch, the sum taken in another order.
    """

    def __init__(self, input_ids, attention_mask):
        self.limit = shared_prefix_len(input_ids, attention_mask)    # columns every row shares
        self.prefixes = {}             # prefix ids -> (hidden (1, p, H), [(keys, values)] per layer)
        self.graphs = []               # (outputs, their leaves) whose backward is still to run
        self.closed = False

    def run(self, model, ids, mask):
        """The prefix's last hidden states (1, p, H) and a KV cache holding it."""
        if self.closed:
            raise RuntimeError("a prefix_once model was used after its context closed: its prefix "
                               "gradient would be lost")
        key = tuple(ids[0].tolist())
        if key not in self.prefixes:
            out = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=True)
            layers = out.past_key_values.layers
            tensors = [out.last_hidden_state] + [t for l in layers for t in (l.keys, l.values)]
            if torch.is_grad_enabled():
                leaves = [t.detach().requires_grad_() for t in tensors]
                self.graphs.append((tensors, leaves))
                tensors = leaves
            self.prefixes[key] = (tensors[0], list(zip(tensors[1::2], tensors[2::2])))
        hidden, layers = self.prefixes[key]
        cache = DynamicCache(config=model.config)
        for i, (keys, values) in enumerate(layers):
            cache.update(keys, values, i)
        return hidden, cache

    def backward(self) -> None:
        """Backward through each prefix run with grad, once, with the gradient its leaves collected."""
        for tensors, leaves in self.graphs:
            pairs = [(t, leaf.grad) for t, leaf in zip(tensors, leaves)
                     if leaf.grad is not None and leaf.grad.any()]
            if pairs:
                torch.autograd.backward(*zip(*pairs))

    def close(self) -> None:
        """Drop the prefixes and any graph still pending; a later use is refused."""
        self.graphs, self.prefixes, self.closed = [], {}, True


def hidden_states(model, input_ids, attention_mask, store: PrefixStore):
    """The last hidden states (B, T, H), the prompt prefix all rows share run once (by `store`).

    The few-shot prompt is most of every CPU-demo episode. Its keys/values are computed for one
    row, expanded to all rows as a KV cache, and the rest runs on top: the same numbers as one plain
    forward (rows see the same keys/values) and the same gradients (the expansion sums them over
    rows)."""
    n, length = input_ids.shape
    p = min(shared_prefix_len(input_ids, attention_mask), length - 1, store.limit)
    if n == 1 or p < 16:
        return model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                   use_cache=False).last_hidden_state
    first_hidden, cache = store.run(model, input_ids[:1, :p], attention_mask[:1, :p])
    cache.batch_repeat_interleave(n)       # (1, heads, p, d) -> (n, heads, p, d), differentiable
    positions = torch.arange(p, length, device=input_ids.device).expand(n, -1)
    rest = model.get_decoder()(input_ids=input_ids[:, p:], attention_mask=attention_mask,
                               past_key_values=cache, position_ids=positions,
                               use_cache=True).last_hidden_state              # (n, T - p, H)
    return torch.cat([first_hidden.expand(n, -1, -1), rest], dim=1)


class _SharedPrefixModel:
    """`model`, but its decoder (input_ids=, attention_mask=) runs the shared prefix once (store)."""

    def __init__(self, model, store: PrefixStore):
        self.model, self.store = model, store

    def get_decoder(self):
        def decoder(input_ids, attention_mask, **kwargs):
            hidden = hidden_states(self.model, input_ids, attention_mask, self.store)
            return types.SimpleNamespace(last_hidden_state=hidden)
        return decoder

    def __getattr__(self, name):
        return getattr(self.model, name)


@contextlib.contextmanager
def prefix_once(model, input_ids, attention_mask, enabled: bool = True):
    """`model` for train.py's token_logprobs, whose forward runs the prompt prefix that all rows of
    (input_ids, attention_mask) (N, T) share once for the whole context: the same numbers as the
    plain forward (tested), in about half the time of a few-shot CPU demo's forward and backward.
    With grad, each backward inside the context stops at the prefix's outputs, and leaving the
    context runs the prefix's own backward once with the gradient they collected, so the context
    closes before the optimizer step. An exception inside the context closes the store without that
    backward, dropping its graph: the caller zeroes the gradients before it steps again. enabled=False
    (gradient checkpointing, under which HF keeps no cache in training) yields `model` itself: every
    pass of a run must take the same path."""
    if not enabled:
        yield model
        return
    store = PrefixStore(input_ids, attention_mask)
    try:
        yield _SharedPrefixModel(model, store)
        store.backward()
    finally:
        store.close()


def in_checkpointed_chunks(rows: int = 1024):
    """Decorator: f(head, hidden (N, H), targets (N,), *args) -> tensors (N,), run `rows` rows at a
    time, each chunk checkpointed under grad, so that at most rows x vocabulary logits live at once.
    The same numbers as one call (tested)."""
    def decorate(f):
        @functools.wraps(f)
        def chunked(head, hidden, targets, *args):
            chunks = zip(hidden.split(rows), targets.split(rows))
            if torch.is_grad_enabled():
                parts = [checkpoint(f, head, h, t, *args, use_reentrant=False) for h, t in chunks]
            else:
                parts = [f(head, h, t, *args) for h, t in chunks]
            if not parts:
                return f(head, hidden, targets, *args)
            return tuple(torch.cat(x) for x in zip(*parts))
        return chunked
    return decorate


class KVBatch:
    """The KV cache and 2-D attention mask of the episodes generating together.

    Every forward appends a left-padded chunk: `ids` (B, L) long with `real` (B, L) 0/1; the mask
    keeps the holes, and positions count real tokens only, so each row computes exactly what it
    would compute alone.
    """

    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.cache = new_cache(model)
        self.mask = torch.zeros(1, 0, dtype=torch.long, device=self.device)  # (B, S), grows per chunk
        config = getattr(model, "config", None)
        self.layer_types, self.window = attention_layers(config) if config else ([], None)

    def feed(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Run one chunk; returns float32 logits (B, V) at each row's last chunk position."""
        self.mask = torch.cat([self.mask.expand(ids.shape[0], -1), real], dim=1)
        positions = (self.mask.cumsum(1) - 1).clamp(min=0)                        # (B, S)
        mask = self.mask if self.window is None else self.windowed_masks(positions, ids.shape[1])
        out = self.model(input_ids=ids, attention_mask=mask,
                         position_ids=positions[:, -ids.shape[1]:], past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[:, -1].float()

    def windowed_masks(self, positions: torch.Tensor, new: int):
        """The attention masks of a model with sliding-window layers, (B, 1, new, S) bool: each
        chunk token sees the real columns at or before its position, a sliding layer only those
        less than `window` positions back. HF counts the window in cache columns, which the holes
        would shrink. Mixed layers get {layer type: mask}, as HF's own masks reach them."""
        query, key = positions[:, -new:, None], positions[:, None, :]      # (B, new, 1), (B, 1, S)
        seen = self.mask.bool()[:, None, :] & (key <= query)
        masks = {"full_attention": seen[:, None],
                 "sliding_attention": (seen & (query - key < self.window))[:, None]}
        kinds = set(self.layer_types)
        return masks[kinds.pop()] if len(kinds) == 1 else masks

    def feed_padded(self, chunks: list[list[int]]) -> torch.Tensor:
        """feed() for per-row token lists of different lengths (left-padded here)."""
        width = max(len(c) for c in chunks)
        ids = torch.full((len(chunks), width), self.pad_id, dtype=torch.long)
        real = torch.zeros(len(chunks), width, dtype=torch.long)
        for row, chunk in enumerate(chunks):
            if chunk:
                ids[row, width - len(chunk):] = torch.tensor(chunk)
                real[row, width - len(chunk):] = 1
        return self.feed(ids.to(self.device), real.to(self.device))

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill the prompts: their common prefix once (expanded to every row), then each rest."""
        shared, shortest = 0, min(len(p) for p in prompts)
        if len(prompts) > 1 and shortest > 1:   # at least one token of each row runs on its own
            ids = torch.tensor([p[:shortest] for p in prompts])
            shared = min(shared_prefix_len(ids, torch.ones_like(ids)), shortest - 1)
        if shared:
            self.feed_padded([prompts[0][:shared]])
            share_rows(self.cache, len(prompts), self.model)
        return self.feed_padded([p[shared:] for p in prompts])

    def keep_rows(self, rows: list[int]) -> None:
        """Drop the rows of finished episodes from the cache and the mask."""
        index = torch.tensor(rows, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]


_CLOSING = weakref.WeakKeyDictionary()       # tokenizer -> {vocab: mask}: built once, not per rollout batch


def closing_tokens(tokenizer, vocab: int) -> torch.Tensor:
    """(vocab,) bool: the tokens whose text contains '>' (convert_ids_to_tokens over the whole
    vocabulary: 151,665 ids for Qwen, so once per tokenizer, not once per rollout batch)."""
    masks = _CLOSING.setdefault(tokenizer, {})
    if vocab not in masks:
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab, len(tokenizer)))))
        masks[vocab] = torch.zeros(vocab, dtype=torch.bool)
        masks[vocab][[i for i, p in enumerate(pieces) if p and ">" in p]] = True
    return masks[vocab]


class StopChecker:
    """Per-row stopping: EOS ids, and any of `stop_strings` in the turn's decoded text.

    Decoding every row at every step is slow; a closing tag can only be completed by a token
    whose text contains '>', so only those tokens trigger a decode of the turn's last tokens.
    """

    def __init__(self, tokenizer, model, vocab: int, device, stop_strings: tuple[str, ...]):
        ids = {tokenizer.eos_token_id}
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        self.eos = torch.zeros(vocab, dtype=torch.bool)
        self.eos[[i for i in ids if i is not None and i < vocab]] = True
        self.eos, self.closes = self.eos.to(device), closing_tokens(tokenizer, vocab).to(device)
        self.tokenizer, self.stop_strings = tokenizer, stop_strings

    def tag_closed(self, turn_ids: list[int]) -> bool:
        tail = self.tokenizer.decode(turn_ids[-16:])  # a closing tag spans at most ~10 tokens
        return any(s in tail for s in self.stop_strings)
