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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bdlora.base.errors import UsageError
from bdlora.forms import HEAD, WIDE_BITS
from bdlora.models.arch import layer_of
from bdlora.models.costs import ModuleShape

RANK_STEP = 8  # ranks above 8 are multiples of 8 (GEMM kernels run them at full speed; the search stays small)


def break_even(shape: ModuleShape) -> int:
    """The smallest rank whose pair costs at least the dense product (SPEC 6.3's "never slower than dense")."""
    i, o = shape.in_features, shape.out_features
    return -(-i * o // (i + o))


def rank_grid(limit: int, step: int = RANK_STEP) -> list[int]:
    """Candidate ranks below ``limit``: 1, 2, 4, ... up to ``step``, then multiples of ``step``."""
    small = [1 << k for k in range(step.bit_length()) if (1 << k) < step]
    return [r for r in small + list(range(step, limit, step)) if r < limit]


Cost = Callable[[ModuleShape, int], float]  # (module, rank; 0 = dense) -> what the budget counts


def mac_cost(shape: ModuleShape, rank: int) -> float:
    return float(shape.lora_cost(rank) if rank else shape.dense_cost)


def options(shape: ModuleShape, energy: np.ndarray, step: int = RANK_STEP,
            cost: Cost = mac_cost) -> list[tuple[int, float, float]]:
    """(rank, cost, error) of every form of one module: dense (rank 0, error 0) and each rank of ``rank_grid``
    below break-even, within the spectrum and cheaper than dense by ``cost`` (with a measured cost a pair may not pay
    at any rank: the module then stays dense); ``energy`` is the per-component error (descending importance)."""
    w = np.clip(np.asarray(energy, dtype=np.float64), 0.0, None)
    tail = np.concatenate([np.cumsum(w[::-1])[::-1], [0.0]])  # tail[r] = error at rank r
    dense = cost(shape, 0)
    out = [(0, dense, 0.0)]
    for r in rank_grid(min(break_even(shape), len(w) + 1), step):
        c = cost(shape, r)
        if c < dense:
            out.append((r, c, float(tail[r])))
    return out


@dataclass
class Allocation:
    """Per-module ranks (0: stays dense), the order modules leave their dense form in (the controller's removal
    score: position in ``order``), the predicted error of each chosen form, and the MLP sites that keep fewer
    channels (``keep``: site -> channels; their projections are at rank 0, dense at the narrower width) and the
    decoder layers removed (``removed``: ``model.layers.N``; their projections are at rank 0 and cost nothing)."""

    ranks: dict[str, int]
    order: list[str]
    errors: dict[str, float] = field(default_factory=dict)
    keep: dict[str, int] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    wide: list[str] = field(default_factory=list)  # projections kept at 8 bits in an int4 export (``--forms bits``)
    kv_heads: int = 0  # the source's key/value heads per layer (an attention site's ``keep`` counts groups of them)
    head_bits: int = 0  # the LM head's bits in an int4 export where the allocation chose them (``--forms bits
    # --speedup``: 4 or 8); 0: not chosen (the export's default, 8)
    head_keep: int = 0  # the tokens the LM head keeps (``--forms vocab``: a draft's head); 0: all of them
    head_module: dict | None = field(default=None, repr=False, compare=False)  # that head's declaration and tensors

    @property
    def bits(self) -> dict[str, int]:
        """Projection -> its bits where wider than the export's precision (``LatencyTable.prediction``'s)."""
        return {n: WIDE_BITS for n in self.wide}

    def gone(self, name: str) -> bool:
        """Whether projection ``name`` goes with its removed layer."""
        return layer_of(name) in self.removed

    def shape(self, s: ModuleShape) -> ModuleShape:
        """``s`` as deployed: narrower when its MLP keeps fewer channels or its attention fewer groups."""
        k = self.keep.get(s.name.rsplit(".", 1)[0])
        return s.pruned(k, self.kv_heads) if k else s

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
        return {"ranks": self.ranks, "order": self.order, "errors": self.errors, "keep": self.keep,
                "removed": self.removed, "wide": self.wide, "kv_heads": self.kv_heads, "head_bits": self.head_bits,
                "head_keep": self.head_keep}

    @classmethod
    def from_json(cls, doc: dict) -> Allocation:
        return cls({k: int(v) for k, v in doc["ranks"].items()}, list(doc["order"]),
                   {k: float(v) for k, v in doc.get("errors", {}).items()},
                   {k: int(v) for k, v in (doc.get("keep") or {}).items()}, list(doc.get("removed") or ()),
                   list(doc.get("wide") or ()), int(doc.get("kv_heads") or 0), int(doc.get("head_bits") or 0),
                   int(doc.get("head_keep") or 0))


BUCKETS = 1 << 16  # the MAC budget's resolution in the allocation (module costs are rounded up to 1/65536 of it)

Option = tuple[object, float, float]  # (what is chosen, its cost, its error)


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
        raise UsageError(beyond(cheapest))
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


def allocate(shapes: list[ModuleShape], energy: dict[str, np.ndarray], mac_ratio: float,
             step: int = RANK_STEP, cost: Cost = mac_cost, unit_name: str = "MAC",
             sites: dict[str, list[Option]] | None = None, lowrank: bool = True,
             layers: dict[str, float] | None = None, rest: dict[str, Rest] | None = None,
             fixed: float = 0.0, wide: dict[str, tuple[float, float]] | None = None,
             kv_heads: int = 0, head: tuple[float, float, float] | None = None,
             vocab: list[tuple[int, float, float]] | None = None) -> Allocation:
    """The per-module forms meeting ``sum cost <= dense total / mac_ratio`` with the least total error (``cost``:
    MACs by default, or measured decode time), by ``knapsack``. ``sites`` (an MLP site -> its channel options,
    ``forms.channels``): that site's three projections become one item choosing between their low-rank forms
    (combined) and keeping fewer channels. The removal order puts the modules that leave their dense form first,
    cheapest error per unit of cost saved first. ``lowrank`` False: no projection becomes a pair (only the sites'
    channels are chosen). ``layers`` (``model.layers.N`` -> the error of removing it, ``forms.layers``): each
    such layer may instead be removed, its projections then costing nothing. ``rest`` (``model.layers.N`` -> its
    decode time outside the projections, ``bench.whole``) and ``fixed`` (the step's own): the budget is then the
    whole step's, ``(dense + rests + fixed) / mac_ratio - fixed``; a removed layer saves its rest, an MLP keeping k
    of W channels the k/W share of its width-scaled part. ``wide`` (projection -> (its dense time at 8 bits, the
    rounding error that gives back), ``forms.bits``): it may instead stay dense at 8 bits in an int4 export, at
    that error below its 4-bit forms'. ``sites`` may hold attention sites too (``model.layers.N.self_attn`` -> its
    options of kept key/value groups, ``forms.groups``; ``kv_heads``: the source's per layer). ``head`` (with
    ``rest``: the LM head's (time at 8 bits, time at 4 bits, the error 4 bits add), ``forms.bits.head_option``):
    the head is one more item, at 8 bits (the teacher's export, whose time ``fixed`` holds) or at 4. ``vocab`` (with
    ``rest``: [(tokens kept, time at 8 bits, error)], ``forms.vocab``): the head may keep fewer tokens (a draft's);
    with ``head`` too, each kept vocabulary at either width (the 4-bit time scaled as the full head's, the errors
    added). Deterministic."""
    sites, rest, wide = sites or {}, rest or {}, wide or {}
    if (head is not None or vocab) and not rest:
        raise ValueError("the LM head is priced against the whole decode step: give rest (the layers' rests)")
    per = {s.name: [((s.name, r, 0), c, e) for r, c, e in options(s, energy[s.name], step, cost)[: None if lowrank
                                                                                                  else 1]]
           + ([((s.name, 0, WIDE_BITS), wide[s.name][0], -wide[s.name][1])] if s.name in wide else [])
           for s in shapes}
    items, members = _items(shapes, per, sites, rest)
    total = sum(cost(s, 0) for s in shapes) + sum(a + m for a, m in rest.values()) + fixed
    if head is not None or vocab:  # the head's 8-bit time leaves the fixed part and becomes its item's
        heads = head_options(head, vocab)
        fixed -= heads[0][1]
        items.append(heads)
        members.append(("head", [HEAD]))
    groups = layer_groups(members, layers or {})
    picked = knapsack(items, total / mac_ratio - fixed, lambda cheapest: (
        f"--{'speedup' if rest else 'mac-ratio'} {mac_ratio:g}: beyond reach; the cheapest form of every "
        f"{'layer' if rest else 'projection'} gives {total / (cheapest + fixed):.2f}x "
        f"{'less decode time' if rest else f'fewer projection {unit_name}s'}"), groups)
    return _allocation(shapes, members, items, picked, per, cost, layers, kv_heads)


def _allocation(shapes, members: list, items: list, picked: list[int], per: dict, cost: Cost, layers: dict | None,
                kv_heads: int) -> Allocation:
    """The ``Allocation`` the knapsack's ``picked`` options of ``items`` (who each is: ``members``) make."""
    ranks, errors, saved, keep, removed, eight, head_bits, head_keep = {}, {}, {}, {}, [], [], 0, 0
    by = {s.name: s for s in shapes}
    for (site, names), o, k in zip(members, items, picked):
        if site == "head":
            (chosen,), _, errors[HEAD] = o[k]
            head_keep, head_bits = chosen[1], chosen[2] if any(x[0][0][2] != WIDE_BITS for x in o) else 0
            continue
        if k < 0:  # the layer goes
            ranks.update({n: 0 for n in names if site != "rest"})
            layer = layer_of(names[0])
            if layer not in removed:
                removed.append(layer)
                errors[layer] = layers[layer]
            continue
        chosen, c, e = o[k]
        if site == "rest":
            continue
        if isinstance(chosen[0], int):  # the site keeps chosen[0] channels (an MLP) or groups (an attention block)
            keep[site] = chosen[0]
            ranks.update({n: 0 for n in names})
            errors[site] = e
            continue
        for n, r, b in chosen:
            ranks[n] = r
            errors[n] = next(err for (_, rr, bb), _, err in per[n] if (rr, bb) == (r, b))
            saved[n] = cost(by[n], 0) - cost(by[n], r)
            if b:
                eight.append(n)
    order = sorted((n for n, r in ranks.items() if r), key=lambda n: (errors[n] / saved[n], n))
    return Allocation(ranks, order, errors, keep, removed, eight, kv_heads, head_bits, head_keep)


def head_options(head: tuple[float, float, float] | None, vocab: list | None) -> list[Option]:
    """The LM head's options, ``((HEAD, tokens kept (0: all), bits),)`` at (time, error), the source's own first
    (every token at 8 bits): the widths of ``head`` (8-bit time, 4-bit time, error added at 4), the kept
    vocabularies of ``vocab`` [(tokens, 8-bit time, error)], or their product."""
    widths = [(WIDE_BITS, 1.0, 0.0)] + ([(4, head[1] / head[0], head[2])] if head is not None else [])
    full = head[0] if head is not None else vocab[0][1]
    keeps = [(0, full, 0.0)] + [(k, c, e) for k, c, e in vocab or () if k]
    return [(((HEAD, k, b),), c * scale, e + eb) for k, c, e in keeps for b, scale, eb in widths]


def _items(shapes, per: dict, sites: dict, rest: dict) -> tuple[list, list]:
    """The knapsack's items and who each is: one per projection, one per MLP site (its projections' combined low-rank
    forms and its kept widths, each with its width's share of the layer's rest), and with ``rest`` one per layer after
    its projections (the rest of it that no site carries)."""
    items, members = [], []
    site_names = list(dict.fromkeys(s.name.rsplit(".", 1)[0] for s in shapes))
    for i, site in enumerate(site_names):
        names = [s.name for s in shapes if s.name.rsplit(".", 1)[0] == site]
        layer = layer_of(site)
        if site in sites:  # an MLP (with its width's share of the layer's rest) or an attention block
            mlp = site.endswith(".mlp")
            width = next(s.in_features for s in shapes if s.name == f"{site}.down_proj") if mlp else 1
            m = rest[layer][1] if layer in rest and mlp else 0.0
            items.append(pareto([(x, c + m, e) for x, c, e in combine([per[n] for n in names])]
                                + [((k,), c + m * k / width, e) for k, c, e in sites[site]]))
            members.append((site, names))
        else:
            items += [[((n_r,), c, e) for n_r, c, e in per[n]] for n in names]
            members += [(None, [n]) for n in names]
        last = i + 1 == len(site_names) or not site_names[i + 1].startswith(layer + ".")
        if last and layer in rest:
            a, m = rest[layer]
            own = a + (0.0 if f"{layer}.mlp" in sites else m)
            items.append([(((f"{layer}.rest", 0, 0),), own, 0.0)])
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
