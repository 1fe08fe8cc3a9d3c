"""What every settings dataclass shares (``OneShotConfig``, ``TrainConfig``, ``BenchConfig``, the export settings,
ship's and sweep's): the docstring under each field, which the CLI shows as the option's help, read from the source so
help and code never diverge. Standard library only."""

from __future__ import annotations

import ast
import inspect


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source (so help text and code never diverge)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {a.target.id: b.value.value for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}
