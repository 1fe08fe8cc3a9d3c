"""Command-line options generated from the config dataclasses, so a default and its help text have one home (the
dataclass field and the docstring under it) and the CLI never repeats either."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Annotated, Optional

import typer

from bdlora.base.errors import UsageError
from bdlora.base.runs import RUNS_DIR
from bdlora.train.config import field_docs

# Options many commands take, declared once: one wording and one default wherever they appear (tests/test_cli.py
# holds every command to it). A command composes them: ``runs_dir: RunsDir = RUNS_DIR``, ``force: Force = False``.
RUNS_DIR_HELP = f"Where runs live: run folders, compressed models and sweeps (default {RUNS_DIR}/)."
FORCE_HELP = ("Replace what this command writes if it already exists (its --out folder, its --json report, the "
              "cached builtin teacher); never an input, nor a file inside a model or run folder.")
RunsDir = Annotated[str, typer.Option(help=RUNS_DIR_HELP, rich_help_panel="Folders")]
Force = Annotated[bool, typer.Option(help=FORCE_HELP, rich_help_panel="Folders")]

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
                   panels: dict[str, tuple[str, ...]] | None = None) -> list[inspect.Parameter]:
    """One keyword option per field of ``cls`` (``names`` or all but ``skip``), ``--field-name`` with the field's
    docstring as help, followed by its entry in ``notes`` (e.g. per-teacher defaults). With ``defaults`` the
    option's default is the field's (shown in --help); otherwise None, meaning "not given" (so YAML values and
    per-teacher defaults can fill it). ``panels``: --help panel -> the fields shown under it (the rest under
    ``panel``, None: the main one), so the options most runs set come first."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rename = rename or {}
    where = {name: title for title, names_ in (panels or {}).items() for name in names_}
    unknown = sorted(set(where) - set(cls.__dataclass_fields__))
    if unknown:  # a renamed or removed field would silently fall back to the main panel
        raise ValueError(f"panels name fields {cls.__name__} lacks: {', '.join(unknown)}")
    params = []
    for f in cls.__dataclass_fields__.values():
        if (names is not None and f.name not in names) or f.name in skip:
            continue
        opt = rename.get(f.name, f.name)
        tp = _base_type(hints[f.name])
        default = _default(f) if defaults else None
        if isinstance(default, list):
            default = ",".join(map(str, default))
        dashed = opt.replace("_", "-")
        decl = f"--{dashed}/--no-{dashed}" if tp is bool else f"--{dashed}"
        text = " ".join(t for t in (docs.get(f.name, ""), (notes or {}).get(f.name, "")) if t)
        option = typer.Option(decl, help=text, rich_help_panel=where.get(f.name, panel))
        annotation = Annotated[tp if defaults and default is not None else Optional[tp], option]
        params.append(inspect.Parameter(opt, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return params


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


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
