"""What every settings dataclass shares (``OneShotConfig``, ``TrainConfig``, ``BenchConfig``, the export settings,
ship's and sweep's): the docstring under each field, which the CLI shows as the option's help, read from the source so
help and code never diverge; and ``Settings``, how each checks its values. Standard library only."""

from __future__ import annotations

import ast
import inspect

from bdlora.base.errors import Checks


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source (so help text and code never diverge);
    a field declared again in a subclass (``forms.dials.TrainDials``, train's wording of a dial) takes the
    subclass's."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if "__dataclass_fields__" not in vars(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        docs.update({a.target.id: b.value.value for a, b in zip(body, body[1:]) if isinstance(a, ast.AnnAssign)
                     and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)})
    return docs


class Settings:
    """The one convention of every settings dataclass (``*Config``): ``check(c)`` adds each problem of its values to
    ``c`` (a ``Checks``) and returns it, so a command holding several settings (serve's speculation, ship's export
    settings) reports all of them at once; ``validate()`` raises them as one ConfigError and returns the settings.
    A class whose check needs more than its values (bench's model context) takes it in both, as keywords. The export
    settings have a field named ``validate`` (``--validate/--no-validate``, recorded in every export.json), which
    hides the method: their callers write ``settings.check(Checks()).done()``, what ``validate()`` does."""

    def check(self, c: Checks) -> Checks:
        raise NotImplementedError(f"{type(self).__name__}.check")

    def validate(self):
        self.check(Checks()).done()
        return self
