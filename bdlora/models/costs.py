"""Shapes, MAC costs, the training-compute proxy (SPEC 5, paper Appendix E) and the compression rules with their
report (SPEC 6). Pure arithmetic on module shapes: ``plan`` runs it from a config alone, ``train`` from the actual
controller log, and ``compress`` must use the very same report code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from bdlora import forms
from bdlora.base.errors import ModelError
from bdlora.models.arch import layer_of, projection_name
from bdlora.models.budgeted.config import DEFAULTS, BudgetedConfig
from bdlora.models.families import FAMILIES, Anatomy, base_type


class CostModel(Protocol):
    """What an allocation prices forms by instead of MACs (None wherever a cost model is taken: MACs): the decode time
    measured at ``precision``. ``table`` returns the cost table of ``shapes`` (``export.genai.latency.LatencyTable``:
    ``cost(shape, rank, bits)``, ``prediction(shapes, deployed)``: a ``Deployed``) with the ``dense`` (K, N) products
    measured too; given the model's ``config``, its prediction covers the whole decode step (``.whole``); ``wide``:
    the 8-bit times beside an int4 table (``--forms bits``); ``head`` / ``heads``: the LM head's products at both
    widths. ``bench.whole.MeasuredCosts`` implements it; the core never builds one."""

    precision: str

    def table(self, shapes, dense=(), config: dict | None = None, wide: bool = False, head: bool = False,
              heads=()): ...


@dataclass(frozen=True)
class ModuleShape:
    name: str
    in_features: int
    out_features: int

    @property
    def dense_cost(self) -> int:
        return self.in_features * self.out_features

    def lora_cost(self, rank: int) -> int:
        return rank * (self.in_features + self.out_features)

    def narrowed(self, keep: int) -> ModuleShape:
        """This gate/up (hidden -> width) or down (width -> hidden) projection of an MLP keeping ``keep``
        channels."""
        if self.name.endswith(("gate_proj", "up_proj")):
            return ModuleShape(self.name, self.in_features, keep)
        return ModuleShape(self.name, keep, self.out_features)

    def grouped(self, keep: int, of: int) -> ModuleShape:
        """This q/k/v (hidden -> heads) or o (heads -> hidden) projection of an attention block keeping ``keep`` of
        its ``of`` key/value groups (each group's query and KV heads go together, so every width scales by
        keep / of)."""
        if self.name.endswith("o_proj"):
            return ModuleShape(self.name, self.in_features * keep // of, self.out_features)
        return ModuleShape(self.name, self.in_features, self.out_features * keep // of)

    def pruned(self, keep: int, of: int = 0) -> ModuleShape:
        """``narrowed(keep)`` for an MLP projection; ``grouped(keep, of)`` for an attention one (``of``: the
        source's key/value heads)."""
        return self.grouped(keep, of) if is_attention(self.name) else self.narrowed(keep)


def is_attention(name: str) -> bool:
    """Whether projection ``name`` belongs to an attention block (``...self_attn.q_proj``)."""
    return ".self_attn." in name


def shapes_from_config(config: dict, layers: int | None = None) -> list[ModuleShape]:
    """The projections of each decoder layer, in the ``named_modules()`` order its family's anatomy declares (the
    table's default when ``config`` names no family it has: self_attn q, k, v, o; mlp gate, up, down)."""
    try:
        hidden = int(config["hidden_size"])
        inter = int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        n_layers = int(layers if layers is not None else config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"model config lacks the projection shapes ({e}); need hidden_size, intermediate_size, "
                         "num_attention_heads, num_hidden_layers (and num_key_value_heads for GQA)") from None
    head_dim = int(config.get("head_dim") or hidden // heads)
    dims = {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    known = FAMILIES.get(base_type(str(config.get("model_type", ""))))
    anatomy = known.anatomy if known is not None else Anatomy()
    return [ModuleShape(projection_name(i, p), *dims[p]) for i in range(n_layers) for p in anatomy.projections]


# --------------------------------------------------------------------------------------------------------------------
# Training-compute proxy (SPEC 5; paper Appendix E)
# --------------------------------------------------------------------------------------------------------------------


def training_compute_proxy(shapes: list[ModuleShape], rank: int | dict[str, int], mean_retained: float) -> dict:
    """C_full = 3D, C_lora = 2D + 3L, C_bud = 2 d_bar D + 3L, each also relative to C_full. ``rank``: one r_max,
    or each module's own."""
    D = sum(s.dense_cost for s in shapes)
    L = sum(s.lora_cost(rank[s.name] if isinstance(rank, dict) else rank) for s in shapes)
    c_full, c_lora, c_bud = 3 * D, 2 * D + 3 * L, 2 * mean_retained * D + 3 * L
    return {"D": D, "L": L, "d_bar": mean_retained, "C_full": c_full, "C_lora": c_lora, "C_bud": c_bud,
            "lora_vs_full": c_lora / c_full, "bud_vs_full": c_bud / c_full}


@dataclass(frozen=True)
class Deployed:
    """A structure as the cost model prices it, whichever forms made it: each projection kept, as deployed
    (``modules``: name -> (its shape, narrower in a pruned block; its pair rank, 0 dense; its bits in an int4
    export, 0 the export's own)), those absent gone with their layer; the LM head's kept tokens and bits (0: as the
    source's). Built by what decided it (``compress.allocate.Allocation.deployed``, a folder's report in ``plan``)."""

    modules: dict[str, tuple[ModuleShape, int, int]]
    head_keep: int = 0
    head_bits: int = 0

    @classmethod
    def dense(cls, shapes: list[ModuleShape]) -> Deployed:
        return cls({s.name: (s, 0, 0) for s in shapes})

    def rank(self, name: str) -> int:
        return self.modules[name][1] if name in self.modules else 0


# --------------------------------------------------------------------------------------------------------------------
# Compression rules (SPEC 6)
# --------------------------------------------------------------------------------------------------------------------


def svd_rank(d: float, eps_lr: float, svd_max_rank: int, in_features: int, out_features: int) -> int:
    """k = max(1, round(r_dense_max * d / eps_lr)), clipped to min(d_out, d_in) (paper Sec. 3.3, case 2)."""
    return min(max(1, round(svd_max_rank * d / eps_lr)), min(in_features, out_features))


@dataclass
class ModuleDecision:
    name: str
    in_features: int
    out_features: int
    d: float
    case: str  # dropped | svd | kept | merged-cheaper | pruned | removed
    lora_rank: int  # LoRA ranks kept after gate hardening
    svd_rank: int  # 0 unless case == svd
    rank: int  # rank of the deployed low-rank pair (0 when dense)
    macs_before: int  # dense + LoRA path of the gated training module, per token
    macs_after: int
    params_before: int
    params_after: int
    lora_rank_max: int = 0  # r_max of the training module (its LoRA path's rank before hardening)
    channels: int = 0  # the intermediate channels its MLP keeps (case "pruned"; 0: the MLP is whole)
    groups: int = 0  # the key/value groups its attention keeps (case "pruned"; 0: the attention is whole)
    bits: int = 0  # its weights' width in an int4 export when wider than 4 (forms.WIDE_BITS; 0: the precision's own)

    @property
    def form(self) -> str:
        return forms.REMOVED.name if self.case == forms.REMOVED.name else forms.of_rank(self.rank).name


def prune_decision(shape: ModuleShape, keep: int, has_bias: bool = False, of: int = 0) -> ModuleDecision:
    """A gate/up/down projection of an MLP keeping ``keep`` of its channels (``forms.CHANNELS``), or with ``of`` a
    q/k/v/o projection of an attention block keeping ``keep`` of its ``of`` key/value groups (``forms.GROUPS``):
    dense at the reduced width."""
    i, o = shape.in_features, shape.out_features
    narrow = shape.pruned(keep, of)
    after = narrow.dense_cost
    bias = narrow.out_features if has_bias else 0
    return ModuleDecision(shape.name, i, o, 1.0, "pruned", 0, 0, 0, shape.dense_cost, after,
                          shape.dense_cost + (o if has_bias else 0), after + bias, 0,
                          0 if of else keep, keep if of else 0)


def removed_decision(shape: ModuleShape, has_bias: bool = False) -> ModuleDecision:
    """A projection of a decoder layer removed whole (``forms.REMOVED``): nothing left to compute or store."""
    i, o = shape.in_features, shape.out_features
    return ModuleDecision(shape.name, i, o, 0.0, forms.REMOVED.name, 0, 0, 0, shape.dense_cost, 0,
                          shape.dense_cost + (o if has_bias else 0), 0)


def site_forms(decisions) -> dict[str, dict]:
    """The ``bdlora_modules`` entries of the sites the decisions prune (``model.layers.N.mlp``: channels kept;
    ``model.layers.N.self_attn``: key/value groups kept)."""
    return {d.name.rsplit(".", 1)[0]: forms.CHANNELS.spec(d.channels) if d.channels else forms.GROUPS.spec(d.groups)
            for d in decisions if d.channels or d.groups}


def deployed_form(rank: int, bits: int = 0) -> dict:
    """The ``bdlora_modules`` config entry of a module deployed at ``rank`` (0 = dense) and ``bits`` (0: the export's
    precision; 8: kept at 8 bits in an int4 export)."""
    return forms.of_rank(rank).spec(rank, bits)


def decide_module(shape: ModuleShape, d: float, lora_rank_kept: int, lora_rank_max: int,
                  cfg: BudgetedConfig = DEFAULTS, has_bias: bool = False) -> ModuleDecision:
    """Deployment form of one gated module by its final retention d (SPEC 6.2) and the "never slower than dense"
    rule (SPEC 6.3: a factorised module whose rank r has r (d_in + d_out) >= d_in d_out is merged instead)."""
    i, o = shape.in_features, shape.out_features
    bias = o if has_bias else 0
    before = shape.dense_cost + shape.lora_cost(lora_rank_max)
    k = 0
    if d < cfg.eps_zero:
        case, rank = "dropped", lora_rank_kept
    elif d < cfg.eps_lr:
        k = svd_rank(d, cfg.eps_lr, cfg.svd_max_rank, i, o)
        case, rank = "svd", k + lora_rank_kept
    else:
        case, rank = "kept", 0
    if rank and rank * (i + o) >= i * o:
        case, rank = "merged-cheaper", 0
    after = forms.of_rank(rank).macs(i, o, rank)
    return ModuleDecision(shape.name, i, o, float(d), case, lora_rank_kept, k if case == "svd" else 0, rank,
                          before, after, before + bias, after + bias, lora_rank_max)


BASELINES = {  # what each figure of a report is relative to, by the kind of student (the paper's Table 5)
    "gated": {"speedup_vs_dense": "the dense projections (D)",
              "speedup_vs_lora": "the gated modules as trained: dense + LoRA paths (D + L)",
              "param_reduction": "the pre-compression footprint of the gated modules (dense + LoRA)"},
    "dense": {"speedup_vs_dense": "the dense projections (D)",
              "speedup_vs_lora": "the student as deployed: dense (kd-lora merges its adapter; kd-full has none)",
              "param_reduction": "the dense student it deploys as (the paper's 0% for KD-Full and KD-LoRA)"},
    "source": {"speedup_vs_dense": "the source model's dense projections (D)",
               "speedup_vs_lora": "the source model's dense projections (no LoRA path was trained)",
               "param_reduction": "the source model's dense projections"},
}


def compression_report(decisions: list[ModuleDecision], budget: float | None = None, thresholds: dict | None = None,
                       baseline: str = "gated") -> dict:
    """SPEC 6.4 totals over the replaced modules, plus the per-module rows. The same keys serve ``plan --json`` and
    ``compress``'s ``compression.json``. ``baseline`` "dense" is for the KD baselines, which deploy as a dense
    student of their size: the paper reports them at 1.00x and 0% (``lora_macs`` still records the trained LoRA);
    "source" for a one-shot compression of a pretrained model, which had no LoRA path. L sums each module's own
    r_max (the quality allocation gives modules different ranks)."""
    D = sum(m.in_features * m.out_features for m in decisions)
    L = sum(m.lora_rank_max * (m.in_features + m.out_features) for m in decisions)
    lora_before = L if baseline == "gated" else 0  # the LoRA paths in the footprint the figures compare against
    c_comp = sum(m.macs_after for m in decisions)
    p_before = sum(m.params_before for m in decisions) - (L - lora_before)
    p_after = sum(m.params_after for m in decisions)
    n = len(decisions)
    kept = sum(m.case in ("kept", "merged-cheaper") for m in decisions)
    sites = site_forms(decisions)  # their projections' case is "pruned"
    return {
        "budget": budget,
        "thresholds": thresholds or {},
        "modules_total": n,
        "dense_kept": kept,
        "dense_svd": sum(m.case == "svd" for m in decisions),
        "dense_dropped": sum(m.case == "dropped" for m in decisions),
        "merged_cheaper": sum(m.case == "merged-cheaper" for m in decisions),
        "mlp_pruned": sum(f["form"] == forms.CHANNELS.name for f in sites.values()),  # MLPs keeping fewer channels
        "attention_pruned": sum(f["form"] == forms.GROUPS.name for f in sites.values()),  # ... fewer key/value groups
        "layers_removed": len({layer_of(m.name) for m in decisions if m.case == forms.REMOVED.name}),
        "int8_modules": sum(m.bits == forms.WIDE_BITS for m in decisions),  # kept at 8 bits in an int4 export
        "avg_lora_rank": sum(m.lora_rank for m in decisions) / n,
        "dense_macs": D,
        "lora_macs": L,
        "compressed_macs": c_comp,
        "speedup_vs_dense": D / c_comp,
        "speedup_vs_lora": (D + lora_before) / c_comp,
        "params_before": p_before,
        "params_after": p_after,
        "param_reduction": 1.0 - p_after / p_before,
        "baselines": BASELINES[baseline],
        "modules": [{**asdict(m), "form": m.form} for m in decisions],
    }
