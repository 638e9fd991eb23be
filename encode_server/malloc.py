"""glibc's allocator, tuned for a server whose buffers are large and short-lived.

Two costs pull against each other. glibc's default raises its mmap threshold (up to 32 MiB) each
time a large block is freed and keeps freed heap pages, so after a burst of large uploads the
process stays near its peak for good, and every thread arena multiplies that. Pinning the
threshold low (128 KiB) gives memory back at once, but then every pixel buffer, processor array
and activation of every request is a fresh mapping whose pages fault in and are zeroed again:
measured, 8-10 ms of a 32 ms tiny-model encode on 2 cores, a quarter of the model's time.

So: buffers under 32 MiB (an encode's working set) are reused from the heap, never mapped anew;
larger ones (burst-sized uploads and decoded frames) are their own mappings, unmapped on free;
the heap is not shrunk on every free (16 MiB trim threshold) and two arenas bound the rest. What
the heap keeps after work goes back to the OS by :func:`release_free_memory`, which the server
calls once it is idle (``encode_server.app``): memory falls back after a burst without any
request paying page faults for it. Operators' own ``MALLOC_*`` environment variables win; other
C libraries (musl has no ``mallopt``) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

__all__ = ["release_free_memory", "tune_allocator"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = 16 << 20
ARENA_MAX = 2


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None or "libc.so" not in name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 - glibc has it, musl does not
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def tune_allocator() -> bool:
    """Apply the tuning (before threads start: arenas are made per thread); True when glibc took it."""
    libc = _glibc()
    if libc is None:
        return False
    done = True
    for env, option, value in (
        ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        ("MALLOC_ARENA_MAX", _M_ARENA_MAX, ARENA_MAX),
    ):
        if env not in os.environ:
            done &= libc.mallopt(option, value) == 1
    if not done:
        log.warning("mallopt refused the tuning: freed request memory may stay resident")
    return bool(done)


def release_free_memory() -> bool:
    """Give the free pages of every heap back to the OS (``malloc_trim``): ~1-2 ms after a burst,
    microseconds when there is nothing to give. True when glibc gave some back."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1
