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

from bdlora.arch import projection_modules
from bdlora.errors import ModelError
from bdlora.export.decoder.attention import (
    MS,
    ROPE,
    gqa_attention,
    gqa_mask,
    plain_attention,
    plain_mask,
    plain_rotary_tables,
    rotary_caches,
    static_rotary,
)
from bdlora.export.decoder.builder import GraphBuilder, Projection, emit_group, emit_packed_qkv
from bdlora.export.defaults import MAX_OPSET
from bdlora.families import Anatomy, family
from bdlora.forms import declared_bits
from bdlora.runtime import DecoderSignature as Sig

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


def _layer(g: GraphBuilder, layout: DecoderLayout, i: int, layer: nn.Module, residual: str, mlp_prev: str | None,
           attn_inputs: tuple, cfg, hd: int, anatomy: Anatomy) -> tuple[str, str]:
    """One decoder layer; returns (residual stream before its MLP add, MLP output): the next norm adds them."""
    s, eps = f"/model/layers.{i}", float(cfg.rms_norm_eps)
    qkv, o_proj, gate_up, down_proj = anatomy.shared_inputs
    w_in = g.init(f"model.layers.{i}.input_layernorm.weight", _f32(layer.input_layernorm.weight))
    normed, residual = _norm(g, layout, residual, mlp_prev, w_in, eps, f"{s}/input_layernorm")
    at = layer.self_attn
    heads = layer_heads(at, hd)  # fewer where the attention keeps fewer groups (--forms groups)
    projs = [_projection(cfg, f"model.layers.{i}.self_attn.{n}", getattr(at, n)) for n in qkv]
    if layout.attention == "gqa":
        attn = gqa_attention(g, i, emit_packed_qkv(g, normed, projs, f"{s}/self_attn"), *attn_inputs, cfg,
                             at.scaling, heads)
    else:
        q, k, v = emit_group(g, normed, projs, f"{s}/self_attn")
        attn = plain_attention(g, i, q, k, v, *attn_inputs, heads, hd, float(at.scaling), layout.fused)
    (o,) = emit_group(g, attn, [_projection(cfg, f"model.layers.{i}.self_attn.{n}", getattr(at, n)) for n in o_proj],
                      f"{s}/self_attn")
    w_post = g.init(f"model.layers.{i}.post_attention_layernorm.weight", _f32(layer.post_attention_layernorm.weight))
    normed, residual = _norm(g, layout, residual, o, w_post, eps, f"{s}/post_attention_layernorm")
    mlp = layer.mlp
    gate, up = emit_group(g, normed, [_projection(cfg, f"model.layers.{i}.mlp.{n}", getattr(mlp, n)) for n in gate_up],
                          f"{s}/mlp")
    act = g.one("Mul", [gate, g.one("Sigmoid", [gate], f"{s}/mlp/act_fn/Sigmoid")], f"{s}/mlp/act_fn/Mul")
    hidden = g.one("Mul", [act, up], f"{s}/mlp/Mul")
    downs = [_projection(cfg, f"model.layers.{i}.mlp.{n}", getattr(mlp, n)) for n in down_proj]
    (down,) = emit_group(g, hidden, downs, f"{s}/mlp")
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


def build_decoder(model: nn.Module, layout: DecoderLayout):
    """The decoder ``ModelProto`` of ``model`` (a HF Llama/Mistral/Qwen2 causal LM, any projection forms) in
    ``layout``."""
    return decoder_graph(model, layout)[0]


def decoder_graph(model: nn.Module, layout: DecoderLayout):
    """(ModelProto, MatMuls saved by the shared first stages)."""
    cfg = model.config
    anatomy = emitted_anatomy(cfg)
    layers = model.model.layers
    hd = layers[0].self_attn.head_dim
    if layout.attention == "gqa" and hd % 16:
        raise ModelError(f"head dim {hd}: onnxruntime's GroupQueryAttention (the genai runtime's attention) needs a "
                         "multiple of 16; use `bdlora export onnx` for this model")
    g = GraphBuilder(layout.opset)
    if layout.attention == "gqa" or layout.fused or static_rotary(model) is None:  # else computed from positions
        cos, sin = rotary_caches(model, layout.positions)
        g.init(ROPE[0], cos)
        g.init(ROPE[1], sin)
    if layout.attention == "gqa":
        attn_inputs: tuple = (gqa_mask(g),)
    else:
        attn_inputs = (plain_mask(g, cfg), None if layout.fused else plain_rotary_tables(g, model))
    emb = g.init("model.embed_tokens.weight", _f32(model.model.embed_tokens.weight))
    residual, mlp_out = g.one("Gather", [emb, Sig.INPUT_IDS], "/model/embed_tokens/Gather"), None
    for i, layer in enumerate(layers):
        residual, mlp_out = _layer(g, layout, i, layer, residual, mlp_out, attn_inputs, cfg, hd, anatomy)
    w_norm = g.init("model.norm.weight", _f32(model.model.norm.weight))
    final, _ = _norm(g, layout, residual, mlp_out, w_norm, float(cfg.rms_norm_eps), "/model/norm")
    head = model.lm_head
    w_head = g.init("lm_head.weight", _f32(head.weight).T)
    if head.bias is None:
        g.node("MatMul", [final, w_head], "/lm_head/MatMul", outputs=[Sig.LOGITS])
    else:
        logits = g.one("MatMul", [final, w_head], "/lm_head/MatMul")
        g.node("Add", [logits, g.init("lm_head.bias", _f32(head.bias))], "/lm_head/Add", outputs=[Sig.LOGITS])
    inputs, outputs = _io(layout, head.weight.shape[0], [layer_heads(x.self_attn, hd)[1] for x in layers], hd)
    return _model(g, f"bdlora_{layout.attention}_decoder", inputs, outputs), g.fused


# the inputs of a decoder layer's projection groups (its anatomy's shared_inputs, in order): x_a (attention-normed),
# x_o (attention output), x_m (MLP-normed), x_d (the MLP's hidden state)
STACK_INPUTS = ("x_a", "x_o", "x_m", "x_d")
EMITTED_ACTIVATIONS = ("silu",)  # the gated MLP activations the emitter writes (SiLU as Sigmoid x Mul)


def emitted_anatomy(cfg) -> Anatomy:
    """The anatomy of ``cfg``'s family from the table, refused in one line when the emitter cannot write it."""
    base = (getattr(cfg, "bdlora", None) or {}).get("base_model_type", cfg.model_type)
    anatomy = family(base, "model_type").anatomy
    if anatomy.activation not in EMITTED_ACTIVATIONS or getattr(cfg, "hidden_act", "silu") != anatomy.activation:
        raise ModelError(f"hidden_act {getattr(cfg, 'hidden_act', None)!r}: the graph emitter writes "
                         f"{', '.join(EMITTED_ACTIVATIONS)}-gated MLPs only")
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
