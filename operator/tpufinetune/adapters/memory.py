"""The operator's resident memory close to what it holds.

After a burst (thousands of runs applied at once, a relist) CPython frees its objects, but
glibc's allocator keeps the pages: without help the RSS stays at the burst's high-water mark.
Two things bring it back down; both are no-ops off glibc:
- at most ARENAS malloc arenas (glibc's default is 8 per core, one per thread that allocates
  while another holds one: the Ray and Kubernetes worker threads would each fragment their
  own);
- every TRIM_INTERVAL_S a garbage collection, then malloc_trim(0), which returns free pages
  to the kernel.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging

log = logging.getLogger(__name__)

ARENAS = 2
TRIM_INTERVAL_S = 30.0
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def bound_arenas(count: int = ARENAS) -> bool:
    """Before the worker threads start: arenas made after this are bounded."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, count))


def trim() -> bool:
    """Collect, then hand free pages back to the kernel; True when glibc did release some."""
    gc.collect()
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


async def trim_forever(interval: float = TRIM_INTERVAL_S) -> None:
    while True:
        await asyncio.sleep(interval)
        trim()
