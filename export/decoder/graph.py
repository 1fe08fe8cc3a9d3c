"""Every decoder graph bdlora writes, emitted node by node over the declared ``DecoderSignature`` (onnxruntime-genai's
builder's way: plain code, no tracing): the genai folder's (``DecoderLayout.genai``), the ONNX folder's and bench's
(``DecoderLayout.plain``), and the projections alone (``build_projection_stack``, bench's modules scope).

Shared by both layouts: the embedding Gather, RMSNorms with the residual adds (``SimplifiedLayerNormalization`` /
``SkipSimplifiedLayerNormalization`` when fused, plain ops otherwise), every projection in its deployed form
(``builder.emit_group``: one first-stage MatMul per shared input), SiLU as Sigmoid x Mul, the LM head. The attention
part is the layout's (``attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch.nn as nn
from onnx import TensorProto, helper

from bdlora.base.errors import ModelError
from bdlora.export.decoder.attention import (
    MS,
    gqa_attention,
    gqa_mask,
    kind_window,
    layer_kinds,
    plain_attention,
    plain_mask,
    plain_rotary_tables,
    rope_names,
    rotary_caches,
    static_rotary,
)
from bdlora.export.decoder.builder import GraphBuilder, Projection, emit_group, emit_packed_qkv
from bdlora.export.decoder.head import emit_head
from bdlora.export.defaults import MAX_OPSET
from bdlora.forms import declared_bits
from bdlora.models.arch import projection_modules
from bdlora.models.families import Anatomy, family
from bdlora.models.lazy import materialized
from bdlora.models.runtime import DecoderSignature as Sig

# the signature's symbolic dims, spelled as onnxruntime-genai's model builder spells them in its graphs
GENAI_DIMS = {"batch": "batch_size", "seq": "sequence_length", "past": "past_sequence_length",
              "total": "total_sequence_length"}


@dataclass(frozen=True)
class DecoderLayout:
    """What differs between the decoder graphs: the attention part (``gqa`` for onnxruntime-genai, ``plain`` with
    position ids for onnxruntime sessions and optimum), whether norms and rotary use onnxruntime's contrib ops
    (``fused``; always for ``gqa``, whose attention is one itself), the opset and the rotary table's length."""

    attention: str
    positions: int
    fused: bool = True
    opset: int = MAX_OPSET

    @classmethod
    def genai(cls, context_length: int) -> DecoderLayout:
        return cls("gqa", context_length)

    @classmethod
    def plain(cls, config, opset: int, fused: bool = False) -> DecoderLayout:
        return cls("plain", int(config.max_position_embeddings), fused, opset)

    @property
    def signature(self) -> Sig:
        return Sig(0, position_ids=self.attention == "plain")


def _f32(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _norm(g: GraphBuilder, layout: DecoderLayout, x: str, delta: str | None, weight: str, eps: float,
          name: str) -> tuple[str, str]:
    """RMSNorm of ``x + delta`` (``delta`` None: of ``x``); returns (normed, the residual stream x + delta)."""
    if layout.fused and delta is None:
        return g.one("SimplifiedLayerNormalization", [x, weight], name, axis=-1, epsilon=eps, stash_type=1), x
    if layout.fused:
        normed, _, _, residual = g.node("SkipSimplifiedLayerNormalization", [x, delta, weight], name, n_out=4,
                                        domain=MS, epsilon=eps)
        return normed, residual
    residual = x if delta is None else g.one("Add", [x, delta], f"{name}/residual/Add")
    ms = g.reduce_mean(g.one("Mul", [residual, residual], f"{name}/Square"), f"{name}/ReduceMean")
    eps_c = g.const(f"/model/constants/FLOAT/eps{eps!r}", eps, np.float32)
    inv = g.one("Reciprocal", [g.one("Sqrt", [g.one("Add", [ms, eps_c], f"{name}/eps")], f"{name}/Sqrt")],
                f"{name}/Reciprocal")
    return g.one("Mul", [g.one("Mul", [residual, inv], f"{name}/normed"), weight], f"{name}/weight"), residual


def _projection(cfg, name: str, module: nn.Module) -> Projection:
    """``module`` as emitted, with the bits its folder declares for it (``bdlora_modules``; ``--forms bits``)."""
    return Projection.of(name, module, declared_bits(getattr(cfg, "bdlora_modules", None)).get(name, 0))


def _norm_weight(g: GraphBuilder, name: str, module: nn.Module, anatomy: Anatomy) -> str:
    """An RMSNorm's scale as the graph multiplies by it (``norm_offset + weight``: Gemma's ``1 + w``)."""
    return g.init(f"{name}.weight", _f32(module.weight) + np.float32(anatomy.norm_offset))


def _head_norm(g: GraphBuilder, layout: DecoderLayout, x: str, heads: int, hd: int, weight: str, eps: float,
               name: str) -> str:
    """RMSNorm over each head of ``x`` (batch, seq, heads * head_dim): the query/key norms of ``qk_norm``."""
    split = g.one("Reshape", [x, g.const(f"/model/constants/INT64/[0,0,{heads},{hd}]", [0, 0, heads, hd])],
                  f"{name}/Reshape")
    normed, _ = _norm(g, layout, split, None, weight, eps, name)
    return g.one("Reshape", [normed, g.const("/model/constants/INT64/[0,0,-1]", [0, 0, -1])], f"{name}/Merge")


def _activation(g: GraphBuilder, layout: DecoderLayout, x: str, anatomy: Anatomy, s: str) -> str:
    """The gated MLP's activation: SiLU as Sigmoid x Mul; tanh-approximated GELU as onnxruntime's ``FastGelu``
    (fused layouts) or its formula ``x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``."""
    if anatomy.activation == "silu":
        return g.one("Mul", [x, g.one("Sigmoid", [x], f"{s}/act_fn/Sigmoid")], f"{s}/act_fn/Mul")
    if layout.fused:
        return g.one("FastGelu", [x], f"{s}/act_fn/FastGelu", domain=MS)
    c = "/model/constants/FLOAT/gelu"
    cube = g.one("Mul", [g.one("Mul", [x, x], f"{s}/act_fn/Square"), x], f"{s}/act_fn/Cube")
    inner = g.one("Add", [x, g.one("Mul", [cube, g.const(f"{c}0.044715", 0.044715, np.float32)], f"{s}/act_fn/c")],
                  f"{s}/act_fn/Add")
    t = g.one("Tanh", [g.one("Mul", [inner, g.const(f"{c}k", np.sqrt(2 / np.pi), np.float32)], f"{s}/act_fn/k")],
              f"{s}/act_fn/Tanh")
    half = g.one("Mul", [x, g.const(f"{c}0.5", 0.5, np.float32)], f"{s}/act_fn/half")
    return g.one("Mul", [half, g.one("Add", [t, g.const(f"{c}1", 1.0, np.float32)], f"{s}/act_fn/one")],
                 f"{s}/act_fn/Mul")


def _attention(g: GraphBuilder, layout: DecoderLayout, i: int, at: nn.Module, normed: str, attn_inputs: tuple, cfg,
               hd: int, anatomy: Anatomy) -> str:
    """One layer's attention output (before o_proj) from its normed input; ``attn_inputs``: the layer kind's (mask,
    rotary tables, window, rotary cache names)."""
    s, eps = f"/model/layers.{i}/self_attn", float(cfg.rms_norm_eps)
    heads = layer_heads(at, hd)  # fewer where the attention keeps fewer groups (--forms groups)
    projs = [_projection(cfg, f"model.layers.{i}.self_attn.{n}", getattr(at, n)) for n in anatomy.shared_inputs[0]]
    mask, tables, window, rope = attn_inputs
    if layout.attention == "gqa" and not anatomy.qk_norm:
        return gqa_attention(g, i, [emit_packed_qkv(g, normed, projs, s)], mask, (window, rope), at.scaling, heads)
    q, k, v = emit_group(g, normed, projs, s)
    if anatomy.qk_norm:
        q = _head_norm(g, layout, q, heads[0], hd, _norm_weight(g, f"model.layers.{i}.self_attn.q_norm", at.q_norm,
                                                                 anatomy), eps, f"{s}/q_norm")
        k = _head_norm(g, layout, k, heads[1], hd, _norm_weight(g, f"model.layers.{i}.self_attn.k_norm", at.k_norm,
                                                                 anatomy), eps, f"{s}/k_norm")
    if layout.attention == "gqa":
        return gqa_attention(g, i, [q, k, v], mask, (window, rope), at.scaling, heads)
    return plain_attention(g, i, q, k, v, mask, tables, heads, hd, float(at.scaling), layout.fused, rope)


def _layer(g: GraphBuilder, layout: DecoderLayout, i: int, layer: nn.Module, residual: str, mlp_prev: str | None,
           attn_inputs: tuple, cfg, hd: int, anatomy: Anatomy) -> tuple[str, str]:
    """One decoder layer; returns (residual stream before its MLP add, MLP output): the next norm adds them. With
    ``sandwich_norms`` each block's output is normed before its add (Gemma's four norms per layer)."""
    s, eps = f"/model/layers.{i}", float(cfg.rms_norm_eps)
    _, o_proj, gate_up, down_proj = anatomy.shared_inputs
    w_in = _norm_weight(g, f"model.layers.{i}.input_layernorm", layer.input_layernorm, anatomy)
    normed, residual = _norm(g, layout, residual, mlp_prev, w_in, eps, f"{s}/input_layernorm")
    at = layer.self_attn
    attn = _attention(g, layout, i, at, normed, attn_inputs, cfg, hd, anatomy)
    (o,) = emit_group(g, attn, [_projection(cfg, f"model.layers.{i}.self_attn.{n}", getattr(at, n)) for n in o_proj],
                      f"{s}/self_attn")
    if anatomy.sandwich_norms:
        w_post = _norm_weight(g, f"model.layers.{i}.post_attention_layernorm", layer.post_attention_layernorm, anatomy)
        o, _ = _norm(g, layout, o, None, w_post, eps, f"{s}/post_attention_layernorm")
    w_mlp = _norm_weight(g, f"model.layers.{i}.{anatomy.mlp_norm}", getattr(layer, anatomy.mlp_norm), anatomy)
    normed, residual = _norm(g, layout, residual, o, w_mlp, eps, f"{s}/{anatomy.mlp_norm}")
    mlp = layer.mlp
    gate, up = emit_group(g, normed, [_projection(cfg, f"model.layers.{i}.mlp.{n}", getattr(mlp, n)) for n in gate_up],
                          f"{s}/mlp")
    hidden = g.one("Mul", [_activation(g, layout, gate, anatomy, f"{s}/mlp"), up], f"{s}/mlp/Mul")
    downs = [_projection(cfg, f"model.layers.{i}.mlp.{n}", getattr(mlp, n)) for n in down_proj]
    (down,) = emit_group(g, hidden, downs, f"{s}/mlp")
    if anatomy.sandwich_norms:
        w_post = _norm_weight(g, f"model.layers.{i}.post_feedforward_layernorm", layer.post_feedforward_layernorm,
                              anatomy)
        down, _ = _norm(g, layout, down, None, w_post, eps, f"{s}/post_feedforward_layernorm")
    return residual, down


def layer_heads(attn: nn.Module, hd: int) -> tuple[int, int]:
    """(query heads, key/value heads) of one attention block, from its q and k projections' widths."""
    return attn.q_proj.out_features // hd, attn.k_proj.out_features // hd


def _io(layout: DecoderLayout, vocab: int, kv_heads: list[int], hd: int) -> tuple[list, list]:
    """The graph's inputs and outputs; ``kv_heads``: each layer's cached key/value heads."""
    layers = len(kv_heads)
    sig = Sig(layers, position_ids=layout.signature.position_ids)
    dims = GENAI_DIMS if layout.attention == "gqa" else {}

    def dim(d: str) -> str:
        return dims.get(d, d)

    batch, seq = (dim(d) for d in sig.TOKENS_DIMS)
    past, present = dim(sig.PAST_DIMS[2]), dim(sig.PRESENT_DIMS[2])
    inputs = [helper.make_tensor_value_info(sig.INPUT_IDS, TensorProto.INT64, [batch, seq]),
              helper.make_tensor_value_info(sig.ATTENTION_MASK, TensorProto.INT64, [dim(d) for d in sig.MASK_DIMS])]
    if sig.position_ids:
        inputs.append(helper.make_tensor_value_info(sig.POSITION_IDS, TensorProto.INT64, [batch, seq]))
    outputs = [helper.make_tensor_value_info(sig.LOGITS, TensorProto.FLOAT, [batch, seq, vocab])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, kv_heads[k // 2], past, hd])
               for k, n in enumerate(sig.cache_inputs)]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, kv_heads[k // 2], present, hd])
                for k, n in enumerate(sig.cache_outputs)]
    return inputs, outputs


def _model(g: GraphBuilder, name: str, inputs: list, outputs: list):
    """The model proto of ``g``'s nodes and initialisers. The weights are moved into it one at a time (each of the
    builder's copies dropped once the graph holds it): handed to ``make_graph`` and then ``make_model``, which copy
    them, a graph's weights were held three times at once (SmolLM2: 2.95 GB for a 0.54 GB graph)."""
    model = helper.make_model(helper.make_graph(g.nodes, name, inputs, outputs),
                              opset_imports=[helper.make_opsetid("", g.opset), helper.make_opsetid(MS, 1)],
                              producer_name="bdlora")
    inits, g.inits = g.inits, []
    inits.reverse()
    while inits:
        model.graph.initializer.append(inits.pop())
    return model


PROTOBUF_LIMIT = 2**31 - 1  # bytes: a larger graph keeps its weights in an external-data file beside it


def save_graph(proto, path) -> None:
    """``proto`` at ``path``, its weights inside unless they pass protobuf's 2 GB limit (then ``<name>.data``)."""
    big = sum(len(t.raw_data) for t in proto.graph.initializer) > PROTOBUF_LIMIT
    onnx.save_model(proto, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
                    location=Path(path).name + ".data")


def build_decoder(model: nn.Module, layout: DecoderLayout, g: GraphBuilder | None = None):
    """The decoder ``ModelProto`` of ``model`` (a HF Llama/Mistral/Qwen2 causal LM, any projection forms) in
    ``layout`` (``g``: the builder to emit into, a streaming one included)."""
    return decoder_graph(model, layout, g)[0]


def decoder_graph(model: nn.Module, layout: DecoderLayout, g: GraphBuilder | None = None):
    """(ModelProto, MatMuls saved by the shared first stages). A model built without weights (``bdlora.models.lazy``:
    synthetic or read from its files, on the meta device) gets them one part at a time: the embedding, norm and head
    for the graph's ends, each decoder layer for its own nodes; ``g.part_done()`` after each."""
    with materialized(model, skip=("model.layers", "model.embed_tokens", "lm_head")):  # the norms: small
        return _decoder_graph(model, layout, GraphBuilder(layout.opset) if g is None else g)


def _decoder_graph(model: nn.Module, layout: DecoderLayout, g: GraphBuilder):
    cfg = model.config
    anatomy = emitted_anatomy(cfg)
    layers = model.model.layers
    hd = layers[0].self_attn.head_dim
    if layout.attention == "gqa" and hd % 16:
        raise ModelError(f"head dim {hd}: onnxruntime's GroupQueryAttention (the genai runtime's attention) needs a "
                         "multiple of 16; use `bdlora export onnx` for this model")
    kinds = layer_kinds(model, anatomy.per_layer_attention)
    masks: dict = {}
    inputs_of = {kind: _kind_inputs(g, model, layout, kind, masks) for kind in dict.fromkeys(kinds)}
    with materialized(model, "model.embed_tokens"):
        emb = g.init("model.embed_tokens.weight", _f32(model.model.embed_tokens.weight))
    residual, mlp_out = g.one("Gather", [emb, Sig.INPUT_IDS], "/model/embed_tokens/Gather"), None
    if anatomy.embed_scale:  # in fp32, as transformers scales (sqrt(hidden) cast to the weights' dtype)
        scale = np.float32(cfg.hidden_size**0.5)
        residual = g.one("Mul", [residual, g.const(f"/model/constants/FLOAT/embed{scale!r}", scale, np.float32)],
                         "/model/embed_tokens/scale")
    g.part_done()
    for i, layer in enumerate(layers):
        with materialized(model, f"model.layers.{i}"):
            residual, mlp_out = _layer(g, layout, i, layer, residual, mlp_out, inputs_of[kinds[i]], cfg, hd,
                                       anatomy)
        g.part_done()
    w_norm = _norm_weight(g, "model.norm", model.model.norm, anatomy)
    final, _ = _norm(g, layout, residual, mlp_out, w_norm, float(cfg.rms_norm_eps), "/model/norm")
    head = model.lm_head
    with materialized(model, "lm_head"):
        emit_head(g, model, final)
    g.part_done()
    inputs, outputs = _io(layout, int(head.out_features), [layer_heads(x.self_attn, hd)[1] for x in layers], hd)
    return _model(g, f"bdlora_{layout.attention}_decoder", inputs, outputs), g.fused


def _kind_inputs(g: GraphBuilder, model: nn.Module, layout: DecoderLayout, kind: str | None, masks: dict) -> tuple:
    """What every layer of one attention kind reads: (mask, rotary tables of the unfused plain layout, sliding window,
    rotary cache names). ``masks``: those built so far (GroupQueryAttention's one, or the plain layout's, per
    window)."""
    window, rope = kind_window(model.config, kind), rope_names(kind)
    if layout.attention == "gqa" or layout.fused or static_rotary(model, kind) is None:  # else from positions
        for name, table in zip(rope, rotary_caches(model, layout.positions, kind)):
            g.init(name, table)
    if layout.attention == "gqa":
        if "gqa" not in masks:
            masks["gqa"] = gqa_mask(g)  # from the 2-D mask; each node applies its own window
        return masks["gqa"], None, window, rope
    if window not in masks:
        masks[window] = plain_mask(g, window)
    return masks[window], None if layout.fused else plain_rotary_tables(g, model, kind), window, rope


# the inputs of a decoder layer's projection groups (its anatomy's shared_inputs, in order): x_a (attention-normed),
# x_o (attention output), x_m (MLP-normed), x_d (the MLP's hidden state)
STACK_INPUTS = ("x_a", "x_o", "x_m", "x_d")
EMITTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP activations the emitter writes (_activation)


def emitted_anatomy(cfg) -> Anatomy:
    """The anatomy of ``cfg``'s family from the table, refused in one line when the emitter cannot write it."""
    base = (getattr(cfg, "bdlora", None) or {}).get("base_model_type", cfg.model_type)
    anatomy = family(base, "model_type").anatomy
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu"
    if anatomy.activation not in EMITTED_ACTIVATIONS or act != anatomy.activation:
        raise ModelError(f"hidden_act {act!r}: the graph emitter writes {', '.join(EMITTED_ACTIVATIONS)}-gated MLPs "
                         f"only ({base!r} declares {anatomy.activation!r})")
    capped = [k for k in ("attn_logit_softcapping", "final_logit_softcapping") if getattr(cfg, k, None)]
    if capped:
        raise ModelError(f"{', '.join(capped)} {getattr(cfg, capped[0])!r}: the graph emitter writes no logit "
                         "soft-capping (set it to null only if the model was trained without it)")
    if len(anatomy.shared_inputs) != len(STACK_INPUTS):
        raise ModelError(f"model_type {base!r}: its projection groups {anatomy.shared_inputs} are not the four the "
                         "emitter wires (attention input, attention output, MLP input, MLP hidden state)")
    return anatomy


def build_projection_stack(model: nn.Module, opset: int = MAX_OPSET):
    """The replaced projections alone (the paper's measure), wired as in the decoder: per layer inputs ``x_a.l``,
    ``x_o.l``, ``x_m.l``, ``x_d.l`` (tokens, width), each group of projections reading one input emitted as in the
    decoder, every projection's output a graph output (``y0``, ``y1``, ... in ``projection_modules`` order)."""
    cfg = model.config
    g = GraphBuilder(opset)
    anatomy = emitted_anatomy(cfg)
    groups: dict[str, list[tuple[int, Projection]]] = {}
    width: dict[str, int] = {}
    for k, (name, m) in enumerate(projection_modules(model)):
        layer = int(name.split("layers.")[1].split(".")[0])
        x = STACK_INPUTS[anatomy.input_group(name.rsplit(".", 1)[-1])]
        groups.setdefault(f"{x}.{layer}", []).append((k, Projection.of(name, m)))
        width[f"{x}.{layer}"] = m.in_features  # the layer's own (a pruned block's projections are narrower)
    outputs = {}
    for x, members in groups.items():
        ys = emit_group(g, x, [p for _, p in members], f"/stack/{x}")
        outputs.update({k: y for (k, _), y in zip(members, ys)})
    renamed = {y: f"y{k}" for k, y in outputs.items()}  # each projection's last node writes its graph output
    for node in g.nodes:
        node.output[:] = [renamed.get(o, o) for o in node.output]
    inputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["tokens", width[x]])
              for x in sorted(groups, key=lambda n: (int(n.split(".")[1]), STACK_INPUTS.index(n.split(".")[0])))]
    outs = [helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, ["tokens", None]) for k in sorted(outputs)]
    return _model(g, "bdlora_projection_stack", inputs, outs)
