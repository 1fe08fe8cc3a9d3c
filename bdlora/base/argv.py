"""A command's flags generated from its settings dataclass, for a command that runs another one (``ship`` runs
export, compress, train and bench as their own processes). The CLI generates each command's options from the same
fields (``cli/options.from_dataclass``: field ``calib_tokens`` is ``--calib-tokens``), so the flags follow the field
names: a field renamed or removed fails here, when the first step is built, instead of in a step's process 40
minutes into a run. Standard library only (and ``errors.flag``, the one spelling of a field as a flag)."""

from __future__ import annotations

import dataclasses

from bdlora.base.errors import flag


def embedded(cls) -> dict[str, type]:
    """The fields of ``cls`` that hold a settings dataclass of their own (by their default: bench's ``rounding``,
    every command's ``pool``), each with that dataclass."""
    out = {}
    for f in dataclasses.fields(cls):
        inner = f.default if f.default is not dataclasses.MISSING else None
        if inner is None and f.default_factory is not dataclasses.MISSING:
            inner = f.default_factory()
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


def flags(classes, **values) -> list[str]:
    """The flags that give ``values`` (field name -> value; None: not given) to the command whose options are the
    fields of ``classes`` (one settings dataclass or a tuple), in the order given: a switch as ``--name`` or
    ``--no-name``, a list comma-separated, a float as ``%g``. A name no class has is a ``TypeError`` naming it."""
    known = fields_of(*(classes if isinstance(classes, tuple) else (classes,)))
    unknown = sorted(set(values) - set(known))
    if unknown:
        owners = ", ".join(sorted({c.__name__ for c in known.values()}))
        raise TypeError(f"no option {', '.join(map(flag, unknown))} in {owners}")
    argv: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag(name) if value else "--no-" + flag(name)[2:])
        elif isinstance(value, (list, tuple)):
            argv += [flag(name), ",".join(map(str, value))]
        else:
            argv += [flag(name), f"{value:g}" if isinstance(value, float) else str(value)]
    return argv
