"""The session's order (harness/session_order.py): what needs nothing first, the ground last,
and a part stopped only once its last user's module is torn down."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
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


LANES_CONFTEST = '''
import os

import pytest

from harness.session_order import ground_lane_refusal, pytest_collection_modifyitems  # noqa: F401 (the hook)


@pytest.fixture(scope="session")
def ground(request):
    refusal = ground_lane_refusal(request.config, request._pyfuncitem.nodeid)
    if refusal:
        pytest.fail(refusal, pytrace=False)


@pytest.fixture
def record(request):
    yield
    with open(os.environ["LANES_OUT"], "a") as out:
        out.write(f"{request.node.nodeid} {os.environ.get('PYTEST_XDIST_WORKER', '-')}\\n")
'''

LANES_TESTS = '''
import pytest


@pytest.mark.parametrize("i", range(4))
def test_local(record, i):
    pass


@pytest.mark.parametrize("i", range(4))
def test_on_the_ground(ground, record, i):
    pass
'''


def test_under_make_tests_xdist_every_ground_test_is_named_into_one_worker(tmp_path):
    """_name_lane against the pinned pytest and xdist, as `make test` runs them: each test's
    id ends in its lane, the ground's tests all run in one worker, and the ground's guard
    lets them start it."""
    (tmp_path / "conftest.py").write_text(LANES_CONFTEST)
    (tmp_path / "test_lanes.py").write_text(LANES_TESTS)
    out = tmp_path / "ran.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this session's worker
    env.update(LANES_OUT=str(out), PYTHONPATH=str(Path(__file__).parent))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadgroup", "-o", "addopts=", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ran = [line.split() for line in out.read_text().splitlines()]
    assert len(ran) == 8, ran
    lanes = {nodeid.rsplit("@", 1)[-1] if "@" in nodeid else "" for nodeid, _ in ran}
    assert lanes == {order.LOCAL_LANE, order.GROUND_LANE}, ran
    ground_workers = {worker for nodeid, worker in ran if "test_on_the_ground" in nodeid}
    assert len(ground_workers) == 1 and ground_workers != {"-"}, ran
    assert all(nodeid.endswith(f"@{order.GROUND_LANE}") == ("test_on_the_ground" in nodeid) for nodeid, _ in ran), ran


def test_the_ground_refuses_a_worker_outside_its_lane():
    worker = SimpleNamespace(workerinput={}, pluginmanager=SimpleNamespace(hasplugin=lambda name: True),
                             getoption=lambda name, default=None: "no", option=SimpleNamespace(loadgroup=True))
    assert order.ground_lane_refusal(worker, "tests/x.py::test_a@ground") == ""
    assert "not in the ground lane" in order.ground_lane_refusal(worker, "tests/x.py::test_a@local")
    assert "not in the ground lane" in order.ground_lane_refusal(worker, "tests/x.py::test_a")
    worker.option.loadgroup = False
    assert "--dist loadgroup" in order.ground_lane_refusal(worker, "tests/x.py::test_a@ground")
    one_process = SimpleNamespace(pluginmanager=SimpleNamespace(hasplugin=lambda name: False))
    assert order.ground_lane_refusal(one_process, "tests/x.py::test_a") == ""
