"""Weight-only quantisation of the genai graph to MatMulNBits (onnxruntime's blockwise int4/int8 MatMul, what the
onnxruntime-genai builder emits for ``-p int4``): onnxruntime's own quantiser (round-to-nearest), or each weight
MatMul rounded here (``quantize_graph``: GPTQ, affine).

Choices (measured on SmolLM2-135M and the builtin student, see the README):
- block size 32 along K, ``accuracy_level`` 4 (activations quantised to int8 inside the kernel: the fastest CPU
  path);
- int4: every projection MatMul (dense weights and both low-rank factors) to 4 bits, the LM head to 8 bits by
  default (a 4-bit head is where greedy decoding of small models degenerates first; ``head_bits`` 4 measures it);
- int8: every MatMul to 8 bits;
- ``method`` "rtn": round-to-nearest on a symmetric grid by onnxruntime's own quantiser (what onnxruntime-genai's
  builder does); "gptq": GPTQ against each MatMul's measured input Gram matrix on an asymmetric grid with integer
  zero points (``gptq``), the same nodes and kernel; "affine": round-to-nearest on each block's own [min, max]
  with a float offset (llama.cpp's Q4_1 grid; 8-bit MatMuls symmetric, Q8_0's), the offset restored by a rank-K/32
  correction carried in the same fast node (``affine``).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from bdlora.base.schemes import DEFAULT_SCHEME, PRECISIONS, ROUNDED, mixed, scheme
from bdlora.export.decoder.builder import contiguous, node_bits
from bdlora.export.genai.affine import (
    AUGMENTED,
    affine_node,
    affine_rtn,
    affine_weights,
    augment_nodes,
    augmented_name,
    symmetric_rtn,
)
from bdlora.export.genai.gptq import (
    ACCURACY_LEVEL,
    BLOCK_SIZE,
    dequantize,
    gptq,
    nbits_node,
    output_error,
    pack,
    rtn,
    weight_matmuls,
)

LM_HEAD = "/lm_head/MatMul"
BITS = {name: PRECISIONS[name].bits for name in ROUNDED}  # the weight bits of each rounded precision


def quantize_nbits(model, precision: str, method: str = "rtn", grams: dict | None = None, head_bits: int = 8,
                   int8_share: float = 0.0, in_place: bool = False):
    """``model`` (an in-memory ``ModelProto``, weights inside) with its MatMuls as MatMulNBits; returns the new
    proto and a description of what was quantised. ``grams``: the input Gram matrix of every MatMul (``method``
    gptq; ``gptq.input_grams``). ``in_place``: ``model`` is the caller's to give away, and is rewritten instead of
    copied (a copy of the fp32 graph is the model's size again: 1.2B parameters hold 5 GB)."""
    if precision not in BITS:
        raise ValueError(f"precision {precision!r}: allowed {', '.join(BITS)}")
    head = head_bits if mixed(precision) else BITS[precision]
    s = scheme(method)
    # the MatMuls whose projections the folder keeps at 8 bits (``--forms bits``): at int4 only
    wide = [n.name for n in model.graph.node if n.op_type == "MatMul" and node_bits(n.doc_string) == 8] \
        if mixed(precision) else []
    docs = {n.name: n.doc_string for n in model.graph.node if n.op_type == "MatMul" and n.doc_string}
    if s.rounds_here:
        out, detail = quantize_graph(model, grams, lambda name: head if name == LM_HEAD else 8 if name in wide
                                     else BITS[precision], method=method,
                                     int8_share=int8_share if mixed(precision) else 0.0, in_place=in_place)
        keep_docs(docs, out)
        eight = [n for n, b in detail["bits"].items() if b == 8 and n != LM_HEAD]
        described = {**describe(out, BLOCK_SIZE), "method": method, "symmetric": s.symmetric, "int8_matmuls": eight,
                     "declared_int8_matmuls": len(wide), "relative_output_error": detail["relative_output_error"]}
        if s.calibrated:
            return out, {**described, "int8_share": int8_share}
        corrected = sum(n.op_type == "MatMulNBits" and n.input[0].endswith(AUGMENTED) for n in out.graph.node)
        return out, {**described, "offset_corrections": corrected}

    def run(proto, bits: int, include=None, exclude=None, copy: bool = False):
        if copy:  # the quantiser rewrites the proto it is given
            proto, given = onnx.ModelProto(), proto
            proto.CopyFrom(given)
        q = MatMulNBitsQuantizer(proto, bits=bits, block_size=BLOCK_SIZE, is_symmetric=True,
                                 accuracy_level=ACCURACY_LEVEL, nodes_to_include=include, nodes_to_exclude=exclude)
        q.process()
        return q.model.model

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantiser logs every node it visits at INFO on the root logger
    try:
        eights = ([LM_HEAD] if head == 8 else []) + wide
        if not mixed(precision) or not eights:
            out = run(model, BITS[precision], copy=not in_place)
        else:  # the first pass's output is ours: the second rewrites it
            out = run(run(model, 4, exclude=eights, copy=not in_place), 8, include=eights)
    finally:
        root.setLevel(level)
    keep_docs(docs, out)
    return out, {**describe(out, BLOCK_SIZE), "method": s.name, "symmetric": s.symmetric,
                 "declared_int8_matmuls": len(wide)}


def keep_docs(docs: dict[str, str], after: onnx.ModelProto) -> None:
    """Each quantised MatMul (``NAME_Q4``/``NAME_Q8``) keeps its source's doc string (``docs``, by node name): the
    projections it computes."""
    for n in after.graph.node:
        if n.op_type == "MatMulNBits" and not n.doc_string:
            n.doc_string = docs.get(n.name.rsplit("_Q", 1)[0], "")


def ort_rtn(b: np.ndarray, bits: int, columns: int):
    """onnxruntime's own blockwise symmetric round-to-nearest of ``b`` (K, N), the kernel its MatMulNBitsQuantizer
    calls with the arguments it passes (blocks of ``BLOCK_SIZE`` along K, K padded with zeros to whole blocks):
    yields (packed codes (cols, K/block, block * bits / 8) uint8, scales (cols, K/block)) for ``columns`` output
    columns at a time (each column's blocks are its own: slicing changes no code)."""
    k, n = b.shape
    kb = -(-k // BLOCK_SIZE)
    per = 8 // bits
    kernel = {4: quantize_matmul_4bits, 8: quantize_matmul_8bits}[bits]
    for c in range(0, n, columns):
        w = contiguous(np.asarray(b[:, c:c + columns], dtype=np.float32))
        cols = w.shape[1]
        if kb * BLOCK_SIZE != k:
            w = np.pad(w, ((0, kb * BLOCK_SIZE - k), (0, 0)))
        packed = np.zeros((cols, kb, BLOCK_SIZE // per), np.uint8)
        scales = np.zeros((cols, kb), np.float32)
        kernel(packed, w, scales, np.zeros((cols, -(-kb // per)), np.uint8), BLOCK_SIZE, cols, k, True)
        yield packed, scales


def torch_rtn(w: np.ndarray, bits: int, rows: int | None = None):
    """``ort_rtn``'s codes and scales, bit for bit, computed by torch from the weight as the model holds it, ``w``
    (N, K) = (out, in): yields (packed codes (r, K/block, block * bits / 8) uint8, scales (r, K/block)) for ``rows``
    output rows at a time (default: about 256k weights a slice, where this CPU's caches make it fastest: 270-320M
    weights/s on two cores against 1024 rows' 110-260M).

    The same float32 operations as onnxruntime's ``BlockwiseQuantizer`` (the kernel ``MatMulNBitsQuantizer``
    calls): per block of ``BLOCK_SIZE`` along K its min and max, ``m`` the one of larger magnitude (the min on a
    tie), scale = m / -2^(bits-1), code = clamp(roundf(v * (1 / scale) + 2^(bits-1))) with roundf's ties away from
    zero, a zero block's scale -0.0 and codes 2^(bits-1); past K (to whole blocks) code 0, and at an odd K the last
    4-bit pair's second code the zero point (the kernel leaves there whatever it reads past the weight's end;
    MatMulNBits never reads it). Tested equal to the kernel (``tests/test_streaming.py``). Why: the kernel runs on
    one core holding the GIL and wants (K, N) in C order, so every weight was transposed first (2.3 s of a 1B
    export); here no transpose, every core, about twice the kernel's rate. A slice holding a NaN or an infinity
    goes to the kernel itself (its comparisons skip a NaN where torch's min and max keep it)."""
    w = np.asarray(w)
    w = torch.from_numpy(w if w.flags.writeable else w.copy())  # torch warns on a read-only array
    n, k = w.shape
    kb, mid = -(-k // BLOCK_SIZE), float(1 << (bits - 1))
    rows = rows or max(1, (1 << 18) // max(k, 1))
    for r in range(0, n, rows):
        x = w[r:r + rows].to(torch.float32)
        if kb * BLOCK_SIZE != k:
            x = torch.nn.functional.pad(x, (0, kb * BLOCK_SIZE - k))
        x = x.reshape(x.shape[0], kb, BLOCK_SIZE)
        lo, hi = x.amin(-1), x.amax(-1)  # both keep a NaN, and an infinity shows in one
        if not bool(torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            yield from ort_rtn(np.asarray(w[r:r + rows], dtype=np.float32).T, bits, rows)
            continue
        scale = torch.where(hi.abs() > lo.abs(), hi, lo) / -mid
        v = x * torch.where(scale != 0, 1.0 / scale, 0.0)[..., None]
        v.add_(mid)
        q = torch.round(v)  # ties to even; roundf takes them away from zero (v >= 0 here up to rounding)
        tie = (v - q) == 0.5
        if bool(tie.any()):
            q[tie] += 1
        q = q.clamp_(0, 2 * mid - 1).to(torch.uint8)
        if kb * BLOCK_SIZE != k:  # the kernel writes no code past K (0), but a 4-bit pair's second is its zero point
            flat = q.view(q.shape[0], kb * BLOCK_SIZE)
            flat[:, k:] = 0
            if bits == 4 and k % 2:
                flat[:, k] = int(mid)
        if bits == 4:
            q = q.view(q.shape[0], kb, BLOCK_SIZE // 2, 2)
            q = q[..., 0] | (q[..., 1] << 4)
        yield q.numpy(), scale.numpy()


def rtn_rounded(weight: np.ndarray, bits: int) -> np.ndarray:
    """``weight`` (out, in) as the default export (``method`` "rtn") holds it at ``bits`` (4 or 8): ``ort_rtn``'s
    codes, zero point 2^(bits-1), dequantised; what ``--forms bits`` measures each projection's rounding error
    with."""
    w = np.asarray(weight, dtype=np.float32)
    n, k = w.shape
    kb = -(-k // BLOCK_SIZE)
    if n == 0:
        return np.zeros((0, k), np.float32)
    ((packed, scales),) = ort_rtn(w.T, bits, n)
    codes = np.stack([packed & 15, packed >> 4], -1) if bits == 4 else packed
    q = codes.reshape(n, kb, BLOCK_SIZE).astype(np.float32) - (1 << (bits - 1))
    return (q * scales[:, :, None]).reshape(n, kb * BLOCK_SIZE)[:, :k]


def scheme_rounded(weight: np.ndarray, bits: int, method: str = DEFAULT_SCHEME) -> np.ndarray:
    """``weight`` (out, in) rounded to ``bits`` as ``method`` rounds it without calibration: the default's
    onnxruntime kernel (``rtn_rounded``); the affine grid with its offsets (as ``affine_node`` computes, Q8_0 at 8
    bits); a calibrated scheme on its own grid with no input to weigh by (GPTQ with an identity Gram matrix is
    round-to-nearest on its asymmetric grid), which over-states the error it will have after calibration."""
    s = scheme(method)
    if not s.rounds_here:
        return rtn_rounded(weight, bits)
    w = torch.from_numpy(np.asarray(weight, dtype=np.float64))
    if s.block_offsets and bits == 4 and w.shape[1] % BLOCK_SIZE == 0:
        return affine_weights(*affine_rtn(w, bits), bits).numpy()
    codes, scales, zeros = symmetric_rtn(w, bits) if s.block_offsets else rtn(w, bits)
    return dequantize(codes, scales, zeros).numpy()


GPTQ_ROWS = 4096  # output rows GPTQ rounds at once: its rows are independent (one H), so a 128k-vocabulary head
# costs slices of 4,096 x K in float64 instead of four copies of the whole (17 GB at 8B)


def _gptq_matmul(b: np.ndarray, h: torch.Tensor, bits: int, name: str, x: str, y: str):
    """``_round_matmul`` of GPTQ on the integer grid: ``b`` (K, N) rounded ``GPTQ_ROWS`` output rows at a time
    against ``h`` (the codes are those of one call over every row)."""
    k, n = b.shape
    parts, error, energy = [], 0.0, 0.0
    for r in range(0, n, GPTQ_ROWS):
        w = torch.from_numpy(np.ascontiguousarray(b[:, r : r + GPTQ_ROWS].T, dtype=np.float64))
        codes, scales, zeros = gptq(w, h, bits)
        parts.append((codes, scales, zeros))
        error += output_error(w, dequantize(codes, scales, zeros), h)
        energy += float(torch.einsum("nk,kl,nl->", w, h, w))
    codes, scales, zeros = (torch.cat([p[i] for p in parts]) for i in range(3))
    node, inits = nbits_node(name, x, y, *pack(codes, scales, zeros, bits), k=k, n=n, bits=bits)
    return ([node], inits), error / max(energy, 1e-30)


def describe(out, block: int) -> dict:
    nodes = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    # each replaced node is renamed (``/lm_head/MatMul`` -> ``/lm_head/MatMul_Q8``)
    bits = {n.name.rsplit("_Q", 1)[0]: next(a.i for a in n.attribute if a.name == "bits") for n in nodes}
    return {"op": "MatMulNBits", "block_size": block, "accuracy_level": ACCURACY_LEVEL,
            "matmuls_quantized": len(nodes), "matmuls_fp32": sum(n.op_type == "MatMul" for n in out.graph.node),
            "lm_head_bits": bits.get(LM_HEAD, 32)}


def quantize_graph(proto: onnx.ModelProto, grams: dict[str, torch.Tensor], bits_of, method: str = "gptq",
                   int8_share: float = 0.0, on_matmul=None, in_place: bool = False) -> tuple[onnx.ModelProto, dict]:
    """``proto`` with every weight MatMul whose ``bits_of(node name)`` is 4 or 8 replaced by MatMulNBits at that
    width (``None`` keeps it fp32), rounded by ``method``: "gptq" or "rtn" on the same grid, or "affine" (``affine``:
    a float offset per block at 4 bits, kept by a correction; ``grams`` may then be None and the errors are the
    weights' own). ``int8_share``: of the
    4-bit MatMuls, those whose rounding hurts most (relative output error per weight on the calibration inputs) go to
    8 bits until they hold this share of the 4-bit weights. Returns the new proto (``in_place``: ``proto`` itself,
    rewritten) and, per MatMul, its bits and the output error of its rounding relative to the output's energy."""
    out = proto
    if not in_place:
        out = onnx.ModelProto()
        out.CopyFrom(proto)
    g = out.graph
    errors, replaced, drop = {}, {}, set()
    todo = [(n, w) for n, w in weight_matmuls(out) if bits_of(n.name) in (4, 8)]
    bits = {n.name: bits_of(n.name) for n, _ in todo}
    for i, (node, w_init) in enumerate(todo):
        replaced[node.name], errors[node.name] = _round_matmul(node, w_init, grams, bits[node.name], method)
        drop.add(w_init.name)
        if on_matmul:
            on_matmul(i + 1, len(todo))
    size = {n.name: int(np.prod(w.dims)) for n, w in todo}
    fours = [n for n, _ in todo if bits[n.name] == 4]
    budget = int8_share * sum(size[n.name] for n in fours)
    for node in sorted(fours, key=lambda n: -errors[n.name] / size[n.name]):  # the most hurt per weight first
        if size[node.name] > budget:
            continue
        budget -= size[node.name]
        bits[node.name] = 8
        w_init = next(w for n, w in todo if n is node)
        replaced[node.name], errors[node.name] = _round_matmul(node, w_init, grams, 8, method)
    nodes, augmented = [], set()
    for node in g.node:
        if node.name not in replaced:
            nodes.append(node)
            continue
        new, inits = replaced[node.name]
        x = node.input[0]
        if any(augmented_name(x) in n.input for n in new) and x not in augmented:
            augmented.add(x)  # [x, block means of x], once, before the first MatMul whose offsets read them
            nodes.extend(augment_nodes(x, int(next(w for n, w in todo if n is node).dims[0]))[1])
        nodes.extend(new)
        g.initializer.extend(inits)
    del g.node[:]
    g.node.extend(nodes)
    still_used = {i for n in g.node for i in n.input}
    keep = [t for t in g.initializer if t.name not in drop or t.name in still_used]
    del g.initializer[:]
    g.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return out, {"method": method, "relative_output_error": errors, "bits": bits}


def _round_matmul(node, w_init, grams, bits: int, method: str):
    """(the MatMulNBits node and its initializers, relative output error) of one MatMul at ``bits``."""
    h = grams[node.input[0]] if grams else None
    name, x, y = node.name + f"_Q{bits}", node.input[0], node.output[0]
    s = scheme(method)
    if s.calibrated:
        return _gptq_matmul(numpy_helper.to_array(w_init), h, bits, name, x, y)
    b = torch.from_numpy(numpy_helper.to_array(w_init).astype(np.float64))  # (K, N): y = x @ B
    w = b.T.contiguous()
    k, n = b.shape
    if s.block_offsets and bits == 4 and k % BLOCK_SIZE == 0:
        codes, scales, zeros = affine_rtn(w, bits)
        new = affine_node(name, x, y, codes, scales, zeros, k=k, n=n, bits=bits)
        w_hat = affine_weights(codes, scales, zeros, bits)
    else:  # block offsets at 8 bits: Q8_0's symmetric grid; where blocks do not divide K: the integer grid
        codes, scales, zeros = symmetric_rtn(w, bits) if s.block_offsets and bits == 8 else rtn(w, bits)
        node_, inits = nbits_node(name, x, y, *pack(codes, scales, zeros, bits), k=k, n=n, bits=bits)
        new, w_hat = ([node_], inits), dequantize(codes, scales, zeros)
    if h is None:  # no calibration: the weights' own relative error
        return new, float(((w - w_hat) ** 2).sum() / max(float((w ** 2).sum()), 1e-30))
    energy = float(torch.einsum("nk,kl,nl->", w, h, w))
    return new, output_error(w, w_hat, h) / max(energy, 1e-30)
