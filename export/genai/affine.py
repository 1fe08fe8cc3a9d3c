"""int4 on an affine grid (a float offset per block) in onnxruntime's fast kernel path.

The grid of llama.cpp's Q4_1 (and of HQQ): each block of 32 input weights gets a float scale ``s = (max - min) / 15``
and a float offset (its min), so ``w = s q + min`` with codes ``q`` in 0..15. A symmetric or integer-zero-point grid
(round-to-nearest, GPTQ) must put 0 on the grid, which a float offset does not: on weights that already lie on a Q4_1
grid (SmolLM2's GGUF) only a float offset gives them back exactly; anything else rounds them a second time (+19-27%
perplexity on SmolLM2). onnxruntime's MatMulNBits takes float zero points, but then falls back to dequantising every
weight on every call (704 against 21.6 us for a 576 x 1536 int4 MatMul at batch 1 on this machine).

So the node keeps an integer zero point ``z = round(z_f)`` (``z_f = -min / s``) and the fast kernel, and the rest of
the offset is added back as a correction of rank K/32: for block b of row n,

    sum_k x_k s (q_k - z_f) = sum_k x_k s (q_k - z) + s (z - z_f) * sum_{k in b} x_k

so ``y = x W_int^T + blocksum(x) O^T`` with ``O[n, b] = s[n, b] (z[n, b] - z_f[n, b])`` (at most half a step
where the block holds 0). Both terms are one MatMulNBits node: its input is ``[x, blockmean(x)]`` (an AveragePool
and a Concat, made once per distinct input and shared by the MatMuls that read it) and its weights
``[W_int, 32 O]``, the offsets rounded to 4 bits in blocks of their own: K/32 more columns (3% more weights). What
it costs is a fixed time per MatMul (the two small nodes in front, and a slower MatMulNBits) that matters on a small
model (see docs/commands.md). Blocks must divide K: a MatMul whose K they do not (a low-rank second factor of odd
rank) keeps the integer grid of round-to-nearest.

8-bit MatMuls take the symmetric grid ``s = max |w| / 127`` with zero point 128: llama.cpp's Q8_0 (SmolLM2's
embedding, which is its LM head), exact on such weights, and at 8 bits the offset is worth nothing measurable.
"""

from __future__ import annotations

import onnx
import torch
from onnx import helper

from bdlora.export.genai.gptq import ACCURACY_LEVEL, BLOCK_SIZE, dequantize, nbits_node, pack, rtn


def affine_rtn(w: torch.Tensor, bits: int, block: int = BLOCK_SIZE) \
        -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of ``w`` (N, K) on each block's own [min, max] with ``2^bits`` levels: (codes (N, K) uint8,
    scales (N, K/block) float64, float zero points ``z_f = -min / scale`` (N, K/block) float64), so that
    ``w ~ (codes - z_f) * scale``. A constant block gets scale 1 and its value as the offset."""
    n, k = w.shape
    kb = -(-k // block)
    padded = torch.empty(n, kb * block, dtype=torch.float64)
    padded[:, :k] = w.double()
    if kb * block > k:  # the padding repeats the last weight, so it widens no block's range
        padded[:, k:] = w[:, -1:].double()
    b = padded.view(n, kb, block)
    lo, hi = b.min(-1).values, b.max(-1).values
    top = (1 << bits) - 1
    scale = (hi - lo) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round((b - lo[..., None]) / scale[..., None]), 0, top)
    return codes.view(n, -1)[:, :k].to(torch.uint8), scale, -lo / scale


def symmetric_rtn(w: torch.Tensor, bits: int, block: int = BLOCK_SIZE) \
        -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest on the symmetric grid ``scale = max |w| / (2^(bits-1) - 1)`` with the integer zero point
    ``2^(bits-1)`` (Q8_0 at 8 bits): (codes, scales, zeros) as ``affine_rtn``."""
    n, k = w.shape
    kb = -(-k // block)
    padded = torch.zeros(n, kb * block, dtype=torch.float64)
    padded[:, :k] = w.double()
    b = padded.view(n, kb, block)
    half = 1 << (bits - 1)
    scale = b.abs().max(-1).values / (half - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round(b / scale[..., None]) + half, 0, (1 << bits) - 1)
    return codes.view(n, -1)[:, :k].to(torch.uint8), scale, torch.full_like(scale, float(half))


def split_offset(scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer zero points the kernel takes, the correction ``O`` (N, K/block) that restores the float ones)."""
    z = torch.clamp(torch.round(zeros), 0, (1 << bits) - 1)
    return z, scales * (z - zeros)


def affine_weights(codes, scales, zeros, bits: int, block: int = BLOCK_SIZE) -> torch.Tensor:
    """(N, K) float64: the weights ``affine_node`` computes with, its rounded offsets included."""
    z, offset = split_offset(scales, zeros, bits)
    o_codes, o_scales, o_zeros = rtn(offset * block, bits)
    rounded = dequantize(o_codes, o_scales, o_zeros, block) / block
    return dequantize(codes, scales, z, block) + rounded.repeat_interleave(block, 1)[:, : codes.shape[1]]


AUGMENTED = "/with_blockmeans"


def augmented_name(x: str) -> str:
    """The name of ``[x, blockmean(x)]`` in the graph (one per distinct MatMul input, shared by its MatMuls)."""
    return x + AUGMENTED


def augment_nodes(x: str, k: int, block: int = BLOCK_SIZE) -> tuple[str, list]:
    """(output name, nodes) of ``[x, blockmean(x)]`` (..., K) -> (..., K + K/block): an AveragePool over the last
    axis (kernel and stride ``block``; x is (batch, seq, K), which pooling reads as (N, C, length)) and a Concat: one
    node fewer than a Reshape and a ReduceSum, though on SmolLM2's decode no faster (docs/commands.md)."""
    if k % block:
        raise ValueError(f"K {k}: block means need whole blocks of {block}")
    means = f"{x}/blockmeans"
    nodes = [helper.make_node("AveragePool", [x], [means], name=f"{means}/AveragePool", kernel_shape=[block],
                              strides=[block]),
             helper.make_node("Concat", [x, means], [augmented_name(x)], name=f"{means}/Concat", axis=-1)]
    return augmented_name(x), nodes


def affine_node(name: str, x: str, out: str, codes, scales, zeros, k: int, n: int, bits: int,
                accuracy_level: int = ACCURACY_LEVEL) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """One MatMulNBits node at integer zero points that also carries the offsets: where the float offsets differ
    from the integer ones, it reads ``[x, blockmean(x)]`` (``augmented_name(x)``, made by ``augment_nodes``;
    ``block`` must divide K) and its weights are ``[W_int, block * O]``, the offsets rounded to ``bits`` in blocks
    of their own (under 1/30 of a row's offset range: the offsets are at most half a step each)."""
    z, offset = split_offset(scales, zeros, bits)
    if not bool(offset.abs().max() > 0):
        node, inits = nbits_node(name, x, out, *pack(codes, scales, z, bits), k=k, n=n, bits=bits,
                                 accuracy_level=accuracy_level)
        return [node], inits
    if k % BLOCK_SIZE:
        raise ValueError(f"K {k}: offsets need whole blocks of {BLOCK_SIZE}")
    o_codes, o_scales, o_zeros = rtn(offset * BLOCK_SIZE, bits)  # the input carries means: sum = block * mean
    node, inits = nbits_node(name, augmented_name(x), out, *pack(torch.cat([codes, o_codes], 1),
                                                                 torch.cat([scales, o_scales], 1),
                                                                 torch.cat([z, o_zeros], 1), bits),
                             k=k + offset.shape[1], n=n, bits=bits, accuracy_level=accuracy_level)
    return [node], inits
