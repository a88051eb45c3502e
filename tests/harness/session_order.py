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

Two lanes (`make test`: pytest-xdist, `-n 2 --dist loadgroup`). The ground's tests spend most
of their time waiting on real parts (pods starting, controllers' timings, a run's epochs):
the whole session used about 25 CPU-minutes in 54. So groups 1-4 (the "local" lane) run in
one worker while groups 5-6 (the "ground" lane) run in the other, each lane in the order
above. A part is stopped after the last test of its own lane that needs it.
"""

from __future__ import annotations

from typing import Callable

import pytest

CONTROL_PLANE = "control_plane"
RAY_HEAD = "ray_head"
GROUND = "ground"
KUEUE = "kueue"
LOCAL_LANE = "local"
GROUND_LANE = "ground"

class Release:
    """Which part each test needs, and the parts to stop once no later test needs them."""

    def __init__(self) -> None:
        self.stoppers: dict[str, Callable[[], None]] = {}
        # (lane, part) -> nodeid of the lane's last test that needs the part; one lane ("")
        # without lanes. A worker runs one lane: the other lane's last users never run there.
        self.last_user: dict[tuple[str, str], str] = {}
        self.due: set[str] = set()  # last user done; stopped once its module is torn down

    def collected(self, items, lanes: bool = False) -> None:
        self.last_user.clear()
        for item in items:
            names = getattr(item, "fixturenames", ())
            for part in (CONTROL_PLANE, RAY_HEAD):
                if part in names:
                    self.last_user[(lane(names) if lanes else "", part)] = item.nodeid

    def hold(self, part: str, stop: Callable[[], None]) -> None:
        self.stoppers[part] = stop

    def torn_down(self, item, nextitem) -> None:
        """After pytest's own teardown of `item`: a module's fixtures (which may still use
        a part) are torn down only when the next test is in another module, so a part is
        stopped then, not at its last user."""
        self.due.update(part for (_, part), last in self.last_user.items() if last == item.nodeid)
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


def lane(fixturenames) -> str:
    return GROUND_LANE if group(fixturenames) >= 5 else LOCAL_LANE


def lanes_on(config) -> bool:
    """`--dist loadgroup`: on the controller its option; in a worker, whose own `dist` is
    "no", the flag xdist sets from it."""
    return config.pluginmanager.hasplugin("xdist") and (
        config.getoption("dist", "no") == "loadgroup" or bool(getattr(config.option, "loadgroup", False)))


def ground_lane_refusal(config, nodeid: str) -> str:
    """Why the test `nodeid` may not start the ground in this process ("" when it may):
    under xdist only the ground lane's one worker starts it, so lanes must be on and the
    test's id must carry the ground lane's suffix (without it, loadgroup spreads the
    ground's tests over both workers: two grounds on two cores)."""
    if not hasattr(config, "workerinput"):
        return ""  # one process: one ground
    if not lanes_on(config):
        return "the ground's tests run in one xdist worker: run with `--dist loadgroup` (make test does)"
    if not nodeid.endswith(f"@{GROUND_LANE}"):
        return (f"{nodeid} needs the ground but is not in the ground lane (its id lacks @{GROUND_LANE}): "
                "session_order._name_lane did not name its lane")
    return ""


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: group(getattr(item, "fixturenames", ())))  # stable: collection order within
    if lanes_on(config):
        for item in items:
            _name_lane(item, lane(getattr(item, "fixturenames", ())))


def _name_lane(item, name: str) -> None:
    """The lane as `--dist loadgroup` reads it: a "@lane" suffix on the test's id, which
    xdist's scheduler groups by. xdist 3.8 adds it from an `xdist_group` mark by setting
    `_nodeid`, which pytest 9.2 no longer reads (the id is the structured `_id`), so the
    suffix is set here, where pytest keeps it."""
    if "@" in item.nodeid.rsplit("]", 1)[-1]:
        return
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{name}")
    else:  # pytest before 9.2
        item._nodeid = f"{item.nodeid}@{name}"


def pytest_collection_finish(session):
    _session.collected(session.items, lanes=lanes_on(session.config))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    _session.torn_down(item, nextitem)
