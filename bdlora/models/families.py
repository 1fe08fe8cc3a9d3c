"""The model families bdlora adapts, one table (litgpt's ``configs`` list, onnxruntime-genai's builder subclasses):
each entry names a family's Hugging Face classes, its anatomy (the projections in ``named_modules()`` order, which of
them read one input, the gated MLP's activation), its onnxruntime-genai model type and whether that runtime's own
model builder converts it. Costs, integrity, plan, the exporters and the teacher loaders read it; a model type the
table lacks is refused in one line naming those it has. Standard library only.

bdlora's own architecture for each family (``deployed/modeling_bdlora.py``) ships inside every model folder as
remote code, so it cannot import this table; ``tests/test_structure.py`` holds the two to the same families.

Adding a family (docs/design.md, "How to add a model family"): one ``Family`` here; its bdlora classes in
``modeling_bdlora.py`` if students of it are trained and compressed; an emitter branch only where its anatomy differs
from one the graph emitter already knows (``export/decoder/graph.py`` refuses an activation it does not emit).
"""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.base.errors import UsageError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Anatomy:
    """What the code that computes costs or emits graphs needs to know of a decoder layer."""

    projections: tuple[str, ...] = ATTENTION + MLP
    """Every adapted projection of a layer, in ``named_modules()`` order (the controller's tie-break order)."""
    shared_inputs: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("o_proj",),
                                                  ("gate_proj", "up_proj"), ("down_proj",))
    """Projections that read one tensor: the emitter stacks their first factors into one MatMul."""
    activation: str = "silu"
    """The gated MLP's activation (``act(gate(x)) * up(x)``), as transformers names it in ``hidden_act`` (or
    ``hidden_activation``)."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head (``self_attn.q_norm`` / ``k_norm``) before the rotation."""
    sandwich_norms: bool = False
    """Each block's output is normed before its residual add (``post_attention_layernorm``,
    ``post_feedforward_layernorm``) and the MLP reads ``pre_feedforward_layernorm``; otherwise the MLP reads
    ``post_attention_layernorm`` (Llama's two norms per layer)."""
    norm_offset: float = 0.0
    """Every RMSNorm scales by ``norm_offset + weight`` (Gemma's ``1 + w``)."""
    embed_scale: bool = False
    """The embeddings are multiplied by ``sqrt(hidden_size)`` before the first layer (the tied head is not)."""
    per_layer_attention: bool = False
    """Each layer's ``layer_types`` entry picks its attention: ``sliding_attention`` (windowed, its own rotary base)
    or ``full_attention``."""

    @property
    def mlp_norm(self) -> str:
        """The norm whose output the MLP reads."""
        return "pre_feedforward_layernorm" if self.sandwich_norms else "post_attention_layernorm"

    def block_of(self, projection: str) -> str:
        """The HF submodule that holds ``projection`` (``self_attn`` or ``mlp``)."""
        return "self_attn" if projection in ATTENTION else "mlp"

    def input_group(self, projection: str) -> int:
        """Index of the ``shared_inputs`` group that holds ``projection``."""
        return next(i for i, group in enumerate(self.shared_inputs) if projection in group)


@dataclass(frozen=True)
class Family:
    """One model family, by its transformers ``model_type``."""

    model_type: str
    causal_lm: str
    """transformers' causal-LM class of the family."""
    anatomy: Anatomy = Anatomy()
    genai_type: str | None = None
    """onnxruntime-genai's model type for the family (None: ``export genai`` refuses it)."""
    builder: bool = False
    """Whether onnxruntime-genai's own model builder converts the family (the bench's builder rows)."""
    weights: bool = True
    """False: ``plan`` reads its shapes, but no other command loads it (no bdlora architecture yet)."""
    gguf_arch: str | None = None
    """llama.cpp's architecture of the family's dense model (``export gguf``; None: refused)."""
    gguf_per_layer: bool = False
    """Whether the family's layer is a Llama layer (biases optional), so that a student whose layers differ (pruned
    MLPs or attention) is written as llama.cpp's per-layer ``GGUF_PER_LAYER`` architecture."""


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("mistral", "MistralForCausalLM", genai_type="mistral", builder=True, gguf_arch="llama",
           gguf_per_layer=True),
    Family("llama", "LlamaForCausalLM", genai_type="llama", builder=True, gguf_arch="llama", gguf_per_layer=True),
    Family("qwen2", "Qwen2ForCausalLM", genai_type="qwen2", builder=True, gguf_arch="qwen2", gguf_per_layer=True),
    # GELU-gated MLP, query/key norms, four norms per layer with 1 + w, scaled embeddings, 5 local : 1 global
    # attention layers with their own rotary bases, a tied 262k-token head
    Family("gemma3_text", "Gemma3ForCausalLM", Anatomy(activation="gelu_pytorch_tanh", qk_norm=True,
                                                       sandwich_norms=True, norm_offset=1.0, embed_scale=True,
                                                       per_layer_attention=True),
           genai_type="gemma3_text", builder=True, gguf_arch="gemma3"),
    # query/key norms and an explicit head_dim: its projections' shapes are known, its layers are not emitted yet
    Family("qwen3", "Qwen3ForCausalLM", weights=False),
)}

# llama.cpp's names (export gguf), here because some spell a family's: its per-layer architecture (Nemotron's), the
# architectures that rotate consecutive pairs (HF's query and key rows are permuted for them), and the tokenizer model
# of a SentencePiece vocabulary
GGUF_PER_LAYER = "deci"
GGUF_ROPE_PAIRS = ("llama", GGUF_PER_LAYER)
GGUF_SPM_TOKENIZER = "llama"

# the families whose weights bdlora loads, trains, compresses and exports
LOADED = tuple(t for t, f in FAMILIES.items() if f.weights)
BDLORA_PREFIX = "bdlora_"  # bdlora's own model_type for a family: bdlora_<family>


def base_type(model_type: str) -> str:
    """The family of ``model_type`` (bdlora's compressed ``bdlora_<family>`` counts as its family)."""
    return model_type.removeprefix(BDLORA_PREFIX)


def family(model_type: str, what: str = "model_type", loaded: bool = True) -> Family:
    """The table's entry for ``model_type`` (or its bdlora form), else a one-line refusal naming the families it has
    (``loaded``: only those whose weights bdlora loads)."""
    found = FAMILIES.get(base_type(str(model_type)))
    if found is None or (loaded and not found.weights):
        have = LOADED if loaded else tuple(FAMILIES)
        more = f" ({', '.join(t for t in FAMILIES if t not in have)}: plan only)" if loaded and len(have) < len(
            FAMILIES) else ""
        raise UsageError(f"{what} {model_type!r}: not a family bdlora adapts (it adapts {', '.join(have)}{more})")
    return found


def with_layers(config: dict, layers: int) -> dict:
    """``config`` (a config.json mapping) of a model of ``layers`` decoder layers: a family whose layers have kinds
    (``layer_types``) keeps its pattern, cycled, so its config stays one transformers accepts."""
    out = {**config, "num_hidden_layers": int(layers)}
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        out["layer_types"] = [kinds[i % len(kinds)] for i in range(int(layers))]
    return out


def genai_families() -> tuple[str, ...]:
    return tuple(t for t, f in FAMILIES.items() if f.weights and f.genai_type)
