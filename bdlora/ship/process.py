"""A ship step's process: its own process group, and ended when ship ends, however ship ends."""

from __future__ import annotations

import os
import subprocess

from bdlora.base.children import dying_with_this_process


def spawn(argv: list[str]) -> subprocess.Popen:
    """A step's process: its own process group (Ctrl-C reaches ship alone, which stops the step as ``_stop`` does),
    ended with ship when ship is killed (``kill -9`` included); output merged into one text pipe."""
    env = {**os.environ, "COLUMNS": "160", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env=env, start_new_session=True, preexec_fn=dying_with_this_process())
