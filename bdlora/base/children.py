"""Child processes that end with the process that started them, however it ends: ``kill -9`` cannot be caught, so a
parent cannot stop its children itself (a ship step ran on under PID 1 holding its output's claim; a bench timing
worker ran on until its next write to the closed pipe). Standard library only."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(parent: int) -> None:
    """In the child, before it runs: SIGTERM when ``parent`` dies. Linux only; elsewhere nothing is armed."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def dying_with_this_process() -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when this process ends."""
    parent = os.getpid()
    return lambda: _die_with(parent)
