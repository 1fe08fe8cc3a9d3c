"""Validation of an exported graph against PyTorch (optimum-onnx's pattern: an explicit tolerance, a typed error)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from bdlora.errors import BdloraError
from bdlora.export.onnx.signature import example_inputs
from bdlora.runtime import run_decoder

TOLERANCE = 1e-4  # max |ONNX - torch| on logits and present key/values, fp32
VALIDATION_SHAPES = ((1, 1, 0), (2, 6, 0), (2, 1, 5), (3, 4, 3))  # (batch, seq, past); rows 0 are left padded


class ExportValidationError(BdloraError):
    """The exported graph disagrees with PyTorch beyond the tolerance."""


@torch.no_grad()
def validate(model: nn.Module, sess, shapes=VALIDATION_SHAPES, tolerance: float = TOLERANCE) -> dict:
    """Compare ONNX Runtime with the model's own forward (native 2D-mask path) at several (batch, seq, past),
    the first row left padded; logits are compared on real (non-padding) positions, present K/V everywhere."""
    from transformers import DynamicCache

    results = []
    worst = 0.0
    for b, s, p in shapes:
        pad = min(2, p + s - 1) if b > 1 else 0
        ids, mask, pos, pasts = example_inputs(model.config, b, s, p, pad_first=pad, seed=b * 100 + s * 10 + p)
        cache = DynamicCache()
        for i in range(model.config.num_hidden_layers):
            cache.update(pasts[2 * i].clone(), pasts[2 * i + 1].clone(), i)
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        got = run_decoder(sess, ids.numpy(), mask.numpy(), pos.numpy(), [t.numpy() for t in pasts])
        real = mask[:, -s:].bool().numpy()  # (B, seq) query positions that are real tokens
        d_logits = float(np.abs(got[0] - ref.logits.numpy())[real].max())
        d_kv = 0.0
        for i, layer in enumerate(ref.past_key_values.layers):
            d_kv = max(d_kv, float(np.abs(got[1 + 2 * i] - layer.keys.numpy()).max()),
                       float(np.abs(got[2 + 2 * i] - layer.values.numpy()).max()))
        worst = max(worst, d_logits, d_kv)
        results.append({"batch": b, "seq": s, "past": p, "left_pad": pad, "max_abs_diff_logits": d_logits,
                        "max_abs_diff_present": d_kv})
    if worst > tolerance:
        raise ExportValidationError(f"ONNX output differs from PyTorch by {worst:.3g} (tolerance {tolerance:g}); "
                                    f"per shape: {results}")
    return {"tolerance": tolerance, "max_abs_diff": worst, "shapes": results}
