"""``ThreadPool``: the onnxruntime intra-op threads a command runs or times with, declared once and embedded as the
``pool`` field of every settings dataclass that takes them (compress --one-shot and plan, export genai, bench,
generate, serve, ship). The CLI reads its field as the one ``--threads`` option (``cli/options.from_dataclass``
follows embedded settings; ``base/argv.fields_of`` does for a command that runs another), and ``from_options`` builds a
dataclass from a command's flat options, routing ``threads`` into its pool. Standard library only.
``flat`` writes a dataclass's values back as those flat options (ship's resume record), as they were before the
pool was embedded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bdlora.base.argv import embedded, field_default
from bdlora.base.errors import Checks, usable_cores

# `export genai --threads`: the intra-op thread count a folder asks for, written for the machine it will run on, so not
# bounded by this one's cores; above this it is a typo (100000 made onnxruntime-genai crash with exit 139 on load)
MAX_GENAI_THREADS = 512


@dataclass(frozen=True)
class ThreadPool:
    threads: int | None = None
    """onnxruntime intra-op threads of what this command runs or times (default: this machine's usable cores)."""

    def check(self, c: Checks, written: bool = False) -> None:
        """Here: 1 up to the cores this process may use. ``written`` (export genai: a count written into
        genai_config.json for the machine the folder will run on): 0 (none written) up to ``MAX_GENAI_THREADS``."""
        if written:
            c.integer("threads", self.threads, lo=0, hi=MAX_GENAI_THREADS,
                      what=" (0 = leave the thread count to the runtime)")
        else:
            c.threads("threads", self.threads)

    @property
    def count(self) -> int:
        """The threads to run with: as given, else this machine's usable cores."""
        return usable_cores() if self.threads is None else self.threads

    def resolved(self) -> ThreadPool:
        """This pool with "this machine's usable cores" (None) made a number, as a record of what ran states it."""
        return self if self.threads is not None else ThreadPool(self.count)


def from_options(cls, values: dict):
    """``cls`` from a command's flat options: a name that is a field of an embedded dataclass (``threads``, the
    ``pool``'s; ``forms``, the ``dials``') goes into that dataclass, whose fields not given keep ``cls``'s default
    for it (one-shot's ``Dials(forms=lowrank,channels)``), the rest to ``cls`` itself; an embedded dataclass given
    whole is taken as it is. An unknown name is ``cls``'s own ``TypeError``, as a misspelt keyword always was."""
    own = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(values)
    for name, inner in embedded(cls).items():
        if name in values:
            continue
        mine = {f.name for f in dataclasses.fields(inner)} - set(own)
        picked = {k: values.pop(k) for k in list(values) if k in mine}
        if picked:
            values[name] = dataclasses.replace(field_default(own[name]), **picked)
    return cls(**values)


def flat(obj) -> dict:
    """A settings dataclass's values as its command line gives them: an embedded dataclass's fields at the top level
    (``"threads": 2``, not ``"pool": {"threads": 2}``), so a record written before a field was embedded (ship's
    resume contract, ``DIR/ship.json``) compares equal to one written after."""
    out, inner = {}, embedded(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in inner and dataclasses.is_dataclass(value):
            out.update(flat(value))
        else:
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out
