"""glibc's allocator tuned so that freed request buffers go back to the OS at once.

By default glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, so
later request bodies, decoded base64 and pixel buffers below that size come from the heap, whose
freed pages are kept: after a burst of large uploads the process stays near its peak for good,
and thread arenas multiply that. A fixed threshold (128 KiB, glibc's own starting value) keeps
every large buffer in its own mapping, unmapped on free, and two arenas bound the rest; what the
request-memory budget counts is then what the process holds. Operators' own ``MALLOC_*``
environment variables win; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["return_freed_memory"]

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 128 * 1024
ARENA_MAX = 2


def return_freed_memory() -> bool:
    """Apply the tuning (before threads start); True when glibc took it."""
    name = ctypes.util.find_library("c")
    if name is None or "libc.so" not in name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    done = True
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        done &= mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    if "MALLOC_ARENA_MAX" not in os.environ:
        done &= mallopt(_M_ARENA_MAX, ARENA_MAX) == 1
    if not done:
        log.warning("mallopt refused the tuning: freed request memory may stay resident")
    return bool(done)
