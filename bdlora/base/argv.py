"""What a command that runs another one (``ship`` runs export, compress, train, bench and plan as their own
processes) hands it: an ``Invocation``, the command and its parameters as its command line would give them, written
as the settings file the child reads with ``--settings-file`` (``cli.settings_file``). The values of a command's
settings dataclass are generated from its fields (``option_values``; the CLI generates each command's options from
the same fields, ``cli/options.from_dataclass``: field ``calib_tokens`` is ``--calib-tokens``), so a field renamed or
removed fails here, when the first step is built, instead of in a step's process 40 minutes into a run. Standard
library only (and ``errors.flag``, the one spelling of a field as a flag)."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from bdlora.base.errors import flag


def field_default(f: dataclasses.Field):
    """A dataclass field's default (its factory's value), or None where it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def embedded(cls) -> dict[str, type]:
    """The fields of ``cls`` that hold a settings dataclass of their own (by their default: bench's ``rounding``,
    every command's ``pool``), each with that dataclass."""
    out = {}
    for f in dataclasses.fields(cls):
        inner = field_default(f)
        if dataclasses.is_dataclass(inner):
            out[f.name] = type(inner)
    return out


def fields_of(*classes) -> dict[str, type]:
    """Every field a command's options come from: the fields of ``classes`` and of the dataclasses they hold as a
    field (``embedded``: bench's ``rounding``, export genai's settings, whose fields are bench's options too)."""
    out: dict[str, type] = {}
    for cls in classes:
        inner = embedded(cls)
        for f in dataclasses.fields(cls):
            if f.name in inner:
                out.update(fields_of(inner[f.name]))
            else:
                out[f.name] = cls
    return out


def option_values(classes, **values) -> dict[str, str | bool]:
    """``values`` (field name -> value; None: not given) as the command line gives them to the command whose options
    are the fields of ``classes``: text (a list comma-separated, a float as ``%g``), a switch as a boolean; what a
    settings file holds (``Invocation``). A name no class has is a ``TypeError`` naming it."""
    known = fields_of(*(classes if isinstance(classes, tuple) else (classes,)))
    unknown = sorted(set(values) - set(known))
    if unknown:
        owners = ", ".join(sorted({c.__name__ for c in known.values()}))
        raise TypeError(f"no option {', '.join(map(flag, unknown))} in {owners}")
    return {name: _text(value) for name, value in values.items() if value is not None}


def _text(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


SETTINGS_FILE = "--settings-file"  # every command's one hidden option: its parameters from an ``Invocation``'s file


@dataclass(frozen=True)
class Invocation:
    """One bdlora command and its parameters, keyed by the command's parameter names, each as its command line
    gives it (text; a switch a boolean; a repeated option or argument a list of texts): what a command that runs
    another one hands it (``ship``'s steps, its reach checks), written as a file the child reads with
    ``--settings-file`` and checks once, as it checks its command line; the CLI spells it as that command line for
    people (``cli.spell``). No other command's flag is written out by the one that runs it."""

    command: tuple[str, ...]  # ("compress",), ("export", "genai")
    values: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "values", {k: v for k, v in self.values.items() if v is not None})

    def to_json(self) -> dict:
        return {"command": list(self.command), "values": dict(self.values)}

    @classmethod
    def from_json(cls, data) -> Invocation:
        """An ``Invocation`` from ``to_json``'s dict; anything else a ``ValueError`` saying what is wrong."""
        if not isinstance(data, dict) or set(data) - {"command", "values", "schema_version"}:
            raise ValueError("not a settings file (a JSON object of 'command' and 'values')")
        command, values = data.get("command"), data.get("values", {})
        if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)):
            raise ValueError(f"'command' {command!r}: a list of a command's words, e.g. [\"export\", \"genai\"]")
        if not isinstance(values, dict):
            raise ValueError(f"'values' {values!r}: an object of parameter names and values")
        for name, value in values.items():
            ok = isinstance(value, (str, bool, int, float)) or (
                isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value))
            if not ok:
                raise ValueError(f"'values' {name}: {value!r} is not a command-line value (text, a number, a "
                                 "switch's true/false or a list of texts)")
        return cls(tuple(command), values)

    def file_argv(self, path) -> list[str]:
        """The argv (without the program) that runs this invocation from its settings file at ``path``."""
        return [*self.command, SETTINGS_FILE, str(path)]


Spell = Callable[[Invocation], list[str]]  # an invocation as the argv a person types (no program; ``cli.spell``)


def shown(inv: Invocation, spell: Spell) -> str:
    """``inv`` as the line a person would type (``spell``: the CLI's spelling of its parameters as flags)."""
    return "bdlora " + shlex.join(spell(inv))
