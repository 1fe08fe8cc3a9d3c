"""The onnxruntime-genai decoder graph of a (compressed) student, emitted node by node with ``onnx.helper``.

The layout is the one onnxruntime-genai's own model builder emits for Llama/Mistral/Qwen2 (its ``make_attention``,
``make_layernorm``, ``make_mlp``), so the runtime drives it natively: inputs ``input_ids``, ``attention_mask`` and
``past_key_values.%d.key/value`` (batch, kv_heads, past, head_dim); outputs ``logits`` and ``present.%d.key/value``;
one ``GroupQueryAttention`` per layer (rotary applied inside it from cos/sin caches, packed q/k/v input, past and
present able to share one buffer), ``SimplifiedLayerNormalization`` / ``SkipSimplifiedLayerNormalization`` for the
RMSNorms with the residual adds fused in, SiLU as Sigmoid x Mul.

What differs is the projections: each keeps its deployed form. Projections reading the same input (q/k/v; gate/up)
run their first stage as ONE MatMul over the concatenated dense weights and first low-rank factors, split after;
each low-rank piece then takes its second factor. A dense+LoRA projection (bench's ``lora`` variant) contributes
both its dense weight and its first factor to the shared MatMul and adds its second stage. We emit the graph
ourselves rather than subclassing the builder: the builder reads checkpoints by its own module names, knows only
dense projections (``make_matmul_lora`` is an unmerged adapter beside a dense weight, not a replacement), and its
internals change between releases; ~200 lines of ``onnx.helper`` are easier to keep working.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
from onnx import TensorProto, helper, numpy_helper

from bdlora.deployed.modeling_bdlora import DenseLoRALinear, LowRankLinear
from bdlora.errors import ModelError
from bdlora.runtime import DecoderSignature as Sig

# the signature's symbolic dims, spelled as onnxruntime-genai's model builder spells them in its graphs
GENAI_DIMS = {"batch": "batch_size", "seq": "sequence_length", "past": "past_sequence_length",
              "total": "total_sequence_length"}

MS = "com.microsoft"
OPSET = 21


@dataclass
class Projection:
    """One projection as deployed: ``y = x W^T + (x A^T) B^T + b`` with any of the parts absent."""

    name: str
    out_features: int
    weight: np.ndarray | None = None  # (out, in) dense part
    lora_a: np.ndarray | None = None  # (r, in) first low-rank factor
    lora_b: np.ndarray | None = None  # (out, r) second low-rank factor
    bias: np.ndarray | None = None
    form: str = "dense"
    rank: int = 0

    @classmethod
    def of(cls, name: str, m: nn.Module) -> Projection:
        def f(t):
            return None if t is None else t.detach().float().cpu().numpy()

        if isinstance(m, LowRankLinear):
            return cls(name, m.out_features, lora_a=f(m.proj_in.weight), lora_b=f(m.proj_out.weight),
                       bias=f(m.proj_out.bias), form="lowrank", rank=m.rank)
        if isinstance(m, nn.Linear):
            return cls(name, m.out_features, weight=f(m.weight), bias=f(m.bias))
        if isinstance(m, DenseLoRALinear):
            return cls(name, m.base.out_features, weight=f(m.base.weight), lora_a=f(m.lora_A),
                       lora_b=f(m.lora_B), bias=f(m.base.bias), form="dense+lora", rank=m.lora_rank)
        raise TypeError(f"{name}: unsupported projection module {type(m).__name__}")

    def first_stage(self) -> list[np.ndarray]:
        """The (in, k) column blocks this projection adds to its group's shared first MatMul."""
        return [w.T for w in (self.weight, self.lora_a) if w is not None]


@dataclass
class GraphBuilder:
    """Accumulates nodes and initialisers; names follow the builder's ``/model/layers.N/...`` scopes."""

    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "", doc: str = "",
             outputs: list[str] | None = None, **attrs) -> list[str]:
        outs = outputs or [f"{name}/output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain or None, doc_string=doc,
                                           **attrs))
        return outs

    def one(self, *args, **kwargs) -> str:
        return self.node(*args, **kwargs)[0]


def _doc(projs: list[Projection]) -> str:
    return json.dumps([{"bdlora_module": p.name, "form": p.form, "rank": p.rank} for p in projs])


def emit_group(g: GraphBuilder, x: str, projs: list[Projection], scope: str) -> list[str]:
    """Outputs of projections sharing the input ``x``: one MatMul over every first-stage block, a Split, then each
    low-rank piece's second factor, the dense and low-rank parts added, then the bias."""
    blocks = [b for p in projs for b in p.first_stage()]
    first = f"{scope}/{'_'.join(p.name.rsplit('.', 1)[-1].removesuffix('_proj') for p in projs)}_in"
    w = g.init(f"{first}.weight", np.concatenate(blocks, axis=1).astype(np.float32))
    y = g.one("MatMul", [x, w], f"{first}/MatMul", doc=_doc(projs))
    sizes = [b.shape[1] for b in blocks]
    pieces = [y] if len(blocks) == 1 else g.node(
        "Split", [y, g.init(f"{first}.split", np.array(sizes, np.int64))], f"{first}/Split", n_out=len(blocks),
        axis=-1)
    outs, i = [], 0
    for p in projs:
        pname = f"{scope}/{p.name.rsplit('.', 1)[-1]}"
        dense = pieces[i] if p.weight is not None else None
        i += p.weight is not None
        out = dense
        if p.lora_a is not None:
            h = pieces[i]
            i += 1
            wb = g.init(f"{pname}.lora_b", p.lora_b.T.astype(np.float32))
            low = g.one("MatMul", [h, wb], f"{pname}/lora_b/MatMul", doc=_doc([p]))
            out = low if dense is None else g.one("Add", [dense, low], f"{pname}/lora/Add")
        if p.bias is not None:
            out = g.one("Add", [out, g.init(f"{pname}.bias", p.bias.astype(np.float32))], f"{pname}/bias/Add")
        outs.append(out)
    return outs


def emit_packed_qkv(g: GraphBuilder, x: str, projs: list[Projection], scope: str) -> str:
    """q, k, v packed on the last axis for GroupQueryAttention. All-dense q/k/v (with their biases) stay one
    MatMul (+ one Add), as the builder emits them."""
    if all(p.form == "dense" for p in projs):
        w = g.init(f"{scope}/qkv_proj.weight", np.concatenate([p.weight.T for p in projs], axis=1))
        y = g.one("MatMul", [x, w], f"{scope}/qkv_proj/MatMul", doc=_doc(projs))
        if any(p.bias is not None for p in projs):
            b = np.concatenate([p.bias if p.bias is not None else np.zeros(p.out_features, np.float32)
                                for p in projs])
            y = g.one("Add", [y, g.init(f"{scope}/qkv_proj.bias", b.astype(np.float32))], f"{scope}/qkv_proj/Add")
        return y
    q, k, v = emit_group(g, x, projs, scope)
    return g.one("Concat", [q, k, v], f"{scope}/qkv/Concat", axis=-1)


def rotary_caches(model: nn.Module, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(length, head_dim / 2) cos and sin tables from the model's own rotary embedding (so any rope scaling the
    model applies is in them); Llama-style rotation (halves, not interleaved)."""
    rot = model.model.rotary_emb
    pos = torch.arange(length)[None]
    with torch.no_grad():
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    half = cos.shape[-1] // 2
    if not torch.allclose(cos[..., :half], cos[..., half:]):
        raise ValueError("the model's rotary tables are not Llama-style halves; the genai graph cannot express them")
    return cos[0, :, :half].float().numpy(), sin[0, :, :half].float().numpy()


def _f32(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _mask_inputs(g: GraphBuilder) -> tuple[str, str]:
    """GroupQueryAttention's ``seqlens_k`` (real tokens per row minus one, int32) and ``total_sequence_length``
    (the mask's width, int32) from the 2D attention mask: the builder's attn_mask_reformat subgraph."""

    one = g.init("/model/constants/INT64/[1]", np.array([1], np.int64))
    total = g.one("ReduceSum", [Sig.ATTENTION_MASK, one], "/model/attn_mask/ReduceSum", keepdims=0)
    seqlens_k = g.one("Cast", [g.one("Sub", [total, one], "/model/attn_mask/Sub")], "/model/attn_mask/seqlens_k",
                      to=TensorProto.INT32)
    width = g.one("Gather", [g.one("Shape", [Sig.ATTENTION_MASK], "/model/attn_mask/Shape"),
                             g.init("/model/constants/INT64/1", np.array(1, np.int64))], "/model/attn_mask/Gather",
                  axis=0)
    return seqlens_k, g.one("Cast", [width], "/model/attn_mask/total_seq_len", to=TensorProto.INT32)


def _layer(g: GraphBuilder, i: int, layer: nn.Module, residual: str, mlp_prev: str | None, mask: tuple[str, str],
           cfg) -> tuple[str, str]:
    """One decoder layer; returns (residual stream before this layer's MLP add, MLP output): the next layer's
    SkipSimplifiedLayerNormalization adds them."""
    s, eps = f"/model/layers.{i}", float(cfg.rms_norm_eps)
    w_in = g.init(f"model.layers.{i}.input_layernorm.weight", _f32(layer.input_layernorm.weight))
    if mlp_prev is None:
        normed = g.one("SimplifiedLayerNormalization", [residual, w_in], f"{s}/input_layernorm", axis=-1,
                       epsilon=eps, stash_type=1)
    else:
        normed, _, _, residual = g.node("SkipSimplifiedLayerNormalization", [residual, mlp_prev, w_in],
                                        f"{s}/input_layernorm", n_out=4, domain=MS, epsilon=eps)
    at = layer.self_attn
    qkv = emit_packed_qkv(g, normed, [Projection.of(f"model.layers.{i}.self_attn.{n}", getattr(at, n))
                                      for n in ("q_proj", "k_proj", "v_proj")], f"{s}/self_attn")
    use_window = getattr(cfg, "use_sliding_window", True)
    window = getattr(cfg, "sliding_window", None) if use_window else None
    attn, _, _ = g.node(
        "GroupQueryAttention",
        [qkv, "", "", Sig.past(i, "key"), Sig.past(i, "value"), *mask, "cos_cache", "sin_cache"],
        f"{s}/self_attn/GroupQueryAttention", domain=MS,
        outputs=[f"{s}/self_attn/GroupQueryAttention/output_0", Sig.present(i, "key"), Sig.present(i, "value")],
        num_heads=cfg.num_attention_heads, kv_num_heads=cfg.num_key_value_heads, scale=float(at.scaling),
        do_rotary=1, rotary_interleaved=0, local_window_size=int(window) if window else -1)
    (o,) = emit_group(g, attn, [Projection.of(f"model.layers.{i}.self_attn.o_proj", at.o_proj)], f"{s}/self_attn")
    w_post = g.init(f"model.layers.{i}.post_attention_layernorm.weight", _f32(layer.post_attention_layernorm.weight))
    normed, _, _, residual = g.node("SkipSimplifiedLayerNormalization", [residual, o, w_post],
                                    f"{s}/post_attention_layernorm", n_out=4, domain=MS, epsilon=eps)
    mlp = layer.mlp
    gate, up = emit_group(g, normed, [Projection.of(f"model.layers.{i}.mlp.{n}", getattr(mlp, n))
                                      for n in ("gate_proj", "up_proj")], f"{s}/mlp")
    act = g.one("Mul", [gate, g.one("Sigmoid", [gate], f"{s}/mlp/act_fn/Sigmoid")], f"{s}/mlp/act_fn/Mul")
    hidden = g.one("Mul", [act, up], f"{s}/mlp/Mul")
    (down,) = emit_group(g, hidden, [Projection.of(f"model.layers.{i}.mlp.down_proj", mlp.down_proj)], f"{s}/mlp")
    return residual, down


def _io(vocab: int, layers: int, kv_heads: int, hd: int) -> tuple[list, list]:
    sig = Sig(layers, position_ids=False)
    dim = GENAI_DIMS.get
    batch, seq = (dim(d) for d in sig.TOKENS_DIMS)
    kv_shape = [batch, kv_heads, dim(sig.PAST_DIMS[2]), hd]
    present_shape = [batch, kv_heads, dim(sig.PRESENT_DIMS[2]), hd]
    inputs = [helper.make_tensor_value_info(sig.INPUT_IDS, TensorProto.INT64, [batch, seq]),
              helper.make_tensor_value_info(sig.ATTENTION_MASK, TensorProto.INT64, [dim(d) for d in sig.MASK_DIMS])]
    outputs = [helper.make_tensor_value_info(sig.LOGITS, TensorProto.FLOAT, [batch, seq, vocab])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in sig.cache_inputs]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, present_shape) for n in sig.cache_outputs]
    return inputs, outputs


def build_decoder(model: nn.Module, context_length: int):
    """The genai decoder ``ModelProto`` of ``model`` (a HF Llama/Mistral/Qwen2 causal LM, any projection forms)."""

    cfg = model.config
    layers = model.model.layers
    hd = layers[0].self_attn.head_dim
    if hd % 16:
        raise ModelError(f"head dim {hd}: onnxruntime's GroupQueryAttention (the genai runtime's attention) needs a "
                         "multiple of 16; use `bdlora export onnx` for this model")
    g = GraphBuilder()
    mask = _mask_inputs(g)
    cos, sin = rotary_caches(model, context_length)
    g.init("cos_cache", cos)
    g.init("sin_cache", sin)
    emb = g.init("model.embed_tokens.weight", _f32(model.model.embed_tokens.weight))
    residual, mlp_out = g.one("Gather", [emb, Sig.INPUT_IDS], "/model/embed_tokens/Gather"), None
    for i, layer in enumerate(layers):
        residual, mlp_out = _layer(g, i, layer, residual, mlp_out, mask, cfg)
    w_norm = g.init("model.norm.weight", _f32(model.model.norm.weight))
    final, _, _, _ = g.node("SkipSimplifiedLayerNormalization", [residual, mlp_out, w_norm], "/model/norm",
                            n_out=4, domain=MS, epsilon=float(cfg.rms_norm_eps))
    head = model.lm_head
    w_head = g.init("lm_head.weight", _f32(head.weight).T)
    if head.bias is None:
        g.node("MatMul", [final, w_head], "/lm_head/MatMul", outputs=[Sig.LOGITS])
    else:
        logits = g.one("MatMul", [final, w_head], "/lm_head/MatMul")
        g.node("Add", [logits, g.init("lm_head.bias", _f32(head.bias))], "/lm_head/Add", outputs=[Sig.LOGITS])
    inputs, outputs = _io(head.weight.shape[0], len(layers), cfg.num_key_value_heads, hd)
    graph = helper.make_graph(g.nodes, "bdlora_genai_decoder", inputs, outputs, initializer=g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                             producer_name="bdlora")
