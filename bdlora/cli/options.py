"""Command-line options generated from the config dataclasses, so a default and its help text have one home (the
dataclass field and the docstring under it) and the CLI never repeats either."""

from __future__ import annotations

import inspect
import typing
from typing import Annotated, Optional

import typer
from rich.markup import escape

from bdlora.base.argv import embedded, field_default, fields_of
from bdlora.base.errors import UsageError, flag
from bdlora.base.runs import RUNS_DIR
from bdlora.base.schemes import SCHEMES
from bdlora.base.settings import field_docs
from bdlora.base.threads import MAX_GENAI_THREADS

# Options many commands take, declared once: one wording and one default wherever they appear (tests/test_cli.py
# holds every command to it). A command composes them (``runs_dir: RunsDir = RUNS_DIR``, ``json_out: Json = False``,
# ``out_dir: Out = None``), and ``from_dataclass`` gives a settings dataclass's field of one of these names the same
# help, with no default on the command line (None: the dataclass's own default applies, which the help names).
# Where a command's default differs (export genai's precision is fp32, ship's int4), the one wording says so.
COMMON = {
    "runs_dir": f"Where runs live: run folders, compressed models and sweeps (default {RUNS_DIR}/).",
    "force": "Replace what this command writes if it already exists (its --out folder, its --report file, the "
             "cached builtin teacher); never an input, nor a file inside a model or run folder.",
    "json": "Print the result as one JSON object instead of tables (progress goes to stderr).",
    "report": "Write the JSON report to this file (eval: instead of MODEL_DIR.eval.json beside the folder; bench and "
              "loadtest: beside their own output); an existing file is replaced only with --force.",
    "out": "The folder this command writes (its default is named in the command's description); an existing one is "
           "replaced only with --force (ship resumes its own).",
    "precision": "fp32, int8 or int4 (MatMulNBits, block 32, as onnxruntime-genai's builder writes): what export "
                 "genai writes (default fp32) and ship ships (default int4); compress, plan and train then price "
                 "each form by its decode time at it, timed in onnxruntime on this machine and cached (default: by "
                 "MACs).",
    "quant": escape("How int8/int4 weights are rounded (default rtn): " + "; ".join(
        f"{s.name}: {s.summary}" for s in SCHEMES.values()) + ". bench rounds every folder with it (the teacher's "
        "and the peers' too unless --teacher-quant); compress, plan and train time that scheme's node layout "
        "(affine's 4-bit MatMuls read block means and hold 3% more columns), and with --forms bits its grid "
        "measures each projection's rounding error. export gguf: llama.cpp's type instead (f16, q8_0 or q4_0 "
        "written here; q4_k_m by llama.cpp's quantizer, the [llamacpp] extra; default q8_0)."),
    "threads": "Threads of what this command runs or times, from 1 to this machine's usable cores (default: all of "
               "them; more than it has would be timed and cached as if real). One exception: export genai writes "
               "the count into genai_config.json for the machine that will run the folder, so it takes 0 (none "
               f"written: onnxruntime-genai then runs one thread) to {MAX_GENAI_THREADS} whatever this machine has.",
    "forms": "The structures the allocation chooses among, comma-separated: lowrank (a projection as a rank-r pair), "
             "channels (an MLP keeping fewer intermediate channels: gate, up and down as narrower dense products, "
             "down refitted to the kept channels), groups (an attention block keeping fewer key/value heads with "
             "their query heads: q, k, v and o as narrower dense products and a smaller KV cache, o refitted), "
             "layers (a decoder layer removed whole), bits (with --precision int4: a dense projection kept at 8 "
             "bits, its measured rounding error bought back at the int8 time) and vocab (with --speedup: the LM "
             "head keeping only the tokens the teacher emits most, for a speculative-decoding draft), each site "
             "taking whichever costs least quality for what it saves; e.g. lowrank,channels,groups,layers,bits. "
             "Default lowrank,channels (measured on SmolLM2 at 1.2x: 12% lower perplexity in domain and 20% lower "
             "on text never seen than lowrank alone); ship's students default to channels,groups; train starts "
             "from the structure a one-shot with these writes of its layers and heals it.",
}
FLAGS = {"json": "--json", "report": "--report", "out": "--out"}  # the common options' flags (the rest: --name)


def common(name: str, panel: str | None = None):
    """The one ``typer.Option`` of common option ``name``."""
    return typer.Option(FLAGS.get(name, flag(name)), help=COMMON[name], rich_help_panel=panel)


RunsDir = Annotated[str, common("runs_dir", "Folders")]
Force = Annotated[bool, common("force", "Folders")]
Json = Annotated[bool, common("json")]
Report = Annotated[Optional[str], common("report")]
Out = Annotated[Optional[str], common("out")]
Precision = Annotated[Optional[str], common("precision")]
Quant = Annotated[Optional[str], common("quant")]
Threads = Annotated[Optional[int], common("threads")]
Forms = Annotated[Optional[str], common("forms")]

# train and sweep --help: the options most runs set stay in the main panel (method, teacher, data, the structure and
# its speed-up, steps, lr, what to stop on, where to write); the rest, which recipes (--config) usually set, below it
TRAIN_PANELS = {
    "Data and batches": ("samples_runtime", "calib_data", "seq_len", "packing", "batch_size", "grad_accum", "tokens",
                         "heldout_fraction", "reweight_every"),
    "The student and its start": ("student_layers", "layer_selection", "lora_rank", "lora_alpha", "lora_init",
                                  "allocation", "mac_ratio", "quant", "calib_tokens"),
    "Loss and optimiser": ("adam_beta1", "adam_beta2", "weight_decay", "grad_clip", "temperature", "kd_weight",
                           "freeze_embeddings", "loss_chunk", "kd_topk", "autocast", "seed"),
    "Budgeted LoRA's controller (paper Sec. 3)": ("budget", "decay_start", "decay_end", "retention_ema", "eps_zero",
                                                  "gate_init"),
    "Evaluation, checkpoints and folders": ("eval_every", "eval_tokens", "save_every", "keep_last",
                                            "measure_step_time", "runs_dir", "cache_dir"),
}


def _base_type(tp):
    """``int | None`` -> int; list types -> str (comma-separated on the command line)."""
    if typing.get_origin(tp) is list:
        return str
    args = [a for a in typing.get_args(tp) if a is not type(None)]  # X | None
    if args:
        return _base_type(args[0])
    return tp


def from_dataclass(cls, names=None, skip=(), rename: dict | None = None, defaults: bool = False,
                   panel: str | None = None, notes: dict[str, str] | None = None,
                   panels: dict[str, tuple[str, ...]] | None = None,
                   order: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """One keyword option per field of ``cls`` (``names`` or all but ``skip``), ``--field-name`` with the field's
    docstring as help, followed by its entry in ``notes`` (e.g. per-teacher defaults). With ``defaults`` the
    option's default is the field's (shown in --help); otherwise None, meaning "not given" (so YAML values and
    per-teacher defaults can fill it). ``panels``: --help panel -> the fields shown under it (the rest under
    ``panel``, None: the main one), so the options most runs set come first. A field named as a ``COMMON`` option
    takes its one wording and no default (None: the caller drops it, so the field's default applies). A field that
    embeds a settings dataclass (``pool``: ``--threads``) gives that dataclass's options, filtered the same way; the
    command builds its dataclass with ``base.threads.from_options``, which routes them back. ``order``: the options
    --help shows first, in this order (an embedded dataclass's fields among the holder's: one-shot's dials), the rest
    after them as declared."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rename = rename or {}
    where = {name: title for title, names_ in (panels or {}).items() for name in names_}
    unknown = sorted(set(where) - set(cls.__dataclass_fields__) - set(fields_of(cls)))
    if unknown:  # a renamed or removed field would silently fall back to the main panel
        raise ValueError(f"panels name fields {cls.__name__} lacks: {', '.join(unknown)}")
    params = []
    inner = embedded(cls)
    for f in cls.__dataclass_fields__.values():
        if f.name in inner and f.name not in skip:  # an embedded settings dataclass (``pool``): its fields' options
            leaves = fields_of(inner[f.name])
            params += from_dataclass(inner[f.name], names, skip, rename, defaults, panel, notes,
                                     {t: tuple(n for n in ns if n in leaves) for t, ns in (panels or {}).items()})
            continue
        if (names is not None and f.name not in names) or f.name in skip:
            continue
        opt = rename.get(f.name, f.name)
        tp = _base_type(hints[f.name])
        default = field_default(f) if defaults else None
        if isinstance(default, list):
            default = ",".join(map(str, default))
        dashed = opt.replace("_", "-")
        decl = f"--{dashed}/--no-{dashed}" if tp is bool else f"--{dashed}"
        text = " ".join(t for t in (docs.get(f.name, ""), (notes or {}).get(f.name, "")) if t)
        if opt in COMMON:  # one wording everywhere, and the dataclass's default where none is given
            decl, text, default = FLAGS.get(opt, decl), COMMON[opt], None
        option = typer.Option(decl, help=text, rich_help_panel=where.get(f.name, panel))
        annotation = Annotated[tp if defaults and default is not None else Optional[tp], option]
        params.append(inspect.Parameter(opt, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    if order:
        unknown = sorted(set(order) - set(fields_of(cls)))
        if unknown:  # a renamed field would silently move to the end
            raise ValueError(f"order names fields {cls.__name__} lacks: {', '.join(unknown)}")
        # stable: the options not named stay as declared, after those named
        params.sort(key=lambda p: order.index(p.name) if p.name in order else len(order))
    return params


def given(opts: dict) -> dict:
    """The options given on the command line (a common option left out arrives as None: its field's default then
    applies)."""
    return {k: v for k, v in opts.items() if v is not None}


def int_list(value: str, flag: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {value!r}: need comma-separated integers, e.g. 1,8") from None
    if not items:
        raise UsageError(f"{flag} {value!r}: empty list; give at least one value")
    return items


def float_list(value: str, flag: str) -> list[float]:
    try:
        return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {value!r}: need comma-separated numbers, e.g. 0.0,0.4,0.8") from None


def str_list(value: str | None) -> list[str] | None:
    return None if value is None else [x.strip() for x in value.split(",") if x.strip()]
