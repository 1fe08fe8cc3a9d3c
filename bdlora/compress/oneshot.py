"""``bdlora compress SOURCE --one-shot --mac-ratio R``: training-free compression of a pretrained model, the
SVD-LLM-style baseline a user would otherwise reach for, with this toolkit's loss-weighted whitening and quality
allocation (``forms.lowrank``, ``compress.allocate``).

One forward and backward pass over ``--calib-tokens`` tokens of ``--data``'s training split measures each
projection's input Gram matrix and output Fisher diagonal; the allocation picks, for the target projection-MAC
speed-up, which projections stay dense and the rank of every other one; each of those becomes the pair ``B A`` of
its loss-weighted whitened truncated SVD. The result is a compressed folder of the bdlora architecture with
``compression.json`` (the same report keys as ``compress``, relative to the source's dense projections), which
every exporter, ``bench``, ``eval`` and ``serve`` take. Its held-out perplexity (and the source's) is measured on
the same corpus, whose settings the report keeps, so ``eval`` scores the same slice by default.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bdlora import SCHEMA_VERSION, __version__
from bdlora import forms as registry
from bdlora.base.errors import UsageError
from bdlora.base.outputs import check_out_dir, free_space
from bdlora.base.reporter import SILENT, Reporter
from bdlora.compress.allocate import MACS, Allocation, Pricing
from bdlora.compress.calibrate import calibration_blocks
from bdlora.compress.config import OneShotConfig
from bdlora.compress.correct import correct_sequential
from bdlora.compress.forms import STEPS
from bdlora.compress.forms.layers import renumbered
from bdlora.compress.forms.lowrank import factored
from bdlora.compress.layerwise import GramStore, calibrate_layers
from bdlora.compress.start import (
    allocate_by,
    calibrate_with_progress,
    table_pricing,
)
from bdlora.compress.streamed import TensorStore, folder_values, made, narrowed, sections, spill
from bdlora.data.blocks import PackedBlocks, scored_blocks
from bdlora.data.corpora import SAMPLES_PREFIXES, check_spec, default_heldout, general_calib_data, load_tokens
from bdlora.deployed.folder import save_model_folder
from bdlora.forms import HEAD, REMOVED
from bdlora.forms.context import OneShotContext
from bdlora.models.arch import projection_modules, set_module
from bdlora.models.budgeted.model import build_deployed_model
from bdlora.models.costs import CostModel, ModuleShape, compression_report, removed_decision
from bdlora.models.depth import take_layers
from bdlora.models.lazy import SOURCE, is_lazy
from bdlora.models.perplexity import perplexity
from bdlora.models.stream import streamed, streams
from bdlora.models.teacher import TeacherSource, load_teacher


@dataclass
class OneShotStructure:
    """What a one-shot allocation deploys: each projection's decision, the modules built ({name: DeployedModule};
    those of removed layers have a decision and nothing built), the calibration tokens, the facts the forms record
    (for the provenance), the allocation, and the LM head's deployment record where a form chose it, each form's
    part from its own ``deploy`` (``--forms vocab``: ``spec``, its declaration, and ``state``, its tensors; ``--forms
    bits``: ``bits``, its width in an int4 export), which ``build_deployed_model`` builds into the folder."""

    decisions: list
    deployed: dict
    tokens: int
    facts: dict
    allocation: Allocation
    head: dict | None = None


def one_shot_structure(model, train_blocks, cfg: OneShotConfig, reporter: Reporter = SILENT,
                       cost_model: CostModel | None = None, store: TensorStore | None = None) -> OneShotStructure:
    """The ``OneShotStructure`` of ``model`` at ``cfg.dials.mac_ratio`` (or ``speedup``): each chosen form (the dials'
    ``forms``, in ``ALLOCATED_FORMS`` order) says what the cost table and the calibration must measure, offers its
    candidates, and deploys what the one knapsack chose (``forms.context``); the modules of removed layers have
    decisions but nothing deployed. ``cost_model`` (``models.costs.CostModel``, the measured decode time the CLI passes
    in; its table given the model's config predicts the whole decode step): allocate by that cost instead of MACs.
    ``facts``, for the provenance: what the allocation predicts at that cost (``allocation_cost``) and what each form
    records. A lazy ``model`` (``models.stream``) is worked on one decoder layer at a time (``compress.streamed``):
    every tensor a form builds goes to ``store`` (a temp one when None) and its module holds a meta tensor."""
    mods = dict(projection_modules(model))
    d = cfg.dials
    ctx = OneShotContext(model, cfg, reporter, d.form_names, [ModuleShape(n, m.in_features, m.out_features)
                                                              for n, m in mods.items()], mods,
                         int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads),
                         model.config.to_dict())
    problem = registry.reach_problem(ctx.config, d.forms, None if d.whole_step else d.mac_ratio, d.speedup)
    if problem:  # before any table is timed or any token calibrated
        raise UsageError(problem)
    steps = [step(name) for name in registry.ALLOCATED_FORMS if ctx.has(name)]
    for st in steps:
        st.pricing(ctx)
    if cost_model is not None:  # the narrower dense products the sites interpolate between, and what forms ask
        ctx.table = cost_model.table(ctx.shapes, dense=ctx.probes, config=ctx.config, **ctx.table_options)
    for st in steps:
        st.calibration(ctx)
    blocks = calibration_blocks(train_blocks, cfg.calib_tokens)
    if is_lazy(model) or streams(cfg.streaming, sum(p.numel() for p in model.parameters()) * 4):  # past 2 GiB
        ctx.calib = calibrate_layers_with_progress(model, blocks, reporter, **ctx.calibration)
    else:
        ctx.calib = calibrate_with_progress(model, blocks, reporter, **ctx.calibration)
    own = TensorStore() if store is None and is_lazy(model) else None
    try:
        return _allocated(model, ctx, steps, mods, cfg, reporter, store or own)
    finally:
        if isinstance(ctx.calib.grams, GramStore):
            ctx.calib.grams.close()
        if own is not None:
            own.close()


def _allocated(model, ctx: OneShotContext, steps: list, mods: dict, cfg: OneShotConfig, reporter: Reporter,
               store: TensorStore | None):
    """``one_shot_structure``'s result from its calibration: the forms' offers, the allocation, the deployed
    modules (their tensors in ``store`` when the source is lazy: ``compress.streamed``)."""
    for st in steps:
        for view, part in sections(ctx, st):
            with made(model, part):
                st.offer(view)
    alloc = allocate_by(ctx.shapes, ctx.offers, cfg.dials.ratio, pricing(model, ctx.table, cfg), reporter, ctx.kv)
    gone = {s.name for s in ctx.shapes if alloc.gone(s.name)}
    if ctx.table is not None:
        ctx.facts["allocation_cost"] = {"cost": "measured decode time", **ctx.table.prediction(
            ctx.shapes, alloc.deployed(ctx.shapes)), "mac_ratio": alloc.mac_ratio(ctx.shapes)}
        if alloc.unmet:
            ctx.facts["allocation_cost"]["unmet"] = alloc.unmet
    built = {}
    if is_lazy(model):
        reporter.stage("building the chosen forms one decoder layer at a time (each built tensor to the temp folder)")
    head: dict = {}  # the LM head's record, each form's part of it (vocab's tensors, bits' width) merged
    for st in steps:
        for view, part in sections(ctx, st):
            with made(model, part):
                record = spill(st.deploy(view, narrowed(alloc, part)), store)
                head.update(record.pop(HEAD, {}))
                built.update(record)
    deployed = {s.name: built.get(s.name) or factored(s, mods[s.name], 0, {}, share=True) for s in ctx.shapes
                if s.name not in gone}
    for st in steps:
        st.finish(ctx, alloc, deployed)
    decisions = [removed_decision(s, has_bias=mods[s.name].bias is not None) if s.name in gone
                 else deployed[s.name].decision for s in ctx.shapes]
    return OneShotStructure(decisions, deployed, ctx.calib.tokens, ctx.facts, alloc, head or None)


def calibrate_layers_with_progress(model, blocks, reporter: Reporter = SILENT, **options):
    """``layerwise.calibrate_layers`` with a stage line and a progress bar over the layer passes."""
    reporter.stage(f"calibrating on {blocks.size:,} training tokens one decoder layer at a time (input Gram "
                   "matrices to the temp folder, then output Fisher diagonals from the top)")
    return calibrate_layers(model, blocks, reporter=reporter, **options)


def step(name: str):
    """What allocated form ``name`` does in the one-shot (``compress.forms.STEPS``, a ``forms.context.Step``): the
    one place a form's name leads to its behaviour (PEFT's dispatch of tuner variants)."""
    if name not in registry.ALLOCATED_FORMS or name not in STEPS:  # read when called: a form added is known here
        raise ValueError(f"form {name!r}: allocated forms are {', '.join(registry.ALLOCATED_FORMS)}")
    return STEPS[name]


def pricing(model, table, cfg: OneShotConfig) -> Pricing:
    """What the one-shot's budget counts: MACs without a table; with one, each form's measured decode time at
    ``cfg.dials.precision``, and with ``cfg.dials.speedup`` the whole step around the projections (``whole_step``)."""
    if table is None:
        return MACS
    rest, fixed = whole_step(model, table) if cfg.dials.whole_step else ({}, 0.0)
    return table_pricing(table, cfg.dials.precision, rest, fixed)


def whole_step(model, table) -> tuple[dict, float]:
    """``--speedup``: each layer's decode time outside its projections and the step's fixed time, from the table's
    fitted whole step (``LatencyTable.whole``, which the CLI's table carries)."""
    whole = getattr(table, "whole", None)
    if whole is None:
        raise UsageError("--speedup: needs the whole decode step measured at --precision (pass a CostModel, "
                         "bench.whole.MeasuredCosts, as the CLI does)")
    o = whole.overhead
    return {f"model.layers.{i}": (o.per_layer - o.per_width, o.per_width)
            for i in range(model.config.num_hidden_layers)}, o.fixed


def correct_deployed(model, deployed: dict, blocks, reporter: Reporter = SILENT, removed=()) -> dict:
    """``--correct``: the second factor of every low-rank pair in ``deployed`` re-solved layer by layer against
    ``model``'s outputs on the calibration ``blocks`` (``compress.correct``), the ``removed`` layers skipped on the
    compressed side; returns the mean relative output error of the pairs before and after."""
    student = copy.deepcopy(model)
    for i in removed:  # the layers above are corrected against the stream without it
        student.model.layers[i] = Skipped()
    low_rank = {}
    for name, dep in deployed.items():
        if dep.decision.channels or dep.decision.groups:  # pruned: the layers above see its narrower outputs
            set_module(student, name, dep.module().to(next(model.parameters()).device))
        if dep.proj_in is None:
            continue
        mod = dep.module().to(next(model.parameters()).device)
        set_module(student, name, mod)

        def store(b, mod=mod, dep=dep):
            mod.proj_out.weight.copy_(b)
            dep.proj_out = b.detach().clone()

        low_rank[name] = (mod, store)
    reporter.stage(f"correcting {len(low_rank)} low-rank pairs layer by layer against the source's outputs")
    errors = correct_sequential(model, student, blocks, low_rank, reporter)
    del student
    before = [e[0] for e in errors.values()]
    after = [e[1] for e in errors.values()]
    return {"method": "sequential least squares of each second factor", "modules": len(errors),
            "mean_relative_error_before": sum(before) / max(1, len(before)),
            "mean_relative_error_after": sum(after) / max(1, len(after))}


class Skipped(torch.nn.Module):
    """A removed decoder layer standing in the compressed side of ``correct_deployed``: the stream passes."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def load_source(source: str, cfg: OneShotConfig, cache_dir: Path | None, reporter: Reporter, what: str):
    """(model, tokenizer, path, calibration blocks, held-out blocks, held-out fraction) of a pretrained ``source``:
    the model frozen in fp32, or lazy (``models.stream``: read one layer at a time) where ``cfg.streaming`` says so
    for a source folder; the training split of ``cfg.calib_data`` (default ``cfg.data``; for a general-purpose
    model scored on the builtin corpus, ``GENERAL_CALIB_DATA``, set on ``cfg``) and the held-out split of
    ``cfg.data``, tokenised (cached) at ``cfg.seq_len`` capped by its positions."""

    check_spec(cfg.data)  # checks the paths before the model loads
    if cfg.calib_data:
        check_spec(cfg.calib_data, "--calib-data")
    reporter.stage(f"loading {source}")
    model, tok, path = load_teacher(source, cache_dir, on_stage=reporter.stage, what=what,
                                    lazy=lambda folder: streams(cfg.streaming, folder))
    if is_lazy(model):
        reporter.stage(f"reading {source} one decoder layer at a time (--streaming {cfg.streaming})")
    general = general_calib_data(cfg.data, cfg.calib_data, model.config.vocab_size)
    if general != cfg.calib_data:
        cfg.calib_data = general  # recorded in the folder's data settings as what it calibrated on
        reporter.stage(f"calibrating a general-purpose model on {general} (--calib-data to choose)")
    seq = min(cfg.seq_len, getattr(model.config, "max_position_embeddings", None) or cfg.seq_len)
    heldout = default_heldout(cfg.data) if cfg.heldout_fraction is None else cfg.heldout_fraction
    teacher = TeacherSource(Path(str(path)), None if is_lazy(model) else model, tok)
    data = load_tokens(cfg.data, tok, heldout, cache_dir, teacher=teacher, reporter=reporter)
    calib = data
    if cfg.calib_data and cfg.calib_data != cfg.data:
        calib = load_tokens(cfg.calib_data, tok, None, cache_dir, what="--calib-data", teacher=teacher,
                            reporter=reporter)
    train_blocks = PackedBlocks(calib.tokens("train"), seq, bos=calib.bos)
    val_blocks = scored_blocks(data.tokens("val"), seq, cfg.eval_tokens, f"--data {cfg.data}", bos=data.bos)
    return model, tok, path, train_blocks, val_blocks, heldout


def forms_plan(source: str, cfg: OneShotConfig, cache_dir: Path | None = None, reporter: Reporter = SILENT,
               cost_model=None) -> tuple[dict, dict]:
    """``plan --model SOURCE --allocation quality --forms F``: (report, the source's config) of the structure
    ``compress --one-shot`` with the same options would write (calibrated, allocated among ``cfg.dials.forms``,
    factored), reported as compress reports it and not written; with ``cost_model``, its allocation cost and
    prediction in ``provenance.allocation_cost``."""
    model, _, _, train_blocks, _, _ = load_source(source, cfg, cache_dir, reporter, "--model")
    shot = one_shot_structure(model, train_blocks, cfg, reporter, cost_model)
    decisions, tokens, facts = shot.decisions, shot.tokens, shot.facts
    report = compression_report(decisions, None, {}, baseline="source")
    report.update(source="plan --allocation quality --forms", provenance={
        "teacher": source, "forms": cfg.dials.forms, "mac_ratio": cfg.dials.mac_ratio, "speedup": cfg.dials.speedup,
        "calib_data": cfg.calib_data or cfg.data, "calib_tokens": tokens, **facts})
    return report, model.config.to_dict()


def compress_one_shot(source: str, cfg: OneShotConfig, out: str | Path, force: bool = False,
                      cache_dir: Path | None = None, evaluate: bool = True,
                      reporter: Reporter = SILENT, cost_model=None) -> tuple[dict, Path]:
    """Compress a pretrained ``source`` (anything ``--teacher`` takes) to ``cfg.dials.mac_ratio`` (or ``speedup``);
    returns (report, folder). The source is never modified. ``cost_model``: see ``one_shot_structure``
    (``cfg.dials.precision``)."""

    cfg.validate()
    if cfg.dials.precision and cost_model is None:
        raise UsageError(f"--precision {cfg.dials.precision}: needs the measured decode time (pass a CostModel, "
                         "bench.whole.MeasuredCosts, as the CLI does)")
    out = Path(out)
    check_out_dir(out, force)
    t0 = time.time()
    loaded = load_source(source, cfg, cache_dir, reporter, "compress")
    check_out_dir(out, force, (loaded[2],))
    store = None
    if is_lazy(loaded[0]):
        check_streamed(loaded[0], cfg, out)
        store = TensorStore()
    try:
        return _compressed(loaded, source, cfg, out, cache_dir, t0, evaluate, reporter, cost_model, store)
    finally:
        if store is not None:
            store.close()


def _compressed(loaded: tuple, source: str, cfg: OneShotConfig, out: Path, cache_dir: Path | None, t0: float,
                evaluate: bool, reporter: Reporter, cost_model, store: TensorStore | None):
    """``compress_one_shot`` once its source is ``loaded`` (``load_source``'s result): the structure, the compressed
    model, its scores, its folder (a lazy source's written one tensor at a time from ``store`` and its files)."""
    model, tok, path, train_blocks, val_blocks, heldout = loaded
    seq = train_blocks.seq_len
    shot = one_shot_structure(model, train_blocks, cfg, reporter, cost_model, store)
    decisions, deployed, tokens, facts = shot.decisions, shot.deployed, shot.tokens, shot.facts
    removed = sorted({int(d.name.split(".")[2]) for d in decisions if d.case == REMOVED.name})
    correction = None
    if cfg.correct:  # on the same calibration blocks (drawn with a fixed seed)
        blocks = calibration_blocks(train_blocks, cfg.calib_tokens)
        correction = correct_deployed(model, deployed, blocks, reporter, removed)
    settings = {"data": cfg.data, "calib_data": cfg.calib_data or cfg.data, "teacher": source,
                "source_path": str(path), "heldout_fraction": heldout, "seq_len": seq,
                "eval_tokens": cfg.eval_tokens, "cache_dir": str(cache_dir) if cache_dir else None,
                SAMPLES_PREFIXES: True, "origin": "the --one-shot options"}
    d = cfg.dials
    dial = f"{d.speedup:g}x decode" if d.whole_step else f"{d.mac_ratio:g}x"
    provenance = {"name": f"{Path(str(path)).name} one-shot {dial}", "method": "one-shot",
                  "teacher": source, "source_path": str(path), "mac_ratio": d.mac_ratio, "calib_tokens": tokens,
                  **({"speedup": d.speedup} if d.whole_step else {}),
                  "lora_init": "whitened", "allocation": "quality", "correct": cfg.correct, "data_settings": settings,
                  **facts, **({"correction": correction} if correction else {})}
    base = model
    if removed:  # a shallower model of the same architecture: the forms of the layers kept, renumbered
        kept = [i for i in range(model.config.num_hidden_layers) if i not in removed]
        provenance.update(layer_indices=kept, removed_layers=removed, student_layers=len(kept))
        base, deployed = take_layers(model, kept), renumbered(deployed, kept)
    compressed = build_deployed_model(base, deployed, provenance, shot.head,
                                      share=True)  # the source is never changed, nor the compressed model trained
    value = None
    if store is not None:  # its weights: the deploys' from the store, the others the source's files
        value = folder_values(model, store, provenance.get("layer_indices"))
        setattr(compressed, SOURCE, value)
    report = compression_report(decisions, None, {}, baseline="source")
    report.update(schema_version=SCHEMA_VERSION, bdlora_version=__version__, source="compress --one-shot",
                  provenance=provenance)
    if evaluate:
        reporter.stage(f"scoring {len(val_blocks) * seq:,} held-out tokens (source vs compressed)")
        with torch.no_grad():
            report["eval"] = {"student_val_ppl": scored(model, val_blocks),
                              "compressed_val_ppl": scored(compressed, val_blocks),
                              "tokens": len(val_blocks) * seq, "baseline": "the source model"}
    report["seconds"] = time.time() - t0
    reporter.stage(f"writing {out}" + (" one tensor at a time" if value else ""))
    save_model_folder(compressed, tok, out, report, value)
    return report, out


def scored(model, blocks) -> float:
    """Held-out perplexity of ``model``, in memory or lazy (``models.stream.streamed``: one layer made at a time)."""
    if not is_lazy(model):
        return perplexity(model, blocks)
    with streamed(model):
        return perplexity(model, blocks, device="cpu")


def check_streamed(model, cfg: OneShotConfig, out: Path) -> None:
    """What a one-shot of a lazy source refuses before any work: ``--correct`` (it re-solves every pair against the
    whole model in memory), an output folder's disk without room for the compressed model (at most the source's
    fp32 weights)."""
    if cfg.correct:
        raise UsageError("--correct: re-solves the low-rank pairs against the whole model held in memory; a source "
                         "read one layer at a time cannot (pass --streaming off, which holds it in fp32)")
    need = sum(p.numel() for p in model.parameters()) * 4
    where, free = free_space(out)
    if need > free:
        raise UsageError(f"{out}: the compressed folder takes up to {need / 2**30:,.1f} GiB and {where} has "
                         f"{free / 2**30:,.1f} GiB free")
