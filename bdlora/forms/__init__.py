"""The forms a deployed projection takes, declared once (PEFT's ``tuners/lora/variants.py``: each variant one class
declaring what it stores and computes, chosen in one place). A form says how it is written in ``config.json``
(``bdlora_modules``: ``{"form": NAME, ...}``), which tensors it stores, its MACs and parameters per token, and what
makes a declaration of it inconsistent. ``costs`` (the compression rules and their report), ``integrity`` (every
folder a command reads), the metadata of both exported graphs and ``describe`` (what an exporter emits for a
module) read this registry; a folder naming a form it lacks is refused in one line naming those it has. A
projection's entry may also say ``"bits": 8``: the width its weights keep in an int4 export (``--forms bits``, the
allocation's per-module bits); the PyTorch module does not change. The LM head's width in an int4 export is
declared beside them, ``config.json``'s ``bdlora_head_bits`` (4 or 8; absent: the export's default, 8), chosen by
the same allocation with ``--forms bits --speedup S``. No heavy import (``describe`` takes a torch module as is).

The PyTorch classes of the forms live in ``deployed/modeling_bdlora.py``, which ships as remote code in every model
folder and so cannot import this file; it refuses an unknown form on its own, and ``tests/test_structure.py`` holds
its ``KNOWN_FORMS`` to this registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.base.errors import ModelError, shown
from bdlora.base.schemes import MIXED, mixed

ALLOCATED_FORMS = ("lowrank", "channels", "groups", "layers", "bits", "vocab")  # what --forms may name: a
# projection's, an MLP's, an attention block's, a whole decoder layer's form, a projection's width at int4, or the
# LM head's vocabulary (a draft's: the teacher verifies every token); each is a module of ``bdlora.compress.forms``
# with the one-shot's step, found by its line in that package's ``STEPS``. ONE_SHOT_FORMS: what ``compress
# --one-shot`` chooses among unless --forms says otherwise: a low-rank pair or an MLP keeping fewer channels (dense:
# the runtime's best kernel at every precision). SmolLM2-135M at --mac-ratio 1.2 (8,192 calibration tokens of
# builtin:1,prose:1, 8,192 held-out each; teacher 17.86 / 11.32 / 52.62): lowrank alone 23.53 builtin / 12.58 prose /
# 104.07 fortunes, channels alone 23.61 / 12.70 / 105.61, both 20.74 / 12.64 / 83.02 (16 MLPs narrower, 50 pairs).
# Groups and layers were never chosen at that budget.
ONE_SHOT_FORMS = "lowrank,channels"

WIDE_BITS = 8  # ``"bits": 8`` on a projection: it ships at 8 bits in an int4 export (chosen by ``--forms bits``)
HEAD = "lm_head"  # the LM head, a site of ``--forms bits`` when the budget is the whole step (``--speedup``)
HEAD_BITS = "bdlora_head_bits"  # config.json: the LM head's bits in an int4 export (4 or 8), where a folder says


def named_forms(forms: str) -> str | None:
    """``forms`` unless it is the one-shot's default (None: a default output folder's name does not carry it)."""
    return None if forms == ONE_SHOT_FORMS else forms


def head_bits_problem(config: dict) -> str | None:
    """Why a folder's declared LM head width (``HEAD_BITS``) is not one an int4 export can give (None: absent or
    valid)."""
    if config.get(HEAD_BITS) is None:
        return None
    bits = config[HEAD_BITS]
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (4, WIDE_BITS):
        return f"{HEAD_BITS} is {shown(bits)} (4 or {WIDE_BITS}: the LM head's width in an int4 export)"
    return None


def declared_head_bits(config) -> int:
    """The LM head's bits a model's config (a dict or a config object) declares for an int4 export (0: none)."""
    value = config.get(HEAD_BITS) if isinstance(config, dict) else getattr(config, HEAD_BITS, None)
    return int(value) if value else 0


def declared_head_keep(config) -> int:
    """The tokens a model's head keeps where its config declares it in the vocab form (a draft's; 0: all)."""
    modules = (config.get("bdlora_modules") if isinstance(config, dict) else getattr(config, "bdlora_modules", None))
    spec = (modules or {}).get(HEAD)
    return int(spec["keep"]) if isinstance(spec, dict) and spec.get("form") == VOCAB.name else 0


def bits_problem(spec: dict, module: str) -> str | None:
    """Why a projection's optional ``bits`` is not a width an int4 export can give it (None when absent or valid)."""
    if "bits" not in spec:
        return None
    bits = spec["bits"]
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (4, WIDE_BITS):
        return f"{module} is declared at {shown(bits)} bits (4 or {WIDE_BITS}: its width in an int4 export)"
    return None


def declared_bits(modules) -> dict[str, int]:
    """Projection -> its declared width, for every ``bdlora_modules`` entry that declares one (``--forms bits``)."""
    return {n: int(s["bits"]) for n, s in (modules or {}).items() if isinstance(s, dict) and s.get("bits")}


def with_bits(spec: dict, bits: int) -> dict:
    """``spec`` carrying ``bits`` when a module ships wider than its export's precision (0: the precision's own)."""
    return {**spec, "bits": int(bits)} if bits else spec


@dataclass(frozen=True)
class Dense:
    """``y = W x + b``: the projection as trained or merged, one (out, in) weight."""

    name: str = "dense"
    module_class: str = "Linear"

    def spec(self, rank: int = 0, bits: int = 0) -> dict:
        return with_bits({"form": self.name}, bits)

    def tensors(self, module: str) -> set[str]:
        return {f"{module}.weight"}

    def macs(self, in_features: int, out_features: int, rank: int = 0) -> int:
        return in_features * out_features

    def problem(self, spec: dict, shapes: dict[str, tuple[int, ...]], module: str) -> str | None:
        return bits_problem(spec, module)


@dataclass(frozen=True)
class LowRank:
    """``y = B (A x) + b``: a rank-r pair (``proj_in`` (r, in), ``proj_out`` (out, r), the bias on the output)."""

    name: str = "lowrank"
    module_class: str = "LowRankLinear"

    def spec(self, rank: int = 0, bits: int = 0) -> dict:
        return with_bits({"form": self.name, "rank": int(rank)}, bits)

    def tensors(self, module: str) -> set[str]:
        return {f"{module}.proj_in.weight", f"{module}.proj_out.weight"}

    def macs(self, in_features: int, out_features: int, rank: int = 0) -> int:
        return rank * (in_features + out_features)

    def problem(self, spec: dict, shapes: dict[str, tuple[int, ...]], module: str) -> str | None:
        rank = spec.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            return f"{module} is declared lowrank with rank {shown(rank)} (a positive integer)"
        held = shapes.get(f"{module}.proj_in.weight")
        if held is not None and (len(held) != 2 or held[0] != rank):
            return f"{module} is declared lowrank with rank {rank}, but its proj_in holds {held}"
        return bits_problem(spec, module)


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # gate and up read the MLP input; down reads their product
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # q, k, v read the attention input; o its output


class SiteForm:
    """What a site form's declaration is: ``{"form": NAME, "keep": K}`` over the weights of its ``projections``."""

    name: str
    projections: tuple[str, ...]

    def spec(self, keep: int = 0) -> dict:
        return {"form": self.name, "keep": int(keep)}

    def tensors(self, module: str) -> set[str]:
        return {f"{module}.{p}.weight" for p in self.projections}

    def held(self, spec: dict, shapes: dict[str, tuple[int, ...]], module: str) -> tuple[list, str | None]:
        """(each projection's 2-D weight shape, why the declaration is refused before the shapes are compared)."""
        keep = spec.get("keep")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            return [], f"{module} is declared {self.name} with keep {shown(keep)} (a positive integer)"
        held = [shapes.get(f"{module}.{p}.weight") for p in self.projections]
        if any(s is None or len(s) != 2 for s in held):
            *first, last = (p.removesuffix("_proj") for p in self.projections)
            names = f"{', '.join(first)} and {last}"
            return [], f"{module} is declared {self.name} but does not hold {names} weights"
        return held, None


@dataclass(frozen=True)
class Channels(SiteForm):
    """A gated MLP keeping ``keep`` of its intermediate channels: gate and up lose the same rows, down the same
    columns, so the site is three smaller *dense* products that every runtime runs at full speed with no extra node
    (Minitron's and SliceGPT's structure). Declared on the MLP site (``model.layers.N.mlp``); its projections stay
    declared ``dense``. The kept channels and the refitted down projection come from ``forms.channels``."""

    name: str = "channels"
    module_class: str = "Linear"  # three plain nn.Linear of the reduced width
    site: str = "mlp"
    projections: tuple[str, ...] = MLP_PROJECTIONS

    def macs(self, hidden: int, keep: int) -> int:
        return 3 * hidden * keep

    def problem(self, spec: dict, shapes: dict[str, tuple[int, ...]], module: str) -> str | None:
        held, why = self.held(spec, shapes, module)
        if why:
            return why
        (gate, up, down), keep = held, spec["keep"]
        if gate[0] != keep or up[0] != keep or down[1] != keep or gate[1] != up[1] or down[0] != gate[1]:
            return f"{module} is declared channels keeping {keep}, but holds gate {gate}, up {up}, down {down}"
        return None


@dataclass(frozen=True)
class Groups(SiteForm):
    """An attention block keeping ``keep`` of its key/value groups, each with its query heads (grouped-query
    attention's unit: a KV head and the ``heads / kv_heads`` query heads reading it): q, k and v lose the dropped
    heads' rows, o the same columns, so the site is four smaller dense products and a smaller KV cache (LLM-Pruner's
    and Minitron's head pruning, at the granularity GQA allows). Declared on the attention site
    (``model.layers.N.self_attn``); its projections stay declared ``dense``. The attention of a kept head does not
    depend on the others, so only o changes (refitted, ``forms.groups``)."""

    name: str = "groups"
    module_class: str = "Linear"  # four plain nn.Linear of the reduced width
    site: str = "self_attn"
    projections: tuple[str, ...] = ATTENTION_PROJECTIONS

    def macs(self, hidden: int, keep: int, group_width: int, kv_width: int) -> int:
        """MACs of the four products keeping ``keep`` groups of ``group_width`` query and ``kv_width`` key (and
        value) columns each."""
        return keep * hidden * 2 * (group_width + kv_width)

    def problem(self, spec: dict, shapes: dict[str, tuple[int, ...]], module: str) -> str | None:
        held, why = self.held(spec, shapes, module)
        if why:
            return why
        (q, k, v, o), keep = held, spec["keep"]
        if k != v or k[0] % keep or q[0] % k[0] or o[1] != q[0] or q[1] != k[1] or o[0] != q[1]:
            return f"{module} is declared groups keeping {keep}, but holds q {q}, k {k}, v {v}, o {o}"
        return None


@dataclass(frozen=True)
class Removed:
    """A decoder layer removed whole (ShortGPT's and Minitron's depth pruning; chosen by ``forms.layers``). It
    is not declared in ``bdlora_modules``: the folder holds a shallower model of the same architecture (every reader
    takes it as it is), whose provenance names the source layers kept (``layer_indices``) and those removed
    (``removed_layers``); the compression report's rows of its projections say this form, at no MACs."""

    name: str = "removed"
    site: str = "layer"

    def macs(self, in_features: int, out_features: int, rank: int = 0) -> int:
        return 0


@dataclass(frozen=True)
class Vocab:
    """The LM head computing the logits of ``keep`` tokens only, the others' set ``VOCAB_MARGIN`` below the lowest
    kept one (probability ~0): a speculative-decoding draft's head (``forms.vocab``). The draft proposes only
    tokens it keeps, and the target verifies every proposal, so the output stays the target's; a draft's head over
    the tokens the teacher emits most is exact wherever the teacher picks one of them and costs ``keep / vocab`` of
    the full head. Declared on the head (``lm_head``): ``{"form": "vocab", "keep": K}``; stores ``lm_head.weight``
    (K, hidden) and ``lm_head.token_ids`` (K,), the kept ids ascending; the folder's embedding is untied from it."""

    name: str = "vocab"
    module_class: str = "VocabHead"
    site: str = HEAD
    projections: tuple[str, ...] = ()
    index_suffixes: tuple[str, ...] = ("token_ids",)  # stored as integers; every other tensor of a folder floats

    def spec(self, keep: int = 0) -> dict:
        return {"form": self.name, "keep": int(keep)}

    def tensors(self, module: str) -> set[str]:
        return {f"{module}.weight", f"{module}.token_ids"}

    def macs(self, hidden: int, keep: int) -> int:
        return hidden * keep

    def problem(self, spec: dict, shapes: dict[str, tuple[int, ...]], module: str) -> str | None:
        keep = spec.get("keep")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            return f"{module} is declared {self.name} with keep {shown(keep)} (a positive integer)"
        w, ids = shapes.get(f"{module}.weight"), shapes.get(f"{module}.token_ids")
        if w is None or ids is None or len(w) != 2 or w[0] != keep or tuple(ids) != (keep,):
            return f"{module} is declared {self.name} keeping {keep}, but holds weight {w}, token ids {ids}"
        return None


VOCAB_MARGIN = 30.0  # a token a vocab head does not keep has the lowest kept logit less this: its probability is below
# e^-30 of the least likely kept token's (a draft never proposes it), and every logit stays finite (a perplexity too)


FORMS: dict[str, Dense | LowRank] = {f.name: f for f in (Dense(), LowRank())}  # what one projection takes
SITE_FORMS: dict[str, Channels | Groups | Vocab] = {f.name: f for f in (Channels(), Groups(), Vocab())}  # a site's
ALL: dict[str, Dense | LowRank | Channels | Groups | Vocab] = {**FORMS, **SITE_FORMS}
DENSE, LOWRANK, CHANNELS, GROUPS = FORMS["dense"], FORMS["lowrank"], SITE_FORMS["channels"], SITE_FORMS["groups"]
VOCAB = SITE_FORMS["vocab"]
REMOVED = Removed()  # a report row's form only: a removed layer leaves nothing in the folder to declare


def is_site(module: str) -> bool:
    """Whether a ``bdlora_modules`` key names a site (an MLP or attention block) rather than one projection."""
    return module.rsplit(".", 1)[-1] in {f.site for f in SITE_FORMS.values()}


def site_form(module: str) -> Channels | Groups | None:
    """The site form that may be declared on ``module`` (channels on an MLP, groups on an attention block)."""
    return next((f for f in SITE_FORMS.values() if module.rsplit(".", 1)[-1] == f.site), None)


def form_named(name, where: str, module: str | None = None) -> Dense | LowRank | Channels:
    """The registered form ``name``, else a one-line refusal naming ``where`` it was read and the forms there are;
    with ``module``, a form declared on the wrong kind of site (channels on a projection, lowrank on an MLP) too."""
    found = ALL.get(name) if isinstance(name, str) else None
    if found is None:
        raise ModelError(f"{where}: unknown form {shown(name)} (bdlora knows {', '.join(ALL)}); the folder was "
                         "written by a newer bdlora or edited")
    site = site_form(module) if module is not None else None
    if module is not None and (found.name not in FORMS if site is None else found is not site):
        allowed = [site.name] if site is not None else FORMS
        raise ModelError(f"{where}: form {found.name} cannot be declared on {module} (there: {', '.join(allowed)})")
    return found


def of_rank(rank: int) -> Dense | LowRank:
    """The form a projection deployed at ``rank`` takes (0: dense): what the compression rules produce."""
    return LOWRANK if rank else DENSE


def declared(spec, where: str, module: str | None = None) -> Dense | LowRank | Channels:
    """The form of one ``bdlora_modules`` entry (a JSON object with a ``form``), refused in one line otherwise."""
    if not isinstance(spec, dict):
        raise ModelError(f"{where}: {shown(spec)} is not a form declaration ({{\"form\": NAME, ...}})")
    return form_named(spec.get("form"), where, module)


def describe(module) -> tuple[str, int, int, int, object]:
    """(form, in features, out features, rank, bias tensor or None) of a deployed projection module, by its class
    (``module_class``); ``dense+lora`` is the bench's dense projection serving an unmerged adapter (not a form a
    folder holds). Raises TypeError for any other module."""
    cls = type(module).__name__
    if cls == LOWRANK.module_class:
        return LOWRANK.name, module.in_features, module.out_features, module.rank, module.proj_out.bias
    if cls == "DenseLoRALinear":
        base = module.base
        return "dense+lora", base.in_features, base.out_features, module.lora_rank, base.bias
    if hasattr(module, "in_features") and hasattr(module, "weight") and module.weight.dim() == 2:  # nn.Linear
        return DENSE.name, module.in_features, module.out_features, 0, module.bias
    raise TypeError(f"unsupported projection module {cls} (forms: {', '.join(FORMS)})")


def form_names(forms: str) -> tuple[str, ...]:
    """The names a ``--forms`` value lists."""
    return tuple(f.strip() for f in forms.split(","))


REACH_MARGIN = 2.0  # a whole-step --speedup this far past the MAC ceiling of the forms' cheapest structure cannot be
# measured (a step's fixed and per-layer time only lowers the reach of its projections' MACs)
WIDTH_MULTIPLE = 32  # kept input widths are multiples of the int4 block by default (one-shot --width-multiple)


def check_width_multiple(c, value) -> None:
    """--width-multiple (one-shot, plan, train, ship): None, or a multiple of the int4 block up to 65,536; each
    problem added to ``c`` (an ``errors.Checks``)."""
    if value is not None and c.integer("width_multiple", value, lo=WIDTH_MULTIPLE, hi=1 << 16):
        c.require(value % WIDTH_MULTIPLE == 0, f"--width-multiple {value}: must be a multiple of {WIDTH_MULTIPLE} "
                                               "(the int4 block; 256 for llama.cpp's K-quants)")

CHANNEL_FLOOR = WIDTH_MULTIPLE  # the narrowest MLP the channels form keeps (forms.channels.CHANNEL_STEP)


def reach_problem(config: dict, forms: str, mac_ratio: float | None = None, speedup: float | None = None) -> \
        str | None:
    """Why a target cannot be reached by any structure of ``forms`` on the model of ``config``, from its shapes
    alone (before any calibration or timing), or None: ``mac_ratio`` above the projections' MAC ratio of the
    cheapest structure (every layer at its forms' cheapest: rank-1 pairs, the narrowest MLP, one key/value group;
    with ``layers``, one layer kept), ``speedup`` above ``REACH_MARGIN`` times the same ratio counted with the LM
    head (``ship --speedups 1e9`` calibrated and timed for minutes before the allocation refused it)."""
    names = set(form_names(forms))
    if not names <= {LOWRANK.name, CHANNELS.name, GROUPS.name, VOCAB.name, "layers", "bits"}:
        return None  # a form this bound does not know may reach anything: its allocation decides
    h, inter, layers = int(config["hidden_size"]), int(config["intermediate_size"]), int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    d = int(config.get("head_dim") or h // heads)
    vocab = int(config["vocab_size"])
    attn = 2 * h * heads * d + 2 * h * kv * d
    mlp = 3 * h * inter
    cheap_attn, cheap_mlp = attn, mlp
    if LOWRANK.name in names:  # every projection a rank-1 pair: its K + N
        cheap_attn = min(cheap_attn, 2 * (h + heads * d) + 2 * (h + kv * d))
        cheap_mlp = min(cheap_mlp, 3 * (h + inter))
    if CHANNELS.name in names:
        cheap_mlp = min(cheap_mlp, 3 * h * min(inter, CHANNEL_FLOOR))
    if GROUPS.name in names:
        cheap_attn = min(cheap_attn, 2 * h * (heads // kv) * d + 2 * h * d)
    kept = 1 if "layers" in names else layers
    head = h * (1 if VOCAB.name in names else vocab)
    projections = layers * (attn + mlp) / (kept * (cheap_attn + cheap_mlp))
    whole = (layers * (attn + mlp) + h * vocab) / (kept * (cheap_attn + cheap_mlp) + head)
    if mac_ratio is not None and mac_ratio > projections * (1 + 1e-9):
        return (f"--mac-ratio {mac_ratio:g}: beyond any structure of --forms {forms} on this model (its cheapest "
                f"gives {projections:.2f}x fewer projection MACs)")
    if speedup is not None and speedup > REACH_MARGIN * whole:
        return (f"--speedup {speedup:g}: beyond any structure of --forms {forms} on this model (its cheapest does "
                f"{whole:.2f}x fewer MACs per token, and a decode step's time falls less than its MACs)")
    return None


def forms_problem(forms) -> str | None:
    """Why ``--forms`` is not a comma-separated set of ``ALLOCATED_FORMS`` (None when it is)."""
    names = list(form_names(forms)) if isinstance(forms, str) else None
    if not names or any(n not in ALLOCATED_FORMS for n in names):
        bad = shown(forms) if not names else ", ".join(repr(n) for n in names if n not in ALLOCATED_FORMS)
        return f"--forms {bad}: allowed {', '.join(ALLOCATED_FORMS)}, comma-separated"
    if len(set(names)) < len(names):
        return f"--forms {forms}: {next(n for n in names if names.count(n) > 1)} given twice"
    return None


def check_forms(c, forms: str, precision: str | None, speedup: float | None = None) -> tuple[str, ...] | None:
    """``--forms`` beside ``--precision`` and ``--speedup`` (one-shot, plan, train): why it is not a known set, names
    bits without an int4 export, or vocab without the whole decode step as the budget, added to ``c`` (an
    ``errors.Checks``); its names when they are known."""
    problem = forms_problem(forms)
    if problem is not None:
        c.add(problem)
        return None
    names = form_names(forms)
    c.require("bits" not in names or mixed(precision),
              f"--forms {forms}: bits chooses which projections an {MIXED} export keeps at 8 bits; give --precision "
              f"{MIXED}")
    c.require(VOCAB.name not in names or speedup is not None,
              f"--forms {forms}: vocab prices the LM head against the whole decode step; give --precision P "
              "--speedup S")
    return names
