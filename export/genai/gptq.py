"""Calibrated low-bit weights in onnxruntime's fast kernel path: GPTQ (Frantar, Ashkboos, Hoefler and Alistarh,
*GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers*, ICLR 2023) on every MatMul of
the genai graph, emitted as the same MatMulNBits nodes round-to-nearest emits.

Round-to-nearest rounds each weight alone. GPTQ rounds the input columns of a weight one after another and spreads
each column's rounding error over the columns not yet rounded, weighted by the inverse Gram matrix ``H = X^T X`` of
the MatMul's *own input* ``X``: the error it minimises is the layer's output error on real activations,
``||X W^T - X Q^T||``, not the weights'. ``H`` is measured by running the fp32 graph on calibration tokens with
every MatMul input exposed as an output, so the fused first stages (one MatMul over q/k/v's dense weights and first
factors), the low-rank second factors (whose input is the rank-r activation) and the LM head each get their own.

Speed is kept by construction: the result is a MatMulNBits node with blocks of 32 along K, an integer (uint8) zero
point per block and ``accuracy_level`` 4, which is what onnxruntime's int8-activation CPU kernel runs. (onnxruntime's
HQQ configuration reaches +0.2% on SmolLM2 with float zero points and no accuracy level, and decodes 15x slower: the
runtime falls back to dequantising every weight each call.) The grid of a block always contains 0 (an integer zero
point in [0, 2^bits - 1] places 0 on it), its range the block's min and max after GPTQ's updates.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from bdlora.models.runtime import DecoderShape, DecoderSignature, empty_past, session_options

BLOCK_SIZE = 32  # along K: one scale and zero point per 32 input weights (the MatMulNBits block)
ACCURACY_LEVEL = 4  # int8 activations inside the kernel: onnxruntime's fastest CPU path
PERCDAMP = 0.01  # GPTQ's damping: 1% of the mean diagonal of H added to it (the paper's default)
COLUMNS = 128  # columns rounded per lazy batch update (the paper's block; a multiple of BLOCK_SIZE)


# --------------------------------------------------------------------------------------------------------------------
# The algorithm (pure torch, float64)
# --------------------------------------------------------------------------------------------------------------------


def grid(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (scale, integer zero point) of an asymmetric ``bits`` grid over ``w`` (rows, cols) that holds the
    row's min and max and 0."""
    top = (1 << bits) - 1
    lo = torch.clamp(w.min(1).values, max=0.0)
    hi = torch.clamp(w.max(1).values, min=0.0)
    scale = (hi - lo) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale, codes at the zp
    zero = torch.clamp(torch.round(-lo / scale), 0, top)
    return scale, zero


def rtn(w: torch.Tensor, bits: int, block: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest on the same grid (the baseline): (codes (N, K), scales (N, K/block), zeros (N, K/block))."""
    n, k = w.shape
    codes = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, -(-k // block), dtype=torch.float64)
    zeros = torch.zeros_like(scales)
    for j, c in enumerate(range(0, k, block)):
        s, z = grid(w[:, c:c + block], bits)
        codes[:, c:c + block] = _round(w[:, c:c + block], s[:, None], z[:, None], bits).to(torch.uint8)
        scales[:, j], zeros[:, j] = s, z
    return codes, scales, zeros


def _round(w, scale, zero, bits):
    return torch.clamp(torch.round(w / scale) + zero, 0, (1 << bits) - 1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, block: int = BLOCK_SIZE):
    """(N, K) float64 weights of (codes, scales, zeros)."""
    s = scales.repeat_interleave(block, 1)[:, : codes.shape[1]]
    z = zeros.repeat_interleave(block, 1)[:, : codes.shape[1]]
    return (codes.double() - z) * s


def gptq(w: torch.Tensor, h: torch.Tensor, bits: int, block: int = BLOCK_SIZE, percdamp: float = PERCDAMP,
         columns: int = COLUMNS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ of ``w`` (N out, K in) against the input Gram matrix ``h`` (K, K): (codes, scales, zeros) as ``rtn``
    (``block`` must divide ``columns``).
    Each block's grid is taken from its columns as GPTQ has updated them when the block is reached (the paper's
    reference code takes it from the weights before the current batch's updates)."""
    h = h.detach().double().clone()
    n, k = w.shape
    dead = torch.diag(h) == 0  # an input that is always 0: its weights never matter
    h[dead, dead] = 1.0
    h.diagonal().add_(percdamp * torch.mean(torch.diag(h)))
    # the factorisation in float64, the column loop in float32 (as the paper's code: twice as fast here); each
    # (K, K) step dropped as the next is made: two float64 copies at once, not four (an 8B down projection's
    # K = 14,336 holds 1.6 GB a copy)
    h = torch.linalg.cholesky(h)
    h = torch.cholesky_inverse(h)
    hinv = torch.linalg.cholesky(h, upper=True).float()
    del h
    w = w.detach().float().clone()
    w[:, dead] = 0.0
    codes = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, -(-k // block), dtype=torch.float64)
    zeros = torch.zeros_like(scales)
    for c1 in range(0, k, columns):
        c2 = min(c1 + columns, k)
        w1, err = w[:, c1:c2].clone(), torch.zeros(n, c2 - c1, dtype=torch.float32)
        h1 = hinv[c1:c2, c1:c2]
        for i in range(c2 - c1):
            col = c1 + i
            if col % block == 0:
                s, z = grid(w1[:, i:i + block].double(), bits)
                scales[:, col // block], zeros[:, col // block] = s, z
                s, z = s.float(), z.float()
            q = _round(w1[:, i], s, z, bits)
            codes[:, col] = q.to(torch.uint8)
            e = (w1[:, i] - (q - z) * s) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err[:, i] = e
        w[:, c2:] -= err @ hinv[c1:c2, c2:]
    return codes, scales, zeros


def output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T)``: the summed squared output error over the calibration inputs."""
    d = (w.double() - w_hat.double())
    return float(torch.einsum("nk,kl,nl->", d, h.double(), d))


# --------------------------------------------------------------------------------------------------------------------
# MatMulNBits packing
# --------------------------------------------------------------------------------------------------------------------


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, block: int = BLOCK_SIZE):
    """MatMulNBits' layout: B (N, K/block, block * bits / 8) uint8, the low nibble first at 4 bits; scales
    (N * K/block,) float32; zero points (N * ceil(K/block * bits / 8),) uint8, packed the same way per row. K is
    padded with zero codes to whole blocks."""
    n, k = codes.shape
    kb = -(-k // block)
    c = torch.zeros(n, kb * block, dtype=torch.uint8)
    c[:, :k] = codes
    c = c.numpy().reshape(n, kb, block)
    z = zeros.numpy().astype(np.uint8)
    if bits == 8:
        packed, zp = c, z.reshape(-1)
    else:
        packed = (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
        zpad = np.zeros((n, kb + kb % 2), dtype=np.uint8)
        zpad[:, :kb] = z
        zp = (zpad[:, 0::2] | (zpad[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    return np.ascontiguousarray(packed), scales.numpy().astype(np.float32).reshape(-1), zp


def nbits_node(name: str, x: str, out: str, packed, scales, zp, k: int, n: int, bits: int,
               block: int = BLOCK_SIZE, accuracy_level: int = ACCURACY_LEVEL) \
        -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """A MatMulNBits node computing ``x @ dequant(B)^T`` with its three initializers."""
    inits = [numpy_helper.from_array(packed, f"{name}.qweight"), numpy_helper.from_array(scales, f"{name}.scales"),
             numpy_helper.from_array(zp, f"{name}.qzeros")]
    node = helper.make_node("MatMulNBits", [x, *(t.name for t in inits)], [out], name=name, domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy_level)
    return node, inits


# --------------------------------------------------------------------------------------------------------------------
# The graph: Gram matrices of every MatMul input, then each MatMul replaced
# --------------------------------------------------------------------------------------------------------------------


def weight_matmuls(proto: onnx.ModelProto) -> list[tuple[onnx.NodeProto, onnx.TensorProto]]:
    """(node, weight initializer) of every MatMul whose second input is a constant."""
    inits = {t.name: t for t in proto.graph.initializer}
    return [(n, inits[n.input[1]]) for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


def input_grams(proto: onnx.ModelProto, shape: DecoderShape, blocks, threads: int | None = None,
                on_block=None) -> dict[str, torch.Tensor]:
    """``X^T X`` (float64) of the input of every weight MatMul over ``blocks`` (packed calibration sequences, each
    run from an empty cache), by input name (fused MatMuls share one)."""
    names = sorted({n.input[0] for n, _ in weight_matmuls(proto)})
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    known = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_tensor_value_info(x, TensorProto.FLOAT, None) for x in names
                              if x not in known)
    opts = session_options(ort)
    if threads:
        opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in sess.get_inputs()]
    grams: dict[str, torch.Tensor] = {}
    for b in range(len(blocks)):
        x = blocks.get([b])
        t = x.shape[1]
        mask = np.ones((1, t), dtype=np.int64)
        values = [x, mask, *empty_past(shape, 1)]
        if DecoderSignature.POSITION_IDS in inputs:
            values.insert(2, np.arange(t, dtype=np.int64)[None])
        outs = sess.run(names, dict(zip(inputs, values)))
        for name, a in zip(names, outs):
            a = torch.from_numpy(a.reshape(-1, a.shape[-1])).double()
            grams[name] = grams.get(name, 0) + a.T @ a
        if on_block:
            on_block(b + 1, len(blocks))
    return grams
