"""``bdlora compress SOURCE --one-shot --mac-ratio R``: training-free compression of a pretrained model, the
SVD-LLM-style baseline a user would otherwise reach for, with this toolkit's loss-weighted whitening and quality
allocation (``budgeted.lowrank``, ``budgeted.allocate``).

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
from pathlib import Path

import numpy as np
import torch

from bdlora import SCHEMA_VERSION, __version__
from bdlora.arch import projection_modules, set_module
from bdlora.blocks import PackedBlocks, scored_blocks
from bdlora.budgeted.allocate import mac_cost
from bdlora.budgeted.bits import head_option, wide_options
from bdlora.budgeted.calibrate import calibration_blocks
from bdlora.budgeted.channels import channel_order, prune, site_options
from bdlora.budgeted.correct import correct_sequential
from bdlora.budgeted.costs import ModuleShape, compression_report, decide_module, prune_decision, removed_decision
from bdlora.budgeted.groups import group_options, group_order, site_probes
from bdlora.budgeted.groups import prune as prune_groups
from bdlora.budgeted.layer import DeployedModule
from bdlora.budgeted.layers import removal_errors, renumbered
from bdlora.budgeted.lowrank import factors, gram_root, spectrum
from bdlora.budgeted.model import build_deployed_model
from bdlora.budgeted.start import allocate_by, calibrate_with_progress, compute_start, shapes_of, structure_report
from bdlora.corpora import check_spec, default_heldout, general_calib_data, load_tokens
from bdlora.deployed.folder import save_model_folder
from bdlora.errors import UsageError
from bdlora.forms import ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from bdlora.oneshot_config import OneShotConfig
from bdlora.outputs import check_out_dir
from bdlora.perplexity import perplexity
from bdlora.reporter import SILENT, Reporter
from bdlora.selfgen import TeacherSource
from bdlora.student import build_student, take_layers
from bdlora.teacher import load_teacher


def one_shot_structure(model, train_blocks, cfg: OneShotConfig, reporter: Reporter = SILENT, cost_table=None):
    """(decisions, {name: DeployedModule}, calibration tokens, facts, the allocation) of ``model`` at
    ``cfg.mac_ratio`` (or ``cfg.speedup``): calibrate, allocate among ``cfg.forms``, factor (and prune); the
    modules of removed layers have decisions but nothing deployed. ``cost_table`` (shapes, dense=(K, N) pairs,
    config -> an object with ``cost(shape, rank)`` and ``prediction(shapes, ranks, shape_of, gone)``, e.g. the
    measured decode-time table of ``bdlora.export.genai.latency``, passed in by the CLI; given the model's config,
    its prediction covers the whole decode step): allocate by that cost instead of MACs. ``facts``, for the
    provenance: what the allocation predicts at that cost (``allocation_cost``) and, with layers, each one's
    removal error (``allocation.removal_errors``)."""
    mods = dict(projection_modules(model))
    shapes = [ModuleShape(n, m.in_features, m.out_features) for n, m in mods.items()]
    table, bits, config = None, "bits" in cfg.form_names, model.config.to_dict()
    head = bits and cfg.speedup is not None  # the LM head's width is bought against the whole step only
    kv = int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads)
    if cost_table is not None:  # with channels or groups, the narrower dense products it interpolates between too
        probes = site_probes(shapes, kv, "channels" in cfg.form_names, "groups" in cfg.form_names)
        table = cost_table(shapes, dense=probes, config=config, **({"wide": True} if bits else {}),
                           **({"head": True} if head else {}))
    calib = calibrate_with_progress(model, calibration_blocks(train_blocks, cfg.calib_tokens), reporter,
                                    residual="layers" in cfg.form_names, rounded=table.rounded if bits else None,
                                    head=head)
    lowrank = "lowrank" in cfg.form_names
    if lowrank:
        reporter.stage("whitened, loss-weighted spectra of every projection")
    roots, spectra = {}, {}
    for s in shapes if lowrank else ():
        gram = calib.gram(s.name)
        root = roots.setdefault(id(gram), gram_root(gram)) if s.out_features > s.in_features else None
        spectra[s.name] = spectrum(mods[s.name].weight, gram, fisher=calib.fisher[s.name], root=root)
    energy = {s.name: spectra[s.name].energy.numpy() if lowrank else np.zeros(0) for s in shapes}
    orders = {}
    if "channels" in cfg.form_names:
        reporter.stage("ranking every MLP's channels by loss-weighted activation energy")
        orders = {n.rsplit(".", 1)[0]: channel_order(m.weight, calib.gram(n), calib.fisher[n])
                  for n, m in mods.items() if n.endswith("down_proj")}
    if "groups" in cfg.form_names:
        reporter.stage("ranking every attention block's key/value groups by loss-weighted output energy")
        hd = model.model.layers[0].self_attn.head_dim
        orders.update({n.rsplit(".", 1)[0]: group_order(m.weight, calib.gram(n), calib.fisher[n], kv, hd)
                       for n, m in mods.items() if n.endswith("o_proj") and kv > 1})
    cost = table.cost if table is not None else mac_cost
    sites = {site: (site_options if site.endswith(".mlp") else group_options)(
        [s for s in shapes if s.name.startswith(site + ".")], order, cost) for site, order in orders.items()}
    layers = removal_errors(calib) if "layers" in cfg.form_names else None
    rest, fixed = whole_step(model, table) if cfg.speedup is not None else (None, 0.0)
    wide = wide_options(shapes, calib, table) if bits else None
    head_cost = head_option(config, calib, table) if head else None
    alloc = allocate_by(shapes, energy, cfg.ratio, reporter, table, cfg.precision, sites, lowrank, layers, rest, fixed,
                        wide, kv, head_cost)
    gone = {s.name for s in shapes if alloc.gone(s.name)}
    cost_doc = None if table is None else {"cost": "measured decode time",
                                           **table.prediction(shapes, alloc.ranks, alloc.shape, gone, alloc.bits,
                                                              alloc.head_bits),
                                           "mac_ratio": alloc.mac_ratio(shapes)}
    decisions, deployed = deploy(shapes, alloc, mods, orders, calib, spectra)
    facts = {**({"allocation_cost": cost_doc} if cost_doc else {}),
             **({"allocation": {"removal_errors": layers}} if layers else {}),
             **({"rounding": rounding_facts(wide, head_cost, alloc, table.scheme)} if wide else {}),
             **({"head_bits": alloc.head_bits} if head else {})}
    return decisions, deployed, calib.tokens, facts, alloc


def rounding_facts(wide: dict, head_cost: tuple | None, alloc, scheme: str) -> dict:
    """The provenance of ``--forms bits``: the scheme (--quant) whose grid measured the errors, each projection's
    error given back at 8 bits and, with the LM head among the sites (``--speedup``), its two widths' times, the
    error 4 bits add and the width chosen."""
    return {"scheme": scheme, "error_given_back_at_8_bits": {n: g for n, (_, g) in wide.items()},
            **({"lm_head": {"us_at_8_bits": head_cost[0], "us_at_4_bits": head_cost[1],
                            "error_added_at_4_bits": head_cost[2], "bits": alloc.head_bits}} if head_cost else {})}


def deploy(shapes: list[ModuleShape], alloc, mods: dict, orders: dict, calib, spectra: dict) -> tuple[list, dict]:
    """(a decision per projection, {name: DeployedModule}) of ``alloc``: pruned MLPs, pairs, dense projections (at
    their allocated bits); the projections of removed layers get a decision and nothing deployed."""
    pruned = {}  # the projections of every MLP keeping fewer channels or attention fewer groups, built once
    for site, keep in alloc.keep.items():
        pruned.update(pruned_site(site, keep, mods, orders[site], calib.gram(f"{site}.down_proj")) if
                      site.endswith(".mlp") else pruned_attention(site, keep, mods, orders[site],
                                                                  calib.gram(f"{site}.o_proj")))
    deployed, removed = {}, {}
    for s in shapes:
        if alloc.gone(s.name):  # its layer goes: nothing deployed
            removed[s.name] = removed_decision(s, has_bias=mods[s.name].bias is not None)
        else:
            deployed[s.name] = pruned.get(s.name) or factored(s, mods[s.name], alloc.ranks[s.name], spectra)
            deployed[s.name].decision.bits = alloc.bits.get(s.name, 0)
    return [removed[s.name] if s.name in removed else deployed[s.name].decision for s in shapes], deployed


def whole_step(model, table) -> tuple[dict, float]:
    """``--speedup``: each layer's decode time outside its projections and the step's fixed time, from the table's
    fitted whole step (``LatencyTable.whole``, which the CLI's table carries)."""
    whole = getattr(table, "whole", None)
    if whole is None:
        raise UsageError("--speedup: needs the whole decode step measured at --precision (pass a cost_table given the "
                         "model's config, as the CLI does)")
    o = whole.overhead
    return {f"model.layers.{i}": (o.per_layer - o.per_width, o.per_width)
            for i in range(model.config.num_hidden_layers)}, o.fixed


def factored(s: ModuleShape, mod, r: int, spectra: dict) -> DeployedModule:
    """Projection ``mod`` deployed at rank ``r`` (0: dense, as it is) with its decision."""
    bias = None if mod.bias is None else mod.bias.detach().clone()
    dec = decide_module(s, 0.0 if r else 1.0, r, 0, has_bias=bias is not None)
    if not r:
        return DeployedModule(dec, weight=mod.weight.detach().clone(), bias=bias)
    a, b = factors(mod.weight, spectra[s.name], r)
    return DeployedModule(dec, proj_in=a.to(mod.weight.dtype), proj_out=b.to(mod.weight.dtype), bias=bias)


def pruned_site(site: str, keep: int, mods: dict, order, gram) -> dict[str, DeployedModule]:
    """The three projections of an MLP ``site`` keeping ``keep`` channels (``budgeted.channels.prune``: down
    refitted), as deployed modules with their decisions."""
    names = [f"{site}.{p}" for p in MLP_PROJECTIONS]
    kept = order.kept(keep)
    weights = prune(*(mods[n].weight for n in names), gram, kept)
    out = {}
    for n, w in zip(names, weights):
        m = mods[n]
        bias = None if m.bias is None else m.bias.detach().clone()
        if bias is not None and not n.endswith("down_proj"):
            bias = bias[kept].clone()
        dec = prune_decision(ModuleShape(n, m.in_features, m.out_features), keep, has_bias=bias is not None)
        out[n] = DeployedModule(dec, weight=w, bias=bias)
    return out


def pruned_attention(site: str, keep: int, mods: dict, order, gram) -> dict[str, DeployedModule]:
    """The four projections of an attention ``site`` keeping ``keep`` key/value groups (``budgeted.groups.prune``:
    o refitted), as deployed modules with their decisions; q, k and v keep their kept rows' biases."""
    names = [f"{site}.{p}" for p in ATTENTION_PROJECTIONS]
    weights = prune_groups(*(mods[n].weight for n in names), gram, order, keep)
    rows = {"q_proj": order.rows(keep, order.ratio * order.head_dim), "k_proj": order.rows(keep, order.head_dim),
            "v_proj": order.rows(keep, order.head_dim)}
    out = {}
    for n, w in zip(names, weights):
        m = mods[n]
        bias = None if m.bias is None else m.bias.detach().clone()
        if bias is not None and n.rsplit(".", 1)[-1] in rows:
            bias = bias[rows[n.rsplit(".", 1)[-1]]].clone()
        dec = prune_decision(ModuleShape(n, m.in_features, m.out_features), keep, has_bias=bias is not None,
                             of=order.groups)
        out[n] = DeployedModule(dec, weight=w, bias=bias)
    return out


def correct_deployed(model, deployed: dict, blocks, reporter: Reporter = SILENT, removed=()) -> dict:
    """``--correct``: the second factor of every low-rank pair in ``deployed`` re-solved layer by layer against
    ``model``'s outputs on the calibration ``blocks`` (``budgeted.correct``), the ``removed`` layers skipped on the
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
    the model frozen in fp32; the training split of ``cfg.calib_data`` (default ``cfg.data``; for a general-purpose
    model scored on the builtin corpus, ``GENERAL_CALIB_DATA``, set on ``cfg``) and the held-out split of
    ``cfg.data``, tokenised (cached) at ``cfg.seq_len`` capped by its positions."""

    check_spec(cfg.data)  # checks the paths before the model loads
    if cfg.calib_data:
        check_spec(cfg.calib_data, "--calib-data")
    reporter.stage(f"loading {source}")
    model, tok, path = load_teacher(source, cache_dir, on_stage=reporter.stage, what=what)
    for p in model.parameters():
        p.requires_grad_(False)
    general = general_calib_data(cfg.data, cfg.calib_data, model.config.vocab_size)
    if general != cfg.calib_data:
        cfg.calib_data = general  # recorded in the folder's data settings as what it calibrated on
        reporter.stage(f"calibrating a general-purpose model on {general} (--calib-data to choose)")
    seq = min(cfg.seq_len, getattr(model.config, "max_position_embeddings", None) or cfg.seq_len)
    heldout = default_heldout(cfg.data) if cfg.heldout_fraction is None else cfg.heldout_fraction
    teacher = TeacherSource(Path(str(path)), model, tok)
    data = load_tokens(cfg.data, tok, heldout, cache_dir, teacher=teacher, reporter=reporter)
    calib = data
    if cfg.calib_data and cfg.calib_data != cfg.data:
        calib = load_tokens(cfg.calib_data, tok, None, cache_dir, what="--calib-data", teacher=teacher,
                            reporter=reporter)
    train_blocks = PackedBlocks(calib.tokens("train"), seq, bos=calib.bos)
    val_blocks = scored_blocks(data.tokens("val"), seq, cfg.eval_tokens, f"--data {cfg.data}", bos=data.bos)
    return model, tok, path, train_blocks, val_blocks, heldout


def quality_plan(source: str, cfg: OneShotConfig, layers: int | None, rank: int, budget: float,
                 cache_dir: Path | None = None, reporter: Reporter = SILENT) -> dict:
    """``plan --model SOURCE --allocation quality``: the structure a budgeted student of ``source`` (``layers``
    deep, the mixed selection) is trained towards with the quality allocation, before any training. ``mac_ratio``
    None: the paper's rule at ``budget`` and ``rank``."""
    model, _, _, train_blocks, _, _ = load_source(source, cfg, cache_dir, reporter, "--model")
    student = build_student(model, layers, "mixed")[0] if layers else model
    start = compute_start(student, "whitened", "quality", rank, budget, cfg.mac_ratio, train_blocks,
                          cfg.calib_tokens, reporter)
    report = structure_report(start, shapes_of(student), budget)
    report["source"] = "plan --allocation quality"
    return report


def forms_plan(source: str, cfg: OneShotConfig, cache_dir: Path | None = None, reporter: Reporter = SILENT,
               cost_table=None) -> tuple[dict, dict]:
    """``plan --model SOURCE --allocation quality --forms F``: (report, the source's config) of the structure
    ``compress --one-shot`` with the same options would write (calibrated, allocated among ``cfg.forms``,
    factored), reported as compress reports it and not written; with ``cost_table``, its allocation cost and
    prediction in ``provenance.allocation_cost``."""
    model, _, _, train_blocks, _, _ = load_source(source, cfg, cache_dir, reporter, "--model")
    decisions, _, tokens, facts, _ = one_shot_structure(model, train_blocks, cfg, reporter, cost_table)
    report = compression_report(decisions, None, {}, baseline="source")
    report.update(source="plan --allocation quality --forms", provenance={
        "teacher": source, "forms": cfg.forms, "mac_ratio": cfg.mac_ratio, "speedup": cfg.speedup,
        "calib_data": cfg.calib_data or cfg.data, "calib_tokens": tokens, **facts})
    return report, model.config.to_dict()


def compress_one_shot(source: str, cfg: OneShotConfig, out: str | Path, force: bool = False,
                      cache_dir: Path | None = None, evaluate: bool = True,
                      reporter: Reporter = SILENT, cost_table=None) -> tuple[dict, Path]:
    """Compress a pretrained ``source`` (anything ``--teacher`` takes) to ``cfg.mac_ratio`` (or ``cfg.speedup``);
    returns (report, folder). The source is never modified. ``cost_table``: see ``one_shot_structure``
    (``cfg.precision``)."""

    cfg.validate()
    if cfg.precision and cost_table is None:
        raise UsageError(f"--precision {cfg.precision}: needs the measured decode-time table (pass cost_table, e.g. "
                         "bdlora.export.genai.latency.latency_table, as the CLI does)")
    out = Path(out)
    check_out_dir(out, force)
    t0 = time.time()
    model, tok, path, train_blocks, val_blocks, heldout = load_source(source, cfg, cache_dir, reporter, "compress")
    check_out_dir(out, force, (path,))
    seq = train_blocks.seq_len
    decisions, deployed, tokens, facts, _ = one_shot_structure(model, train_blocks, cfg, reporter, cost_table)
    removed = sorted({int(d.name.split(".")[2]) for d in decisions if d.case == "removed"})
    correction = None
    if cfg.correct:  # on the same calibration blocks (drawn with a fixed seed)
        blocks = calibration_blocks(train_blocks, cfg.calib_tokens)
        correction = correct_deployed(model, deployed, blocks, reporter, removed)
    settings = {"data": cfg.data, "calib_data": cfg.calib_data or cfg.data, "teacher": source,
                "source_path": str(path), "heldout_fraction": heldout, "seq_len": seq,
                "eval_tokens": cfg.eval_tokens, "cache_dir": str(cache_dir) if cache_dir else None,
                "origin": "the --one-shot options"}
    dial = f"{cfg.mac_ratio:g}x" if cfg.speedup is None else f"{cfg.speedup:g}x decode"
    provenance = {"name": f"{Path(str(path)).name} one-shot {dial}", "method": "one-shot",
                  "teacher": source, "source_path": str(path), "mac_ratio": cfg.mac_ratio, "calib_tokens": tokens,
                  **({"speedup": cfg.speedup} if cfg.speedup is not None else {}),
                  "lora_init": "whitened", "allocation": "quality", "correct": cfg.correct, "data_settings": settings,
                  **facts, **({"correction": correction} if correction else {})}
    base = model
    if removed:  # a shallower model of the same architecture: the forms of the layers kept, renumbered
        kept = [i for i in range(model.config.num_hidden_layers) if i not in removed]
        provenance.update(layer_indices=kept, removed_layers=removed, student_layers=len(kept))
        base, deployed = take_layers(model, kept), renumbered(deployed, kept)
    compressed = build_deployed_model(base, deployed, provenance, facts.get("head_bits", 0))
    report = compression_report(decisions, None, {}, baseline="source")
    report.update(schema_version=SCHEMA_VERSION, bdlora_version=__version__, source="compress --one-shot",
                  provenance=provenance)
    if evaluate:
        reporter.stage(f"scoring {len(val_blocks) * seq:,} held-out tokens (source vs compressed)")
        with torch.no_grad():
            report["eval"] = {"student_val_ppl": perplexity(model, val_blocks),
                              "compressed_val_ppl": perplexity(compressed, val_blocks),
                              "tokens": len(val_blocks) * seq, "baseline": "the source model"}
    report["seconds"] = time.time() - t0
    reporter.stage(f"writing {out}")
    save_model_folder(compressed, tok, out, report)
    return report, out
