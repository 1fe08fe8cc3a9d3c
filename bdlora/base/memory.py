"""The process's freed memory handed back to the system: ``release_freed_memory`` (glibc's ``malloc_trim``). Standard
library only."""

from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc ``malloc_trim``; elsewhere nothing), after work that
    freed a lot: an idle genai engine (a cohort's KV buffer is one allocation of (rows x prompt + generation)
    positions; glibc serves a size it has freed before from its heap and keeps those pages, so without this the
    server's memory after a burst depended on which buffers had last been freed: 195-245 MB between identical idle
    rounds), a response of many megabytes (echo with logprobs: 108 MB before, 619 MB kept after one), or a
    streamed export's whole-graph session (1.1 GB of a 3B int4 session's run kept after it closed, under the next
    session's)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None
