"""The wait after a 429 Too Many Requests (core/retryafter.py, pure): Retry-After read as
seconds or an HTTP-date, a default for what cannot be read, every wait bounded, and the
waits of one call bounded in total."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest

from tpufinetune.core import retryafter
from tpufinetune.core.retryafter import next_wait, retry_after_seconds

NOW = datetime(2026, 12, 2, 6, 0, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("value,seconds", [
    ("1", 1.0),  # what the kube-apiserver sends
    ("7", 7.0),
    (" 2.5 ", 2.5),
    ("3600", retryafter.MOST_S),  # never longer than the most
    ("0", retryafter.LEAST_S),  # never a tight loop
    (None, retryafter.DEFAULT_S),
    ("", retryafter.DEFAULT_S),
    ("soon", retryafter.DEFAULT_S),
    ("-5", retryafter.DEFAULT_S),
    ("nan", retryafter.DEFAULT_S),
    ("inf", retryafter.DEFAULT_S),
])
def test_retry_after_in_seconds_is_bounded_and_a_garbled_one_gets_the_default(value, seconds):
    assert retry_after_seconds(value, NOW) == seconds


def test_retry_after_as_an_http_date_counts_from_now():
    assert retry_after_seconds(format_datetime(NOW + timedelta(seconds=12), usegmt=True), NOW) == 12.0
    # A date already past: ask again after the least wait; a date far ahead: the most.
    assert retry_after_seconds(format_datetime(NOW - timedelta(hours=1), usegmt=True), NOW) == retryafter.LEAST_S
    assert retry_after_seconds(format_datetime(NOW + timedelta(days=1), usegmt=True), NOW) == retryafter.MOST_S
    # Without a clock a date cannot be read.
    assert retry_after_seconds(format_datetime(NOW, usegmt=True)) == retryafter.DEFAULT_S


def test_the_waits_of_one_call_stop_at_the_budget():
    assert next_wait("1", waited=0) == 1.0
    assert next_wait("1", waited=retryafter.BUDGET_S - 1) == 1.0
    assert next_wait("1", waited=retryafter.BUDGET_S - 0.5) is None
    assert next_wait("5", waited=2, budget=6) is None
    # Even a server that always says 0 runs out the budget.
    waited, waits = 0.0, 0
    while (wait := next_wait("0", waited)) is not None:
        waited, waits = waited + wait, waits + 1
    assert waited <= retryafter.BUDGET_S and waits >= int(retryafter.BUDGET_S / retryafter.LEAST_S) - 1
