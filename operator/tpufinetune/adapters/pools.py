"""Bounded pools of named threads for the blocking clients (Ray's Job API, Kubernetes).

Each kind of call has its own pool, so one kind held up (heads that accept connections and
never answer, each holding a thread for TPUFT_RAY_TIMEOUT) cannot queue the other behind
it: a run's status writes go on while every Ray thread waits on a black hole.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor


class Pool:
    """`threads` worker threads named `<name>_<n>`, started as calls need them."""

    def __init__(self, name: str, threads: int):
        self.name = name
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def call(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` in one of the pool's threads (with the caller's context
        variables, as asyncio.to_thread does); waits for a free thread."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        return await loop.run_in_executor(self._executor, functools.partial(context.run, fn, *args, **kwargs))
