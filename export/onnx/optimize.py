"""Graph pass: onnxruntime's transformer optimizer over an exported decoder (``export onnx --optimize``).

Its ``qwen3`` fusions match the Llama/Mistral/Qwen2 decoder layer: RMSNorm -> ``SimplifiedLayerNormalization``,
residual add + RMSNorm -> ``SkipSimplifiedLayerNormalization``, rotary position embedding -> ``RotaryEmbedding``
(com.microsoft contrib ops: the graph then runs on onnxruntime only). The projections are untouched.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import numpy_helper
from onnxruntime.transformers.optimizer import optimize_model

from bdlora.arch import base_model
from bdlora.export.onnx.metadata import read_metadata


def optimize_graph(path: Path, model: nn.Module) -> dict[str, int]:
    """Rewrite ``path`` in place with onnxruntime's transformer optimizer (its ``qwen3`` fusions, which match the
    Llama/Mistral/Qwen2 decoder layer): RMSNorm -> ``SimplifiedLayerNormalization``, residual add + RMSNorm ->
    ``SkipSimplifiedLayerNormalization``, rotary position embedding -> ``RotaryEmbedding`` (com.microsoft contrib
    ops, so the graph then runs on onnxruntime only). The projections' MatMuls are untouched. Returns the count of
    each fused op.

    The optimizer writes cos/sin caches for 131,072 positions computed with its own RoPE assumptions; they are
    replaced by the model's own rotary embedding (``model.model.rotary_emb``, so RoPE scaling variants are exact)
    over ``max_position_embeddings`` positions."""

    config = model.config
    fused_ops = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RotaryEmbedding")
    # the optimizer and its symbolic shape inference log a line per attention block they cannot prove shapes for
    quiet = [logging.getLogger(n) for n in ("onnxruntime.transformers", "symbolic_shape_infer",
                                           "onnxruntime.tools.symbolic_shape_infer")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        meta = read_metadata(path)
        om = optimize_model(str(path), model_type="qwen3", num_heads=config.num_attention_heads,
                            hidden_size=config.hidden_size, opt_level=0)
    finally:
        for q, lv in zip(quiet, levels):
            q.setLevel(lv)
    g = om.model.graph
    # RotaryEmbedding inputs: (input, position_ids, cos_cache, sin_cache), caches (max_positions, rotary_dim / 2)
    caches = {n.input[i]: kind for n in g.node if n.op_type == "RotaryEmbedding" and len(n.input) >= 4
              for i, kind in ((2, "cos"), (3, "sin"))}
    if caches:
        core = base_model(model).model
        n_pos = config.max_position_embeddings
        with torch.no_grad():
            probe = torch.zeros(1, dtype=torch.float32)
            cos, sin = core.rotary_emb(probe, torch.arange(n_pos)[None])  # (1, P, head_dim), halves repeated
        half = cos.shape[-1] // 2
        exact = {"cos": cos[0, :, :half].numpy().astype(np.float32),
                 "sin": sin[0, :, :half].numpy().astype(np.float32)}
        for init in g.initializer:
            if init.name in caches:
                init.CopyFrom(numpy_helper.from_array(exact[caches[init.name]], init.name))
    onnx.helper.set_model_props(om.model, meta)
    om.save_model_to_file(str(path))
    counts = {op: sum(1 for n in g.node if n.op_type == op) for op in fused_ops}
    return {k: v for k, v in counts.items() if v}
