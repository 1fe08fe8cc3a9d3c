"""The attention part of a decoder graph, one per runtime; everything else (norms, projections, MLP, head) is
shared (``graph``).

- ``gqa``: onnxruntime-genai's layout, as its model builder emits it: one ``GroupQueryAttention`` per layer (rotary
  applied inside from cos/sin caches, packed q/k/v input, past and present able to share one buffer), positions
  derived from the mask's row sums, so batches are right-aligned.
- ``plain``: the layout of ``export onnx`` (optimum's ORTModelForCausalLM, bdlora's ort engine with left-padded
  continuous batching): explicit ``position_ids``, a (batch, 1, seq, total) additive mask built once from the 2-D
  attention mask (causal, padding, sliding window), rotary from the position ids (``RotaryEmbedding`` when fused,
  plain ops otherwise), past and present as separate tensors (present = past ++ new), grouped-query attention by
  reshaping the query heads onto their key/value head (no repeated K/V), softmax in fp32.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from onnx import TensorProto

from bdlora.export.decoder.builder import GraphBuilder
from bdlora.models.runtime import DecoderSignature as Sig

MS = "com.microsoft"
ROPE = ("cos_cache", "sin_cache")


def rotary_caches(model: nn.Module, length: int, kind: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(length, head_dim / 2) cos and sin tables from the model's own rotary embedding (so any rope scaling the
    model applies is in them; ``kind``: the layer type of a family whose layer types have their own bases);
    Llama-style rotation (halves, not interleaved)."""
    rot = model.model.rotary_emb
    pos = torch.arange(length)[None]
    with torch.no_grad():
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos, *([kind] if kind else []))
    half = cos.shape[-1] // 2
    if not torch.allclose(cos[..., :half], cos[..., half:]):
        raise ValueError("the model's rotary tables are not Llama-style halves; bdlora's graphs cannot express them")
    return cos[0, :, :half].float().numpy(), sin[0, :, :half].float().numpy()


def sliding_window(cfg) -> int | None:
    use = getattr(cfg, "use_sliding_window", True)
    w = getattr(cfg, "sliding_window", None) if use else None
    return int(w) if w else None


def layer_kinds(model: nn.Module, per_layer: bool) -> list[str | None]:
    """Each layer's attention kind: its ``layer_types`` entry for a family whose layers differ (Gemma 3's
    ``sliding_attention`` / ``full_attention``, each with its own window and rotary base), else None (one kind)."""
    cfg = model.config
    return list(cfg.layer_types) if per_layer else [None] * int(cfg.num_hidden_layers)


def kind_window(cfg, kind: str | None) -> int | None:
    """The sliding window of a layer of ``kind`` (None: the model's, for every layer)."""
    if kind is None:
        return sliding_window(cfg)
    return int(cfg.sliding_window) if kind == "sliding_attention" and cfg.sliding_window else None


def rope_names(kind: str | None) -> tuple[str, str]:
    """The cos/sin cache initialisers of a layer kind (onnxruntime-genai's names when there is one kind)."""
    return ROPE if kind is None else (f"{ROPE[0]}_{kind}", f"{ROPE[1]}_{kind}")


# --------------------------------------------------------------------------------------------------------------------
# gqa: onnxruntime-genai
# --------------------------------------------------------------------------------------------------------------------


def gqa_mask(g: GraphBuilder) -> tuple[str, str]:
    """GroupQueryAttention's ``seqlens_k`` (real tokens per row minus one, int32) and ``total_sequence_length``
    (the mask's width, int32) from the 2D attention mask: the builder's attn_mask_reformat subgraph."""

    one = g.const("/model/constants/INT64/[1]", [1])
    total = g.one("ReduceSum", [Sig.ATTENTION_MASK, one], "/model/attn_mask/ReduceSum", keepdims=0)
    seqlens_k = g.one("Cast", [g.one("Sub", [total, one], "/model/attn_mask/Sub")], "/model/attn_mask/seqlens_k",
                      to=TensorProto.INT32)
    width = g.one("Gather", [g.one("Shape", [Sig.ATTENTION_MASK], "/model/attn_mask/Shape"),
                             g.const("/model/constants/INT64/1", 1)], "/model/attn_mask/Gather", axis=0)
    return seqlens_k, g.one("Cast", [width], "/model/attn_mask/total_seq_len", to=TensorProto.INT32)


def gqa_attention(g: GraphBuilder, i: int, qkv: list[str], mask: tuple[str, str], kind: tuple, scaling: float,
                  heads: tuple[int, int]) -> str:
    """One layer's GroupQueryAttention of ``heads`` (query heads, key/value heads: the layer's own, fewer where its
    attention keeps fewer groups; the runtime sizes each layer's cache from the graph's inputs). ``qkv``: the packed
    q/k/v, or q, k and v apart (normed per head first); ``kind``: (window or None, the rotary cache names).
    ``local_window_size`` is transformers' ``sliding_window`` as it stands (tested against PyTorch beyond the
    window)."""
    s = f"/model/layers.{i}/self_attn"
    window, rope = kind
    qkv = list(qkv) + [""] * (3 - len(qkv))
    out, _, _ = g.node(
        "GroupQueryAttention", [*qkv, Sig.past(i, "key"), Sig.past(i, "value"), *mask, *rope],
        f"{s}/GroupQueryAttention", domain=MS,
        outputs=[f"{s}/GroupQueryAttention/output_0", Sig.present(i, "key"), Sig.present(i, "value")],
        num_heads=heads[0], kv_num_heads=heads[1], scale=float(scaling),
        do_rotary=1, rotary_interleaved=0, local_window_size=window or -1)
    return out


# --------------------------------------------------------------------------------------------------------------------
# plain: export onnx
# --------------------------------------------------------------------------------------------------------------------


def plain_mask(g: GraphBuilder, window: int | None) -> str:
    """The (batch, 1, seq, total) additive mask: 0 where query t (at cache position past + t) may attend key j
    (j <= past + t, j a real token, and within the sliding window if the model has one), the fp32 minimum
    elsewhere (not -inf, so a fully padded query row stays finite)."""
    m = "/model/attn_mask" + (f"_window{window}" if window else "")
    dim = g.const("/model/constants/INT64/1", 1)
    seq = g.one("Gather", [g.one("Shape", [Sig.INPUT_IDS], f"{m}/ids/Shape"), dim], f"{m}/seq", axis=0)
    total = g.one("Gather", [g.one("Shape", [Sig.ATTENTION_MASK], f"{m}/Shape"), dim], f"{m}/total", axis=0)
    past = g.one("Sub", [total, seq], f"{m}/past")
    zero, one = g.const("/model/constants/INT64/0", 0), g.const("/model/constants/INT64/1", 1)
    q = g.one("Unsqueeze", [g.one("Range", [past, total, one], f"{m}/q/Range"),
                            g.const("/model/constants/axes/1", [1])], f"{m}/q")  # (seq, 1)
    k = g.one("Unsqueeze", [g.one("Range", [zero, total, one], f"{m}/k/Range"),
                            g.const("/model/constants/axes/0", [0])], f"{m}/k")  # (1, total)
    allowed = g.one("LessOrEqual", [k, q], f"{m}/causal")
    if window:
        low = g.one("Sub", [q, g.const("/model/constants/INT64/window", window)], f"{m}/window/Sub")
        allowed = g.one("And", [allowed, g.one("Greater", [k, low], f"{m}/window/Greater")], f"{m}/window/And")
    pad = g.one("Cast", [g.one("Unsqueeze", [Sig.ATTENTION_MASK, g.const("/model/constants/axes/1,2", [1, 2])],
                               f"{m}/pad/Unsqueeze")], f"{m}/pad", to=TensorProto.BOOL)  # (batch, 1, 1, total)
    allowed = g.one("And", [allowed, pad], f"{m}/allowed")
    return g.one("Where", [allowed, g.const("/model/constants/FLOAT/0", 0.0, np.float32),
                           g.const("/model/constants/FLOAT/min", np.finfo(np.float32).min, np.float32)], f"{m}/Where")


def static_rotary(model: nn.Module, kind: str | None = None) -> tuple[np.ndarray, float] | None:
    """(inv_freq, attention_scaling) of a rotary embedding whose angles are ``position * inv_freq`` (default,
    linear, llama3, yarn...: the scaling is in ``inv_freq``); None for the types that change it with the length.
    ``kind``: the layer type of a family whose layer types have their own rotary bases."""
    rot = model.model.rotary_emb
    prefix = f"{kind}_" if kind else ""
    rope_type = getattr(rot, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(kind, "default")
    if not hasattr(rot, f"{prefix}inv_freq") or rope_type in ("dynamic", "longrope"):
        return None
    return (getattr(rot, f"{prefix}inv_freq").detach().float().cpu().numpy(),
            float(getattr(rot, f"{prefix}attention_scaling", 1.0)))


def plain_rotary_tables(g: GraphBuilder, model: nn.Module, kind: str | None = None) -> tuple[str, str]:
    """cos and sin at each (batch, seq) position id, (batch, seq, 1, head_dim) with the halves repeated, computed
    once for every layer: from the position ids as PyTorch computes them (``position * inv_freq``, so any position
    the model takes, as in PyTorch), or for a length-dependent RoPE gathered from the (positions, head_dim / 2)
    caches."""
    static = static_rotary(model, kind)
    r = "/model/rotary" + (f"_{kind}" if kind else "")
    if static is not None:
        inv, scaling = static
        pos = g.one("Unsqueeze", [g.one("Cast", [Sig.POSITION_IDS], f"{r}/Cast", to=TensorProto.FLOAT),
                                  g.const("/model/constants/axes/-1", [-1])], f"{r}/positions")  # (B, S, 1)
        freqs = g.one("Mul", [pos, g.init(f"{r}.inv_freq", inv.astype(np.float32))], f"{r}/freqs")
        emb = g.one("Concat", [freqs, freqs], f"{r}/Concat", axis=-1)
        out = []
        for fn in ("Cos", "Sin"):
            t = g.one(fn, [emb], f"{r}/{fn}")
            if scaling != 1.0:
                t = g.one("Mul", [t, g.const(f"/model/constants/FLOAT/rope{scaling!r}", scaling, np.float32)],
                          f"{r}/{fn}/scaling")
            out.append(g.one("Unsqueeze", [t, g.const("/model/constants/axes/2", [2])], f"{r}/{fn.lower()}"))
        return out[0], out[1]
    out = []
    for table in rope_names(kind):
        full = g.one("Concat", [table, table], f"{r}/{table}/Concat", axis=-1)
        at = g.one("Gather", [full, Sig.POSITION_IDS], f"{r}/{table}/Gather", axis=0)
        out.append(g.one("Unsqueeze", [at, g.const("/model/constants/axes/2", [2])], f"{r}/{table}"))
    return out[0], out[1]


def _rotate(g: GraphBuilder, x: str, tables: tuple[str, str], half: int, name: str) -> str:
    """x * cos + rotate_half(x) * sin on (batch, seq, heads, head_dim), rotate_half(x) = [-x2, x1]."""
    x1, x2 = g.node("Split", [x, g.const(f"/model/constants/INT64/[{half},{half}]", [half, half])], f"{name}/Split",
                    n_out=2, axis=-1)
    rot = g.one("Concat", [g.one("Neg", [x2], f"{name}/Neg"), x1], f"{name}/Concat", axis=-1)
    return g.one("Add", [g.one("Mul", [x, tables[0]], f"{name}/cos"), g.one("Mul", [rot, tables[1]], f"{name}/sin")],
                 f"{name}/Add")


def _heads(g: GraphBuilder, x: str, n: int, hd: int, name: str) -> str:
    return g.one("Reshape", [x, g.const(f"/model/constants/INT64/[0,0,{n},{hd}]", [0, 0, n, hd])], name)


def plain_attention(g: GraphBuilder, i: int, q: str, k: str, v: str, mask: str, tables, layer_heads: tuple[int, int],
                    hd: int, scaling: float, fused: bool, rope: tuple[str, str] = ROPE) -> str:
    """One layer's attention from its projected q, k, v (batch, seq, width) with ``layer_heads`` (query heads,
    key/value heads); writes ``present.{i}.key/value``. ``rope``: the layer's cos/sin caches (fused)."""
    s = f"/model/layers.{i}/self_attn"
    heads, kv = layer_heads
    if fused:
        q, k = (g.one("RotaryEmbedding", [x, Sig.POSITION_IDS, *rope], f"{s}/{n}_rotary", domain=MS,
                      interleaved=0) for x, n in ((q, "q"), (k, "k")))
    q, k, v = _heads(g, q, heads, hd, f"{s}/q/Reshape"), _heads(g, k, kv, hd, f"{s}/k/Reshape"), \
        _heads(g, v, kv, hd, f"{s}/v/Reshape")
    if not fused:
        q, k = _rotate(g, q, tables, hd // 2, f"{s}/q_rotary"), _rotate(g, k, tables, hd // 2, f"{s}/k_rotary")
    q, k, v = (g.one("Transpose", [x], f"{s}/{n}/Transpose", perm=[0, 2, 1, 3]) for x, n in ((q, "q"), (k, "k"),
                                                                                              (v, "v")))
    k = g.one("Concat", [Sig.past(i, "key"), k], f"{s}/k/Concat", outputs=[Sig.present(i, "key")], axis=2)
    v = g.one("Concat", [Sig.past(i, "value"), v], f"{s}/v/Concat", outputs=[Sig.present(i, "value")], axis=2)
    # the query heads of one key/value head as one (group * seq) block: (batch, kv, group * seq, head_dim)
    grouped = g.one("Reshape", [q, g.const(f"/model/constants/INT64/[0,{kv},-1,{hd}]", [0, kv, -1, hd])],
                    f"{s}/q/group")
    scores = g.one("MatMul", [grouped, g.one("Transpose", [k], f"{s}/k/T", perm=[0, 1, 3, 2])], f"{s}/scores")
    scores = g.one("Mul", [scores, g.const(f"/model/constants/FLOAT/scale{scaling!r}", scaling, np.float32)],
                   f"{s}/scale")
    scores = g.one("Reshape", [scores, g.const(f"/model/constants/INT64/[0,{heads},-1,0]", [0, heads, -1, 0])],
                   f"{s}/scores/heads")
    probs = g.one("Softmax", [g.one("Add", [scores, mask], f"{s}/mask")], f"{s}/Softmax", axis=-1)
    probs = g.one("Reshape", [probs, g.const(f"/model/constants/INT64/[0,{kv},-1,0]", [0, kv, -1, 0])],
                  f"{s}/probs/group")
    ctx = g.one("MatMul", [probs, v], f"{s}/context")
    ctx = g.one("Reshape", [ctx, g.const(f"/model/constants/INT64/[0,{heads},-1,{hd}]", [0, heads, -1, hd])],
                f"{s}/context/heads")
    ctx = g.one("Transpose", [ctx], f"{s}/context/Transpose", perm=[0, 2, 1, 3])
    return g.one("Reshape", [ctx, g.const("/model/constants/INT64/[0,0,-1]", [0, 0, -1])], f"{s}/context/Reshape")
