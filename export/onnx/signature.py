"""The declared signature of an exported bdlora decoder (optimum-onnx's pattern: names and dynamic axes first).

    inputs   input_ids (batch, seq) int64, attention_mask (batch, past + seq) int64, position_ids (batch, seq)
             int64, past_key_values.{i}.key / .value (batch, kv_heads, past, head_dim) float32
    outputs  logits (batch, seq, vocab), present.{i}.key / .value (batch, kv_heads, past + seq, head_dim)
"""

from __future__ import annotations

import torch

from bdlora.errors import UsageError
from bdlora.export.defaults import DEFAULT_OPSET, MIN_OPSET  # noqa: F401  (re-exported: trace, folder)
from bdlora.runtime import DecoderShape, io_names


def max_opset() -> int:
    from torch.onnx._constants import ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET

    return int(ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET)


def check_opset(opset: int) -> None:
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= max_opset():
        raise UsageError(f"--opset {opset}: the exporter supports opsets {MIN_OPSET}..{max_opset()}")


def dynamic_axes(num_layers: int) -> dict[str, dict[int, str]]:
    ins, outs = io_names(num_layers)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    axes.update({n: {0: "batch", 2: "past"} for n in ins[3:]})
    axes.update({n: {0: "batch", 2: "total"} for n in outs[1:]})
    return axes


def position_ids_from_mask(attention_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """HF/optimum convention: cumsum of the mask minus one, padding set to 1, last ``seq_len`` positions."""
    pos = attention_mask.long().cumsum(-1) - 1
    pos = pos.masked_fill(attention_mask == 0, 1)
    return pos[:, -seq_len:]


def example_inputs(config, batch: int, seq: int, past: int, pad_first: int = 0, seed: int = 0):
    """Random inputs of the graph's signature; the first row is left padded by ``pad_first`` tokens."""
    g = torch.Generator().manual_seed(seed)
    shape = DecoderShape.of(config)
    ids = torch.randint(0, shape.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    if pad_first:
        mask[0, :pad_first] = 0
    pos = position_ids_from_mask(mask, seq)
    pasts = [torch.randn(batch, shape.kv_heads, past, shape.head_dim, generator=g) for _ in range(2 * shape.layers)]
    return ids, mask, pos, pasts
