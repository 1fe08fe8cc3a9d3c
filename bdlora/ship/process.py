"""A ship step's process: its own process group, and ended when ship ends, however ship ends."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """In the child, before it runs: SIGTERM when the process that started it dies, however it dies (``kill -9``
    cannot be caught, so ship cannot stop its step itself; without this the step ran on under PID 1, holding its
    output's claim). Linux only; elsewhere the step ends at its next write to the closed pipe."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def spawn(argv: list[str]) -> subprocess.Popen:
    """A step's process: its own process group (Ctrl-C reaches ship alone, which stops the step as ``_stop`` does),
    ended with ship when ship is killed; output merged into one text pipe."""
    parent = os.getpid()
    env = {**os.environ, "COLUMNS": "160", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env=env, start_new_session=True, preexec_fn=lambda: _die_with_parent(parent))
