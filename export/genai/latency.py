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
``(t_C - t_1) / (C - 1)`` is the form's time with the per-call overhead cancelled. Weight values do not change the
time of these kernels, so random bytes stand in for them.

Ranks are measured on a coarse grid (1, 8, 16, 32, 64, then doubling, and the largest rank below the MAC break-even)
and interpolated linearly between grid points; the table is cached per (form, precision, node layout, threads,
onnxruntime version, CPU) under ``<cache>/latency/`` and only missing forms are measured.

The block-offset layout is priced per projection, its AveragePool and Concat included: in the deployed graph the
MatMuls reading one input share them (q, k and v; gate and up), so a dense layer is priced a few small nodes above
what it runs; the whole-step fit (``bench.whole``) measures real graphs of the same layout and absorbs the rest.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from bdlora.base.errors import UsageError, usable_cores
from bdlora.base.io import read_json, write_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.schemes import DEFAULT_SCHEME, PRECISIONS, ROUNDED, rounded, scheme
from bdlora.compress.allocate import break_even
from bdlora.export.genai.affine import augment_nodes
from bdlora.export.genai.gptq import BLOCK_SIZE, nbits_node
from bdlora.export.genai.quantize import scheme_rounded
from bdlora.models.costs import Deployed, ModuleShape
from bdlora.models.runtime import session_options

BITS = {name: PRECISIONS[name].bits for name in ROUNDED}  # the weight bits of each rounded precision
BUSY_CORES = 0.5  # CPU other processes may use while forms are timed before the times are kept out of the cache
STREAM_BYTES = 48 << 20  # weight bytes per measured graph: beyond the last-level cache of most CPUs
MAX_COPIES, MIN_COPIES = 64, 4
REPEATS, WARMUP = 25, 5
TABLE_VERSION = 1


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


def _median_run_us(proto: onnx.ModelProto, k: int, threads: int) -> float:
    so = session_options(ort)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    value = np.random.default_rng(1).standard_normal(k, dtype=np.float32)
    x = {i.name: value.reshape(i.shape) for i in sess.get_inputs()}
    for _ in range(WARMUP):
        sess.run(None, x)
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        sess.run(None, x)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e6


def measure_form(k: int, n: int, rank: int, precision: str, threads: int, layout: str = "nbits") -> float:
    """Decode-time microseconds of one instance of a form in ``layout`` (see the module docstring)."""
    copies = int(min(MAX_COPIES, max(MIN_COPIES, math.ceil(STREAM_BYTES / form_bytes(k, n, rank, precision)))))
    one = _median_run_us(form_graph(k, n, rank, precision, 1, layout=layout), k, threads)
    many = _median_run_us(form_graph(k, n, rank, precision, copies, layout=layout), k, threads)
    return max((many - one) / (copies - 1), 1e-3)


def others_busy(seconds: float = 0.5) -> float | None:
    """Cores' worth of CPU time the machine's *other* processes used over ``seconds`` (``/proc/stat``'s busy time
    less this process's own), or None where that cannot be read (not Linux)."""
    def sample():
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = os.times()
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"), own.user + own.system, \
            time.monotonic()
    try:
        b0, o0, t0 = sample()
        time.sleep(seconds)
        b1, o1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, (b1 - b0) - (o1 - o0)) / max(t1 - t0, 1e-9)


def quiet(reporter: Reporter, what: str) -> bool:
    """Whether the machine is quiet enough for times to be cached (``others_busy`` at most ``BUSY_CORES``); if not,
    says so: times taken beside another job would misprice every later allocation that reads them."""
    busy = others_busy()
    if busy is None or busy <= BUSY_CORES:
        return True
    reporter.stage(f"other processes are using {busy:.1f} cores: {what} timed for this run only and not cached "
                   "(times taken beside another job would misprice every later run); run it on a quiet machine")
    return False


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


def latency_table(shapes: list[ModuleShape], precision: str, threads: int, cache: Path,
                  reporter: Reporter = SILENT, dense=(), ranks: bool = True,
                  quant: str = DEFAULT_SCHEME) -> LatencyTable:
    """The table for ``shapes`` at ``precision`` and ``threads`` in the node layout of the scheme ``quant``, read
    from the cache and completed by measuring the forms it lacks (the dense product and the rank ``grid`` of every
    distinct (K, N); with ``ranks`` False the dense products only); ``dense``: further (K, N) products measured
    dense only (the narrower widths a pruned MLP interpolates between)."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision}: must be one of {', '.join(PRECISIONS)}")
    if not 1 <= threads <= usable_cores():  # a table measured on more threads than cores would be cached as real
        raise UsageError(f"--threads {threads}: must be between 1 and the cores this process may use "
                         f"({usable_cores()})")
    layout = scheme(quant).layout(precision)
    path = table_path(Path(cache), precision, threads, layout)
    table = LatencyTable(precision, threads, scheme=quant, path=path)
    if path.is_file():
        table.us, dropped = read_table(path)
        if dropped:
            reporter.stage(f"{path}: {dropped} damaged entr{'y' if dropped == 1 else 'ies'} (not a positive finite "
                           "time of a KxN@R form), measuring again")
    todo = []
    for k, n in dict.fromkeys((s.in_features, s.out_features) for s in shapes):
        for r in [0, *(grid(ModuleShape("", k, n)) if ranks else ())]:
            if _key(k, n, r) not in table.us:
                todo.append((k, n, r))
    todo += [(k, n, 0) for k, n in dict.fromkeys(dense) if _key(k, n, 0) not in table.us and (k, n, 0) not in todo]
    if todo:
        reporter.stage(f"measuring {len(todo)} projection forms at {precision} ({layout}) on {threads} thread(s) "
                       f"(cached in {path.parent})")
        calm = quiet(reporter, f"the {len(todo)} forms are")
        reporter.count(0, len(todo), "forms")
        for k, n, r in todo:
            table.us[_key(k, n, r)] = measure_form(k, n, r, precision, threads, layout)
            reporter.count(1, len(todo), "forms")
        if calm and quiet(reporter, f"the {len(todo)} forms were"):  # before and after: a job may start between
            write_json(path, {"version": TABLE_VERSION, "precision": precision, "layout": layout,
                              "threads": threads, "cpu": cpu_name(), "us": table.us})
    return table
