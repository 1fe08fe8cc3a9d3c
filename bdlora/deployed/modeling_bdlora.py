"""The compressed Budgeted-LoRA student as its own Hugging Face architecture (SPEC 8).

This file is self-contained (it imports only torch and transformers): ``bdlora compress`` copies it into every
compressed model folder and points ``auto_map`` at it, so

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

works where bdlora is not installed. With ``bdlora.deployed`` imported, the classes are registered with
``AutoConfig`` / ``AutoModelForCausalLM`` and load without remote code.

One config/model pair per supported base family (``bdlora_mistral``, ``bdlora_llama``, ``bdlora_qwen2``,
``bdlora_gemma3_text``). The config
is the base family's config plus ``bdlora_modules``: for every replaced projection its deployment form, ``dense``
or ``lowrank`` with its rank, for every MLP kept narrower than ``intermediate_size`` its ``channels`` (``keep``), and
for every attention block keeping fewer key/value heads its ``groups`` (``keep``).
The model is the base family's model with exactly those modules: a low-rank module is two bias-free ``nn.Linear``
layers in sequence (``proj_in``: d_in -> r, ``proj_out``: r -> d_out), the second carrying any bias; a pruned MLP
is the family's MLP with gate/up of ``keep`` outputs and down of ``keep`` inputs; a pruned attention block has q, k, v
and o of ``keep`` key/value heads (the heads each layer caches may differ).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)


class LowRankLinear(nn.Module):
    """y = proj_out(proj_in(x)): a rank-r factorisation of a d_in -> d_out projection (r (d_in + d_out) MACs)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.proj_in = nn.Linear(in_features, rank, bias=False)  # (r, d_in)
        self.proj_out = nn.Linear(rank, out_features, bias=bias)  # (d_out, r)

    def forward(self, x):
        return self.proj_out(self.proj_in(x))  # (..., d_in) -> (..., r) -> (..., d_out)


class DenseLoRALinear(nn.Module):
    """y = base(x) + B (A x): a dense projection serving an unmerged LoRA adapter (scale folded into B), as a LoRA
    student is deployed without merging (the bench's ``lora`` variant; not part of the bdlora architecture)."""

    def __init__(self, base: nn.Linear, lora_A, lora_B):
        super().__init__()
        self.base = base
        self.lora_rank = lora_A.shape[0]
        self.lora_A = nn.Parameter(lora_A, requires_grad=False)  # (r, d_in)
        self.lora_B = nn.Parameter(lora_B, requires_grad=False)  # (d_out, r)
        self.in_features, self.out_features = base.in_features, base.out_features

    def forward(self, x):
        return self.base(x) + nn.functional.linear(nn.functional.linear(x, self.lora_A), self.lora_B)


class VocabHead(nn.Module):
    """An LM head computing ``keep`` tokens' logits (``token_ids``), every other token's ``VOCAB_MARGIN`` below the
    lowest kept one (probability ~0): a speculative-decoding draft's head, over the tokens its teacher emits most
    (``bdlora.forms.VOCAB``)."""

    def __init__(self, in_features: int, keep: int, vocab_size: int):
        super().__init__()
        self.in_features, self.keep, self.out_features = in_features, keep, vocab_size
        self.weight = nn.Parameter(torch.zeros(keep, in_features))  # (K, hidden)
        self.register_buffer("token_ids", torch.zeros(keep, dtype=torch.long))  # (K,)

    def forward(self, x):
        z = nn.functional.linear(x, self.weight)  # (..., K)
        floor = z.amin(-1, keepdim=True) - VOCAB_MARGIN  # (..., 1)
        out = floor.expand(*z.shape[:-1], self.out_features)  # (..., V)
        return out.index_copy(-1, self.token_ids, z)


VOCAB_MARGIN = 30.0  # bdlora.forms.VOCAB_MARGIN (held equal by tests/test_structure.py)


class BdloraConfigMixin:
    """The base family's config plus ``bdlora_modules`` (every replaced projection's form) and ``bdlora``
    (provenance: base model type, budget F, thresholds, MAC totals; informational)."""

    def __init__(self, bdlora_modules=None, bdlora=None, **kwargs):
        super().__init__(**kwargs)
        # {"model.layers.0.self_attn.q_proj": {"form": "lowrank", "rank": 16}, ...}; modules not listed stay dense
        self.bdlora_modules = dict(bdlora_modules or {})
        self.bdlora = dict(bdlora or {})


class BdloraModelMixin:
    """The base family's causal LM with the projections of ``config.bdlora_modules`` replaced."""

    def __init__(self, config):
        super().__init__(config)
        _replace_modules(self, config.bdlora_modules)
        self.post_init()


# the forms this file builds (bdlora.forms declares them; tests/test_structure.py holds the two together): one
# projection's (dense, lowrank), then a site's (channels: an MLP keeping ``keep`` intermediate channels; groups: an
# attention block keeping ``keep`` key/value heads with their query heads; vocab: the LM head keeping ``keep`` tokens)
KNOWN_FORMS = ("dense", "lowrank", "channels", "groups", "vocab")
SITES = {"channels": "mlp", "groups": "self_attn", "vocab": "lm_head"}


def _replace_modules(model: nn.Module, modules: dict) -> None:
    """Sites first (a pruned MLP's projections get their reduced width), then each projection's form (a low-rank
    pair takes the width its projection has by then): each form's builder (``BUILDERS``) replaces its module."""
    for name, spec in modules.items():
        form = spec.get("form") if isinstance(spec, dict) else None
        if form not in KNOWN_FORMS:  # never load an unknown form as dense: its weights would be random
            raise ValueError(f"bdlora_modules[{name}]: unknown form {form!r} (this file builds "
                             f"{', '.join(KNOWN_FORMS)}); the folder was written by a newer bdlora or edited")
        if SITES.get(form) != (name.rsplit(".", 1)[-1] if name.rsplit(".", 1)[-1] in SITES.values() else None):
            raise ValueError(f"bdlora_modules[{name}]: form {form!r} cannot be declared there")
    for sites in (True, False):
        for name, spec in modules.items():
            if (spec["form"] in SITES) == sites and BUILDERS[spec["form"]] is not None:
                BUILDERS[spec["form"]](model, name, spec)


def _keep_channels(model: nn.Module, name: str, spec: dict) -> None:
    mlp, keep = model.get_submodule(name), int(spec["keep"])
    hidden = mlp.gate_proj.in_features
    for proj in ("gate_proj", "up_proj"):
        old = getattr(mlp, proj)
        setattr(mlp, proj, nn.Linear(hidden, keep, bias=old.bias is not None))
    mlp.down_proj = nn.Linear(keep, hidden, bias=mlp.down_proj.bias is not None)


def _low_rank(model: nn.Module, name: str, spec: dict) -> None:
    parent_name, child = name.rsplit(".", 1)
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    setattr(parent, child, LowRankLinear(old.in_features, old.out_features, int(spec["rank"]),
                                         bias=old.bias is not None))


def _vocab_head(model: nn.Module, name: str, spec: dict) -> None:
    old = model.get_submodule(name)
    setattr(model, name, VocabHead(old.in_features, int(spec["keep"]), old.out_features))


def _groups(model: nn.Module, name: str, spec: dict) -> None:
    _keep_groups(model.get_submodule(name), int(spec["keep"]))


def _keep_groups(attn: nn.Module, keep: int) -> None:
    """``attn`` (a Llama/Mistral/Qwen2/Gemma 3 attention block) keeping ``keep`` key/value heads and their query
    heads: the family's forward reshapes q, k and v by ``head_dim`` and repeats each KV head ``num_key_value_groups``
    times, so narrower projections are all it takes (the cache of this layer holds ``keep`` heads)."""
    hd, ratio = attn.head_dim, attn.num_key_value_groups
    hidden = attn.q_proj.in_features
    for proj, width in (("q_proj", keep * ratio * hd), ("k_proj", keep * hd), ("v_proj", keep * hd)):
        setattr(attn, proj, nn.Linear(hidden, width, bias=getattr(attn, proj).bias is not None))
    attn.o_proj = nn.Linear(keep * ratio * hd, hidden, bias=attn.o_proj.bias is not None)


BUILDERS = {"dense": None, "lowrank": _low_rank, "channels": _keep_channels, "groups": _groups,
            "vocab": _vocab_head}


class BdloraMistralConfig(BdloraConfigMixin, MistralConfig):
    model_type = "bdlora_mistral"


class BdloraLlamaConfig(BdloraConfigMixin, LlamaConfig):
    model_type = "bdlora_llama"


class BdloraQwen2Config(BdloraConfigMixin, Qwen2Config):
    model_type = "bdlora_qwen2"


class BdloraGemma3TextConfig(BdloraConfigMixin, Gemma3TextConfig):
    model_type = "bdlora_gemma3_text"


class BdloraMistralForCausalLM(BdloraModelMixin, MistralForCausalLM):
    config_class = BdloraMistralConfig


class BdloraLlamaForCausalLM(BdloraModelMixin, LlamaForCausalLM):
    config_class = BdloraLlamaConfig


class BdloraQwen2ForCausalLM(BdloraModelMixin, Qwen2ForCausalLM):
    config_class = BdloraQwen2Config


class BdloraGemma3ForCausalLM(BdloraModelMixin, Gemma3ForCausalLM):
    config_class = BdloraGemma3TextConfig


# base model_type -> (config class, model class): bdlora's architecture of each family of bdlora.models.families' table
# whose weights it loads (this file ships as remote code in every model folder, so it cannot import the table;
# tests/test_structure.py holds the two to the same families)
BDLORA_CLASSES = {
    "mistral": (BdloraMistralConfig, BdloraMistralForCausalLM),
    "llama": (BdloraLlamaConfig, BdloraLlamaForCausalLM),
    "qwen2": (BdloraQwen2Config, BdloraQwen2ForCausalLM),
    "gemma3_text": (BdloraGemma3TextConfig, BdloraGemma3ForCausalLM),
}
