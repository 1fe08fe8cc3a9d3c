"""Model-level Budgeted LoRA (PEFT's ``model.py`` step): wrap a student's projections, save and load the gated
student, and compress it into the deployed bdlora architecture (SPEC 6).

A saved gated student is the dense student folder plus ``budgeted.safetensors`` (per module: lora_A, lora_B,
gate_logits, retention) and ``budgeted.json`` (rank, alpha, schedule and per-module shapes and d).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from bdlora import SCHEMA_VERSION, forms
from bdlora.base.errors import ModelError
from bdlora.base.io import load_tensors, read_json, save_tensors, write_json
from bdlora.base.runs import FACTORS_FILE, META_FILE
from bdlora.deployed.modeling_bdlora import BDLORA_CLASSES
from bdlora.forms import CHANNELS, GROUPS
from bdlora.models.arch import PROJECTIONS, base_model, dense_state_dict, is_projection, set_module
from bdlora.models.budgeted.config import DEFAULTS, BudgetedConfig
from bdlora.models.budgeted.layer import DeployedModule, GatedLoRALinear
from bdlora.models.costs import compression_report, deployed_form, site_forms
from bdlora.models.families import base_type
from bdlora.models.families import family as table_family
from bdlora.models.lazy import empty

TENSORS = ("lora_A", "lora_B", "gate_logits", "retention")


def apply_budgeted_lora(model: nn.Module, rank: int, alpha: float, gate_init: float = DEFAULTS.gate_init,
                        target_modules: tuple[str, ...] = PROJECTIONS,
                        ranks: dict[str, int] | None = None) -> list[str]:
    """Wrap every ``nn.Linear`` whose name ends in one of ``target_modules`` (the seven projection kinds) in a
    ``GatedLoRALinear``, freeze every other parameter, and return the wrapped names in ``named_modules()`` order
    (the controller's tie-break order). ``ranks`` gives modules their own rank (the quality allocation's); the
    others get ``rank``. alpha / r is the same for every module (alpha scales with the rank)."""
    for p in model.parameters():
        p.requires_grad_(False)
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in target_modules]
    if not targets:
        raise ValueError(f"no nn.Linear named {', '.join(target_modules)} in the model")
    for name, mod in targets:
        r = (ranks or {}).get(name) or rank
        set_module(model, name, GatedLoRALinear(mod, r, alpha * r / rank, gate_init))
    return list(gated_modules(model))


def gated_modules(model: nn.Module) -> dict[str, GatedLoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, GatedLoRALinear)}


def save_budgeted(gated: dict[str, GatedLoRALinear], cfg: BudgetedConfig, out_dir: Path) -> None:
    """``budgeted.safetensors`` + ``budgeted.json`` beside a dense student folder."""
    tensors = {f"{name}.{t}": getattr(m, t) for name, m in gated.items() for t in TENSORS}
    save_tensors(out_dir / FACTORS_FILE, tensors, metadata={"format": "pt"})
    write_json(out_dir / META_FILE, {
        "schema_version": SCHEMA_VERSION, "rank": cfg.rank, "alpha": cfg.alpha, "gate_init": cfg.gate_init,
        "budget": cfg.budget, "eps_zero": cfg.eps_zero,
        "modules": [{"name": n, "in_features": m.in_features, "out_features": m.out_features, "d": m.d,
                     "rank": m.rank} for n, m in gated.items()]})


def read_meta(path: Path) -> dict:
    """``budgeted.json``, checked: a JSON object with a positive integer rank and a positive alpha."""
    try:
        meta = read_json(path)
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({type(e).__name__}); the run is damaged") from None
    ok = (isinstance(meta, dict) and isinstance(meta.get("rank"), int) and not isinstance(meta["rank"], bool)
          and meta["rank"] > 0 and isinstance(meta.get("alpha"), (int, float)) and meta["alpha"] > 0
          and isinstance(meta.get("gate_init", 0.0), (int, float)))
    if not ok:
        raise ModelError(f"{path}: not a budgeted-module description (needs a positive integer rank and a positive "
                         "alpha); the run is damaged")
    return meta


def load_budgeted(student_dir: Path, model: nn.Module) -> nn.Module:
    """Re-wrap a dense student with gated modules and load the saved factors, gates and retentions; every module
    must be present with its declared shape."""
    meta = read_meta(student_dir / META_FILE)
    ranks = {m["name"]: m["rank"] for m in meta.get("modules") or () if isinstance(m, dict) and isinstance(
        m.get("rank"), int) and m["rank"] > 0 and isinstance(m.get("name"), str)}  # per module (older runs: one)
    apply_budgeted_lora(model, meta["rank"], meta["alpha"], meta.get("gate_init", DEFAULTS.gate_init), ranks=ranks)
    tensors = load_tensors(student_dir / FACTORS_FILE)
    gated = gated_modules(model)
    expected = {f"{n}.{t}" for n in gated for t in TENSORS}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ModelError(f"{student_dir / FACTORS_FILE}: does not match the student (missing {missing[:3]}, "
                         f"unexpected {extra[:3]})")
    for name, m in gated.items():
        with torch.no_grad():
            for t in ("lora_A", "lora_B", "gate_logits"):
                src, dst = tensors[f"{name}.{t}"], getattr(m, t)
                if src.shape != dst.shape:
                    raise ModelError(f"{student_dir / FACTORS_FILE}: {name}.{t} has shape {tuple(src.shape)}, the "
                                     f"student needs {tuple(dst.shape)}")
                dst.copy_(src)
        m.set_retention(float(tensors[f"{name}.retention"]))
    return model


def build_deployed_model(base: nn.Module, deployed: dict[str, DeployedModule], provenance: dict,
                         head: dict | None = None, share: bool = False):
    """The bdlora HF architecture holding the ``deployed`` projections and every other weight of ``base``; ``head``:
    the LM head's deployment record (``compress.oneshot.OneShotStructure.head``): ``spec`` and ``state``, the head in
    another form, its declaration and tensors (a draft's ``forms.VOCAB``; the embedding is then untied from it), and
    ``bits`` (4 or 8), its width in an int4 export, declared in its config (``forms.HEAD_BITS``; without it, what
    ``base`` declares, if anything: a student started from such a folder keeps it, as it keeps a pruned width).
    ``share``: the model holds ``base``'s and ``deployed``'s tensors themselves (built on the meta device and
    assigned: no random initialisation, no copy), for a caller that trains neither (the one-shot); otherwise its own
    copies."""

    family = table_family(base_type(base.config.model_type), "base model_type").model_type
    cfg_cls, model_cls = BDLORA_CLASSES[family]
    modules = {n: deployed_form(c.decision.rank, c.decision.bits) for n, c in deployed.items()}
    # MLPs and attention blocks pruned now (one-shot decisions) or already (a student started from a pruned folder)
    # (keyed by the deployed names: a one-shot above a removed layer is renumbered, its decisions are not)
    modules.update({**narrow_sites(base), **{n.rsplit(".", 1)[0]: spec for n, c in deployed.items()
                                            for spec in site_forms([c.decision]).values()}})
    head = head or {}
    if "spec" in head:
        modules[forms.HEAD] = head["spec"]
    config = cfg_cls(bdlora_modules=modules,
                     bdlora={"base_model_type": family, **provenance}, **_base_config_dict(base.config))
    if forms.HEAD in modules:  # a head of its own form holds its own weights
        config.tie_word_embeddings = False
    config.auto_map = {"AutoConfig": f"modeling_bdlora.{cfg_cls.__name__}",
                       "AutoModelForCausalLM": f"modeling_bdlora.{model_cls.__name__}"}
    config.architectures = [model_cls.__name__]
    if head.get("bits"):
        setattr(config, forms.HEAD_BITS, int(head["bits"]))
    model = empty(lambda: model_cls(config)) if share else model_cls(config)
    state = {k: v for k, v in dense_state_dict(base).items() if not any(k.startswith(n + ".") for n in deployed)}
    for n, c in deployed.items():
        state.update(c.state(n))
    if "state" in head:
        state = {k: v for k, v in state.items() if not k.startswith(forms.HEAD + ".")} | head["state"]
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=share)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def narrow_sites(model: nn.Module) -> dict[str, dict]:
    """The site entries of ``model``'s pruned blocks: ``channels`` for an MLP narrower than its ``intermediate_size``
    (its down projection's input width), ``groups`` for an attention block with fewer key/value heads than its
    ``num_key_value_heads`` (its k projection's output width over the head size), ``vocab`` for a head keeping
    fewer tokens, through any PEFT or gated wrapper."""
    base = base_model(model)
    cfg = base.config
    width = int(cfg.intermediate_size)
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    out = {}
    for i, layer in enumerate(base.model.layers):
        k = int(getattr(layer.mlp.down_proj, "in_features", width))
        if k != width:
            out[f"model.layers.{i}.mlp"] = CHANNELS.spec(k)
        g = int(getattr(layer.self_attn.k_proj, "out_features", kv * hd)) // hd
        if g != kv:
            out[f"model.layers.{i}.self_attn"] = GROUPS.spec(g)
    keep = getattr(base.get_output_embeddings(), "keep", None)  # a draft's head keeping fewer tokens
    if keep is not None:
        out[forms.HEAD] = forms.VOCAB.spec(int(keep))
    return out


def declared_bits(model: nn.Module) -> dict[str, int]:
    """The projections ``model``'s config keeps at 8 bits in an int4 export (a student started from a folder
    compressed with ``--forms bits``: its compressed folder keeps them, as it keeps a pruned MLP's width)."""
    return forms.declared_bits(getattr(base_model(model).config, "bdlora_modules", None))


def _base_config_dict(config) -> dict:
    cfg = config.to_dict()
    for k in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path", "bdlora_modules",
              "bdlora"):
        cfg.pop(k, None)
    return cfg


def compress_budgeted(model: nn.Module, cfg: BudgetedConfig, provenance: dict):
    """(compressed HF model, SPEC 6.4 report) of a student with ``GatedLoRALinear`` modules."""
    cfg.validate_thresholds()
    gated = gated_modules(model)
    if not gated:
        raise ModelError("the student has no gated modules to compress")
    deployed = {n: m.to_deployed(n, cfg) for n, m in gated.items()}
    for n, bits in declared_bits(model).items():
        if n in deployed:
            deployed[n].decision.bits = bits
    report = compression_report([c.decision for c in deployed.values()], provenance.get("budget"),
                                cfg.thresholds())
    return build_deployed_model(model, deployed, {**provenance, "thresholds": report["thresholds"]}), report


def dense_projections(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and is_projection(n)}
