"""The one polling wait of the harness and the tests: poll a predicate until it returns
something true, or fail naming what was awaited and the last value seen."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.5,
             details: Callable[[], str] | None = None) -> T:
    """The first true value `predicate()` returns within `timeout` seconds; AssertionError
    naming `what`, the last value and `details()` (a log tail) otherwise. The predicate is
    called at least once."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            more = f"\n{details()}" if details is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}{more}")
        time.sleep(interval)
