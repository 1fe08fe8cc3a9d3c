"""Where a MAC budget hurts least: per-module ranks, and which projections stay dense, chosen from a measured quality
cost (``--allocation quality``) instead of the paper's cheapest-first order (``--allocation cost``).

Each projection may stay dense (d_in d_out MACs per token) or become a rank-r pair (r (d_in + d_out) MACs), r a
rank of ``rank_grid`` (1, 2, 4, then multiples of ``RANK_STEP``) below the break-even rank (a pair at or above it
would not be faster: SPEC 6.3). Its cost at rank r is the *loss-weighted truncation error* of its spectrum
(``lowrank``): the activation energy it loses with every output weighted by its Fisher diagonal (the mean squared
gradient of the next-token loss, measured on the calibration tokens), so errors compare in the loss's own units
across modules and layers. The raw activation energy does not (SmolLM2's late layers carry 100x larger activations
without mattering 100x more): allocated by it, a 1.5x budget measured perplexity 461; by the Fisher-weighted error
44.9; with one uniform rank 116 (SmolLM2-135M, no training, whitened factors without the output weighting; README).

The allocation is the exact solution of that knapsack (least total error under the MAC budget, by dynamic programming
over the budget); the modules it takes out of their dense form, ordered by error per MAC saved, give the removal
order the budget controller walks during training (``BudgetController(scores=...)``). Pure numpy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from bdlora.base.errors import UsageError
from bdlora.compress.pricing import Cost, Option, mac_cost
from bdlora.forms import HEAD, WIDE_BITS
from bdlora.forms.context import Choice
from bdlora.models.arch import layer_of
from bdlora.models.costs import Deployed, ModuleShape


class Head(NamedTuple):
    """What the allocation chose at the LM head, read from the choices taken there whichever forms offered them:
    the tokens it keeps (0: all of them) and its bits in an int4 export (0: not chosen, the export's default)."""

    keep: int = 0
    bits: int = 0


@dataclass
class Allocation:
    """Per-module ranks (0: stays dense), the order modules leave their dense form in (the controller's removal
    score: position in ``order``), the predicted error of each chosen form, and the MLP sites that keep fewer
    channels (``keep``: site -> channels; their projections are at rank 0, dense at the narrower width) and the
    decoder layers removed (``removed``: ``model.layers.N``; their projections are at rank 0 and cost nothing).
    What the choices taken do beyond ranks, widths and removals (a projection's bits, the LM head's kept tokens and
    bits) is read from them (``chosen``, ``bits``, ``head``), never set by form; each form deploys its own
    (``by``) and returns its own record of it (``forms.context.Step.deploy``)."""

    ranks: dict[str, int]
    order: list[str]
    errors: dict[str, float] = field(default_factory=dict)
    keep: dict[str, int] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    kv_heads: int = 0  # the source's key/value heads per layer (an attention site's ``keep`` counts groups of them)
    unmet: str | None = None  # the target was beyond the reach of costs measured unclean: what was allocated instead
    chosen: dict = field(default_factory=dict, repr=False, compare=False)  # site -> the Choices taken there

    def by(self, form: str) -> dict:
        """Site -> the choice form ``form`` offered there and the knapsack took (what the form deploys)."""
        return {site: c for site, cs in self.chosen.items() for c in cs if c.form == form}

    @property
    def bits(self) -> dict[str, int]:
        """Projection -> its bits where a choice taken sets them (wider than the export's precision:
        ``LatencyTable.prediction``'s), whichever form offered it."""
        return {site: c.bits for site, cs in self.chosen.items() if site != HEAD for c in cs if c.bits}

    @property
    def head(self) -> Head:
        """The LM head as the choices taken there leave it (``Head()``: as it is)."""
        taken = self.chosen.get(HEAD, ())
        return Head(max((c.keep for c in taken), default=0), max((c.bits for c in taken), default=0))

    def gone(self, name: str) -> bool:
        """Whether projection ``name`` goes with its removed layer."""
        return layer_of(name) in self.removed

    def shape(self, s: ModuleShape) -> ModuleShape:
        """``s`` as deployed: narrower when its MLP keeps fewer channels or its attention fewer groups."""
        k = self.keep.get(s.name.rsplit(".", 1)[0])
        return s.pruned(k, self.kv_heads) if k else s

    def deployed(self, shapes: list[ModuleShape]) -> Deployed:
        """``shapes`` as this allocation deploys them (what a cost model prices)."""
        bits, head = self.bits, self.head
        return Deployed({s.name: (self.shape(s), self.ranks.get(s.name, 0), bits.get(s.name, 0))
                         for s in shapes if not self.gone(s.name)}, head.keep, head.bits)

    def macs(self, shapes: list[ModuleShape]) -> int:
        return sum(s.lora_cost(self.ranks[s.name]) if self.ranks.get(s.name) else self.shape(s).dense_cost
                   for s in shapes if not self.gone(s.name))

    def mac_ratio(self, shapes: list[ModuleShape]) -> float:
        return sum(s.dense_cost for s in shapes) / self.macs(shapes)

    def cost_ratio(self, shapes: list[ModuleShape], cost: Cost) -> float:
        """The projections' speed-up by ``cost`` (dense total over the chosen forms' total)."""
        return sum(cost(s, 0) for s in shapes) / sum(cost(self.shape(s), self.ranks.get(s.name, 0)) for s in shapes
                                                     if not self.gone(s.name))

    def scores(self, names: list[str]) -> list[float]:
        """Removal scores for ``BudgetController``: the dropped modules first, in allocation order."""
        pos = {n: i for i, n in enumerate(self.order)}
        return [float(pos.get(n, len(pos) + i)) for i, n in enumerate(names)]

    def to_json(self) -> dict:
        """What a run's low-rank start records (``lora_start.json``): the ranks, the order, the errors, the structure,
        and what the choices taken set beyond them (``bits``, ``head``; read back as those choices)."""
        head = self.head
        return {"ranks": self.ranks, "order": self.order, "errors": self.errors, "keep": self.keep,
                "removed": self.removed, "kv_heads": self.kv_heads, "bits": self.bits,
                **({"head": head._asdict()} if head != Head() else {})}

    @classmethod
    def from_json(cls, doc: dict) -> Allocation:
        """An allocation written by ``to_json``, or before it (its fields ``wide``, ``head_bits`` and ``head_keep``
        read back as the choices they stood for)."""
        bits = doc.get("bits") or dict.fromkeys(doc.get("wide") or (), WIDE_BITS)
        head = doc.get("head") or {"keep": doc.get("head_keep") or 0, "bits": doc.get("head_bits") or 0}
        chosen = {n: [Choice("", 0.0, 0.0, bits=int(b))] for n, b in bits.items()}
        if head["keep"] or head["bits"]:
            chosen[HEAD] = [Choice("", 0.0, 0.0, keep=int(head["keep"]), bits=int(head["bits"]))]
        return cls({k: int(v) for k, v in doc["ranks"].items()}, list(doc["order"]),
                   {k: float(v) for k, v in doc.get("errors", {}).items()},
                   {k: int(v) for k, v in (doc.get("keep") or {}).items()}, list(doc.get("removed") or ()),
                   int(doc.get("kv_heads") or 0), chosen=chosen)


class BeyondReach(UsageError):
    """A target no choice of the options meets; ``cheapest`` is the least total cost the options allow."""

    def __init__(self, message: str, cheapest: float):
        super().__init__(message)
        self.cheapest = cheapest


REACH_MARGIN = 0.02  # an unclean target beyond reach is allocated this far below the reach (the buckets' rounding)
BUCKETS = 1 << 16  # the MAC budget's resolution in the allocation (module costs are rounded up to 1/65536 of it)



Group = tuple[int, int, float, float]  # items[start:stop] replaced together by one alternative of (cost, error)


def knapsack(items: list[list[Option]], target: float, beyond: Callable[[float], str],
             groups: list[Group] = ()) -> list[int]:
    """The option of each item (each list's first option: the item as it is) meeting ``sum cost <= target`` with the
    least total error: exact dynamic programming over the budget in ``BUCKETS`` steps (each cost rounded up, so the
    result always meets the budget; at most one bucket per item is left unspent). Ties keep the earlier option.
    ``groups`` (disjoint ranges of consecutive items, e.g. a decoder layer's): each may instead take its alternative
    (a removed layer: its items cost nothing); its items are then picked as -1. ``beyond(cheapest total)`` is the
    refusal when even the cheapest options exceed the budget."""
    in_group = {m: g for g in groups for m in range(g[0], g[1])}
    cheapest = sum(min(c for _, c, _ in o) for m, o in enumerate(items) if m not in in_group) + sum(
        min(c, sum(min(cc for _, cc, _ in o) for o in items[a:b])) for a, b, c, _ in groups)
    if cheapest > target:
        raise BeyondReach(beyond(cheapest), cheapest)
    unit = target / BUCKETS

    def need(c: float) -> int:
        return int(np.ceil(c / unit - 1e-9))

    starts = {g[0] for g in groups}
    ends = {g[1] - 1: i for i, g in enumerate(groups)}
    best = np.zeros(BUCKETS + 1)  # best[b]: least error of the items so far within b buckets
    choice = np.zeros((len(items), BUCKETS + 1), dtype=np.int32)
    replaced = np.zeros((len(groups), BUCKETS + 1), dtype=bool)
    before = best
    for m, o in enumerate(items):
        if m in starts:
            before = best
        new = np.full(BUCKETS + 1, np.inf)
        for k, (_, c, err) in enumerate(o):
            n = need(c)
            if n > BUCKETS:
                continue
            cand = np.full(BUCKETS + 1, np.inf)
            cand[n:] = best[: BUCKETS + 1 - n] + err
            better = cand < new
            new[better], choice[m, better] = cand[better], k
        if m in ends and (n := need(groups[ends[m]][2])) <= BUCKETS:
            alt = np.full(BUCKETS + 1, np.inf)
            alt[n:] = before[: BUCKETS + 1 - n] + groups[ends[m]][3]
            replaced[ends[m]] = alt < new
            new = np.minimum(new, alt)
        best = new
    picked, b, m = [0] * len(items), BUCKETS, len(items) - 1
    while m >= 0:
        if m in ends and replaced[ends[m], b]:
            first, _, c, _ = groups[ends[m]]
            picked[first : m + 1] = [-1] * (m + 1 - first)
            b, m = b - need(c), first - 1
            continue
        picked[m] = int(choice[m, b])
        b -= need(items[m][picked[m]][1])
        m -= 1
    return picked


def pareto(options: list[Option]) -> list[Option]:
    """The options no other is both cheaper (or as cheap) and better than, the first (the item as it is) kept first:
    dropping the rest never changes the knapsack's optimum."""
    first, rest = options[0], sorted(options[1:], key=lambda o: (o[1], o[2]))
    kept: list[Option] = []
    for o in rest:  # by cost: each kept option is better than every cheaper one
        if (o[1] < first[1] or o[2] < first[2]) and (not kept or o[2] < kept[-1][2]):
            kept.append(o)
    return [first, *kept]


def combine(groups: list[list[Option]]) -> list[Option]:
    """One item's options from several items chosen together (their options' products, pruned to the Pareto front
    after each step): the choice is a tuple, one per group."""
    out: list[Option] = [((), 0.0, 0.0)]
    for g in groups:
        out = pareto([((*a, b), ca + cb, ea + eb) for a, ca, ea in out for b, cb, eb in g])
    return out


Rest = tuple[float, float]  # a decoder layer's decode time outside its projections: (width-independent, MLP-width)


@dataclass(frozen=True)
class Pricing:
    """What the budget counts: each projection form's ``cost`` (MACs, or measured decode time in ``unit``s) and,
    for a budget on the whole decode step, each decoder layer's ``rest`` (its time outside its projections:
    ``bench.whole``) and the step's ``fixed`` own time (the LM head's included)."""

    cost: Cost = mac_cost
    unit: str = "MAC"
    rest: dict[str, Rest] = field(default_factory=dict)
    fixed: float = 0.0
    measured: str = ""  # measured costs: where they are cached (what a refusal names, to measure them again)
    unclean: str | None = None  # measured costs taken on a busy machine (or whose repeats disagreed): why. No
    # refusal rests on them: a target beyond their reach is allocated at the reach, and said (``Allocation.unmet``)


MACS = Pricing()


def is_layer(site: str) -> bool:
    """Whether ``site`` names a whole decoder layer (``model.layers.N``)."""
    return site.count(".") == 2 and layer_of(site) == site


def allocate(shapes: list[ModuleShape], offers: dict[str, list[Choice]], ratio: float,
             pricing: Pricing = MACS, kv_heads: int = 0) -> Allocation:
    """The choices meeting ``sum cost <= dense total / ratio`` with the least total error (``pricing.cost``: MACs by
    default, or measured decode time), by ``knapsack``, reading each site's ``offers`` (``Choice``) without knowing
    which form made them. A projection chooses between its dense form and its offers; a block (an MLP or an
    attention block) between its projections' choices (combined) and its own offers; a decoder layer offered an
    alternative may instead go whole (``knapsack``'s groups), its projections then costing nothing; the LM head's
    offers (with ``pricing.rest`` only) combine across forms into one more item. The removal order puts the
    projections that leave their dense form first, cheapest error per unit of cost saved first. With
    ``pricing.rest`` the budget is the whole step's, ``(dense + rests + fixed) / ratio - fixed``; a removed layer
    saves its rest, an MLP keeping k of W channels the k/W share of its width-scaled part (``kv_heads``: the
    source's key/value heads per layer, what an attention site's kept groups count). Deterministic."""
    rest, fixed = pricing.rest, pricing.fixed
    heads = offers.get(HEAD)
    if heads and not rest:
        raise ValueError("the LM head is priced against the whole decode step: give rest (the layers' rests)")
    dense = {s.name: pricing.cost(s, 0) for s in shapes}
    per = {n: [((Choice("", c, 0.0),), c, 0.0)] + [((o,), o.cost, o.error) for o in offers.get(n, ())]
           for n, c in dense.items()}  # a projection as it is (no form), then its offers
    items, members = _items(shapes, per, offers, rest)
    total = sum(dense.values()) + sum(a + m for a, m in rest.values()) + fixed
    if heads:  # the head's as-is time leaves the fixed part and becomes its item's
        options = head_options(heads)
        fixed -= options[0][1]
        items.append(options)
        members.append(("head", [HEAD]))
    groups = layer_groups(members, {site: cs[0].error for site, cs in offers.items() if cs and is_layer(site)})
    dial = f"--{'speedup' if rest else 'mac-ratio'} {ratio:g}"
    every = f"the cheapest form of every {'layer' if rest else 'projection'}"
    less = "less decode time" if rest else f"fewer projection {pricing.unit}s"

    def beyond(cheapest: float) -> str:
        said = f"{dial}: beyond reach; {every} gives {total / (cheapest + fixed):.2f}x {less}"
        if pricing.measured:  # a refusal resting on a measurement says what was measured and how to measure again
            said += (f" (by decode times measured on this machine, cached in {pricing.measured}: delete them to "
                     "measure again)")
        return said

    unmet = None
    try:
        picked = knapsack(items, total / ratio - fixed, beyond, groups)
    except BeyondReach as e:
        if pricing.unclean is None:
            raise
        reach = total / (e.cheapest + fixed)
        at = reach / (1 + REACH_MARGIN)  # the knapsack rounds each cost up to a bucket: a margin below the reach
        unmet = (f"{dial}: {every} is predicted at {reach:.2f}x, "
                 f"but by times measured unclean ({pricing.unclean}), so nothing is refused on them: allocated at "
                 f"{at:.2f}x, the closest; the bench measures what it gives")
        picked = knapsack(items, total / at - fixed, beyond, groups)
    return _allocation(members, items, picked, offers, dense, kv_heads, unmet)


def _allocation(members: list, items: list, picked: list[int], offers: dict, dense: dict[str, float],
                kv_heads: int = 0, unmet: str | None = None) -> Allocation:
    """The ``Allocation`` the knapsack's ``picked`` options of ``items`` (who each is: ``members``) make: each
    choice's effect on its site read from the choice, whichever form made it (``dense``: each projection's cost as
    it is, for the removal order)."""
    a, saved = Allocation({}, [], kv_heads=kv_heads, unmet=unmet), {}
    for (site, names), o, k in zip(members, items, picked):
        if site == "rest":
            continue
        if k < 0:  # the layer goes
            a.ranks.update({n: 0 for n in names})
            layer = layer_of(names[0])
            if layer not in a.removed:
                a.removed.append(layer)
                a.errors[layer] = offers[layer][0].error
                a.chosen[layer] = [offers[layer][0]]
            continue
        chosen, _, e = o[k]
        if site == "head":
            a.errors[HEAD], a.chosen[HEAD] = e, list(chosen)
        elif isinstance(chosen, Choice):  # the block keeps chosen.keep channels or key/value groups
            a.keep[site], a.errors[site], a.chosen[site] = chosen.keep, e, [chosen]
            a.ranks.update({n: 0 for n in names})
        else:
            for n, c in zip(names, chosen):
                a.ranks[n], a.errors[n] = c.rank, c.error
                if c.form:
                    a.chosen[n] = [c]
                if c.rank:
                    saved[n] = dense[n] - c.cost
    a.order = sorted((n for n, r in a.ranks.items() if r), key=lambda n: (a.errors[n] / saved[n], n))
    return a


def head_options(offered: list[Choice]) -> list[Option]:
    """The LM head's options from the choices forms offered at it: one factor per form (its choices in the order
    given, its first the head as it is), combined as their product, the last form's varying slowest; each priced
    as that form's choice, scaled by every other's cost ratio to its own first, at the sum of the errors. The first
    option is every form's first: the head as it is."""
    forms = list(dict.fromkeys(c.form for c in offered))
    factors = [[c for c in offered if c.form == f] for f in reversed(forms)]
    out = []
    for combo in itertools.product(*factors):
        cost = combo[0].cost
        for c, f in zip(combo[1:], factors[1:]):
            cost *= c.cost / f[0].cost
        out.append((combo, cost, sum(c.error for c in combo)))
    return out


def _items(shapes, per: dict, offers: dict, rest: dict) -> tuple[list, list]:
    """The knapsack's items and who each is: one per projection, one per offered block (its projections' combined
    choices and its own, each kept width with its share of the layer's rest), and with ``rest`` one per layer after
    its projections (the rest of it that no block carries)."""
    items, members = [], []
    site_names = list(dict.fromkeys(s.name.rsplit(".", 1)[0] for s in shapes))
    for i, site in enumerate(site_names):
        names = [s.name for s in shapes if s.name.rsplit(".", 1)[0] == site]
        layer = layer_of(site)
        if site not in per and offers.get(site):  # a block: an MLP (its width's share of the layer's rest with it) or
            # an attention block
            mlp = site.endswith(".mlp")
            width = next(s.in_features for s in shapes if s.name == f"{site}.down_proj") if mlp else 1
            m = rest[layer][1] if layer in rest and mlp else 0.0
            items.append(pareto([(x, c + m, e) for x, c, e in combine([[(c_[0], c, e) for c_, c, e in per[n]]
                                                                        for n in names])]
                                + [(c, c.cost + m * c.keep / width, c.error) for c in offers[site]]))
            members.append((site, names))
        else:
            items += [list(per[n]) for n in names]
            members += [(None, [n]) for n in names]
        last = i + 1 == len(site_names) or not site_names[i + 1].startswith(layer + ".")
        if last and layer in rest:
            a, m = rest[layer]
            own = a + (0.0 if offers.get(f"{layer}.mlp") else m)
            items.append([((f"{layer}.rest",), own, 0.0)])
            members.append(("rest", [f"{layer}.rest"]))
    return items, members


def layer_groups(members: list[tuple], layers: dict[str, float]) -> list[Group]:
    """The knapsack groups of the decoder layers that may be removed: the range of consecutive items holding each
    one's projections, its alternative costing nothing at its removal error."""
    of = [layer_of(names[0]) for _, names in members]
    groups = []
    for layer, err in layers.items():
        at = [m for m, x in enumerate(of) if x == layer]
        if at:
            if at != list(range(at[0], at[-1] + 1)):
                raise ValueError(f"{layer}: its projections are not consecutive in the allocation's items")
            groups.append((at[0], at[-1] + 1, 0.0, float(err)))
    return sorted(groups)


def greedy_targets(costs: Sequence[int], budget: float, scores: Sequence[float] | None = None) -> np.ndarray:
    """Greedy retention targets meeting ``sum target_m c_m = budget * sum c_m``.

    Starting from full retention, modules are walked in ascending removal score (SPEC 5: s_m = c_m, cheapest
    first; ``scores`` replaces it, e.g. the quality allocation's order) with ties in the given registration order,
    and each is lowered by as much as still needed, down to 0. At most one module ends fractional.
    """
    c = np.asarray(costs, dtype=np.float64)
    s = c if scores is None else np.asarray(scores, dtype=np.float64)
    targets = np.ones(len(c), dtype=np.float64)
    need = (1.0 - budget) * c.sum()  # dense MACs still to remove
    for i in sorted(range(len(c)), key=lambda i: (s[i], i)):  # stable: registration order breaks ties
        if need <= 0.0:
            break
        if need >= c[i] * (1.0 - 1e-12):  # a budget that is exactly a sum of costs drops those modules whole
            targets[i] = 0.0
            need -= c[i]
        else:
            targets[i] = (c[i] - need) / c[i]
            need = 0.0
    return targets
