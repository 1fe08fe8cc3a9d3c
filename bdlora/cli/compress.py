"""``bdlora plan`` (what compress would produce, from shapes alone) and ``bdlora compress``."""

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from bdlora.base.errors import Checks, UsageError, flag
from bdlora.base.runs import RUNS_DIR, ModelDir, RunDir, one_shot_out
from bdlora.base.schemes import DEFAULT_SCHEME, GENAI_PRECISIONS, mixed, quant_problem
from bdlora.base.threads import ThreadPool, from_options
from bdlora.cli import render
from bdlora.cli.app import command, err, out
from bdlora.cli.options import Force, Json, Out, Precision, Quant, RunsDir, Threads, from_dataclass
from bdlora.cli.progress import RichReporter
from bdlora.compress.bounds import DEEPER, check_fits, check_report_provenance, check_shape_config
from bdlora.compress.config import CALIB_TOKENS, OneShotConfig
from bdlora.data.documents import BUILTIN
from bdlora.data.tokens import default_cache_dir
from bdlora.export.settings import GGUF_OF, GGUF_QUANTS
from bdlora.forms import LOWRANK, REMOVED, declared_head_bits, declared_head_keep, forms_problem, named_forms
from bdlora.models import sources
from bdlora.models.arch import check_lora_rank, layer_of
from bdlora.models.budgeted.config import ALLOCATIONS, THRESHOLDS, BudgetedConfig
from bdlora.models.costs import Deployed, ModuleShape, shapes_from_config
from bdlora.models.integrity import check_model_folder
from bdlora.train.plan import DEFAULT_PLAN_STEPS, read_model_config
from bdlora.train.plan import plan as run_plan

PLAN_FIELDS = ("budget", "rank", "eps_lr", "eps_zero", "svd_max_rank", "decay_start", "decay_end", "retention_ema")


# --help's order of the one-shot's options: its dial first, then what it calibrates and scores on, then the
# dials that refine the allocation (they are one embedded ``Dials`` in OneShotConfig, shown where they always were)
ONE_SHOT_ORDER = ("mac_ratio", "speedup", "calib_tokens", "data", "calib_data", "heldout_fraction", "seq_len",
                  "eval_tokens", "correct", "precision", "forms", "quant", "streaming", "threads", "width_multiple")
PLAN_FORMS = ("forms", "speedup", "streaming", "width_multiple")  # with --model and --allocation quality: the
# one-shot structure over any forms, its source read one layer at a time past 2 GiB of fp32 weights


DEPLOYED_PANEL = "--precision: the deployed decode step"
PLAN_RUNTIMES = ("genai", "llamacpp")  # where plan --precision predicts the step: onnxruntime-genai, or llama.cpp
RUNTIME_HELP = ("With --precision: the runtime whose decode step is predicted: genai (onnxruntime-genai, each form "
                "priced from a table measured here) or llamacpp (llama.cpp, the --gguf file of the teacher's shapes "
                "and of the planned structure timed in llama.cpp itself; the [llamacpp] extra; --forms "
                "channels,groups,layers).")
GGUF_HELP = ("--runtime llamacpp: the GGUF type (f16, q8_0, q4_0, q4_k_m; default: --precision's, int4 q4_k_m, int8 "
             "q8_0, fp32 f16).")


SPECULATIVE_HELP = ("With FOLDER (a draft, e.g. compress --one-shot --forms layers,channels,vocab) and --precision: "
                    "predict the speed-up of its teacher's export with it as the speculative draft (its greedy "
                    "agreement measured on held-out text, the teacher's verification cost on its shapes).")


@command(options=from_dataclass(BudgetedConfig, names=PLAN_FIELDS, rename={"rank": "lora_rank"}, defaults=True,
                                panel="The paper's rule (--model-config): budget, rank, schedule, thresholds")
         + from_dataclass(OneShotConfig, names=PLAN_FORMS, panel="--model --allocation quality over any forms",
                          order=ONE_SHOT_ORDER,
                          notes={"forms": "plan: the structure compress --one-shot would write (nothing written)."}))
def plan(
    folder: Annotated[Optional[str], typer.Argument(help="A compressed folder (compress's output): its own structure "
                                                        "(with --precision, its predicted decode speed-up).",
                                                   show_default=False)] = None,
    model_config: Annotated[Optional[str], typer.Option(help="Hugging Face config.json (or a folder holding one): "
                                                             "the paper's rule, from shapes alone.")] = None,
    model: Annotated[Optional[str], typer.Option(help="A pretrained model (folder, .gguf, preset, hub id): with "
                                                      "--allocation quality its calibration decides the structure.")]
    = None,
    allocation: Annotated[str, typer.Option(help="cost (the paper's cheapest-first rule, from shapes) or quality "
                                                 "(measured on --model).")] = ALLOCATIONS[0],
    mac_ratio: Annotated[Optional[float], typer.Option(help="--allocation quality: the projection-MAC speed-up to "
                                                            "allocate for (default: the paper's rule at --budget).")]
    = None,
    calib_tokens: Annotated[int, typer.Option(help="--allocation quality: calibration tokens of --data.")]
    = CALIB_TOKENS,
    data: Annotated[str, typer.Option(help="--allocation quality: the corpus to calibrate on (as train's).")]
    = BUILTIN,
    calib_data: Annotated[Optional[str], typer.Option(help="--allocation quality: calibrate on this instead.")] = None,
    layers: Annotated[Optional[int], typer.Option(help="Student decoder layers (default: the config's).")] = None,
    steps: Annotated[int, typer.Option(help="Optimiser steps the schedule is simulated over.")] = DEFAULT_PLAN_STEPS,
    precision: Precision = None,
    threads: Threads = None,
    quant: Quant = None,
    runtime: Annotated[str, typer.Option(help=RUNTIME_HELP, rich_help_panel=DEPLOYED_PANEL)] = PLAN_RUNTIMES[0],
    gguf: Annotated[Optional[str], typer.Option(help=GGUF_HELP, show_default=False,
                                                rich_help_panel=DEPLOYED_PANEL)] = None,
    speculative: Annotated[bool, typer.Option(help=SPECULATIVE_HELP)] = False,
    json_out: Json = False,
    **opts,
):
    """Predict what `compress` would produce before any training: per-module case and rank, MAC speed-ups vs dense
    and vs LoRA, parameter reduction and the training-compute proxy. From a config alone for the paper's rule; with
    --model and --allocation quality, from the model's own calibration; for a compressed FOLDER, its own structure.
    With --precision, each form's decode time measured here and the whole decode step predicted."""

    rank, shot = opts.pop("lora_rank"), {k: opts.pop(k) for k in PLAN_FORMS}
    _check_runtime(runtime, gguf, precision, speculative)
    _check_plan(opts, rank, model_config or folder, model, allocation, mac_ratio, calib_tokens, layers, steps,
                precision, threads, quant, shot)
    if folder is not None:
        report, config, title = _folder_report(folder, "--model-config" if model_config else model and "--model")
    elif any(v is not None for v in shot.values()):
        report, config, title = _forms_plan(model, shot, json_out, mac_ratio=mac_ratio, calib_tokens=calib_tokens,
                                            data=data, calib_data=calib_data, precision=precision, quant=quant,
                                            threads=threads)
    else:
        report, config, title = _planned(model_config, model, allocation, rank, layers, mac_ratio, calib_tokens,
                                         calib_data or data, steps, opts, json_out)
    if precision:
        title = _predicted(report, config, title, folder, precision, threads, quant, runtime, gguf, speculative,
                           RichReporter(err if json_out else out), json_out)
    _show(report, title, json_out)


def _predicted(report: dict, config: dict, title: str, folder, precision: str, threads, quant, runtime: str, gguf,
               speculative: bool, reporter, json_out: bool) -> str:
    """plan --precision: the structure's decode step in ``runtime`` added to ``report``; the title saying it."""
    check_fits(check_shape_config(config, "the model's config"), f"plan --precision {precision}", whole=False)
    if runtime == "llamacpp":
        report["deployed"] = _llamacpp_prediction(report, config, gguf or GGUF_OF[precision], threads, reporter)
        report["predicted_decode_speedup"] = report["deployed"]["predicted_decode_speedup"]
        return (f"{title}; {report['predicted_decode_speedup']:.2f}x faster decode in llama.cpp at "
                f"{report['deployed']['precision']}")
    report["deployed"] = _deployed_prediction(report, precision, threads, reporter, config, quant)
    report["predicted_decode_speedup"] = report["deployed"]["predicted_decode_speedup"]
    if speculative:
        report["speculative"] = _speculative(folder, report, precision, threads, quant, json_out)
    return (f"{title}; {report['deployed']['predicted_projection_speedup']:.2f}x less projection decode time at "
            f"{precision}, {report['predicted_decode_speedup']:.2f}x faster whole decode")


def _show(report: dict, title: str, json_out: bool) -> None:
    if json_out:
        print(json.dumps(report, indent=2))
        return
    render.compression_report(report, title=title)
    if report.get("deployed", {}).get("runtime") == "llamacpp":
        render.llamacpp_step(report["deployed"])
    elif report.get("deployed"):
        render.latency_forms(report["deployed"])
    if report.get("speculative"):
        render.speculative_prediction(report["speculative"])


def _check_runtime(runtime: str, gguf: str | None, precision: str | None, speculative: bool) -> None:
    c = Checks()
    c.choice("runtime", runtime, PLAN_RUNTIMES)
    if gguf is not None:
        c.require(runtime == "llamacpp", f"--gguf {gguf}: the GGUF type of --runtime llamacpp; add --runtime llamacpp")
        c.choice("gguf", gguf, GGUF_QUANTS)
    if runtime == "llamacpp":
        c.require(precision is not None, "--runtime llamacpp: predicts the decode step at a precision; add "
                  "--precision int4 (llama.cpp's q4_k_m; --gguf picks another type)")
        c.require(not speculative, "--runtime llamacpp: --speculative predicts onnxruntime-genai's drafted decoding; "
                  "drop one of them")
    c.done()


def _llamacpp_prediction(report: dict, config: dict, quant: str, threads: int | None, reporter) -> dict:
    """The planned structure's decode step in llama.cpp at the GGUF type ``quant`` against the teacher's
    (``bench.llamacpp_step``: both written as export gguf would, with zero weights, and timed in llama.cpp)."""
    from bdlora.bench.llamacpp_step import predict

    return predict(config, report["modules"], quant, ThreadPool(threads).count, default_cache_dir(), reporter)


def _speculative(folder, report: dict, precision: str, threads, quant, json_out: bool) -> dict:
    from bdlora.bench.verify import predict_speculative

    if folder is None:
        raise UsageError("--speculative: give the draft's compressed FOLDER (plan FOLDER --precision P --speculative)")
    reporter = RichReporter(err if json_out else out)

    def teacher_step(config: dict) -> float:  # the teacher's dense whole step, predicted as the draft's is
        shapes = shapes_from_config(config)
        table = cost_model(precision, threads, None, reporter, quant).table(shapes, config=config)
        return table.prediction(shapes)["decode_us"]

    return predict_speculative(Path(folder), report, report["deployed"]["decode_us"], teacher_step, precision,
                               ThreadPool(threads).count, default_cache_dir(), quant or DEFAULT_SCHEME,
                               reporter=reporter)


def _planned(model_config, model, allocation, rank, layers, mac_ratio, calib_tokens, data, steps, opts, json_out):
    """(report, config, title) of a structure planned from shapes (the paper's rule) or a model's calibration."""
    config = read_model_config(model_config or _resolved(model))
    if allocation == "quality":
        report = _quality_plan(model, rank, layers, mac_ratio, calib_tokens, data, opts, json_out)
        return report, config, f"plan --allocation quality: {report['speedup_vs_dense']:.2f}x fewer projection MACs"
    opts["rank"] = check_lora_rank(rank, config)
    return run_plan(config, BudgetedConfig(**opts), layers=layers, steps=steps), config, f"plan: F = {opts['budget']}"


def _check_plan(opts, rank, model_config, model, allocation, mac_ratio, calib_tokens, layers, steps, precision,
                threads, quant, shot: dict) -> None:
    c = Checks()  # every option's own range first, then what the model allows
    if any(v is not None for v in shot.values()):
        given = " ".join(f"{flag(k)} {v}" for k, v in shot.items() if v is not None)
        c.require(model is not None and allocation == "quality" and layers is None,
                  f"{given}: plans the one-shot structure of --model (with --allocation quality, at the model's "
                  "depth: no --layers)")
        c.require(mac_ratio is not None or shot["speedup"] is not None,
                  f"{given}: give --mac-ratio R (or with --precision P, --speedup S)")
        problem = forms_problem(shot["forms"]) if shot["forms"] is not None else None
        c.require(problem is None, problem or "")
    BudgetedConfig(**opts, rank=rank).check(c)
    c.integer("layers", layers, lo=1)
    c.integer("steps", steps, lo=1)
    c.choice("allocation", allocation, ALLOCATIONS)
    c.number("mac_ratio", mac_ratio, lo=1.0)
    c.integer("calib_tokens", calib_tokens, lo=1)
    c.require(model_config is not None or model is not None, "--model-config or --model: name the model to plan")
    c.require(allocation == "cost" or model is not None, "--allocation quality: needs --model (its weights and a "
              "calibration decide the structure)")
    if precision is not None:
        c.choice("precision", precision, GENAI_PRECISIONS)
    quant_problem(c, quant, precision)
    ThreadPool(threads).check(c)
    c.done()


def _resolved(model: str) -> str:
    return sources.resolve(model, what="--model")


def _forms_plan(model: str, shot: dict, json_out: bool, **options) -> tuple[dict, dict, str]:
    """(report, config, title) of ``plan --model M --allocation quality --forms F``: the one-shot structure."""
    from bdlora.compress.oneshot import forms_plan

    cfg = from_options(OneShotConfig, {**options, **{k: v for k, v in shot.items() if v is not None}}).validate()
    reporter = RichReporter(err if json_out else out)
    d = cfg.dials
    report, config = forms_plan(model, cfg, reporter=reporter,
                                cost_model=cost_model(d.precision, cfg.pool.threads, None, reporter, d.quant))
    return report, config, f"plan --forms {d.forms}: {report['speedup_vs_dense']:.2f}x fewer projection MACs"


def _quality_plan(model, rank, layers, mac_ratio, calib_tokens, data, opts, json_out) -> dict:
    from bdlora.train.budgeted.start import quality_plan

    rank = check_lora_rank(rank, read_model_config(_resolved(model)))
    cfg = from_options(OneShotConfig, {"mac_ratio": mac_ratio, "calib_tokens": calib_tokens, "data": data})
    return quality_plan(model, cfg, layers, rank, opts["budget"], reporter=RichReporter(err if json_out else out))


ONE_SHOT = from_dataclass(OneShotConfig, panel="--one-shot (a pretrained model, no training)", order=ONE_SHOT_ORDER)
ONE_SHOT_FIELDS = tuple(p.name for p in ONE_SHOT)


@command(options=from_dataclass(BudgetedConfig, names=THRESHOLDS, defaults=True) + ONE_SHOT)
def compress(
    run_dir: Annotated[Optional[str], typer.Argument(
        metavar="[RUN_DIR | SOURCE]", help="A finished run (default: the latest under --runs-dir); with --one-shot, a "
        "pretrained model: a Hugging Face folder, a .gguf file, a preset (smollm2-135m, gemma3-270m) or a hub "
        "id.")] = None,
    out_dir: Out = None,
    force: Force = False,
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip the held-out perplexity of both models.")] = False,
    runs_dir: RunsDir = RUNS_DIR,
    one_shot: Annotated[bool, typer.Option("--one-shot", help="Compress a pretrained model without training: the "
                                           "loss-weighted whitened SVD of each projection at ranks allocated for "
                                           "--mac-ratio.", rich_help_panel="--one-shot (a pretrained model, no "
                                           "training)")] = False,
    cache_dir: Annotated[Optional[str], typer.Option(help="Cache of tokenised corpora and materialised models "
                                                          "(default ~/.cache/bdlora or $BDLORA_CACHE).")] = None,
    json_out: Json = False,
    **opts,
):
    """Turn a trained student into its deployment form: drop, SVD-approximate or merge each dense path (budgeted),
    merge the adapter (kd-lora) or pass through (kd-full); saved as a Hugging Face model folder. With --one-shot,
    compress a pretrained model to --mac-ratio without any training. --out defaults to RUN_DIR.compressed (with
    --one-shot: RUNS_DIR/SOURCE.oneshot-Rx.compressed)."""

    shot = {k: opts.pop(k) for k in list(opts) if k in ONE_SHOT_FIELDS}
    reporter = RichReporter(err if json_out else out)
    if one_shot:
        report, folder = _one_shot(run_dir, shot, out_dir, force, runs_dir, cache_dir, not no_eval, reporter)
        prov = report["provenance"]
        dial = f"{prov['speedup']:g}x decode" if prov.get("speedup") else f"{prov['mac_ratio']:g}x"
        title = f"compress --one-shot {run_dir} ({dial})"
    else:
        given = [flag(k) for k, v in shot.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: options of --one-shot (add --one-shot to compress a pretrained "
                             "model)")
        from bdlora.train.compress_run import compress_run

        cfg = BudgetedConfig(**opts).validate_thresholds()
        run = RunDir(run_dir) if run_dir else RunDir.latest(runs_dir)
        report, folder = compress_run(run, cfg, out=out_dir, force=force, evaluate=not no_eval, reporter=reporter)
        title = f"compress {Path(run.path).name} ({report['provenance']['method']})"
    if json_out:
        print(json.dumps(report, indent=2))
        return
    render.compression_report(report, title=title)
    if report.get("provenance", {}).get("allocation_cost"):
        render.latency_forms(report["provenance"]["allocation_cost"])
    out.print(f"[green]wrote[/] {escape(str(folder))}")


def _deployed_prediction(report: dict, precision: str, threads: int | None, reporter, config: dict,
                         quant: str | None = None) -> dict:
    """The planned structure's decode time at ``precision`` from the measured table of its forms (low-rank pairs,
    MLPs keeping fewer channels, attention blocks keeping fewer groups, removed layers, projections kept at 8 bits):
    its projections, and the whole step against the dense model of ``config`` (``bench.whole``)."""
    from bdlora.compress.forms.groups import site_probes

    mods = report["modules"]
    shapes = [ModuleShape(m["name"], m["in_features"], m["out_features"]) for m in mods]
    kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    narrow = {m["name"]: m["channels"] for m in mods if m.get("channels")}
    grouped = {m["name"]: m["groups"] for m in mods if m.get("groups")}
    # the projections kept at 8 bits weigh in an int4 export only (at int8 every one is 8 bits, at fp32 none is)
    bits = {m["name"]: m["bits"] for m in mods if m.get("bits")} if mixed(precision) else {}
    head = declared_head_bits(config) if mixed(precision) else 0  # the LM head's declared width (int4 only)
    probes = site_probes(shapes, kv, bool(narrow), bool(grouped))
    keep = declared_head_keep(config)  # a draft's head keeping fewer tokens: its product and the full one's
    heads = [(int(config["hidden_size"]), keep), (int(config["hidden_size"]), int(config["vocab_size"]))] if keep \
        else []
    table = cost_model(precision, threads, None, reporter, quant).table(shapes, dense=probes, config=config,
                                                                        wide=bool(bits) or bool(head) or bool(keep),
                                                                        head=bool(head), heads=heads)
    deployed = Deployed({s.name: (s.narrowed(narrow[s.name]) if s.name in narrow else s.grouped(grouped[s.name], kv)
                                  if s.name in grouped else s, m["rank"] if m["form"] == LOWRANK.name else 0,
                                  bits.get(s.name, 0))
                         for s, m in zip(shapes, mods) if m["case"] != REMOVED.name}, keep, head)
    return table.prediction(shapes, deployed)


def _folder_report(folder: str, other: str | None = None) -> tuple[dict, dict, str]:
    """(compression.json, the config of the dense model it came from, title) of a compressed folder: its own config
    at the source's depth (the layers its report covers, removed ones included, or the highest source layer it
    kept). ``other``: the flag of a model given beside it (refused)."""
    if other:
        raise UsageError(f"plan {folder}: a compressed folder is planned from its own report; drop {other}")
    src = ModelDir(folder)
    if not src.finished():
        raise UsageError(f"plan {folder}: not a compressed folder (no compression.json); give compress's output, or "
                         "--model-config / --model to plan from shapes")
    report, config = src.report(), read_model_config(folder)
    mods = report.get("modules") if isinstance(report.get("modules"), list) else []
    covered = {layer_of(m["name"]) for m in mods if isinstance(m, dict) and isinstance(m.get("name"), str)}
    check_report_provenance(report, str(src.path / ModelDir.MARKER),
                            deepest=DEEPER * max(int(config["num_hidden_layers"]), len(covered)))
    check_model_folder(src.path, report)  # the checks every other reader runs: forms, sizes, digests, tokenizer
    prov = report.get("provenance") or {}
    depth = max(len(covered), int(prov.get("teacher_layers") or 0), 1 + max(prov.get("layer_indices") or [-1]))
    title = f"plan {folder}: {report['speedup_vs_dense']:.2f}x fewer projection MACs"
    return report, {**config, "num_hidden_layers": depth}, title


def _one_shot(source, shot: dict, out_dir, force: bool, runs_dir: str, cache_dir, evaluate: bool, reporter):
    if not source:
        raise UsageError("--one-shot: name the pretrained model to compress (a folder, a .gguf file, a preset such "
                         "as smollm2-135m or gemma3-270m, or a hub id)")
    cfg = from_options(OneShotConfig, {k: v for k, v in shot.items() if v is not None}).validate()
    from bdlora.compress.oneshot import compress_one_shot  # after the checks: a bad flag is refused at once

    d = cfg.dials
    out_path = Path(out_dir) if out_dir else one_shot_out(source, d.ratio, runs_dir, d.precision,
                                                          named_forms(d.forms), d.whole_step, d.quant)
    cache = Path(cache_dir).expanduser() if cache_dir else None
    return compress_one_shot(source, cfg, out_path, force=force, evaluate=evaluate, cache_dir=cache,
                             reporter=reporter, cost_model=cost_model(d.precision, cfg.pool.threads, cache, reporter,
                                                                      d.quant))


def cost_model(precision: str | None, threads: int | None, cache: Path | None, reporter, quant: str | None = None):
    """--precision: the measured decode time of the model's projection forms (``bench.whole.MeasuredCosts``, tables
    built when the shapes are known) in the node layout of the scheme ``quant`` (--quant; default rtn), else None
    (MACs). For compress --one-shot, plan and train."""
    if not precision:
        return None
    from bdlora.bench.whole import MeasuredCosts

    return MeasuredCosts(precision, ThreadPool(threads).count, cache or default_cache_dir(), reporter,
                         quant or DEFAULT_SCHEME)
