"""The operator's RSS comes back down after a burst (adapters/memory.py): freed objects'
pages go back to the kernel once trimmed, instead of staying at the high-water mark."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import sys
    from tpufinetune.adapters import memory

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    assert memory.bound_arenas()
    held = [bytes(2048) + bytes([i % 251]) for i in range(60_000)]  # ~120 MB in malloc'd blocks
    keep = held[::1000]  # a few survive, scattered, as a burst leaves some objects alive
    del held
    before = rss_mb()
    released = memory.trim()
    after = rss_mb()
    print(f"{before:.0f} {after:.0f} {int(released)}")
""")


def test_a_trim_hands_a_bursts_freed_memory_back():
    # A fresh process: the test runner's own heap would blur the figures. Without the trim
    # (a gc.collect() alone) the same process stays at its high-water mark: checked.
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout.split()
    before, after, released = float(out[0]), float(out[1]), out[2]
    assert released == "1"
    assert before - after > 60, f"RSS {before:.0f} MB -> {after:.0f} MB after the trim"


def test_the_body_kopf_keeps_for_a_run_loses_its_managed_fields_and_nothing_else():
    # kopf's own Body view, as its watch hands it to the event handler and keeps it for the
    # run's daemon: the drop must reach the dict kopf holds, not a copy.
    import kopf

    from tpufinetune.adapters.handlers import drop_managed_fields

    raw = {"metadata": {"name": "a", "namespace": "n", "uid": "u", "generation": 2, "labels": {"x": "y"},
                        "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]},
           "spec": {"epochs": 3}, "status": {"phase": "Pending"}}
    body = kopf.Body(raw)
    drop_managed_fields(body)
    assert "managedFields" not in raw["metadata"]
    assert raw == {"metadata": {"name": "a", "namespace": "n", "uid": "u", "generation": 2, "labels": {"x": "y"}},
                   "spec": {"epochs": 3}, "status": {"phase": "Pending"}}
    assert body.metadata.name == "a" and body.spec["epochs"] == 3
    drop_managed_fields(kopf.Body({}))  # an event without metadata: nothing to drop


def test_once_a_run_holds_its_own_status_the_kept_body_keeps_only_kopfs_part_of_it():
    # handlers.resource_seen, as kopf calls it with the body it keeps for the run's daemon:
    # before the run took its status (a new daemon reads it from the body) the body is whole;
    # after, its status is kopf's part only, and the gauges were fed the whole one first.
    import asyncio

    import kopf

    from tpufinetune.adapters import handlers, metrics

    def event_body() -> dict:
        return {"metadata": {"name": "a", "namespace": "n", "uid": "u", "generation": 1},
                "spec": {"epochs": 3},
                "status": {"phase": "Pending", "appliedSpec": "{}", "kopf": {"lastHandledConfiguration": "{}"}}}

    class Run:
        generation, settling, status_taken = 1, False, False
        wake = asyncio.Event()

    run = Run()
    handlers.RUNS[("n", "a")] = run
    try:
        raw = event_body()
        asyncio.run(handlers.resource_seen(type="MODIFIED", body=kopf.Body(raw)))
        assert raw["status"]["appliedSpec"] == "{}"  # the daemon has not taken it yet
        run.status_taken = True
        raw = event_body()
        asyncio.run(handlers.resource_seen(type="MODIFIED", body=kopf.Body(raw)))
        assert raw["status"] == {"kopf": {"lastHandledConfiguration": "{}"}}
        assert raw["spec"] == {"epochs": 3} and raw["metadata"]["generation"] == 1
        assert metrics.RESOURCES._phase[("n", "a")] == "Pending"  # the gauge was fed the whole status first
    finally:
        handlers.RUNS.pop(("n", "a"), None)
        metrics.forget("n", "a", "u")
