"""Option files: ``--config FILE`` (a YAML mapping of TrainConfig options) or a recipe shipped with bdlora
(``--config paper``: the paper's full budget), each value checked like the flag it stands for."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from bdlora.base.errors import ConfigError, shown
from bdlora.train.config import OPTION_NAMES, TrainConfig

RECIPES_DIR = Path(__file__).parents[1] / "recipes"
RECIPES = tuple(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))  # shipped YAML files, named by --config NAME
MAX_CONFIG_BYTES = 1 << 20


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file of options, or a recipe shipped with the package (``--config paper``: the paper's budget)."""
    import yaml

    p = Path(path)
    if not p.is_file() and str(path) in RECIPES:
        p = RECIPES_DIR / f"{path}.yaml"
    if not p.exists():
        raise ConfigError([f"--config {path}: no such file (or a recipe shipped with bdlora: {', '.join(RECIPES)})"])
    if not p.is_file():  # a folder, a FIFO (reading would block), a device (/dev/zero never ends)
        kind = "a folder" if p.is_dir() else "not a regular file"
        raise ConfigError([f"--config {path}: is {kind}; name a YAML file (or a recipe: {', '.join(RECIPES)})"])
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError([f"--config {path}: {p.stat().st_size:,} bytes; an option file is a few lines (at most "
                           f"{MAX_CONFIG_BYTES:,} bytes)"])
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError([f"--config {path}: not valid YAML ({str(e).splitlines()[0]})"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: must be a mapping of option: value"])
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(OPTION_NAMES))
    if unknown:
        raise ConfigError([f"--config {path}: unknown option(s) {', '.join(unknown)}"])
    wrong = [f"{k}: {shown(v)} is not {TYPE_WORDS[t]}" for k, v in data.items()
             if v is not None and (t := yaml_type(k)) is not None and not _is(v, t)]
    if wrong:
        raise ConfigError([f"--config {path}: {'; '.join(wrong)} (YAML values get the same checks as the flags)"])
    return data


TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def is_option(name: str) -> bool:
    """Whether ``name`` is a ``bdlora train`` option (a TrainConfig field an option file or a sweep grid may set)."""
    return name in OPTION_NAMES


def yaml_type(name: str):
    """The scalar type of a TrainConfig field (None for lists and anything else YAML may spell freely)."""

    tp = typing.get_type_hints(TrainConfig).get(name)
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return args[0] if args[0] in TYPE_WORDS else None


def _is(v, t) -> bool:
    if t is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, t) and (t is bool or not isinstance(v, bool))
