"""An ``Invocation`` as the command line a person would type (what ship shows as a step starts and puts in its
recommendation), from the commands' own click parameters: arguments in place, an option by its first flag, a
switch by its on or off flag, a repeated option once per value. The command reads the same words as its
settings file (``cli.settings_file``): a test holds them equal for every step ship runs."""

from __future__ import annotations

import typer.main

from bdlora.base.argv import Invocation
from bdlora.base.errors import UsageError
from bdlora.cli.app import app
from bdlora.cli.settings_file import NAME


def click_command(words: tuple[str, ...]):
    """The click command ``bdlora WORDS`` runs (a ``UsageError`` for no such command)."""
    cmd = typer.main.get_command(app)
    for word in words:
        sub = getattr(cmd, "commands", {}).get(word)
        if sub is None:
            raise UsageError(f"no command `bdlora {' '.join(words)}`")
        cmd = sub
    return cmd


def spell(inv: Invocation) -> list[str]:
    """``inv`` as the command line (without the program) that gives the same parameters, in ``inv.values``' order; a
    parameter its command lacks is a ``UsageError`` naming it."""
    cmd = click_command(inv.command)
    params = {p.name: p for p in cmd.params}
    argv = list(inv.command)
    for name, value in inv.values.items():
        p = params.get(name)
        if p is None or name == NAME:
            raise UsageError(f"`bdlora {' '.join(inv.command)}` has no parameter {name}")
        items = value if isinstance(value, list) else [value]
        if p.param_type_name == "argument":
            argv += [str(v) for v in items]
        elif getattr(p, "is_flag", False) and isinstance(value, bool):
            if value:
                argv.append(p.opts[0])
            elif p.secondary_opts:
                argv.append(p.secondary_opts[0])
        else:
            for v in items:
                argv += [p.opts[0], v if isinstance(v, str) else f"{v:g}" if isinstance(v, float) else str(v)]
    return argv
