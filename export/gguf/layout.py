"""What a model folder becomes in llama.cpp: its GGUF architecture, the shape of every layer, the hyperparameter keys
and every tensor under llama.cpp's name with the type it is stored in, planned from ``config.json`` and the weight
files' headers alone (nothing is read), and what llama.cpp cannot express, refused in one line.

A dense model of a family is written as llama.cpp's converter writes it (``Family.gguf_arch``: ``llama`` for Llama
and Mistral, ``qwen2``, ``gemma3``). A student whose layers differ (an MLP keeping fewer channels, an attention
block fewer key/value groups with their query heads, removed layers: its folder holds only the kept ones, numbered
in order) is llama.cpp's ``deci`` architecture, the one Nemotron-51B uses: per-layer ``attention.head_count``,
``attention.head_count_kv`` and ``feed_forward_length`` shape each layer's tensors and its KV cache
(``src/models/deci.cpp``), for Llama-layered families (Llama, Mistral, Qwen2: its biases ride along, its rotary
taken to llama.cpp's by the permutation Llama's weights get). Traps from llama.cpp's source, refused before
anything is written: a layer keeping attention but no MLP loses its attention output there (the loop continues
before the residual), layer 0 must keep attention (the head size is read from it), every layer one head size.

Low-rank pairs have no llama.cpp form: refused, naming the modules and the forms that can be written (``--forms
channels,groups,layers``), or with ``--merge-lowrank`` multiplied out into dense weights (the speed they bought is
lost: the row in ``export.json`` says how many MACs come back). A head keeping fewer tokens (a draft's ``vocab``
form) is refused: llama.cpp's embedding and output share one vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from bdlora.base.errors import ModelError, UsageError
from bdlora.forms import VOCAB
from bdlora.models.families import GGUF_PER_LAYER, GGUF_ROPE_PAIRS, base_type, family

QUANTS = ("f16", "q8_0", "q4_0", "q4_k_m")
NUMPY_QUANTS = ("f16", "q8_0", "q4_0")  # written by the gguf package; q4_k_m by llama.cpp's own quantizer
GEMMA3_27B_LAYERS = 62  # llama.cpp's gemma3 scales queries by hidden / heads at this depth, by the head size otherwise
CHUNK_BYTES = 64 << 20  # fp32 rows produced, rounded and written at a time (a 128k vocabulary's embedding at 8B)


@dataclass(frozen=True)
class LayerShape:
    heads: int
    kv_heads: int
    ffn: int


@dataclass(frozen=True)
class Planned:
    """One GGUF tensor: its name, its (rows, cols) in PyTorch's orientation (GGUF reverses it), what it is made from
    (``source``: the folder's tensor names; two for a merged pair, none for a computed one) and how."""

    name: str
    shape: tuple[int, ...]
    source: tuple[str, ...]
    permute: int = 0  # heads whose rows are permuted to llama.cpp's rotary order (0: none)
    shift: float = 0.0  # added to every value (Gemma's norms store w, llama.cpp multiplies by 1 + w)
    rows: int | None = None  # the first rows only (an embedding trimmed to the tokenizer's tokens)
    value: tuple[float, ...] = ()  # a computed tensor's values (llama 3's rotary factors)


@dataclass
class GgufLayout:
    arch: str
    family: str
    config: dict
    layers: list[LayerShape]
    head_dim: int
    tied: bool
    merged: list[str] = field(default_factory=list)  # low-rank modules multiplied out (--merge-lowrank)

    @property
    def per_layer(self) -> bool:
        return self.arch == GGUF_PER_LAYER


def rope_parameters(config: dict) -> dict:
    """The rotary settings of the full-attention layers, whichever transformers wrote them (5.x
    ``rope_parameters``, per layer kind for Gemma 3; 4.x ``rope_theta`` and ``rope_scaling``)."""
    rp = config.get("rope_parameters")
    if isinstance(rp, dict):
        return dict(rp.get("full_attention", rp)) if isinstance(rp.get("full_attention"), dict) else dict(rp)
    out = dict(config.get("rope_scaling") or {})
    if config.get("rope_theta") is not None:
        out["rope_theta"] = config["rope_theta"]
    return out


def _module_shapes(tensors: dict[str, tuple[int, ...]], name: str) -> tuple[int, int, bool]:
    """(out, in, low-rank) of projection ``name`` from the weight files' shapes."""
    if f"{name}.weight" in tensors:
        out, inp = tensors[f"{name}.weight"]
        return out, inp, False
    if f"{name}.proj_in.weight" in tensors and f"{name}.proj_out.weight" in tensors:
        return tensors[f"{name}.proj_out.weight"][0], tensors[f"{name}.proj_in.weight"][1], True
    raise ModelError(f"no weight for {name} in the folder's weight files")


def plan_layout(config: dict, tensors: dict[str, tuple[int, ...]], merge_lowrank: bool = False) -> GgufLayout:
    """The GGUF form of the model ``config`` declares, whose weight files hold ``tensors`` (name -> shape)."""
    fam = family(config.get("model_type"), "the model's model_type")
    name = base_type(str(config.get("model_type")))
    if fam.gguf_arch is None:
        raise UsageError(f"model_type {config.get('model_type')!r}: no llama.cpp architecture bdlora writes it as")
    modules = config.get("bdlora_modules") or {}
    vocab = [site for site, spec in modules.items() if isinstance(spec, dict) and spec.get("form") == VOCAB.name]
    if vocab or "lm_head.token_ids" in tensors:
        raise UsageError("the LM head keeps fewer tokens (--forms vocab, a draft's head): llama.cpp's embedding and "
                         "output share one vocabulary; export a student of --forms channels,groups,layers")
    heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads)
    scalar = config.get("query_pre_attn_scalar")
    if fam.anatomy.per_layer_attention and scalar is not None:  # Gemma 3: llama.cpp fixes the query scale
        runs = hidden / heads if int(config["num_hidden_layers"]) == GEMMA3_27B_LAYERS else head_dim
        if float(scalar) != float(runs):
            raise UsageError(f"query_pre_attn_scalar {scalar}: llama.cpp's gemma3 scales queries by 1/sqrt({runs:g}) "
                             "for a model of this depth and reads no key for it; this model would run otherwise there")
    layers, lowrank = [], []
    for i in range(int(config["num_hidden_layers"])):
        q, _, lq = _module_shapes(tensors, f"model.layers.{i}.self_attn.q_proj")
        k, _, lk = _module_shapes(tensors, f"model.layers.{i}.self_attn.k_proj")
        _, ffn, ld = _module_shapes(tensors, f"model.layers.{i}.mlp.down_proj")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            block = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            if _module_shapes(tensors, f"model.layers.{i}.{block}.{proj}")[2]:
                lowrank.append(f"model.layers.{i}.{block}.{proj}")
        if q % head_dim or k % head_dim:
            raise ModelError(f"layer {i}: {q} query and {k} key rows are not whole heads of {head_dim}")
        layers.append(LayerShape(q // head_dim, k // head_dim, ffn))
    if lowrank and not merge_lowrank:
        shown = ", ".join(lowrank[:3]) + (f" and {len(lowrank) - 3} more" if len(lowrank) > 3 else "")
        raise UsageError(f"{len(lowrank)} low-rank module(s) ({shown}) have no llama.cpp form: export a student of "
                         "--forms channels,groups,layers, or pass --merge-lowrank to multiply them out (dense again: "
                         "their speed-up is lost)")
    full = LayerShape(heads, kv, int(config["intermediate_size"]))
    arch = fam.gguf_arch
    if any(s != full for s in layers) or len(layers) != int(config.get("num_hidden_layers")):
        if not fam.gguf_per_layer:
            raise UsageError(f"a {name} student with pruned blocks: llama.cpp's per-layer architecture (deci) is "
                             f"Llama's, and {name}'s layers differ from it; export its dense teacher, or a student "
                             "of a Llama, Mistral or Qwen2 model")
        arch = GGUF_PER_LAYER
    for i, s in enumerate(layers):
        if s.heads == 0 or s.kv_heads == 0:
            raise UsageError(f"layer {i} keeps no attention: llama.cpp reads the head size from layer 0 and drops a "
                             "layer's attention output when it has no MLP; keep at least one key/value group")
        if s.ffn == 0:
            raise UsageError(f"layer {i} keeps attention but no MLP: llama.cpp's deci loses that layer's attention "
                             "output (its loop continues before the residual add); drop the layer whole instead")
        if s.heads % s.kv_heads:
            raise ModelError(f"layer {i}: {s.heads} query heads do not share {s.kv_heads} key/value heads evenly")
    tied = bool(config.get("tie_word_embeddings", False)) and "lm_head.weight" not in tensors
    return GgufLayout(arch, name, config, layers, head_dim, tied, lowrank)


def tensor_plan(layout: GgufLayout, tensors: dict[str, tuple[int, ...]], vocab_rows: int) -> list[Planned]:
    """Every tensor of the GGUF file, in the order llama.cpp's converter writes them (the rotary factors, the
    embedding, each layer's, the final norm, the output head unless tied)."""
    import gguf

    cfg = layout.config
    arch = gguf.MODEL_ARCH[layout.arch.upper()]
    names = gguf.get_tensor_name_map(arch, len(layout.layers))
    permute = layout.arch in GGUF_ROPE_PAIRS
    shift = family(layout.family).anatomy.norm_offset  # Gemma's norms store w, llama.cpp multiplies by 1 + w
    out: list[Planned] = []
    factors = llama3_rope_factors(cfg, layout.head_dim)
    if factors is not None:
        out.append(Planned(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", (len(factors),), (),
                           value=tuple(factors)))
    sources = [n for n in tensors if not n.endswith(".proj_out.weight")]
    order = {"model.embed_tokens.weight": -2, "model.norm.weight": 10**9, "lm_head.weight": 10**9 + 1}
    for src in sorted(sources, key=lambda n: (order.get(n, _layer(n)), n)):
        if src.endswith(".proj_in.weight"):  # a low-rank pair, multiplied out (the plan refused it otherwise)
            module = src.removesuffix(".proj_in.weight")
            hf, pair = f"{module}.weight", (f"{module}.proj_out.weight", src)
            shape = (tensors[pair[0]][0], tensors[src][1])
        elif src.endswith(".proj_out.bias"):
            hf, pair, shape = src.replace(".proj_out.bias", ".bias"), (src,), tensors[src]
        else:
            hf, pair, shape = src, (src,), tensors[src]
        mapped = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ModelError(f"{src}: no llama.cpp tensor of the {layout.arch} architecture holds it")
        layer = _layer(hf)
        heads = 0
        if permute and hf.endswith(("q_proj.weight", "q_proj.bias")):
            heads = layout.layers[layer].heads
        elif permute and hf.endswith(("k_proj.weight", "k_proj.bias")):
            heads = layout.layers[layer].kv_heads
        rows = None
        if hf in ("model.embed_tokens.weight", "lm_head.weight") and shape[0] != vocab_rows:
            if shape[0] < vocab_rows:
                raise ModelError(f"{src}: {shape[0]} rows, fewer than the tokenizer's {vocab_rows} tokens")
            rows, shape = vocab_rows, (vocab_rows, *shape[1:])
        out.append(Planned(mapped, tuple(shape), pair, heads, shift if hf.endswith("norm.weight") else 0.0, rows))
    return out


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1


def llama3_rope_factors(config: dict, head_dim: int) -> list[float] | None:
    """Llama 3's rotary frequency factors (``rope_type`` llama3), as llama.cpp's converter computes them into
    ``rope_freqs.weight``; None for any other rotary."""
    rp = rope_parameters(config)
    if str(rp.get("rope_type", rp.get("type", ""))).lower() != "llama3":
        return None
    base = float(rp.get("rope_theta", 10000.0))
    factor = float(rp.get("factor", 8.0))
    low, high = float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
    old = float(rp.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old / low, old / high
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # in float32, as there
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out

