"""The one polling wait of the harness and the tests: poll a predicate until it returns
something true, or fail naming what was awaited and the last value seen."""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.5,
             details: Callable[[], str] | None = None) -> T:
    """The first true value `predicate()` returns within `timeout` seconds; AssertionError
    naming `what`, the last value and `details()` (a log tail) otherwise. The predicate is
    called at least once."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        last = predicate()
        if last:
            if os.environ.get("TPUFT_TEST_TRACE"):
                print(f"[trace {time.strftime('%H:%M:%S')}] {time.monotonic() - started:6.1f}s waiting for {what}", file=sys.stderr, flush=True)
            return last
        if time.monotonic() >= deadline:
            more = f"\n{details()}" if details is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}{more}")
        time.sleep(interval)
