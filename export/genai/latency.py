"""What each form of a projection costs at decode time in onnxruntime on this machine, measured, at the precision it
ships in: the allocation's cost when ``compress --one-shot --precision P`` (and ``plan --precision P``) is given.

MACs price a rank-r pair at r (K + N) against K N for the dense product. At int8/int4 a decode step is a few
milliseconds and each MatMulNBits node has a fixed cost MACs do not see, so a pair that is 2x cheaper in MACs can be
no faster than the dense node it replaces (SmolLM2-135M at int4: the students' MAC speed-up vanished in deployment).
So the cost of each form is measured: one ``(1, K)`` row through the node(s) the genai exporter emits for that form
(``MatMul`` at fp32; ``MatMulNBits`` with blocks of 32, uint8 zero points and accuracy level 4 at int8/int4; the
node layout of the scheme the export rounds with, ``Scheme.layout``: with block offsets at int4, each node reads
``[x, block means of x]`` through its own AveragePool and Concat and carries K/32 more columns), at the deployed
thread count, in a graph of ``C`` independent copies with distinct random weights (so the weights
stream from memory as a model's do, not from a warm cache) timed against a graph of one copy:
``(t_C - t_1) / (C - 1)`` is the form's time with the per-call overhead cancelled, each graph timed alone at the
median of its repeats. Neither the minimum nor interleaving the two graphs: at Llama-3.2-1B shapes tables of minima
(a lucky run whose weights stayed in this machine's large last-level cache) predicted a 1.25x channels,groups student
1.23x whose int4 graph decoded 1.09x faster, and alternating the two graphs' sessions (each evicting the other)
priced the dense model's step at 63 ms where it decodes at 40 (the medians of graphs timed alone: 38.8 ms, the
student 1.12x). Other processes are kept out by the checks below, not by the statistic. Weight values do not change
the time
of these kernels, so random bytes stand in for them.

A time that feeds decisions must be clean (``base.load``): the other processes' load is watched before and over the
whole measurement and the repeats must agree. An unclean time is used by the run that measured it and cached marked
unclean; a later run on a quiet machine measures it again, and no refusal (a speed-up "beyond reach") rests on it.
"""

from __future__ import annotations

import hashlib
import math
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from bdlora.base import load  # through the module: the tests set its readers
from bdlora.base.errors import UsageError, usable_cores
from bdlora.base.io import read_json, write_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.schemes import DEFAULT_SCHEME, PRECISIONS, ROUNDED, rounded, scheme
from bdlora.compress.pricing import break_even
from bdlora.export.genai.affine import augment_nodes
from bdlora.export.genai.gptq import BLOCK_SIZE, nbits_node
from bdlora.export.genai.quantize import scheme_rounded
from bdlora.models.costs import Deployed, ModuleShape
from bdlora.models.runtime import session_options

BITS = {name: PRECISIONS[name].bits for name in ROUNDED}  # the weight bits of each rounded precision
STREAM_BYTES = 48 << 20  # weight bytes per measured graph: beyond the last-level cache of most CPUs
MAX_COPIES, MIN_COPIES = 64, 4
REPEATS, WARMUP = 25, 5
TABLE_VERSION = 3  # 3: medians, each graph alone, checked, the load recorded (2: minima of interleaved runs)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def grid(shape: ModuleShape) -> list[int]:
    """Ranks measured for ``shape``: 1, 8, 16, 32, 64, doubling, and the largest rank below the MAC break-even."""
    top = break_even(shape) - 1
    ranks = {1, top}
    r = 8
    while r < top:
        ranks.add(r)
        r = r * 2 if r >= 64 else r + (8 if r < 16 else 16 if r < 32 else 32)
    return sorted(x for x in ranks if 1 <= x <= top)


def _product(k: int, n: int, precision: str, rng: np.random.Generator, name: str, x: str, out: str,
             layout: str = "nbits") -> tuple[list, list]:
    """(nodes, initializers) of one ``(1, K) -> (1, N)`` product at ``precision`` in ``layout`` (random values; at
    int8/int4 the MatMulNBits node the calibrated export emits, ``gptq.nbits_node``; ``nbits+means`` where blocks
    divide K: the node reads ``[x, block means]``, made here for it alone, and holds K/32 more columns, as
    ``affine.affine_node`` writes it)."""
    if not rounded(precision):
        w = numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32), f"{name}.w")
        return [helper.make_node("MatMul", [x, w.name], [out], name=name)], [w]
    front = []
    if layout == "nbits+means" and k % BLOCK_SIZE == 0:
        x, front = augment_nodes(x, k)
        k += k // BLOCK_SIZE
    bits, kb = BITS[precision], -(-k // BLOCK_SIZE)
    packed = rng.integers(0, 256, (n, kb, BLOCK_SIZE * bits // 8), dtype=np.uint8)
    scales = rng.random(n * kb, dtype=np.float32) * 0.01
    zp = rng.integers(0, 256, n * (kb if bits == 8 else -(-kb // 2)), dtype=np.uint8)
    node, inits = nbits_node(name, x, out, packed, scales, zp, k, n, bits)
    return [*front, node], inits


def form_bytes(k: int, n: int, rank: int, precision: str) -> int:
    per = PRECISIONS[precision].bits / 8
    return int((k * n if rank == 0 else rank * (k + n)) * per) + 1


def form_graph(k: int, n: int, rank: int, precision: str, copies: int, seed: int = 0,
               layout: str = "nbits") -> onnx.ModelProto:
    """``copies`` independent instances of one form (dense: ``rank`` 0; else the pair K -> rank -> N) in ``layout``
    (``Scheme.layout``), on one input ``x`` (1, K); in ``nbits+means`` each copy reads its own input ``x<c>`` (the
    same values), so that onnxruntime does not merge the copies' identical AveragePools into one, shaped (1, 1, K)
    as the decoder's activations are (the pooling reads the last axis as its length)."""
    rng = np.random.default_rng(seed)
    nodes, inits, outs = [], [], []
    own = layout == "nbits+means"
    for c in range(copies):
        x, out = f"x{c}" if own else "x", f"y{c}"
        if rank == 0:
            parts = [_product(k, n, precision, rng, f"d{c}", x, out, layout)]
        else:
            parts = [_product(k, rank, precision, rng, f"a{c}", x, f"h{c}", layout),
                     _product(rank, n, precision, rng, f"b{c}", f"h{c}", out, layout)]
        for made, w in parts:
            nodes += made
            inits += w
        outs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, 1, n] if own else [1, n]))
    inputs = [helper.make_tensor_value_info(f"x{c}" if own else "x", TensorProto.FLOAT, [1, 1, k] if own else [1, k])
              for c in range(copies if own else 1)]
    g = helper.make_graph(nodes, "form", inputs, outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _session(proto: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    so = session_options(ort)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run_us(sess: ort.InferenceSession, feed: dict) -> float:
    t = time.perf_counter()
    sess.run(None, feed)
    return (time.perf_counter() - t) * 1e6


def _repeats_us(proto: onnx.ModelProto, k: int, threads: int) -> list[float]:
    """Every timed repeat (microseconds) of one graph, run alone after its warm-up."""
    sess = _session(proto, threads)
    value = np.random.default_rng(1).standard_normal(k, dtype=np.float32)
    feed = {i.name: value.reshape(i.shape) for i in sess.get_inputs()}
    for _ in range(WARMUP):
        sess.run(None, feed)
    return [_run_us(sess, feed) for _ in range(REPEATS)]


def measure_form(k: int, n: int, rank: int, precision: str, threads: int, layout: str = "nbits") -> tuple[float, bool]:
    """(decode-time microseconds of one instance of a form in ``layout``, whether its repeats agree): the graphs of
    one and of ``copies`` instances, each timed alone at the median of its repeats (see the module docstring). The
    repeats agree (``load.agree``) and the copies cost more than one."""
    copies = int(min(MAX_COPIES, max(MIN_COPIES, math.ceil(STREAM_BYTES / form_bytes(k, n, rank, precision)))))
    one = _repeats_us(form_graph(k, n, rank, precision, 1, layout=layout), k, threads)
    many = _repeats_us(form_graph(k, n, rank, precision, copies, layout=layout), k, threads)
    consistent = load.agree(one) and load.agree(many) and np.median(many) > np.median(one)
    return max(float(np.median(many) - np.median(one)) / (copies - 1), 1e-3), consistent


def _key(k: int, n: int, rank: int) -> str:
    return f"{k}x{n}@{rank}"


@dataclass
class LatencyTable:
    """Measured decode microseconds of each form at one precision and thread count, in the node layout of
    ``scheme`` (the export's ``--quant``); ``cost(shape, rank)`` (rank 0: dense) is what
    ``compress.allocate.allocate`` takes, interpolated between measured ranks."""

    precision: str
    threads: int
    us: dict[str, float] = field(default_factory=dict)
    path: Path | None = None
    whole: object | None = None  # a ``bench.whole.WholeStep``: prediction() then covers the whole decode step
    wide: LatencyTable | None = None  # int4: the int8 table, pricing the projections kept at 8 bits (--forms bits)
    scheme: str = DEFAULT_SCHEME  # whose node layout was timed (and whose grid ``rounded`` rounds on)
    unclean: str | None = None  # why some of the times this table prices with were not measured cleanly (busy,
    # repeats that disagree), None when all were: a prediction from it is said to be unclean and refuses nothing

    def noisy(self) -> str | None:
        """Why this table's prediction rests on times not measured cleanly (its own forms', its 8-bit table's or
        the whole step's), None when every time was."""
        whole = getattr(getattr(self, "whole", None), "overhead", None)
        said = [self.unclean, self.wide.unclean if self.wide is not None else None,
                getattr(whole, "unclean", None)]
        return "; ".join(x for x in said if x) or None

    def measured_where(self) -> str:
        """The cached files this table's times come from (what to delete to measure them again)."""
        whole = getattr(getattr(self, "whole", None), "overhead", None)
        files = [str(p) for p in (self.path, self.wide.path if self.wide is not None else None,
                                  getattr(whole, "path", None)) if p]
        return ", ".join(files) or "not cached"

    def measured_ranks(self, k: int, n: int) -> list[int]:
        pre = f"{k}x{n}@"
        return sorted(int(key[len(pre):]) for key in self.us if key.startswith(pre) and key[len(pre):] != "0")

    def cost(self, shape: ModuleShape, rank: int, bits: int = 0) -> float:
        """Microseconds of ``shape`` at ``rank`` (0: dense); ``bits`` 8 in an int4 table: at 8 bits (``wide``)."""
        if bits and bits != BITS.get(self.precision):
            if self.wide is None or BITS.get(self.wide.precision) != bits:
                raise KeyError(f"no {bits}-bit table beside this {self.precision} one")
            return self.wide.cost(shape, rank)
        k, n = shape.in_features, shape.out_features
        if rank == 0:
            return self.us[_key(k, n, 0)] if _key(k, n, 0) in self.us else self.dense_between(k, n)
        ranks = self.measured_ranks(k, n)
        if not ranks:
            raise KeyError(f"no measured ranks for {k}x{n}")
        xs = np.array(ranks, dtype=np.float64)
        ys = np.array([self.us[_key(k, n, r)] for r in ranks])
        if rank >= xs[-1] and len(xs) > 1:  # extrapolate along the last segment
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return float(ys[-1] + slope * (rank - xs[-1]))
        return float(np.interp(rank, xs, ys))

    def dense_between(self, k: int, n: int) -> float:
        """A dense (K, N) product not measured itself (a pruned MLP's narrower width): interpolated linearly between
        the measured dense products sharing K (or N), extrapolated along the nearest segment."""
        for fixed, varies in ((0, 1), (1, 0)):
            known = sorted((int(p[varies]), v) for key, v in self.us.items() if key.endswith("@0")
                           for p in [key[:-2].split("x")] if int(p[fixed]) == (k, n)[fixed])
            if len(known) >= 2:
                xs, ys = np.array([x for x, _ in known], float), np.array([y for _, y in known])
                x = (k, n)[varies]
                i = int(np.clip(np.searchsorted(xs, x), 1, len(xs) - 1))  # the segment x lies in (or nearest)
                slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
                return float(max(ys[i - 1] + slope * (x - xs[i - 1]), 1e-3))
        raise KeyError(f"no measured dense products to interpolate {k}x{n} between")

    def pays(self, shape: ModuleShape) -> int:
        """The largest rank whose pair decodes faster than the dense product (0: none does)."""
        best = 0
        for r in range(1, break_even(shape)):
            if self.cost(shape, r) < self.cost(shape, 0):
                best = r
        return best

    def rounded(self, weight, bits: int):
        """``weight`` (out, in) as the export's scheme rounds it to ``bits`` without calibration
        (``quantize.scheme_rounded``): what the rounding error of ``--forms bits`` is measured with."""
        return scheme_rounded(weight, bits, self.scheme)

    def prediction(self, shapes: list[ModuleShape], deployed: Deployed | None = None) -> dict:
        """What a structure over ``shapes`` (``deployed``: each projection as deployed, those absent gone with their
        layer, and the head; None: every projection dense) costs at this precision: the projections' decode
        microseconds dense and as structured, the predicted speed-up, the forms measured, and which projections have
        a low-rank form slower than their dense one."""
        deployed = deployed or Deployed.dense(shapes)
        dense = sum(self.cost(s, 0) for s in shapes)
        chosen = sum(self.cost(shape, rank, bits) for shape, rank, bits in deployed.modules.values())
        slower = sorted({s.name.split(".")[-1] for s in shapes
                         if deployed.rank(s.name) and self.cost(s, deployed.rank(s.name)) >= self.cost(s, 0)})
        doc = {"precision": self.precision, "scheme": self.scheme,
               "layout": scheme(self.scheme).layout(self.precision), "threads": self.threads,
               "projection_us_dense": dense,
               "projection_us": chosen, "predicted_projection_speedup": dense / chosen,
               "forms": self.summary(shapes), "lowrank_slower_than_dense": slower,
               "table": str(self.path) if self.path else None}
        if self.whole is not None:  # the whole decode step: the projections and everything around them
            doc.update(self.whole.prediction(self, shapes, deployed))
        doc["measured_clean"] = self.noisy() is None
        if self.noisy():
            doc["measurement"] = self.noisy()
        if any(bits for _, _, bits in deployed.modules.values()):
            doc["int8_modules"] = sum(bits == 8 for _, _, bits in deployed.modules.values())
        return doc

    def summary(self, shapes: list[ModuleShape]) -> list[dict]:
        """One row per distinct (K, N): dense microseconds, the MAC break-even rank, the measured one."""
        rows, seen = [], set()
        for s in shapes:
            if (s.in_features, s.out_features) in seen:
                continue
            seen.add((s.in_features, s.out_features))
            rows.append({"shape": f"{s.in_features}x{s.out_features}", "dense_us": self.cost(s, 0),
                         "mac_break_even": break_even(s), "measured_break_even": self.pays(s) + 1,
                         "rank_8_us": self.cost(s, 8) if break_even(s) > 8 else None})
        return rows


def table_path(cache: Path, precision: str, threads: int, layout: str = "nbits") -> Path:
    """The cached table of ``precision`` in ``layout`` (the plain layouts keep the names they always had)."""
    tag = hashlib.sha256(f"{TABLE_VERSION}|{ort.__version__}|{cpu_name()}".encode()).hexdigest()[:12]
    named = "" if layout in ("matmul", "nbits") else "-" + layout.replace("+", "-")
    return cache / "latency" / f"{precision}{named}-t{threads}-{tag}.json"


_ENTRY = re.compile(r"[1-9]\d{0,6}x[1-9]\d{0,6}@(?:0|[1-9]\d{0,6})")
MAX_US = 1e9  # a quarter of an hour for one projection: no measurement, a damaged value


def read_table(path: Path) -> tuple[dict[str, float], int]:
    """(the valid entries of a cached table, how many were dropped). An entry is kept only when its key names a
    form (``KxN@R``) and its value is a finite time in (0, MAX_US] microseconds: NaN made plan print a NaN speed-up
    with exit 0, zero a division by zero, and a table nested past the recursion limit a traceback. A table that
    does not parse at all counts as one dropped entry."""
    try:
        doc = read_json(path)
        items = doc["us"].items()
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return {}, 1
    kept: dict[str, float] = {}
    for k, v in items:
        if isinstance(k, str) and _ENTRY.fullmatch(k) and isinstance(v, (int, float)) and not isinstance(v, bool) \
                and math.isfinite(v) and 0 < v <= MAX_US:
            kept[k] = float(v)
    return kept, len(doc["us"]) - len(kept)


def _measure_forms(todo: list, precision: str, threads: int, layout: str,
                   reporter: Reporter) -> tuple[dict[str, float], set[str], load.Load]:
    """({form: microseconds}, the forms measured unclean, the load they were measured under) of the (K, N, rank)
    forms ``todo``: a form whose repeats disagree is timed once more; on a busy machine every form is unclean."""
    reporter.count(0, len(todo), "forms")
    times, disagree = {}, set()
    with load.LoadWatch() as watch:
        for k, n, r in todo:
            us, consistent = measure_form(k, n, r, precision, threads, layout)
            if not consistent:  # once more: a spell of other work between repeats
                us, consistent = measure_form(k, n, r, precision, threads, layout)
            times[_key(k, n, r)] = us
            if not consistent:
                disagree.add(_key(k, n, r))
            reporter.count(1, len(todo), "forms")
    bad = set(times) if not watch.load.quiet else disagree
    if bad:
        why = "" if not watch.load.quiet else (f"their repeats disagreed twice (a tenth of them not within "
                                               f"{load.AGREE:g}x of the fastest)")
        load.not_cached(reporter, f"{len(bad)} of the {len(todo)} forms", watch.load, why)
    return times, bad, watch.load


def read_unclean(path: Path) -> set[str]:
    """The entries of a cached table that were measured unclean (busy, or repeats that disagreed): kept for runs on
    a busy machine, measured again by a quiet one."""
    try:
        keys = read_json(path).get("unclean") or []
    except (ValueError, TypeError, AttributeError, RecursionError):
        return set()
    return {k for k in keys if isinstance(k, str)} if isinstance(keys, list) else set()


def latency_table(shapes: list[ModuleShape], precision: str, threads: int, cache: Path,
                  reporter: Reporter = SILENT, dense=(), ranks: bool = True,
                  quant: str = DEFAULT_SCHEME) -> LatencyTable:
    """The table for ``shapes`` at ``precision`` and ``threads`` in the node layout of the scheme ``quant``, read
    from the cache and completed by measuring the forms it lacks (the dense product and the rank ``grid`` of every
    distinct (K, N); with ``ranks`` False the dense products only); ``dense``: further (K, N) products measured
    dense only (the narrower widths a pruned MLP interpolates between).

    Forms are timed with the machine's other load watched (``load.LoadWatch``) and their repeats checked (``agree``; a
    form whose repeats disagree is timed once more). The cache records which entries were measured unclean, and the
    load: a busy run reuses them (the table then says so, ``unclean``, and no refusal rests on it), a quiet run
    measures them again, so a busy machine's times never outlive a quiet run."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision}: must be one of {', '.join(PRECISIONS)}")
    if not 1 <= threads <= usable_cores():  # a table measured on more threads than cores would be cached as real
        raise UsageError(f"--threads {threads}: must be between 1 and the cores this process may use "
                         f"({usable_cores()})")
    layout = scheme(quant).layout(precision)
    path = table_path(Path(cache), precision, threads, layout)
    table = LatencyTable(precision, threads, scheme=quant, path=path)
    unclean: set[str] = set()
    if path.is_file():
        table.us, dropped = read_table(path)
        unclean = read_unclean(path) & set(table.us)
        if dropped:
            reporter.stage(f"{path}: {dropped} damaged entr{'y' if dropped == 1 else 'ies'} (not a positive finite "
                           "time of a KxN@R form), measuring again")
    needed = []
    for k, n in dict.fromkeys((s.in_features, s.out_features) for s in shapes):
        needed += [(k, n, r) for r in [0, *(grid(ModuleShape("", k, n)) if ranks else ())]]
    needed += [(k, n, 0) for k, n in dict.fromkeys(dense) if (k, n, 0) not in needed]
    stale = [f for f in needed if _key(*f) in unclean]
    if stale and load.Load(load.others_busy(), None).quiet:  # measured busy before, quiet now: those times go
        reporter.stage(f"{path}: {len(stale)} form(s) were measured unclean (on a busy machine, or with repeats "
                       "that disagreed); measuring them again now that it is quiet")
        for f in stale:
            del table.us[_key(*f)]
            unclean.discard(_key(*f))
    todo = [f for f in needed if _key(*f) not in table.us]
    if todo:
        reporter.stage(f"measuring {len(todo)} projection forms at {precision} ({layout}) on {threads} thread(s) "
                       f"(cached in {path.parent})")
        times, bad, measured = _measure_forms(todo, precision, threads, layout, reporter)
        table.us.update(times)
        unclean = (unclean - set(times)) | bad
        write_json(path, {"version": TABLE_VERSION, "precision": precision, "layout": layout, "threads": threads,
                          "cpu": cpu_name(), "us": table.us, "unclean": sorted(unclean), "load": measured.record()})
    left = sum(_key(*f) in unclean for f in needed)
    if left:
        table.unclean = (f"{left} of the {len(needed)} {precision} forms timed on a busy machine or with repeats that "
                         f"disagreed ({path})")
    return table
