"""Tracing a (compressed) student into an ONNX decoder with KV cache.

Why a wrapper and a hand-built mask: transformers' vmap-based mask builder does not trace with the TorchScript
exporter, the older mask function bakes shapes in, and the dynamo exporter is slow; a ``DynamicCache`` cannot be an
ONNX input either. So ``DecoderWithCache`` takes flat past tensors, rebuilds the cache, and passes a 4D additive
mask (causal and padding, built from plain comparisons) that transformers uses as is. Attention runs eagerly.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from pathlib import Path

import onnx
import torch
import torch.nn as nn
from transformers import DynamicCache

from bdlora.arch import base_model
from bdlora.export.onnx.fuse import fuse_shared_input_matmuls
from bdlora.export.onnx.metadata import module_table, tag_nodes
from bdlora.export.onnx.signature import DEFAULT_OPSET, check_opset, dynamic_axes, example_inputs
from bdlora.kv_cache import cache_argument, returned_cache
from bdlora.runtime import DecoderSignature


def build_4d_mask(attention_mask: torch.Tensor, seq_len: int, dtype=torch.float32) -> torch.Tensor:
    """(B, 1, seq, past + seq) additive mask: 0 where query t may attend key j (j <= past + t and j not padding),
    the dtype's minimum elsewhere (not -inf, so a fully padded query row stays finite)."""
    b, total = attention_mask.shape
    past = total - seq_len
    q = torch.arange(seq_len, device=attention_mask.device).view(1, 1, seq_len, 1) + past
    k = torch.arange(total, device=attention_mask.device).view(1, 1, 1, total)
    allowed = (k <= q) & attention_mask.view(b, 1, 1, total).bool()
    return torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


class DecoderWithCache(nn.Module):
    """Flat-tensor wrapper of a causal LM: (input_ids, attention_mask, position_ids, *past) -> (logits, *present)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.num_layers = model.config.num_hidden_layers
        self.cache_argument = cache_argument(model)

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        mask = build_4d_mask(attention_mask, input_ids.shape[1])
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                         **{self.cache_argument: cache})
        present = []
        for layer in returned_cache(out).layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def _rotary_as_matmul(self, x, position_ids):
    """RoPE angles as ``inv_freq @ positions`` (transformers 4.x's form) instead of 5.x's broadcast product: the
    same numbers (each angle is one product either way), but the graph onnxruntime's transformer optimizer
    recognises and fuses into ``RotaryEmbedding`` (``export onnx --optimize``, the genai export)."""
    inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


@contextlib.contextmanager
def traceable_rotary(model: nn.Module):
    """While tracing, compute the rotary angles in the matmul form (see ``_rotary_as_matmul``). Static RoPE types
    only (default, linear, llama3, yarn, ...: a fixed ``inv_freq``); dynamic and longrope keep their own forward."""
    rope = getattr(base_model(model).model, "rotary_emb", None)
    if rope is None or not hasattr(rope, "inv_freq") or getattr(rope, "rope_type", "") in ("dynamic", "longrope"):
        yield
        return
    rope.forward = types.MethodType(_rotary_as_matmul, rope)
    try:
        yield
    finally:
        del rope.forward  # back to the class's own


def export_decoder(model: nn.Module, path: Path, opset: int = DEFAULT_OPSET, fuse: bool = True) -> int:
    """Trace ``model`` (fp32, eager attention) into ``path`` with the KV-cache signature and dynamic axes; tag each
    module's nodes, then fuse MatMuls that share an input (q/k/v, gate/up; see ``fuse``). Returns the number of
    MatMuls fused away."""
    check_opset(opset)
    model.config._attn_implementation = "eager"
    wrapper = DecoderWithCache(model).eval()
    sig = DecoderSignature(model.config.num_hidden_layers)
    ins, outs = sig.inputs, sig.outputs
    ids, mask, pos, pasts = example_inputs(model.config, 2, 3, 2)
    with torch.no_grad(), warnings.catch_warnings(), traceable_rotary(model):
        warnings.simplefilter("ignore")  # tracer warnings about the cache's Python-side bookkeeping
        torch.onnx.export(wrapper, (ids, mask, pos, *pasts), str(path), input_names=ins, output_names=outs,
                          dynamic_axes=dynamic_axes(model.config.num_hidden_layers), opset_version=opset,
                          dynamo=False, do_constant_folding=True)
    return postprocess(path, module_table(model), fuse)


def postprocess(path: Path, rows: list[dict], fuse: bool = True) -> int:
    """Tag module nodes, then (optionally) fuse shared-input MatMuls; returns the number of MatMuls fused away."""

    m = onnx.load(str(path))
    tag_nodes(m, rows)
    n = fuse_shared_input_matmuls(m) if fuse else 0
    onnx.save(m, str(path))
    return n
