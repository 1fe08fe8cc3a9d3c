"""The declared signature of an exported bdlora decoder (optimum-onnx's pattern: names and dynamic axes first):
``bdlora.models.runtime.DecoderSignature`` names the inputs, outputs and cache; this module adds the opset bounds and
the example inputs validation feeds.
"""

from __future__ import annotations

import torch

from bdlora.base.errors import UsageError
from bdlora.export.defaults import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET  # noqa: F401  (re-exported: folder)
from bdlora.models.runtime import DecoderShape


def check_opset(opset: int) -> None:
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise UsageError(f"--opset {opset}: the exporter supports opsets {MIN_OPSET}..{MAX_OPSET}")


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
    pasts = [torch.randn(batch, shape.kv(i // 2), past, shape.head_dim, generator=g) for i in range(2 * shape.layers)]
    return ids, mask, pos, pasts
