"""The typer app, its consoles and the one error contract of every command: a ``BdloraError`` becomes one red line
on stderr and exit 2 (bad usage) or 1 (failure); Ctrl-C exits 130 with what was saved; nothing else prints a
traceback unless it is a bug."""

from __future__ import annotations

import errno
import functools
import inspect
import os
import re
import signal
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from bdlora.base.errors import BdloraError, Terminated
from bdlora.base.io import NotAFileError, release_claims
from bdlora.cli import settings_file


def quiet_transformers() -> None:
    """The CLI draws its own progress and reports problems in one line: transformers' own bars (5.x draws "Loading
    weights" on every ``from_pretrained``) and its warnings and load-report tables would interleave with both on
    stderr. Through the environment when transformers is not loaded yet (it reads both at import; the bench's and
    torchrun's worker processes inherit them), directly when it is. Library users keep theirs."""
    if "transformers" in sys.modules:
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()
    else:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


quiet_transformers()

# OSErrors that mean "the disk refused the write", not a bug: one line and exit 1, like any failure
STORAGE_ERRORS = {errno.EFBIG: " (the file-size limit: see `ulimit -f`)", errno.ENOSPC: " (the disk is full)",
                  errno.EDQUOT: " (the disk quota is exhausted)", errno.EROFS: ""}


def storage_errno(e: BaseException) -> int | None:
    """The errno of a write the disk refused (an OSError, or safetensors' own error, which carries the OS error only
    in its message: "I/O error: File too large (os error 27)"), else None."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None and type(e).__name__ == "SafetensorError":
        found = re.search(r"os error (\d+)", str(e))
        code = int(found.group(1)) if found else None
    return code if code in STORAGE_ERRORS else None

class OneLineErrors(TyperGroup):
    """Usage errors the option parser finds (an unknown option, ``--max-steps abc``) follow the same contract as
    ours: one line on stderr naming the bad value, exit 2; typer would draw a multi-line box. Click's exception
    classes are matched by their interface (``format_message``, ``exit_code``): typer vendors click in some
    versions and depends on it in others."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except Exception as e:  # noqa: BLE001 - re-raised unless it is one of click's usage errors
            if type(e).__name__ == "NoArgsIsHelpError":
                out.print(e.ctx.get_help())
                sys.exit(2)
            if type(e).__name__ == "Abort":
                sys.exit(1)
            if not (hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int)):
                raise
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            raise SystemExit(fail(f"{e.format_message()}{hint}", e.exit_code).exit_code) from None
        sys.exit(code if isinstance(code, int) else 0)  # commands return None; an int is an Exit's code


app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Budgeted LoRA: distil a causal LM into a mixed dense/low-rank student that is faster.")
export_app = typer.Typer(no_args_is_help=True, help="Export a compressed model (hf: a shareable HF folder; onnx: a "
                                                    "validated ONNX decoder; genai: an onnxruntime-genai folder).")
app.add_typer(export_app, name="export")

# Piped output (logs, CI) gets a wide console so tables are not cropped at 80 columns.
# emoji off: rich turned "--data builtin:-1" into a thumbs-down. Text from the user (paths, corpus specs, names) is
# passed through rich.markup.escape wherever it is printed: a folder named "a[/]b" was a MarkupError traceback.
out = Console(width=None if sys.stdout.isatty() else 150, emoji=False)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 150, emoji=False)


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # "[gpu]" is text, not markup
    return typer.Exit(code)


def plain_help(text: str | None) -> str | None:
    """Help text as written: typer reads it as rich markup, where "the [llamacpp] extra" lost its bracketed name
    (a style tag to rich); text already escaped (a backslash before a bracket) is kept as it is."""
    return text if not text or "\\[" in text else escape(text)


def command(target: typer.Typer = app, name: str | None = None, options=()):
    """Register ``fn`` as a command with the error contract above. ``options`` are extra ``inspect.Parameter``s
    (typically generated from a config dataclass, see ``options``) appended to ``fn``'s own, which then receives
    them as keyword arguments (``**opts``); every command also takes the hidden ``--settings-file``
    (``cli.settings_file``)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(**kwargs):
            kwargs.pop(settings_file.NAME, None)  # read by its callback, into click's defaults
            try:
                fn(**kwargs)  # returns nothing: an int from the app means an exit code (OneLineErrors)
            except BdloraError as e:
                raise fail(str(e), e.exit_code) from None
            except NotAFileError as e:  # something not a regular file appeared at an output path while we worked
                raise fail(str(e), 1) from None
            except Exception as e:  # noqa: BLE001 - re-raised unless the disk refused a write
                if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG:  # a path the user gave: bad usage
                    name = max(Path(e.filename or "").parts or [""], key=lambda part: len(part.encode()))
                    raise fail(f"{e.filename}: a name in this path ({len(name.encode())} bytes) is longer than the "
                               "file system allows (usually 255 bytes)", 2) from None
                code = storage_errno(e)
                if code is None:
                    raise
                # every artefact is written under a temp name and renamed when whole: a failed write left nothing
                where = f" {e.filename}" if getattr(e, "filename", None) else ""
                raise fail(f"could not write{where}: {os.strerror(code)}{STORAGE_ERRORS[code]}; the partial "
                           "output was discarded (artefacts are renamed into place only when whole)", 1) from None
            except KeyboardInterrupt as e:
                err.print(f"[bold red]interrupted[/]{': ' + escape(str(e)) if str(e) else ''}", highlight=False,
                          soft_wrap=True)
                raise typer.Exit(143 if isinstance(e, Terminated) else 130) from None
            finally:
                release_claims()  # the outputs this command claimed are whole or gone: another command may write them

        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        wrapper.__doc__ = plain_help(fn.__doc__)
        for p in [*own, *options]:
            for info in (p.default, *getattr(p.annotation, "__metadata__", ())):
                if getattr(info, "help", None):
                    info.help = plain_help(info.help)
        # typer reads this signature (inspect stops unwrapping at __signature__) and resolves fn's own annotations
        # through __wrapped__; the generated options carry real annotation objects
        wrapper.__signature__ = sig.replace(parameters=own + list(options) + [settings_file.parameter()])
        target.command(name)(wrapper)
        return fn

    return deco


def _terminated(signum, frame) -> None:
    raise Terminated("terminated (SIGTERM)")


def main() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    app()
