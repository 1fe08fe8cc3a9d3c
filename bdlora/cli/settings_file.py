"""Every command's hidden ``--settings-file FILE``: its parameters from an ``Invocation``'s JSON (what ``ship``
writes for each step it runs), read before any other parameter and given to click as the command's defaults, so
the file's values are parsed and checked exactly as the same words on the command line would be (once, by the
command's own checks); a value also given on the command line wins. The file names its command: a file written for
another command, or naming a parameter this command lacks, is refused in one line.

``cli.spell`` writes an ``Invocation`` as the command line a person would type."""

from __future__ import annotations

import inspect
from typing import Annotated, Optional

import typer

from bdlora.base.argv import SETTINGS_FILE, Invocation
from bdlora.base.io import read_json

NAME = "settings_file"  # the parameter's name in every command


def _words(ctx) -> tuple[str, ...]:
    """The command's words below the program (``bdlora export genai`` -> ("export", "genai")); a command run on its
    own (no group above it: a test's ``make_context``) is its own name."""
    words = []
    while ctx is not None and (ctx.parent is not None or not words):
        words.append(ctx.info_name)
        ctx = ctx.parent
    return tuple(reversed(words))


def _load(ctx: typer.Context, value: Optional[str]) -> Optional[str]:
    if not value:
        return value
    try:
        inv = Invocation.from_json(read_json(value))
    except OSError as e:
        raise typer.BadParameter(f"{value}: cannot read it ({e.strerror or e})",
                                 param_hint=f"'{SETTINGS_FILE}'") from None
    except ValueError as e:
        raise typer.BadParameter(f"{value}: {e}", param_hint=f"'{SETTINGS_FILE}'") from None
    here = _words(ctx)
    if inv.command != here and not (ctx.parent is None and inv.command[-1:] == here):  # alone: its last word
        raise typer.BadParameter(f"{value}: written for `bdlora {' '.join(inv.command)}`, not `bdlora "
                                 f"{' '.join(here)}`", param_hint=f"'{SETTINGS_FILE}'")
    names = {p.name for p in ctx.command.params} - {NAME}
    unknown = sorted(set(inv.values) - names)
    if unknown:
        raise typer.BadParameter(f"{value}: `bdlora {' '.join(here)}` has no parameter {', '.join(unknown)} "
                                 f"(it has {', '.join(sorted(names))})", param_hint=f"'{SETTINGS_FILE}'")
    ctx.default_map = {**(ctx.default_map or {}), **inv.values}
    return value


def parameter() -> inspect.Parameter:
    """The ``--settings-file`` parameter ``cli.app.command`` adds to every command (hidden: ``--help`` shows the
    options a person types; docs/commands.md documents it)."""
    option = typer.Option(SETTINGS_FILE, hidden=True, is_eager=True, callback=_load,
                          help="Take this command's parameters from a settings file (JSON of 'command' and "
                               "'values'); the command line wins.")
    return inspect.Parameter(NAME, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[Optional[str], option])
