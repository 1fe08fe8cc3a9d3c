"""The typer app, its consoles and the one error contract of every command: a ``BdloraError`` becomes one red line
on stderr and exit 2 (bad usage) or 1 (failure); Ctrl-C exits 130 with what was saved; nothing else prints a
traceback unless it is a bug."""

from __future__ import annotations

import functools
import inspect
import sys

import typer
from rich.console import Console
from rich.markup import escape

from bdlora._registration import quiet_transformers
from bdlora.errors import BdloraError

quiet_transformers()  # the CLI draws its own progress; stderr carries only its one-line errors

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Budgeted LoRA: distil a causal LM into a mixed dense/low-rank student that is faster.")
export_app = typer.Typer(no_args_is_help=True, help="Export a compressed model (hf: a shareable HF folder; onnx: a "
                                                    "validated ONNX decoder).")
app.add_typer(export_app, name="export")

# Piped output (logs, CI) gets a wide console so tables are not cropped at 80 columns.
out = Console(width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 150)


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # "[gpu]" is text, not markup
    return typer.Exit(code)


def command(target: typer.Typer = app, name: str | None = None, options=()):
    """Register ``fn`` as a command with the error contract above. ``options`` are extra ``inspect.Parameter``s
    (typically generated from a config dataclass, see ``options``) appended to ``fn``'s own, which then receives
    them as keyword arguments (``**opts``)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(**kwargs):
            try:
                return fn(**kwargs)
            except BdloraError as e:
                raise fail(str(e), e.exit_code) from None
            except KeyboardInterrupt as e:
                err.print(f"[bold red]interrupted[/]{': ' + str(e) if str(e) else ''}", highlight=False,
                          soft_wrap=True)
                raise typer.Exit(130) from None

        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        # typer reads this signature (inspect stops unwrapping at __signature__) and resolves fn's own annotations
        # through __wrapped__; the generated options carry real annotation objects
        wrapper.__signature__ = sig.replace(parameters=own + list(options))
        target.command(name)(wrapper)
        return fn

    return deco


def main() -> None:
    app()
