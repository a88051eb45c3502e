"""The session's order (harness/session_order.py): what needs nothing first, the ground last,
and a part stopped only once its last user's module is torn down."""

from __future__ import annotations

from types import SimpleNamespace

from harness import session_order as order


def test_groups_run_from_nothing_up_to_the_ground_with_kueue_last():
    cases = [((), 1), (("tmp_path",), 1), (("control_plane", "namespace"), 2),
             (("control_plane", "ray_head"), 3), (("ray_head",), 4),
             (("ground", "control_plane"), 5), (("ground", "kueue"), 6)]
    assert [order.group(names) for names, _ in cases] == [expected for _, expected in cases]


def test_a_part_stops_after_its_last_users_module_not_before():
    stopped = []
    module_a, module_b = object(), object()
    items = [SimpleNamespace(nodeid=f"a::{i}", module=module_a, fixturenames=("control_plane",) if i < 2 else ())
             for i in range(3)] + [SimpleNamespace(nodeid="b::0", module=module_b, fixturenames=())]
    release = order.Release()
    release.collected(items)
    release.hold(order.CONTROL_PLANE, lambda: stopped.append("control plane"))
    release.torn_down(items[1], items[2])  # the last user; its module still runs
    assert stopped == []
    release.torn_down(items[2], items[3])  # module a torn down
    assert stopped == ["control plane"]
    release.torn_down(items[3], None)
    assert stopped == ["control plane"]


def test_with_lanes_a_part_stops_after_the_last_user_of_the_lane_that_runs_it():
    stopped = []
    local, ground = object(), object()
    local_items = [SimpleNamespace(nodeid=f"l::{i}", module=local, fixturenames=("control_plane",)) for i in range(2)]
    # A ground test that also names the control plane: in one lane it would keep it up.
    ground_items = [SimpleNamespace(nodeid="g::0", module=ground, fixturenames=("ground", "control_plane"))]
    assert [order.lane(i.fixturenames) for i in local_items + ground_items] == ["local", "local", "ground"]
    release = order.Release()
    release.collected(local_items + ground_items, lanes=True)
    release.hold(order.CONTROL_PLANE, lambda: stopped.append("control plane"))
    release.torn_down(local_items[0], local_items[1])
    release.torn_down(local_items[1], None)  # the local lane's worker ends here
    assert stopped == ["control plane"]

    one_lane = order.Release()
    one_lane.collected(local_items + ground_items, lanes=False)
    one_lane.hold(order.CONTROL_PLANE, lambda: stopped.append("too early"))
    one_lane.torn_down(local_items[1], ground_items[0])
    assert stopped == ["control plane"]
