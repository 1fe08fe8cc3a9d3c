"""``bdlora sweep --vary``: ablation grids over any ``train`` option and the compress thresholds.

One ``--vary`` is an *axis*: ``OPTION=V1,V2,...`` varies one option; ``OPT1,OPT2=A1:B1,A2:B2`` varies several
together (their values zipped, as the paper's Table 2 pairs each temperature with one KD weight). The grid is the
Cartesian product of all axes. Train options make one training run per grid point; the compress thresholds
(``COMPRESS_OPTIONS``) vary at compress time only, so a threshold grid re-compresses one trained run instead of
retraining it (the paper's Appendix threshold sweep). Values are read by the option's type (``2``, ``0.5``,
``true``, ``mixed``) and ``none`` unsets an option; each grid point is checked like the flags before anything runs.
"""

from __future__ import annotations

import itertools
import math
import re
import typing
from pathlib import Path

from bdlora.base.errors import UsageError
from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.train.option_files import TYPE_WORDS, is_option, yaml_type

COMPRESS_OPTIONS = ("eps_lr", "gate_threshold", "svd_max_rank")  # compress-time only: no retraining
# Options a grid may not vary, and what to use instead: one sweep measures one teacher on one held-out split.
FIXED = {
    "method": "--baselines (and --budgets for budgeted)", "budget": "--budgets", "out": "--out",
    "runs_dir": "--runs-dir", "cache_dir": "--cache-dir", "defaulted": "nothing",
    "teacher": "one sweep per teacher, combined with `bdlora sweep-merge`",
    "data": "one sweep per corpus (members must be evaluated on the same held-out split)",
    "eval_tokens": "one value per sweep (members must be evaluated alike)",
    "heldout_fraction": "one value per sweep (members must be evaluated alike)",
}


def _option(name: str, spec: str) -> str:
    key = name.strip().lstrip("-").replace("-", "_")
    if key in FIXED:
        raise UsageError(f"--vary {spec}: {key} cannot vary inside a sweep (use {FIXED[key]})")
    if not is_option(key) and key not in COMPRESS_OPTIONS:
        raise UsageError(f"--vary {spec}: unknown option {name.strip()!r} (any `bdlora train` option, or a compress "
                         f"threshold: {', '.join(COMPRESS_OPTIONS)})")
    return key


def _value(key: str, text: str, spec: str):
    text = text.strip()
    if text == "":
        raise UsageError(f"--vary {spec}: an empty value for {key}")
    if text.lower() in ("none", "null"):
        return None
    t = typing.get_type_hints(BudgetedConfig)[key] if key in COMPRESS_OPTIONS else yaml_type(key)
    try:
        if t is bool:
            return {"true": True, "false": False}[text.lower()]
        if t in (int, float):
            v = t(text)
            if t is float and not math.isfinite(v):
                raise ValueError
            return v
    except (KeyError, ValueError):
        raise UsageError(f"--vary {spec}: {key} {text!r} is not {TYPE_WORDS[t]}") from None
    return text


def parse_axis(spec: str) -> dict:
    """``"a,b=1:2,3:4"`` -> ``{"options": ["a", "b"], "values": [[1, 2], [3, 4]]}`` (checked, typed)."""
    left, sep, right = spec.partition("=")
    if not sep or not left.strip() or not right.strip():
        raise UsageError(f"--vary {spec!r}: expected OPTION=V1,V2 (or OPT1,OPT2=A1:B1,A2:B2 to vary options together)")
    keys = [_option(k, spec) for k in left.split(",")]
    if len(set(keys)) != len(keys):
        raise UsageError(f"--vary {spec}: an option named twice")
    if len(keys) > 1 and any(k in COMPRESS_OPTIONS for k in keys) and any(k not in COMPRESS_OPTIONS for k in keys):
        raise UsageError(f"--vary {spec}: a compress threshold cannot be zipped with a train option (give it its own "
                         "--vary)")
    values = []
    for point in right.split(","):
        parts = point.split(":") if len(keys) > 1 else [point]
        if len(parts) != len(keys):
            raise UsageError(f"--vary {spec}: {point!r} has {len(parts)} value(s) for {len(keys)} options "
                             f"({', '.join(keys)}); separate them with ':'")
        values.append([_value(k, p, spec) for k, p in zip(keys, parts)])
    if len({tuple(map(repr, v)) for v in values}) != len(values):
        raise UsageError(f"--vary {spec}: each value once")
    return {"options": keys, "values": values}


def check_axes(axes: list[dict]) -> None:
    seen = [k for a in axes for k in a["options"]]
    twice = sorted({k for k in seen if seen.count(k) > 1})
    if twice:
        raise UsageError(f"--vary: {', '.join(twice)} varied by more than one --vary (zip them in one: "
                         f"{','.join(twice)}=A1:B1,...)")


def grid(axes: list[dict], compress: bool) -> list[dict]:
    """Every grid point of the train (``compress=False``) or compress-time axes, as option -> value, in order."""
    chosen = [a for a in axes if all((k in COMPRESS_OPTIONS) == compress for k in a["options"])]
    points = []
    for combo in itertools.product(*[a["values"] for a in chosen]):
        point = {}
        for a, vals in zip(chosen, combo):
            point.update(zip(a["options"], vals))
        points.append(point)
    return points


def show(v) -> str:
    """A setting as member names and tables spell it: ``none``, ``true``, ``0.5`` (not ``0.50``), a path by its
    last part."""
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) \
        else Path(str(v)).name or str(v)


def label(settings: dict) -> str:
    """The name suffix of a grid point: ``+temperature=2+kd_weight=0.5``."""
    return "".join(f"+{k}={re.sub(r'[^A-Za-z0-9._-]', '-', show(v))}" for k, v in settings.items())
