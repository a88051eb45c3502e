"""How long to wait after an API server answered 429 Too Many Requests. Pure.

The kube-apiserver answers 429 when its priority level (API Priority and Fairness) or its
in-flight limit is full, with `Retry-After` in seconds. A call so answered was not
processed, so it is repeated after that wait: creates, conditional deletes and status
patches carrying a resourceVersion are all safe to send again.
"""

from __future__ import annotations

import math
from datetime import datetime
from email.utils import parsedate_to_datetime

DEFAULT_S = 1.0  # no Retry-After, or one that cannot be read
LEAST_S = 0.2  # a server saying 0 is not asked again at once, in a loop
MOST_S = 60.0  # one wait is never longer, whatever the header says
# The waits of one call add up to at most this; then the 429 is the call's error (the step
# fails, and a status write counts toward TPUFT_STALL_TIMEOUT from then on).
BUDGET_S = 60.0


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float:
    """Seconds to wait from a Retry-After header: delta-seconds ("1", "2.5") or an
    HTTP-date (needs `now`, timezone-aware); absent or unreadable gives DEFAULT_S. Always
    between LEAST_S and MOST_S."""
    seconds = _parse(value, now)
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        seconds = DEFAULT_S
    return min(max(seconds, LEAST_S), MOST_S)


def _parse(value: str | None, now: datetime | None) -> float | None:
    text = (value or "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    if now is None:
        return None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT
        return None
    return max(0.0, (when - now).total_seconds())


def next_wait(value: str | None, waited: float, now: datetime | None = None,
              budget: float = BUDGET_S) -> float | None:
    """The wait before repeating a call answered 429 with Retry-After `value`, after
    `waited` seconds already spent waiting on this call; None once the budget would be
    passed (give the error to the caller)."""
    wait = retry_after_seconds(value, now)
    return None if waited + wait > budget else wait
