"""Typed errors and the one validation style. The CLI turns a ``BdloraError`` into one red line on stderr: exit 2
for bad usage, 1 for failures. Option dataclasses validate with ``Checks``: every problem is collected and raised
once, as a ``ConfigError`` naming each bad value and what is allowed (litgpt style)."""

from __future__ import annotations

import math
import os
import reprlib

# How a bad value is quoted in a message: bounded, so a YAML alias bomb (a few lines expanding to billions of
# nested items) is named in one short line instead of being expanded by repr().
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 60, 60


def shown(v) -> str:
    """A bounded repr of a user-supplied value for error messages."""
    return _REPR.repr(v)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's or a container's stop) taken as Ctrl-C is: every ``finally`` and context
    manager runs, so temp folders and timing workers go and claims are released (a killed bench used to leave its
    hidden work folder, GBs for a large model, behind); the CLI exits 143 (130 for Ctrl-C). Training and the server
    install their own handlers while they run (checkpoint on stop; drain), and raise it when the stop was SIGTERM."""


class BdloraError(Exception):
    """Base class of every error bdlora raises on purpose."""

    exit_code = 1


class UsageError(BdloraError):
    """The user asked for something invalid (a bad value, a missing path, an incompatible option)."""

    exit_code = 2


class ConfigError(UsageError):
    """One or more option values are invalid; the message lists every problem at once."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class DataError(UsageError):
    """The corpus cannot be used (missing, empty, too short for one block, unknown format)."""


class ModelError(UsageError):
    """A model or checkpoint cannot be used (missing, corrupt, wrong architecture, mismatched vocabulary)."""


class RunDirError(UsageError):
    """A directory that should be a bdlora artefact is not one (or is incomplete)."""


class TrainingError(BdloraError):
    """Training failed for a reason that is not the user's input (e.g. the loss became NaN)."""


def flag(name: str) -> str:
    """``eps_lr`` -> ``--eps-lr``: how an option is named on the command line (and in every message)."""
    return "--" + name.replace("_", "-")


class Checks:
    """Collects problems; ``done()`` raises them as one ConfigError. Numbers must be finite and of the right type
    (a YAML ``"0.4"`` or ``true`` is refused like a bad flag); ``None`` means "unset" and passes."""

    def __init__(self):
        self.problems: list[str] = []

    def add(self, problem: str) -> None:
        self.problems.append(problem)

    def require(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)

    def integer(self, name: str, v, lo: int | None = None, hi: int | None = None, what: str = "") -> bool:
        if v is None:
            return True
        if isinstance(v, bool) or not isinstance(v, int):
            self.add(f"{flag(name)} {shown(v)}: must be an integer")
            return False
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            bound = "a positive integer" if lo == 1 and hi is None else _bounds(lo, hi, False, False)
            self.add(f"{flag(name)} {v}: must be {bound}{what}")
            return False
        return True

    def threads(self, name: str, v) -> bool:
        """An intra-op thread count: 1 up to the cores this process may use (more never runs faster, and a typo
        such as 100000 would have onnxruntime spawn that many threads before anything else could answer)."""
        cores = usable_cores()
        return self.integer(name, v, lo=1, hi=cores, what=f" (the cores this process may use: {cores})")

    def number(self, name: str, v, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
               hi_open: bool = False) -> bool:
        if v is None:
            return True
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.add(f"{flag(name)} {shown(v)}: must be a number")
            return False
        bad = not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) or (
            hi is not None and (v >= hi if hi_open else v > hi))
        if bad:
            self.add(f"{flag(name)} {v}: must be {_bounds(lo, hi, lo_open, hi_open)}")
        return not bad

    def choice(self, name: str, v, allowed) -> bool:
        if v not in allowed:
            self.add(f"{flag(name)} {shown(v)}: unknown (allowed: {', '.join(map(str, allowed))})")
            return False
        return True

    def text(self, name: str, v) -> bool:
        if v is not None and not isinstance(v, str):
            self.add(f"{flag(name)} {shown(v)}: must be a string")
            return False
        return True

    def done(self) -> None:
        if self.problems:
            raise ConfigError(self.problems)


def _num(v) -> str:
    """A bound as a user reads it: integers whole (1048576, not 1.04858e+06), other numbers short."""
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else f"{v:g}"


def _bounds(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi:g}"
    return "a finite number"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one, else ``os.cpu_count()``)."""

    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def require_finite_nll(nll: float, what: str = "the model") -> float:
    """A mean NLL that is a number: NaN or inf (a NaN weight, a config value such as a negative ``rope_theta``) is
    refused in one line, never reported as a perplexity (``eval`` printed "perplexity: nan" and bench put NaN rows
    on the front)."""
    if not math.isfinite(nll):
        raise ModelError(f"{what}: its outputs are not finite (mean NLL {nll}) on the held-out text: a weight or a "
                         "config value is corrupt (NaN or inf weights, a negative rope_theta ...); no figure reported")
    return nll
