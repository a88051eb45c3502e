"""The collectives check across slices on the CPU: four real gloo processes as two slices of
two (the slices interleave the ranks: 0 and 2 are slice 0), each told its slice as the
operator tells a pod (TPUFT_SLICE_INDEX). The check measures an all_reduce within each slice
(ICI) and one across slices at each position (DCN) over the fine-tune's own mesh groups, and
reports bus bandwidth per link class; the floor judges ICI."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tpufinetune_trainer.collectives import bus_bandwidth_gbps, link_figures, report
from tpufinetune_trainer.config import CollectivesConfig
from tpufinetune_trainer.errors import CollectivesError
from trainer_helpers import events_of, run_rank_processes

WORKER = Path(__file__).with_name("collectives_links_worker.py")
WORLD, SLICES, MIB = 4, 2, 1.0


@pytest.fixture(scope="module")
def two_slices(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("links")

    def argv(rank: int, port: int) -> list[str]:
        return [str(out), str(port), str(rank), str(WORLD), str(SLICES), str(rank % SLICES), str(MIB)]

    run_rank_processes(WORKER, WORLD, argv, timeout=240)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _config(floor: float = 0.0) -> CollectivesConfig:
    return CollectivesConfig(num_workers=WORLD, device="cpu", bandwidth_mib=MIB, min_bus_bandwidth_gbps=floor)


def _event(capsys) -> dict:
    (event,) = [e for e in events_of(capsys.readouterr().out) if e["event"] == "collectives"]
    return event


@pytest.mark.timeout(300)
def test_each_link_class_is_measured_over_the_meshs_groups_of_the_ranks_slices(two_slices, capsys):
    assert [r["where"]["slice"] for r in two_slices] == [0, 1, 0, 1]  # from each rank's pod
    results = [r["result"] for r in two_slices]
    slice_of = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for r in results:
        assert r["links"]["ici"]["ranks"] == slice_of[r["rank"]]  # its slice: a mesh row
        assert r["links"]["dcn"]["ranks"] == ([0, 1] if r["rank"] in (0, 1) else [2, 3])  # one rank per slice
        assert r["all_reduce_s"] > 0 and all(m["seconds"] > 0 for m in r["links"].values())

    assert report(results, "gloo", _config(), {"127.0.0.1": WORLD}) == 0
    event = _event(capsys)
    links = event["links"]
    assert event["passed"] and event["world_size"] == WORLD and event["bus_bandwidth_gbps"] > 0
    assert links["ici"]["group_ranks"] == [[0, 2], [1, 3]] and links["dcn"]["group_ranks"] == [[0, 1], [2, 3]]
    assert (links["ici"]["groups"], links["ici"]["ranks_per_group"]) == (2, 2)
    assert (links["dcn"]["groups"], links["dcn"]["ranks_per_group"]) == (2, 2)
    # The slowest group's figure, with the group's own size (2), not the world's (4).
    ici_slowest = max(r["links"]["ici"]["seconds"] for r in results)
    assert links["ici"]["bus_bandwidth_gbps"] == round(bus_bandwidth_gbps(MIB, 2, ici_slowest), 3)


@pytest.mark.timeout(300)
def test_the_floor_judges_the_bandwidth_within_a_slice_not_across(two_slices, capsys):
    results = [copy.deepcopy(r["result"]) for r in two_slices]
    ici = link_figures(results, MIB, None)["ici"]["bus_bandwidth_gbps"]
    for r in results:  # DCN far slower than the floor: reported, not judged
        r["links"]["dcn"]["seconds"] = 1e3
    assert report(results, "gloo", _config(floor=ici / 2), {"127.0.0.1": WORLD}) == 0
    assert _event(capsys)["links"]["dcn"]["bus_bandwidth_gbps"] < ici / 2
    with pytest.raises(CollectivesError, match=r"within a slice \(ICI\) .* under the floor"):
        report(results, "gloo", _config(floor=ici * 2), {"127.0.0.1": WORLD})
    assert _event(capsys)["passed"] is False


def test_one_slice_reports_its_figure_as_ici_and_no_dcn():
    results = [{"rank": r, "all_reduce_s": 0.5, "links": None} for r in range(4)]
    assert link_figures(results, MIB, 1.5) == {"ici": {"bus_bandwidth_gbps": 1.5, "groups": 1, "ranks_per_group": 4}}
    assert link_figures(results, 0.0, None) == {}  # nothing measured: nothing reported


def test_tpu_ranks_of_two_slices_follow_their_slice_then_the_webhooks_worker_id():
    from tpufinetune_trainer.collectives import assign_ranks

    # Two v6e 2x4 slices of two hosts x 4 devices, in the order Ray placed them (slice 1 first);
    # the webhook numbers hosts 0 and 1 in each slice.
    places = [{"node_ip": f"10.0.{s}.{h}", "tpu_worker_id": h, "accelerator_id": d, "tpu_hosts": "", "slice": s}
              for s in (1, 0) for h in range(2) for d in range(4)]
    ranks = assign_ranks(places, devices_per_host=4)
    assert sorted(r["rank"] for r in ranks) == list(range(16))
    assert ranks[0] == {"worker_id": 0, "local_rank": 0, "rank": 8}  # slice 1's first device
    assert ranks[13] == {"worker_id": 1, "local_rank": 1, "rank": 5}  # slice 0, host 1, device 1
