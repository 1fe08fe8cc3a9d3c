"""A GGUF file written one tensor at a time (``bdlora export gguf``): every tensor's name, shape and type is known
from the plan (``layout``), so the header, the keys and the tensor table go first and each tensor follows, read from
the folder's weight files in row chunks of at most ``CHUNK_BYTES`` of fp32, rounded and appended (an 8B model's
embedding is never whole in fp32; the peak is one chunk and its rounding).

Types follow llama.cpp's converter (``--outtype f16|q8_0``): 1-D tensors, norms and rotary factors stay F32, every
other weight takes the file's type, and a row length its blocks do not divide falls back to F16. ``q4_0`` is rounded
by the ``gguf`` package too (numpy, Q4_0's grid bit for bit), with the output head, and the embedding when it serves
as the head, at Q8_0: llama.cpp's quantizer keeps the head at 6 bits (Q6_K), a type numpy cannot write, and the head
is where small models lose most. ``q4_k_m`` is written at F16 and rounded by llama.cpp's own quantizer
(``quantize.py``, the ``[llamacpp]`` extra), as a user's ``llama-quantize`` would.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from bdlora.base.errors import ModelError
from bdlora.base.reporter import SILENT, Reporter
from bdlora.export.gguf.layout import CHUNK_BYTES, GgufLayout, Planned, rope_parameters
from bdlora.models.families import GGUF_ROPE_PAIRS, family
from bdlora.models.integrity import check_safetensors, tensor_files

FILE_TYPE = {"f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0", "q4_k_m": "MOSTLY_Q4_K_M"}
HEAD_NAMES = ("output.weight",)


def qtype_of(p: Planned, quant: str, tied: bool):
    """The GGML type ``p`` is stored in within a ``quant`` file (the module docstring's rules)."""
    import gguf

    T = gguf.GGMLQuantizationType
    if len(p.shape) == 1 or p.name.endswith("_norm.weight") or p.value or not p.name.endswith(".weight"):
        return T.F32
    want = {"f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k_m": T.F16}[quant]
    if quant == "q4_0" and (p.name in HEAD_NAMES or (tied and p.name == "token_embd.weight")):
        want = T.Q8_0
    block = gguf.GGML_QUANT_SIZES[want][0]
    return want if p.shape[-1] % block == 0 else T.F16


def nbytes(shape: tuple[int, ...], qtype) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


class FolderTensors:
    """Rows of the folder's tensors as fp32 numpy arrays (as its index maps them), each checked finite."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.where = tensor_files(self.folder, check_safetensors)

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        with safe_open(str(self.where[name]), framework="pt") as f:
            part = f.get_slice(name)
            t = part[start:stop] if stop is not None or start else part[:]
        t = t.to(torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise ModelError(f"{self.folder}: weight tensor {name} holds NaN or infinity; the folder is damaged or "
                             "its training diverged")
        return t.numpy()


def permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's query/key rows (each head's first half of the rotary dimensions, then its second) in llama.cpp's order
    for a ``GGUF_ROPE_PAIRS`` architecture (consecutive pairs): the converter's ``LlamaModel.permute``."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def chunks(src: FolderTensors, p: Planned):
    """The fp32 values of planned tensor ``p``, in row chunks of at most ``CHUNK_BYTES``."""
    if p.value:
        yield np.asarray(p.value, dtype=np.float32)
        return
    rows = p.shape[0]
    second = src.rows(p.source[1]) if len(p.source) == 2 else None  # a low-rank pair's first factor (r, d_in)
    if len(p.shape) == 1 or p.permute:  # a vector, or rows permuted across a head: whole (at most one projection)
        w = src.rows(p.source[0])
        if second is not None:
            w = (torch.from_numpy(w) @ torch.from_numpy(second)).numpy()
        if p.permute:
            w = permuted(w, p.permute)
        yield (w + np.float32(p.shift)) if p.shift else w
        return
    step = max(1, CHUNK_BYTES // (4 * math.prod(p.shape[1:])))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        w = src.rows(p.source[0], a, b)
        if second is not None:  # proj_out rows (b - a, r) @ proj_in (r, d_in): the merged weight's rows
            w = (torch.from_numpy(w) @ torch.from_numpy(second)).numpy()
        yield (w + np.float32(p.shift)) if p.shift else w


def rounded(chunk: np.ndarray, qtype) -> np.ndarray:
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(chunk, dtype=np.float32)
    return gguf.quants.quantize(np.ascontiguousarray(chunk, dtype=np.float32), qtype)


def hyperparameters(writer, layout: GgufLayout, quant: str) -> None:
    """The architecture's keys, as llama.cpp's converter writes them for the family (deci: per-layer arrays)."""
    import gguf

    cfg = layout.config
    n = len(layout.layers)
    writer.add_block_count(n)
    writer.add_context_length(int(cfg.get("max_position_embeddings") or 4096))
    writer.add_embedding_length(int(cfg["hidden_size"]))
    if layout.per_layer:
        writer.add_feed_forward_length([s.ffn for s in layout.layers])
        writer.add_head_count([s.heads for s in layout.layers])
        writer.add_head_count_kv([s.kv_heads for s in layout.layers])
    else:
        writer.add_feed_forward_length(layout.layers[0].ffn)
        writer.add_head_count(layout.layers[0].heads)
        writer.add_head_count_kv(layout.layers[0].kv_heads)
    rp = rope_parameters(cfg)
    kind = str(rp.get("rope_type", rp.get("type", "default"))).lower()
    if kind == "linear" and rp.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rp["factor"]))
    elif kind not in ("default", "llama3"):
        raise ModelError(f"rope_type {kind!r}: not a rotary llama.cpp reads from this export (default, linear, "
                         "llama3)")
    if rp.get("rope_theta") is not None:
        writer.add_rope_freq_base(float(rp["rope_theta"]))
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") if isinstance(
        cfg.get("rope_parameters"), dict) else None
    if isinstance(local, dict) and local.get("rope_theta") is not None:
        writer.add_rope_freq_base_swa(float(local["rope_theta"]))
    elif cfg.get("rope_local_base_freq") is not None:
        writer.add_rope_freq_base_swa(float(cfg["rope_local_base_freq"]))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps") or 1e-6))
    if cfg.get("head_dim") is not None or layout.per_layer:  # deci: the head size is not hidden / heads of layer 0
        writer.add_key_length(layout.head_dim)
        writer.add_value_length(layout.head_dim)
    if layout.arch in GGUF_ROPE_PAIRS:
        writer.add_vocab_size(int(cfg["vocab_size"]))
        writer.add_rope_dimension_count(layout.head_dim)
    if layout.arch == family(layout.family).gguf_arch and family(layout.family).anatomy.per_layer_attention:
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
        if cfg.get("sliding_window_pattern") != 1 and cfg.get("sliding_window"):
            writer.add_sliding_window(int(cfg["sliding_window"]))
            kinds = cfg.get("layer_types")
            if isinstance(kinds, list) and len(kinds) == len(layout.layers):  # which layers slide, as the model says
                writer.add_sliding_window_pattern([k == "sliding_attention" for k in kinds])  # (llama.cpp: 5 in 6)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPE[quant]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _begin(path: Path, layout: GgufLayout, plan: list[Planned], quant: str, name: str, add_vocab):
    """(writer, {tensor: type}, the vocabulary's summary): the header, keys and tensor table of ``plan`` written to
    ``path``; the tensors' bytes follow."""
    import gguf

    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer prints every file's plan at INFO
    writer = gguf.GGUFWriter(None, layout.arch)
    writer.add_name(name)
    hyperparameters(writer, layout, quant)
    vocab = add_vocab(writer)
    types = {}
    for p in plan:
        qt = qtype_of(p, quant, layout.tied)
        types[p.name] = qt
        if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if qt == gguf.GGMLQuantizationType.F32 else np.float16
            writer.add_tensor_info(p.name, p.shape, np.dtype(dtype), nbytes(p.shape, qt))
        else:
            writer.add_tensor_info(p.name, gguf.quant_shape_to_byte_shape(p.shape, qt), np.dtype(np.uint8),
                                   nbytes(p.shape, qt), raw_dtype=qt)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer, types, vocab


def _summary(path: Path, plan: list[Planned], types: dict, vocab: dict) -> dict:
    counts: dict[str, int] = {}
    for qt in types.values():
        counts[qt.name] = counts.get(qt.name, 0) + 1
    return {"tensors": len(plan), "types": counts, "bytes": path.stat().st_size, "vocab": vocab}


def write_gguf(path: Path, folder: Path, layout: GgufLayout, plan: list[Planned], quant: str, name: str,
               add_vocab, reporter: Reporter = SILENT) -> dict:
    """``plan`` of ``folder`` written to ``path`` as a ``quant`` GGUF (``add_vocab(writer)`` adds the tokenizer's
    keys); returns {tensor: type} counts and the bytes written."""
    writer, types, vocab = _begin(path, layout, plan, quant, name, add_vocab)
    src = FolderTensors(folder)
    reporter.count(0, len(plan), "tensors")
    for p in plan:
        _write_tensor(writer, (rounded(c, types[p.name]) for c in chunks(src, p)))
        reporter.count(1, len(plan), "tensors")
    writer.close()
    return _summary(path, plan, types, vocab)


def write_zero_gguf(path: Path, layout: GgufLayout, plan: list[Planned], quant: str, name: str, add_vocab) -> dict:
    """``plan`` written to ``path`` as a ``quant`` GGUF whose weights are all zero, as a sparse file (nothing of a
    projection is written: the file's holes read as zeros, which every GGML type decodes to zero, its block scales
    being zero): a stand-in of a model's shapes for timing llama.cpp's kernels, whose speed does not depend on the
    values (``bench.llamacpp_step``). Vectors (norms) are ones and computed tensors (rotary factors) their values, so
    nothing divides by zero."""
    import gguf

    writer, types, vocab = _begin(path, layout, plan, quant, name, add_vocab)
    fout = writer.fout[0]
    for p in plan:
        if p.value or len(p.shape) == 1:
            _write_tensor(writer, [np.asarray(p.value, np.float32) if p.value else np.ones(p.shape, np.float32)])
            continue
        info = writer.tensors[0].pop(p.name)
        writer.write_padding(fout, fout.tell())
        fout.seek(info.nbytes, 1)  # a hole of zeros
        writer.write_padding(fout, info.nbytes)
        writer.state = gguf.gguf_writer.WriterState.WEIGHTS
    fout.truncate(fout.tell())  # the last hole, if the file ends in one
    writer.close()
    return _summary(path, plan, types, vocab)


def _write_tensor(writer, parts) -> None:
    """The next tensor of ``writer``'s table from its rounded row chunks (``GGUFWriter.write_tensor_data`` for a
    tensor that is never whole in memory: padding, the bytes, padding)."""
    from gguf.gguf_writer import WriterState

    fout = writer.fout[0]
    name = next(iter(writer.tensors[0]))
    info = writer.tensors[0].pop(name)
    writer.write_padding(fout, fout.tell())
    written = 0
    for part in parts:
        part.tofile(fout)
        written += part.nbytes
    if written != info.nbytes:
        raise AssertionError(f"{name}: wrote {written} bytes, its table entry says {info.nbytes}")
    writer.write_padding(fout, written)
    writer.state = WriterState.WEIGHTS
