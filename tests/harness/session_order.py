"""The order of a test session, and the early release of what later tests no longer need.

On two cores, the trainer's tests train while anything else is up only at a cost: an idle
control plane, Ray head or test ground still takes CPU (watches, heartbeats, pollers). So
the session runs its tests in groups, each after the last, and stops a session-wide part
once the last test that needs it has finished:

1. tests that need none of these parts (the pure core, the trainer in-process);
2. tests of the bare control plane (no Ray);
3. tests of the bare control plane with a Ray head;
4. tests of a Ray head alone;  -- the bare control plane is stopped before these
5. tests on the test ground;    -- the Ray head is stopped before these
6. tests on the ground that queue with Kueue (Kueue, once started, stays up).

The order inside a group is the collection order. A part's fixture registers the live object
with `hold`; its session teardown still runs at the end and must tolerate a part already
stopped (every `stop` here is idempotent).
"""

from __future__ import annotations

from typing import Callable

import pytest

CONTROL_PLANE = "control_plane"
RAY_HEAD = "ray_head"
GROUND = "ground"
KUEUE = "kueue"

class Release:
    """Which part each test needs, and the parts to stop once no later test needs them."""

    def __init__(self) -> None:
        self.stoppers: dict[str, Callable[[], None]] = {}
        self.last_user: dict[str, str] = {}  # part -> nodeid of the last test that needs it
        self.due: set[str] = set()  # last user done; stopped once its module is torn down

    def collected(self, items) -> None:
        self.last_user.clear()
        for item in items:
            for part in (CONTROL_PLANE, RAY_HEAD):
                if part in getattr(item, "fixturenames", ()):
                    self.last_user[part] = item.nodeid

    def hold(self, part: str, stop: Callable[[], None]) -> None:
        self.stoppers[part] = stop

    def torn_down(self, item, nextitem) -> None:
        """After pytest's own teardown of `item`: a module's fixtures (which may still use
        a part) are torn down only when the next test is in another module, so a part is
        stopped then, not at its last user."""
        self.due.update(part for part, last in self.last_user.items() if last == item.nodeid)
        if nextitem is not None and nextitem.module is item.module:
            return
        for part in sorted(self.due):
            stop = self.stoppers.pop(part, None)
            if stop is not None:
                stop()
        self.due.clear()


_session = Release()


def hold(part: str, stop: Callable[[], None]) -> None:
    """A session fixture's part is up: `stop` ends it early once no later test needs it."""
    _session.hold(part, stop)


def group(fixturenames) -> int:
    names = set(fixturenames)
    if KUEUE in names:
        return 6
    if GROUND in names:
        return 5
    if CONTROL_PLANE in names:
        return 3 if RAY_HEAD in names else 2
    if RAY_HEAD in names:
        return 4
    return 1


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: group(getattr(item, "fixturenames", ())))  # stable: collection order within


def pytest_collection_finish(session):
    _session.collected(session.items)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    _session.torn_down(item, nextitem)
