"""What a whole decode step costs beyond its projections, measured, so that a structure's *whole* decode speed-up can
be predicted (``plan --precision P``, ``compress --one-shot --precision P``) and a removed layer is priced with its
attention, norms and KV cache. In the bench package: it exports and times graphs as ``bench --runtime genai`` does.

The latency table (``latency``) times each projection form alone. A decode step at batch 1 after ``CONTEXT`` tokens
also runs, per layer, attention over the cache, two norms, the rotary embedding, the MLP's activation and product and
two residual adds, and once per step the embedding, the final norm, the LM head and the generator's own work. Those
are measured on three synthetic genai graphs of the model's shapes (random weights: speed does not depend on
values), exported by this toolkit's exporter at the precision (in the scheme's node layout, ``Scheme.timed_as``:
round-to-nearest, or the block-offset layout of affine; the LM head at ``head_bits``) and timed by
``og.Generator`` as ``bench --runtime genai`` times a folder, decode ms/token:

- ``t_hi``, ``t_lo``: the model's own depth ``hi`` (fewer layers once they hold ``STREAM_BYTES``) and half of
  it, ``lo``, dense layers of full MLP width;
- ``t_half``: ``hi`` layers whose MLPs keep half their channels.

The model's own depth, because a step's time is not linear in the depth on a CPU: SmolLM2's int4 layers (about 2 MB
each) measured 230 us a layer between 2 and 8 layers, whose weights stay in the last-level cache, and 334 us between
4 and 16; the latency table times every product streaming from memory, as a whole model's weights do. Past
``STREAM_BYTES`` of layers every further one streams too, so a larger model's fit uses fewer layers (1B at int4: 5).

With ``P(w)`` a layer's projections at MLP width ``w`` from the table, the step is modelled as
``fixed + sum over layers (P(w_l) + a + m w_l / W)`` (``a``: the width-independent rest of a layer, ``m``: the rest
that scales with the MLP width ``W``), so ``a + m = (t_hi - t_lo) / (hi - lo) - P(W)``,
``m = 2 ((t_hi - t_half) / hi - (P(W) - P(W/2)))`` and ``fixed = t_lo - lo (P(W) + a + m)`` (each at least 0, and
``m`` at most ``a + m``: on a tiny model the timing noise can exceed them); a removed layer saves its
``P + a + m``. The fit is cached per shapes, precision, node layout, threads, head bits, onnxruntime version and
CPU beside the latency table. The graphs are timed in a separate process, interleaved (``bench.genai.time_genai``),
each at the median of its repeats (``latency``'s docstring says why not the minimum); the timings must agree with
each other (``step_times``: else timed once more)
and are taken with the machine's other load watched. The cache records that load: a fit timed on a busy machine or
from contradicting timings is marked unclean, reused only while the machine is busy, measured again by a quiet run,
and never the ground of a refusal (``latency`` module docstring).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bdlora.base import load  # through the module: the tests set its readers
from bdlora.base.io import read_json, write_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.schemes import DEFAULT_SCHEME, PRECISIONS, WIDE, mixed, scheme
from bdlora.base.threads import ThreadPool
from bdlora.bench.genai import _stand_in_tokenizer, time_genai
from bdlora.compress.forms.bits import head_shape
from bdlora.compress.forms.channels import CHANNEL_STEP
from bdlora.deployed.modeling_bdlora import BDLORA_CLASSES
from bdlora.export.genai.folder import deployment
from bdlora.export.genai.latency import (
    TABLE_VERSION,
    cpu_name,
    latency_table,
)
from bdlora.export.settings import GenaiExportConfig
from bdlora.models.arch import layer_of
from bdlora.models.costs import Deployed, ModuleShape, shapes_from_config
from bdlora.models.families import base_type, with_layers
from bdlora.models.families import family as table_family
from bdlora.models.lazy import empty

CONTEXT = 128  # tokens in the cache when the step is timed (bench's default decode shape: batch 1 after 128)
STEPS, REPEATS, WARMUP = 32, 15, 3  # decode tokens per timing, timed repeats, untimed ones
OVERHEAD_VERSION = 5  # 5: the median of interleaved repeats, checked, the load recorded (4: minima)


@dataclass
class Overhead:
    """Decode microseconds outside the projections: ``fixed`` per step, ``per_layer`` per layer at full MLP width,
    of which ``per_width`` scales with the kept share of the MLP's channels; with the raw timings it was fitted
    from."""

    precision: str
    threads: int
    head_bits: int
    fixed: float
    per_layer: float
    per_width: float
    timings_ms: dict
    path: str | None = None
    load: dict | None = None  # the other processes' load while it was timed (``latency.Load.record``)
    unclean: str | None = None  # why its timings were not clean (busy, or repeats that disagreed), None when clean

    def layer(self, width_share: float = 1.0) -> float:
        """One layer's decode time outside its projections, its MLP keeping ``width_share`` of its channels."""
        return self.per_layer - self.per_width * (1.0 - width_share)


def shape_key(config: dict) -> dict:
    """The shapes a decode step's cost depends on (the same whether read from config.json or a loaded config)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return {"family": base_type(str(config.get("model_type", ""))), "hidden": hidden,
            "mlp": int(config["intermediate_size"]), "heads": heads,
            "kv": int(config.get("num_key_value_heads") or heads), "head_dim": int(config.get("head_dim") or
                                                                                  hidden // heads),
            "vocab": int(config["vocab_size"]), "tied": bool(config.get("tie_word_embeddings", True))}


def overhead_path(cache: Path, config: dict, precision: str, threads: int, head_bits: int,
                  layout: str = "nbits") -> Path:
    plain = layout in ("matmul", "nbits")  # the plain layouts keep the key they always had
    tag = hashlib.sha256(json.dumps([OVERHEAD_VERSION, TABLE_VERSION, ort.__version__, cpu_name(), shape_key(config),
                                     depths(config, precision), head_bits, CONTEXT, *([] if plain else [layout])],
                                    sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache) / "latency" / f"overhead-{precision}-t{threads}-{tag}.json"


def _dense_model(config: dict, layers: int, width: int):
    """A random dense model of ``config``'s family with ``layers`` layers whose MLPs keep ``width`` channels, built
    without weights (the exporter makes them one layer at a time: a 3B model's probes stay within memory)."""
    family = table_family(base_type(str(config["model_type"])), "model_type").model_type
    cfg_cls, model_cls = BDLORA_CLASSES[family]
    base = {k: v for k, v in with_layers(config, layers).items()
            if k not in ("model_type", "architectures", "auto_map", "bdlora", "bdlora_modules")}
    base["max_position_embeddings"] = max(int(base.get("max_position_embeddings") or 0), CONTEXT + STEPS + 8)
    full = int(config["intermediate_size"])
    sites = {} if width == full else {
        s.name.rsplit(".", 1)[0]: {"form": "channels", "keep": width}
        for s in shapes_from_config({**config, "num_hidden_layers": layers}) if s.name.endswith("down_proj")}
    cfg = cfg_cls(bdlora_modules=sites, bdlora={"base_model_type": family}, **base)
    return empty(lambda: model_cls(cfg)).eval()  # weights made a layer at a time by the exporter (models.lazy)


def _layer_projections(config: dict, table, width: int) -> float:
    return sum(table.cost(s.narrowed(width) if ".mlp." in s.name else s, 0)
               for s in shapes_from_config({**config, "num_hidden_layers": 1}))


def fit(t_lo: float, t_hi: float, t_half: float, lo: int, hi: int, p_full: float, p_half: float) -> tuple:
    """(fixed, per_layer, per_width) microseconds from the three timings (ms/token) and a layer's projection
    microseconds at full and half MLP width (the module docstring's model)."""
    t_lo, t_hi, t_half = (1000.0 * t for t in (t_lo, t_hi, t_half))
    per_layer = max(0.0, (t_hi - t_lo) / (hi - lo) - p_full)  # at 0 when timing noise exceeds it (tiny models)
    per_width = min(per_layer, max(0.0, 2.0 * ((t_hi - t_half) / hi - (p_full - p_half))))
    fixed = max(0.0, t_lo - lo * (p_full + per_layer))
    return fixed, per_layer, per_width


STREAM_BYTES = 128 << 20  # layer weights the deeper graph holds at least: far beyond any last-level cache


def depths(config: dict, precision: str) -> tuple[int, int]:
    """(hi, lo): the model's own depth, or fewer layers when ``STREAM_BYTES`` of them already stream from memory
    (a 1B model's layers stream from memory from the first few, and its full-depth export nearly fills 24 GB), and
    half of it."""
    layer = sum(s.dense_cost for s in shapes_from_config({**config, "num_hidden_layers": 1}))
    enough = -(-STREAM_BYTES // int(layer * PRECISIONS[precision].bits / 8))
    hi = max(2, min(int(config["num_hidden_layers"]), max(4, enough)))
    return hi, hi // 2


def half_width(config: dict) -> int:
    return max(CHANNEL_STEP, int(config["intermediate_size"]) // 2 // CHANNEL_STEP * CHANNEL_STEP)


def decode_overhead(config: dict, table, precision: str, threads: int, cache: Path, head_bits: int = 8,
                    reporter: Reporter = SILENT) -> Overhead:
    """The fitted overhead of ``config``'s shapes at ``precision`` (``table``: the latency table at the same
    precision and threads, holding the dense and half-width products; its scheme's node layout is the graphs'),
    from the cache or measured."""
    timed = scheme(table.scheme).timed_as(precision)
    path = overhead_path(cache, config, precision, threads, head_bits, timed.layout(precision))
    full, half = int(config["intermediate_size"]), half_width(config)
    if path.is_file():
        cached = read_overhead(path)
        if cached is not None and load.reusable(cached.unclean, path, reporter):
            return refitted(cached, config, table, full, half)
        if cached is None:
            reporter.stage(f"{path}: damaged (not three finite, non-negative times), measuring again")
    hi, lo = depths(config, precision)
    graphs = {"lo": (lo, full), "hi": (hi, full), "half": (hi, half)}
    settings = GenaiExportConfig(quant=timed.name, head_bits=head_bits, context_length=CONTEXT + STEPS + 8,
                                 pool=ThreadPool(threads), validate=False).at(precision)  # at fp32: no scheme
    work = Path(tempfile.mkdtemp(prefix="bdlora-overhead-"))
    try:
        folders = {}
        for name, (layers, width) in graphs.items():
            reporter.stage(f"exporting a synthetic {layers}-layer graph (MLP width {width}) at {precision} to time "
                           "the decode step outside the projections")
            folders[name] = deployment(_dense_model(config, layers, width), _stand_in_tokenizer(), work / name,
                                       settings)
        with load.LoadWatch() as watch:
            for attempt in range(2):  # once more when the timings contradict each other
                rows = time_genai(folders, [["decode", 1, CONTEXT]], REPEATS, WARMUP, STEPS,
                                  int(config["vocab_size"]), work, reporter)
                ms, why = step_times(rows, lo, hi)
                if why is None:
                    break
                if attempt == 0:
                    reporter.stage(f"the decode-step timings disagree ({why}): timing them again")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fixed, per_layer, per_width = fit(ms["lo"], ms["hi"], ms["half"], lo, hi, _layer_projections(config, table, full),
                                      _layer_projections(config, table, half))
    unclean = why if watch.load.quiet else f"timed with {watch.load.said()}"
    if unclean:
        load.not_cached(reporter, "the decode step's overhead", watch.load, why if watch.load.quiet else "")
    out = Overhead(precision, threads, head_bits, fixed, per_layer, per_width,
                   {"lo": [lo, ms["lo"]], "hi": [hi, ms["hi"]], "half": [hi, half, ms["half"]]},
                   load=watch.load.record(), unclean=unclean)
    write_json(path, {k: v for k, v in asdict(out).items() if k != "path"})
    out.path = str(path)
    return out


def refitted(cached: Overhead, config: dict, table, full: int, half: int) -> Overhead:
    """A cached fit fitted again from its own graph timings against ``table``'s projections: the graphs' times are
    the cache's, what their projections cost is the table's now (SmolLM2's fit, made against a table timed beside
    another job and measured again quiet, had kept a layer's rest at 0 us: the busy projections had exceeded the
    whole graphs' time; fitted against the quiet table, 141 us)."""
    t = cached.timings_ms
    try:
        (lo, t_lo), (hi, t_hi), (_, _, t_half) = t["lo"], t["hi"], t["half"]
    except (KeyError, TypeError, ValueError):
        return cached
    fixed, per_layer, per_width = fit(t_lo, t_hi, t_half, int(lo), int(hi), _layer_projections(config, table, full),
                                      _layer_projections(config, table, half))
    return replace(cached, fixed=fixed, per_layer=per_layer, per_width=per_width)


HALF_SLOWER = 1.05  # the half-width graph may time this much above the full one before the timings contradict


def step_times(rows: list[dict], lo: int, hi: int) -> tuple[dict[str, float], str | None]:
    """({graph: its decode ms/token, the median of its interleaved repeats}, why they contradict each other or
    None): each graph's repeats must agree (``latency.agree``), ``hi`` layers must cost more than ``lo``, and the
    half-width MLPs no more than the full ones (beside another job a 4-layer graph timed 1.13 ms against 1.03 for 2
    layers, which fitted 748 us of fixed time where a quiet machine measures 0-87)."""
    raw = {r["variant"]: r["ms"] for r in rows}
    ms = {k: float(np.median(v)) for k, v in raw.items()}
    spread = [k for k, v in raw.items() if not load.agree(v)]
    if spread:
        return ms, f"the repeats of the {', '.join(spread)} graph(s) are not within {load.AGREE:g}x of their fastest"
    if ms["hi"] <= ms["lo"]:
        return ms, f"{hi} layers timed {ms['hi']:.3f} ms, no more than {lo} layers' {ms['lo']:.3f}"
    if ms["half"] > HALF_SLOWER * ms["hi"]:
        return ms, f"half-width MLPs timed {ms['half']:.3f} ms, above the full width's {ms['hi']:.3f}"
    return ms, None


def read_overhead(path: Path) -> Overhead | None:
    """The cached fit at ``path``, or None when it is damaged: not JSON, fields missing or extra, or times that are
    not finite and non-negative with the width-scaled part within the layer's rest (the checks the latency table's
    entries get: a NaN here made every prediction NaN)."""
    try:
        o = Overhead(**{**read_json(path), "path": str(path)})
    except (TypeError, ValueError, RecursionError, UnicodeDecodeError):
        return None
    times = (o.fixed, o.per_layer, o.per_width)
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0
               for t in times) or o.per_width > o.per_layer:
        return None
    return o


@dataclass
class WholeStep:
    """What ``LatencyTable.whole`` holds: the fitted overhead of one model's shapes, so the table's prediction covers
    the whole decode step (``LatencyTable.prediction`` calls ``prediction``)."""

    overhead: Overhead
    config: dict

    def prediction(self, table, shapes, deployed: Deployed) -> dict:
        return decode_prediction(self.overhead, table, self.config, shapes, deployed)


def decode_prediction(overhead: Overhead, table, config: dict, shapes: list[ModuleShape],
                      deployed: Deployed | None = None) -> dict:
    """The whole decode step of the teacher (``config``: every layer dense) and of a structure over ``shapes``
    (its layers' projections as ``deployed``: see ``LatencyTable.prediction``), in microseconds, and the predicted
    speed-up. A layer's rest scales with the share of its MLP's channels kept; a head at other bits than the overhead
    was timed with changes the step by the two widths' times of its product in ``table``
    (``forms.bits.head_shape``), a head keeping fewer tokens by its narrower product's."""
    deployed = deployed or Deployed.dense(shapes)
    head_bits, head_keep = deployed.head_bits, deployed.head_keep
    full = int(config["intermediate_size"])
    teacher_shapes = shapes_from_config(config)
    teacher = overhead.fixed + int(config["num_hidden_layers"]) * overhead.per_layer + sum(
        table.cost(s, 0) for s in teacher_shapes)
    chosen = sum(table.cost(shape, rank, bits) for shape, rank, bits in deployed.modules.values())
    widths = {layer_of(n): shape.in_features for n, (shape, _, _) in deployed.modules.items()
              if n.endswith("down_proj")}
    layers = dict.fromkeys(layer_of(n) for n in deployed.modules)
    student = overhead.fixed + chosen + sum(overhead.layer(widths.get(n, full) / full) for n in layers)
    h = head_shape(config)
    if head_bits and head_bits != overhead.head_bits:
        student += table.cost(h, 0, head_bits) - table.cost(h, 0, overhead.head_bits)
    if head_keep:  # the narrower head at its own bits, in place of the full one
        at = head_bits or overhead.head_bits
        student += table.cost(ModuleShape(h.name, h.in_features, head_keep), 0, at) - table.cost(h, 0, at)
    return {"decode_us_teacher": teacher, "decode_us": student, "predicted_decode_speedup": teacher / student,
            **({"head_bits": head_bits} if head_bits else {}), **({"head_keep": head_keep} if head_keep else {}),
            "decode_layers": len(layers), "teacher_layers": int(config["num_hidden_layers"]),
            "overhead": {"fixed_us": overhead.fixed, "per_layer_us": overhead.per_layer,
                         "per_layer_width_us": overhead.per_width, "head_bits": overhead.head_bits,
                         "timings_ms": overhead.timings_ms, "cache": overhead.path, "load": overhead.load,
                         **({"unclean": overhead.unclean} if overhead.unclean else {})}}


@dataclass
class MeasuredCosts:
    """``models.costs.CostModel`` by measured decode time: the latency tables of ``export.genai.latency`` at
    ``precision`` on ``threads`` (cached under ``cache``), in the node layout of the scheme ``quant``, with the decode
    step's cost outside the projections fitted here (``decode_overhead``) when the model's config is given."""

    precision: str
    threads: int
    cache: Path
    reporter: Reporter = SILENT
    quant: str = DEFAULT_SCHEME

    def table(self, shapes, dense=(), config: dict | None = None, wide: bool = False, head: bool = False, heads=()):
        if config is None:
            return self._with_wide(self._measure(shapes, dense), wide, shapes)
        hidden, half = int(config["hidden_size"]), half_width(config)
        h = head_shape(config)
        heads = list(dict.fromkeys([*([(h.in_features, h.out_features)] if head else []), *heads]))
        table = self._measure(shapes, (*dense, (hidden, half), (half, hidden), *heads))
        table.whole = WholeStep(decode_overhead(config, table, self.precision, self.threads, self.cache,
                                                reporter=self.reporter), config)
        return self._with_wide(table, wide, shapes, heads)

    def _measure(self, shapes, dense, precision: str | None = None, ranks: bool = True):
        return latency_table(shapes, precision or self.precision, self.threads, self.cache, self.reporter, dense,
                             ranks=ranks, quant=self.quant)

    def _with_wide(self, table, wide: bool, shapes, heads=()):
        if wide and mixed(self.precision):  # the 8-bit times of projections (and heads) an int4 graph keeps wide
            table.wide = self._measure(shapes, heads, WIDE, ranks=False)
        return table
