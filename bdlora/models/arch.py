"""How to reach the parts of the decoders bdlora adapts (the families of ``bdlora.models.families``' table).

One place for: the seven projection names and which block holds each, the check that a model is of a family the
table loads (by ``isinstance`` on transformers' classes, which bdlora's compressed classes subclass), the
unwrap of a PEFT-wrapped model, the final hidden states + LM head without full-vocabulary logits, and the plain
state dict of a wrapped student. torch and transformers are imported by the functions that need them, so
``plan``, the CLI and serving can read the names without loading torch.
"""

from __future__ import annotations

from bdlora.base.errors import UsageError
from bdlora.models.families import ATTENTION as ATTENTION_PROJECTIONS
from bdlora.models.families import FAMILIES, LOADED
from bdlora.models.families import MLP as MLP_PROJECTIONS

PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
SUPPORTED_FAMILIES = LOADED
# tensors a training wrapper adds beside the dense weights (PEFT LoRA, bdlora gated modules)
ADAPTER_TENSORS = ("lora_", "gate_logits", "retention", "lora_dropout")


def block_of(projection: str) -> str:
    """``q_proj`` -> ``self_attn``, ``down_proj`` -> ``mlp`` (the HF submodule that holds it)."""
    return "self_attn" if projection in ATTENTION_PROJECTIONS else "mlp"


def layer_of(name: str) -> str:
    """``model.layers.N`` of a projection's or an MLP site's name (or of the layer's own)."""
    return ".".join(name.split(".")[:3])


def projection_name(layer: int, projection: str) -> str:
    return f"model.layers.{layer}.{block_of(projection)}.{projection}"


def max_lora_rank(config) -> tuple[int, str]:
    """(the largest useful LoRA rank, the projections that bound it): the smallest ``min(in, out)`` over the seven
    projections; a rank above a projection's own rank adds compute and parameters and nothing else. ``config``
    is a transformers config or its dict."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    h, inter, heads = int(get("hidden_size")), int(get("intermediate_size")), int(get("num_attention_heads"))
    head_dim = int(get("head_dim", None) or h // heads)
    kv = int(get("num_key_value_heads", None) or heads)
    dims = {"q_proj/o_proj": min(h, heads * head_dim), "k_proj/v_proj": min(h, kv * head_dim),
            "gate_proj/up_proj/down_proj": min(h, inter)}
    name = min(dims, key=dims.get)
    return dims[name], name


def check_lora_rank(rank: int | None, config, defaulted: bool = False) -> int | None:
    """``rank`` if it is at most ``max_lora_rank(config)``; a defaulted rank is lowered to it, an explicit one
    above it is a one-line error naming the bound."""

    bound, where = max_lora_rank(config)
    if rank is None or rank <= bound:
        return rank
    if defaulted:
        return bound
    raise UsageError(f"--lora-rank {rank}: above this model's largest useful rank {bound} (min(in, out) of "
                     f"{where}); use at most {bound}")


def is_projection(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in PROJECTIONS


def base_model(model):
    """The HF causal LM inside a PEFT wrapper (the model itself when it is not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def hidden_and_head(model, input_ids, attention_mask=None):
    """Final-norm hidden states (B, T, H) of a Llama/Mistral/Qwen2 causal LM (plain, PEFT-wrapped, or with bdlora
    gated modules) and its LM head, without computing full-vocabulary logits."""
    base = base_model(model)
    out = base.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state, base.lm_head


def family_classes() -> dict:
    """model_type -> transformers' causal-LM class of each family whose weights bdlora loads (the table's)."""
    import transformers

    return {t: getattr(transformers, FAMILIES[t].causal_lm) for t in LOADED}


def family_of(model) -> str | None:
    """The supported family a model belongs to (bdlora's compressed classes count as their base), else None."""
    for family, cls in family_classes().items():
        if isinstance(base_model(model), cls):
            return family
    return None


def projection_modules(model) -> list[tuple[str, object]]:
    """(name, module) of every projection, in ``named_modules()`` order (the controller's tie-break order)."""
    return [(n, m) for n, m in model.named_modules() if is_projection(n) and "." in n]


def set_module(model, name: str, module) -> None:
    parent, child = name.rsplit(".", 1)
    setattr(model.get_submodule(parent), child, module)


def unsupported(what: str, model_type: str) -> str:
    return (f"{what}: not a family bdlora adapts (model_type {model_type}); bdlora adapts the q/k/v/o/gate/up/down "
            f"projections of the {', '.join(SUPPORTED_FAMILIES)} families")


def dense_state_dict(model) -> dict:
    """The plain HF state dict of a (possibly PEFT- or gated-LoRA-wrapped) student: adapter tensors dropped and
    ``base_layer.`` unwrapped, so it loads into the unwrapped architecture."""
    out = {}
    for k, v in base_model(model).state_dict().items():
        if any(t in k for t in ADAPTER_TENSORS):
            continue
        out[k.replace(".base_layer.", ".")] = v
    return out
