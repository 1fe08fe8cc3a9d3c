"""The ``bdlora`` command line (typer + rich). Commands are thin: parse, build a config, call one library function,
print a table (``render``) or JSON. Errors become one red line on stderr (exit 2 bad usage, 1 failure).

- ``app``: the typer app, consoles and the error contract; ``options``: options generated from config dataclasses;
- ``progress``: the rich progress reporter; ``render``: every table;
- one module per command group: ``train`` (teacher, train), ``compress`` (plan, compress), ``export`` (hf, onnx),
  ``bench``, ``eval`` (eval, sweep), ``serve`` (serve, loadtest).

Importing this package registers every command (in the order ``bdlora --help`` lists them) and loads neither torch
nor transformers: each command imports what it needs when it runs.
"""

import importlib

from bdlora.cli.app import app, main

COMMAND_MODULES = ("train", "compress", "export", "bench", "eval", "generate", "serve", "ship")
for _name in COMMAND_MODULES:
    importlib.import_module(f"bdlora.cli.{_name}")

__all__ = ["app", "main"]
