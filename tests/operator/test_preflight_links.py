"""Bus bandwidth per link class (ICI within a slice, DCN across slices) from the trainer's
collectives event into status.preflight and status.collectives. Pure: the event is the one
the trainer's own `report` prints, parsed as the operator parses job logs."""

from __future__ import annotations

import contextlib
import io
from datetime import timedelta

from tpufinetune.core.phases import JobView, Plan
from tpufinetune.core.runevents import apply_event
from tpufinetune.core.status import checked_status
from tpufinetune_trainer.collectives import report
from tpufinetune_trainer.config import CollectivesConfig
from tpufinetune_trainer.events import parse_text

from phase_helpers import READY, step

PREFLIGHT = Plan(cluster_name="demo-rc", epochs=2, provision_timeout=timedelta(minutes=30), preflight=True)
MIB = 64.0


def _rank(rank: int, world: int, links: dict | None) -> dict:
    return {"rank": rank, "local_rank": rank % 2, "worker_id": rank // 2, "node_ip": f"10.0.0.{rank // 2}",
            "all_reduce_sum": [world * (world + 1) / 2] * 4, "max_abs_diff": 0.0, "shard_ok": True,
            "parity_ok": True, "all_reduce_s": 0.01, "links": links}


def two_slices_of_two() -> list[dict]:
    """Ranks 0, 1 in slice 0 and 2, 3 in slice 1; DCN 10x slower than ICI."""
    rows = [[0, 1], [2, 3]]
    return [_rank(r, 4, {"ici": {"ranks": rows[r // 2], "seconds": 0.01},
                         "dcn": {"ranks": [r % 2, r % 2 + 2], "seconds": 0.1}}) for r in range(4)]


def collectives_event(results: list[dict]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report(results, "gloo", CollectivesConfig(num_workers=len(results), bandwidth_mib=MIB))
    (event,) = [e for e in parse_text(out.getvalue()) if e["event"] == "collectives"]
    return dict(event)


def preflight_after(events: tuple[dict, ...]) -> dict:
    d = step({}, plan=PREFLIGHT)
    d = step(d.status, plan=PREFLIGHT)
    d = step(d.status, plan=PREFLIGHT, cluster=READY)
    d = step(d.status, plan=PREFLIGHT, cluster=READY)
    done = step(d.status, plan=PREFLIGHT, cluster=READY, preflight_job=JobView("SUCCEEDED"), preflight_events=events)
    checked_status(done.status)  # the status model (and so the CRD) takes it
    return done.status["preflight"]


def test_two_slices_give_status_preflight_both_link_classes_with_their_groups():
    preflight = preflight_after((collectives_event(two_slices_of_two()),))
    assert preflight["phase"] == "Passed"
    # 64 MiB in 0.01 s over a group of 2: 2 x 1/2 x 67.1 MB / 0.01 s = 6.711 GB/s; DCN 10x slower.
    assert preflight["links"] == {"ici": {"busBandwidthGBps": 6.711, "groups": 2, "ranksPerGroup": 2},
                                  "dcn": {"busBandwidthGBps": 0.671, "groups": 2, "ranksPerGroup": 2}}
    assert "within a slice (ICI) 6.711 GB/s, across slices (DCN) 0.671 GB/s" in preflight["message"]


def test_one_slice_gives_ici_equal_to_the_bus_bandwidth_and_no_dcn():
    preflight = preflight_after((collectives_event([_rank(r, 4, None) for r in range(4)]),))
    assert preflight["links"] == {"ici": {"busBandwidthGBps": preflight["busBandwidthGBps"], "groups": 1,
                                          "ranksPerGroup": 4}}
    assert "ICI" not in preflight["message"]


def test_an_older_trainers_event_leaves_links_out():
    event = collectives_event([_rank(r, 4, None) for r in range(4)])
    del event["links"]
    preflight = preflight_after((event,))
    assert preflight["phase"] == "Passed" and "links" not in preflight and preflight["busBandwidthGBps"] > 0


def test_mode_collectives_folds_the_links_into_status_collectives():
    status: dict = {}
    apply_event(status, collectives_event(two_slices_of_two()))
    assert status["collectives"]["passed"] is True
    assert status["collectives"]["links"]["dcn"] == {"busBandwidthGBps": 0.671, "groups": 2, "ranksPerGroup": 2}
    assert "across slices (DCN) 0.671 GB/s" in status["collectives"]["message"]
    checked_status(status)
