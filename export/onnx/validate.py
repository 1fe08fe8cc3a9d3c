"""Validation of an exported graph, one harness for both folders: parity with PyTorch (optimum-onnx's pattern: an
explicit tolerance, a typed error), and a quantised graph's held-out perplexity against its fp32 graph's."""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn as nn
from transformers import DynamicCache

from bdlora.base.errors import BdloraError
from bdlora.export.onnx.signature import example_inputs
from bdlora.models.kv_cache import cache_argument, returned_cache
from bdlora.models.runtime import DecoderShape, run_decoder, score_blocks

TOLERANCE = 1e-4  # max |ONNX - torch| on logits and present key/values, fp32
# ... unless PyTorch's own fp32 forward is further than TOLERANCE / NOISE_FACTOR from its float64 forward: deep
# models with massive activations (SmolLM2-135M's residual stream reaches 17,000, where an fp32 ulp is 0.002) then
# differ from any other fp32 implementation by more than 1e-4 through rounding alone, and the bound becomes
# NOISE_FACTOR x that measured rounding error. The factor is wide because that error is itself a noisy estimate:
# on SmolLM2 (30 layers) PyTorch's largest fp32-vs-fp64 difference over the validation shapes was 0.00133 at two
# threads and 0.000295 at one, while onnxruntime's difference from PyTorch stayed at 0.0021-0.0023 (7.7x the
# one-thread figure: its GEMM blocking and softmax differ from PyTorch's). A wrong graph is off by orders of
# magnitude more (a missing low-rank path or a swapped K/V moves logits by 0.1-10).
NOISE_FACTOR = 16.0
VALIDATION_SHAPES = ((1, 1, 0), (2, 6, 0), (2, 1, 5), (3, 4, 3))  # (batch, seq, past); rows 0 are left padded


class ExportValidationError(BdloraError):
    """The exported graph disagrees with PyTorch beyond the tolerance."""


def _attention(model: nn.Module, impl: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # an older transformers reads the choice from the config
        model.config._attn_implementation = impl


@contextmanager
def in_float64(model: nn.Module):
    """``model`` itself in float64 inside the block and in its own dtypes again after (exact both ways: every float32
    is a float64): the forward PyTorch's own fp32 rounding error is measured against, without a float64 twin beside
    the model (the two parity layers of a 3B model: a 1.6 GB twin, the export's peak). Eager attention runs as SDPA
    inside: in float64 it turns a fully masked (left-padding) query row into NaN, and the NaN reaches the row's real
    positions through the next layer's zero-weighted padding values; SDPA keeps them finite."""
    params = [(p, p.dtype) for p in model.parameters()]  # the same Parameter objects after ``double``
    buffers = {n: b.dtype for n, b in model.named_buffers()}  # buffers are replaced: kept by name
    eager = getattr(model.config, "_attn_implementation", None) == "eager"
    model.double()
    if eager:
        _attention(model, "sdpa")
    try:
        yield model
    finally:
        for p, dtype in params:
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
        for name, b in list(model.named_buffers()):
            if buffers.get(name, b.dtype) != b.dtype:
                owner, _, attr = name.rpartition(".")
                model.get_submodule(owner)._buffers[attr] = b.to(buffers[name])
        if eager:
            _attention(model, "eager")


@torch.no_grad()
def validate(model: nn.Module, sess, shapes=VALIDATION_SHAPES, tolerance: float = TOLERANCE,
             left_pad: bool = True) -> dict:
    """Compare ONNX Runtime with the model's own forward (native 2D-mask path) at several (batch, seq, past),
    the first row left padded (unless ``left_pad`` is False); logits are compared on real (non-padding) positions,
    present K/V everywhere. The bound is ``tolerance``, or ``NOISE_FACTOR`` x PyTorch's own fp32 rounding error (its
    distance from the model's float64 forward, ``in_float64``) when that is larger."""

    cases = []
    for b, s, p in shapes:
        pad = min(2, p + s - 1) if b > 1 and left_pad else 0
        ids, mask, pos, pasts = example_inputs(model.config, b, s, p, pad_first=pad, seed=b * 100 + s * 10 + p)
        ref = torch_forward(model, ids, mask, pos, pasts)
        got = run_decoder(sess, ids.numpy(), mask.numpy(), pos.numpy(), [t.numpy() for t in pasts])
        cases.append(((b, s, p, pad), (ids, mask, pos, pasts), ref, got))
    with in_float64(model):
        refs64 = [torch_forward(model, ids, mask, pos, [t.double() for t in pasts])
                  for _, (ids, mask, pos, pasts), _, _ in cases]
    results = []
    worst, noise = 0.0, 0.0
    for ((b, s, p, pad), inputs, ref, got), ref64 in zip(cases, refs64):
        mask = inputs[1]
        real = mask[:, -s:].bool().numpy()  # (B, seq) query positions that are real tokens
        if not all(np.isfinite(a[0][real]).all() for a in (got, ref, ref64)):  # NaN compares False: it "passed"
            raise ExportValidationError("the outputs are not finite (PyTorch's or the graph's logits hold NaN or "
                                        "inf): a weight or a config value of the model is corrupt; nothing was "
                                        "exported")
        kv_real = mask.bool().numpy()  # (B, past + seq) cache positions that hold real tokens
        d_logits = max_abs_diff(got[0][real], ref[0][real])
        d_kv = max(max_abs_diff(_at(g, kv_real), _at(r, kv_real)) for g, r in zip(got[1:], ref[1:]))
        n = max(max_abs_diff(ref[0][real], ref64[0][real]),
                max(max_abs_diff(_at(r, kv_real), _at(r64, kv_real)) for r, r64 in zip(ref[1:], ref64[1:])))
        worst, noise = max(worst, d_logits, d_kv), max(noise, n)
        results.append({"batch": b, "seq": s, "past": p, "left_pad": pad, "max_abs_diff_logits": d_logits,
                        "max_abs_diff_present": d_kv, "torch_fp32_vs_fp64": n})
    bound = max(tolerance, NOISE_FACTOR * noise)
    if worst > bound:
        raise ExportValidationError(f"ONNX output differs from PyTorch by {worst:.3g} (tolerance {bound:.3g}); "
                                    f"per shape: {results}")
    return {"tolerance": bound, "max_abs_diff": worst, "torch_fp32_vs_fp64": noise, "noise_factor": NOISE_FACTOR,
            "shapes": results}


def _at(kv: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The cache entries (B, heads, T, dim) at real token positions (B, T): a padding position's K/V is never
    attended to, and a fully masked query row may be NaN in PyTorch's own forward."""
    return kv.transpose(0, 2, 1, 3)[positions]


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b|, infinite if either holds a NaN or an infinity (never silently dropped by ``max``)."""
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(d.max()) if d.size and np.isfinite(d).all() else (0.0 if not d.size else float("inf"))


def torch_forward(model, ids, mask, pos, pasts) -> list[np.ndarray]:
    """[logits, present key 0, value 0, ...] of the model's own cached forward, as float arrays."""

    cache = DynamicCache()
    for i in range(model.config.num_hidden_layers):
        cache.update(pasts[2 * i].clone(), pasts[2 * i + 1].clone(), i)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_argument(model): cache})
    kv = [t for layer in returned_cache(out).layers for t in (layer.keys, layer.values)]
    return [out.logits.numpy()] + [t.numpy() for t in kv]


def quantized_quality(fp32_sess, q_sess, shape: DecoderShape, blocks) -> dict:
    """Held-out NLL of the fp32 and quantised graphs on the same blocks, and how often their argmax agrees."""
    return quality_figures(score_blocks(fp32_sess, shape, blocks), score_blocks(q_sess, shape, blocks), blocks)


def quality_figures(reference: tuple, rounded: tuple, blocks) -> dict:
    """The figures of a rounded graph's (NLL, argmax) on ``blocks`` against its fp32 reference's."""
    (nll32, arg32), (nllq, argq) = reference, rounded
    return {"val_ppl_fp32": math.exp(nll32), "val_ppl_quantized": math.exp(nllq),
            "ppl_change": math.exp(nllq - nll32) - 1.0, "argmax_agreement": float((arg32 == argq).mean()),
            "tokens": len(blocks) * blocks.seq_len}
