"""faiss indexes and encoder settings for retriever.py's dense backend.

- `new_index` / `add_streamed`: any faiss index_factory string ("Flat", "SQfp16", "HNSW32",
  "HNSW32,SQfp16", "IVF4096,PQ64", ...), inner-product metric, filled block by block as the encoder
  produces vectors: indexes that need training (IVF, PQ) are trained on the first TRAIN_VECTORS
  vectors, which are then added; the corpus's vectors are never all in memory at once, and a flat
  index's storage is allocated once (faiss's own add grows it by doubling: up to 2x at a time).
- `read_index`: a file written by faiss (ours, or Search-R1's e5_Flat.index) memory-mapped where
  faiss can (flat, SQ and PQ codes; an HNSW graph is read into RAM).
- `on_device`: the index moved to a GPU when faiss has GPU support (faiss-gpu), fp16 storage there.
- `sentence_transformers_settings`: the pooling and the query/passage prompts a sentence-transformers
  model folder declares (modules.json, 1_Pooling/config.json, config_sentence_transformers.json).
faiss errors (a C++ file and line, then the message) become one-line ValueErrors.
"""
import json
import re
from pathlib import Path

import numpy as np

TRAIN_VECTORS = 200_000  # vectors an IVF / PQ index trains on (faiss asks ~40 per IVF list)


def _faiss():
    try:
        import faiss
    except ImportError:
        raise ValueError("dense retrieval needs faiss: pip install faiss-cpu==1.15.1 (or faiss-gpu)") from None
    return faiss


def faiss_error(e: Exception) -> str:
    """faiss's message without its 'Error in <C++ signature> at <file>:<line>: ' head."""
    return re.sub(r"^Error in .*? at \S+:\d+: (Error: )?", "", str(e)).splitlines()[0]


def new_index(dim: int, spec: str):
    faiss = _faiss()
    try:
        return faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        raise ValueError(f"--faiss-type {spec!r}: {faiss_error(e)}") from None


def add_streamed(index, blocks, total: int) -> None:
    """Add every (n, D) float32 block of `blocks` (`total` rows in all) to `index`, in order: row i
    of the corpus is id i."""
    faiss, pending, filled = _faiss(), [], 0
    # A flat-codes index (Flat, SQ, PQ) keeps its codes in one vector that index.add grows by
    # doubling: up to twice the index in memory at once. Sized once here, filled in place instead.
    flat_codes = isinstance(index, faiss.IndexFlatCodes) and index.is_trained
    if flat_codes:
        index.codes.resize(total * index.code_size)
        codes = faiss.rev_swig_ptr(index.codes.data(), total * index.code_size).reshape(total, index.code_size)
    for vectors in blocks:
        if flat_codes:
            codes[filled:filled + len(vectors)] = index.sa_encode(vectors)
            filled += len(vectors)
            index.ntotal = filled
            continue
        if index.is_trained:
            index.add(vectors)
            continue
        pending.append(vectors)
        if sum(map(len, pending)) >= TRAIN_VECTORS:
            _train_and_add(index, pending)
            pending = []
    if pending:
        _train_and_add(index, pending)


def _train_and_add(index, blocks: list) -> None:
    vectors = np.concatenate(blocks)
    try:
        index.train(vectors)
    except RuntimeError as e:
        raise ValueError(f"this --faiss-type cannot be trained on this corpus ({faiss_error(e)}); "
                         "choose one with fewer lists or centroids") from None
    index.add(vectors)


def read_index(path):
    faiss = _faiss()
    try:
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC)
    except RuntimeError:
        try:  # an index type faiss cannot map: read it into RAM
            return faiss.read_index(str(path))
        except RuntimeError as e:
            raise ValueError(f"{path}: not a faiss index faiss can read ({faiss_error(e)})") from None


def on_device(index, device: str):
    """The index on `device` ("cpu", "cuda", "cuda:N"); on a GPU with fp16 storage, as Search-R1."""
    if device == "cpu":
        return index
    faiss = _faiss()
    if not hasattr(faiss, "StandardGpuResources"):
        raise ValueError(f"--index-device {device}: this faiss has no GPU support; pip install faiss-gpu "
                         "(or faiss-gpu-cu12) instead of faiss-cpu, or pass --index-device cpu")
    options = faiss.GpuClonerOptions()
    options.useFloat16 = True
    resources = faiss.StandardGpuResources()
    try:
        gpu_index = faiss.index_cpu_to_gpu(resources, int(device.partition(":")[2] or 0), index, options)
    except RuntimeError as e:
        raise ValueError(f"--index-device {device}: {faiss_error(e)}") from None
    gpu_index.resources = resources  # the GPU memory lives as long as the index
    return gpu_index


def set_search_params(index, params: str | None) -> None:
    """faiss's own search-time parameters, e.g. "efSearch=128" (HNSW) or "nprobe=32" (IVF)."""
    if params:
        faiss = _faiss()
        space = faiss.GpuParameterSpace() if "Gpu" in type(index).__name__ else faiss.ParameterSpace()
        try:
            space.set_index_parameters(index, params)
        except RuntimeError as e:
            raise ValueError(f"--faiss-params {params!r}: {faiss_error(e)}") from None


def sentence_transformers_settings(folder) -> dict:
    """{"pooling": "mean" | "cls" | None, "query_prefix": str | None, "passage_prefix": str | None}
    as the model folder declares them; None where it says nothing."""
    folder = Path(folder)

    def read(name):
        path = folder / name
        return json.loads(path.read_text()) if path.is_file() else {}

    pooling = None
    modules = read("modules.json") or []
    pooling_dir = next((m.get("path", "") for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling_dir is not None:
        modes = {k.removeprefix("pooling_mode_").removesuffix("_token").removesuffix("_tokens"): v
                 for k, v in read(f"{pooling_dir}/config.json").items() if k.startswith("pooling_mode_")}
        on = [m for m, v in modes.items() if v]
        pooling = on[0] if len(on) == 1 else ("+".join(on) or None)
    prompts = read("config_sentence_transformers.json").get("prompts") or {}
    return {"pooling": pooling, "query_prefix": prompts.get("query"),
            "passage_prefix": prompts.get("passage", prompts.get("document"))}
