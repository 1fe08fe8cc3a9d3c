"""What else the machine is doing while something is timed, and whether repeated timings agree: the two checks a time
must pass before a decision rests on it (the latency tables, the decode step's fitted overhead, the verification
curve; ``export.genai.latency``, ``bench.whole``, ``bench.verify``).

A machine shared with other jobs (a compiler, a second test worker) slows some repeats of a timing, or all of them:
the decode step's overhead fitted beside two busy processes came out at 748 us where a quiet machine measures 0-87,
and once cached it made ``ship`` refuse a speed-up the model reaches, for good. So a timing's repeats are interleaved
(a spell of other work falls on every variant alike), the other processes' load is read before and averaged over
the whole measurement (``LoadWatch``: ``/proc/stat``'s busy time less this process's and its children's), and the
repeats must agree (``agree``). A measurement that fails either is *unclean*: the run that took it uses it, the cache
keeps it marked so with the load it was measured under, a later run reuses it only while the machine is busy too
(``reusable``), and no refusal rests on it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bdlora.base.reporter import Reporter

BUSY_CORES = 0.5  # cores' worth of other processes' CPU beyond which a measurement is unclean
AGREE = 1.5  # the fastest tenth of a measurement's repeats within this factor of its minimum: the repeats agree


def _cpu_sample() -> tuple[float, float, float]:
    """(seconds of CPU the whole machine has been busy, of which this process's own and its waited-for children's,
    monotonic time): ``/proc/stat``'s busy time and ``os.times``."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    own = os.times()
    return ((sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"),
            own.user + own.system + own.children_user + own.children_system, time.monotonic())


def load_mark():
    """The start of a window ``others_since`` measures, or None where ``/proc/stat`` cannot be read (not Linux)."""
    try:
        return _cpu_sample()
    except (OSError, ValueError, IndexError):
        return None


def others_since(mark) -> float | None:
    """Cores' worth of CPU the machine's *other* processes used on average since ``mark`` (``load_mark``): the
    machine's busy time less this process's own and its children's (a timing worker's, once waited for)."""
    if mark is None:
        return None
    try:
        b1, o1, t1 = _cpu_sample()
    except (OSError, ValueError, IndexError):
        return None
    b0, o0, t0 = mark
    return max(0.0, (b1 - b0) - (o1 - o0)) / max(t1 - t0, 1e-9)


def others_busy(seconds: float = 0.5) -> float | None:
    """Cores' worth of CPU the machine's *other* processes used over the next ``seconds``, or None where that cannot
    be read (not Linux)."""
    mark = load_mark()
    time.sleep(seconds)
    return others_since(mark)


@dataclass(frozen=True)
class Load:
    """What the machine's other processes used while a measurement ran, in cores: in the half second before it
    (``before``) and on average over the whole of it (``during``); None where it could not be read."""

    before: float | None
    during: float | None

    @property
    def cores(self) -> float | None:
        seen = [v for v in (self.before, self.during) if v is not None]
        return max(seen) if seen else None

    @property
    def quiet(self) -> bool:
        """At most ``BUSY_CORES`` of other work before and during: times that may be cached and acted on."""
        return self.cores is None or self.cores <= BUSY_CORES

    def record(self) -> dict:
        """What a cached table keeps of the load it was measured under (``read_load`` reads it back)."""
        return {"others_cores_before": self.before, "others_cores_during": self.during, "busy_above": BUSY_CORES}

    def said(self) -> str:
        return "load unknown" if self.cores is None else f"other processes using {self.cores:.1f} cores"


def read_load(doc) -> Load | None:
    """The ``Load`` a cached table's ``load`` record holds, or None when it has none (written before loads were
    recorded) or a damaged one."""
    rec = doc.get("load") if isinstance(doc, dict) else None
    if not isinstance(rec, dict):
        return None
    values = [rec.get("others_cores_before"), rec.get("others_cores_during")]
    if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
               for v in values):
        return None
    return Load(*values)


class LoadWatch:
    """``with LoadWatch() as w: <measure>``, then ``w.load``: the other processes' load before and over the whole
    measurement (a job started half-way through counts, which a sample before and after can miss)."""

    def __enter__(self) -> LoadWatch:
        self._before = others_busy()
        self._mark = load_mark()
        return self

    def __exit__(self, *exc) -> None:
        self.load = Load(self._before, others_since(self._mark))


def not_cached(reporter: Reporter, what: str, load: Load, why: str = "") -> None:
    """Says that ``what`` was measured unclean (busy, or repeats that disagree: ``why``): times taken beside another
    job would misprice every later run that trusted them, so the cache marks them and a quiet run replaces them."""
    reason = why or f"measured with {load.said()} (more than {BUSY_CORES:g})"
    reporter.stage(f"{what}: {reason}; cached marked unclean: no decision refuses on them, and the next run on a "
                   "quiet machine measures them again")


def reusable(unclean: str | None, path: Path, reporter: Reporter) -> bool:
    """Whether a cached measurement at ``path`` is used as it is: when it was measured cleanly, or when it was not
    (``unclean`` says why) and the machine is busy now too (measuring again would be no cleaner). A quiet run
    measures an unclean one again: a busy machine's times never outlive a quiet run."""
    if unclean is None:
        return True
    if not Load(others_busy(), None).quiet:
        return True
    reporter.stage(f"{path}: measured unclean ({unclean}); measuring again now that the machine is quiet")
    return False


def agree(times) -> bool:
    """Whether repeated timings of one thing agree: a tenth of them within ``AGREE`` of the fastest, so the fastest
    is no lone fluke. The bound is loose because a quiet machine's repeats spread too: one int4 MatMulNBits on 2
    threads had its lower quartile at 2.5x its fastest, while the fastest of 25 repeats came back within 5-20% run
    after run and the fastest tenth within 1.41x. A fastest time far below all the others is a lucky gap between
    another job's slices, not the form's time."""
    t = np.asarray(times, dtype=np.float64)
    return t.size > 0 and float(np.percentile(t, 10)) <= AGREE * float(t.min())
