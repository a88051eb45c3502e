"""Root conftest: shared fixtures come from the harness plugins.

`tests/` is on sys.path (pytest's rootdir-relative import), so `harness` imports directly.
"""
# session_order first: the fixture plugins import it, and it must be rewritten before that.
pytest_plugins = ["harness.session_order", "harness.k8s_fixtures", "harness.ray_fixtures",
                  "harness.ground_fixtures", "harness.kueue_fixtures", "harness.gcs_fixtures"]

import pytest

# Every test has a time limit (pytest-timeout, the signal method: the test fails with its
# report, fixtures torn down, and the session goes on), by what it runs. A test may name its
# own with @pytest.mark.timeout(N). pyproject.toml's session_timeout ends the whole session
# with its summary before CI's limit.
TIME_LIMITS_S = (("ground", 900), ("slow", 600), ("ray", 600), ("cluster", 300))
PURE_TIME_LIMIT_S = 300


@pytest.hookimpl(trylast=True)  # after the fixture plugins have marked the tests
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue
        limit = next((s for marker, s in TIME_LIMITS_S if item.get_closest_marker(marker)), PURE_TIME_LIMIT_S)
        item.add_marker(pytest.mark.timeout(limit))


def pytest_terminal_summary(terminalreporter):
    """Seconds per test file (setup, call and teardown together), the 15 heaviest: where a
    cut to the suite's time pays. The per-test figures are in --durations above."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                path = report.nodeid.split("::", 1)[0]
                per_file[path] = per_file.get(path, 0.0) + report.duration
    if not per_file:
        return
    terminalreporter.write_sep("=", "heaviest 15 test files (s)")
    for path, seconds in sorted(per_file.items(), key=lambda item: -item[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    write_lanes(terminalreporter)
    from harness.ground_fixtures import CLUSTERS_STASH  # a plugin: imported by then

    clusters = terminalreporter.config.stash.get(CLUSTERS_STASH, None)
    if clusters is not None:
        terminalreporter.write_sep("=", f"RayClusters whose workers ran on the ground: {len(clusters)}")
        for line in clusters:
            terminalreporter.write_line(line)


def write_lanes(terminalreporter) -> None:
    """Each lane's tests, the seconds they took and its span from its first test's start to
    its last test's end: the longer lane is the session's time, so a cut pays there."""
    lanes: dict[str, list] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not isinstance(report, pytest.TestReport) or not getattr(report, "start", None):
                continue
            name = report.nodeid.rsplit("@", 1)[1].split("[")[0] if "@" in report.nodeid else "one lane"
            lane = lanes.setdefault(name, [set(), 0.0, report.start, report.stop])
            lane[0].add(report.nodeid)
            lane[1] += report.duration
            lane[2], lane[3] = min(lane[2], report.start), max(lane[3], report.stop)
    if not lanes:
        return
    terminalreporter.write_sep("=", "lanes")
    for name, (tests, busy, first, last) in sorted(lanes.items()):
        terminalreporter.write_line(f"{name:>9}: {len(tests):5d} tests, {busy:7.1f} s in tests, "
                                    f"{last - first:7.1f} s from the first start to the last end")
