"""Registers the bdlora architectures with transformers when (and only when) transformers is imported.

A post-import hook (a ``sys.meta_path`` finder, the pattern ``wrapt.when_imported`` uses): ``import bdlora`` stays
standard-library only, and ``AutoConfig`` / ``AutoModelForCausalLM`` still know the ``bdlora_*`` model types in any
program that imports both, whichever comes first.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

_TARGET = "transformers"


def _register() -> None:
    try:
        from bdlora.deployed.folder import register

        register()
    except Exception as e:  # noqa: BLE001  never break the user's `import transformers`
        warnings.warn(f"bdlora: could not register its architectures with transformers ({e})", stacklevel=2)
    if _quiet:
        _silence_progress()


_quiet = False


def _silence_progress() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    # 5.x also prints a "load report" table for every missing or unexpected key; the CLI checks the weights itself
    # and says what is wrong in one line (bdlora.models.check_weights_match)
    logging.set_verbosity_error()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for ``transformers`` it asks the other finders and runs the registration right after
    the module has executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot, and no recursion through importlib.util.find_spec below
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module  # the loader instance is this spec's own: wrapping it touches nothing else

        def exec_module(module):
            execute(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


def quiet_transformers() -> None:
    """For the CLI, which draws its own progress and reports problems in one line: transformers' own bars (5.x
    draws "Loading weights" on every ``from_pretrained``) and warnings would interleave with both on stderr.
    Library users keep theirs."""
    global _quiet
    _quiet = True
    if _TARGET in sys.modules:
        _silence_progress()
    else:
        register_with_transformers()


def register_with_transformers() -> None:
    """Register now if transformers is loaded, otherwise as soon as it is."""
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
