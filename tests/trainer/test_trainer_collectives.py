"""`collectives` on a real Ray head: Ray Core actors, gloo, DTensor tensor parallelism."""

from __future__ import annotations

import re

import pytest

from trainer_helpers import run_trainer

pytestmark = pytest.mark.ray


def test_collectives_pass(ray_head):
    ranks = 4  # two ranks run in the failure cases below
    run = run_trainer(["collectives", "--num-workers", str(ranks), "--device", "cpu"], ray_head.env(), timeout=240)
    assert run.rc == 0, run.tail()
    start, result = run.one("start"), run.one("collectives")
    assert (start["mode"], start["world_size"], start["backend"]) == ("collectives", ranks, "gloo")
    expected = ranks * (ranks + 1) / 2
    assert result["passed"] is True and result["failed_ranks"] == []
    assert result["all_reduce_sum"] == result["expected_sum"] == expected
    assert result["tp_max_abs_err"] < 1e-4  # fp32 on CPU: far inside the tutorial's tolerance
    # The tutorial's per-rank lines, one per rank, in rank order.
    lines = re.findall(r"^Rank +(\d+) \(worker_id=0, local_rank=(\d+), ip=[\d.]+\): all_reduce_sum=\[(.*)\]$",
                       run.output, re.M)
    assert [(int(r), int(l)) for r, l, _ in lines] == [(i, i) for i in range(ranks)]
    assert all(s == ", ".join([f"{expected:.1f}"] * 4) for _, _, s in lines)
    assert f"All {ranks} gloo ranks verified DTensor TP parity" in run.output
    assert not run.of("failure")


def test_a_corrupted_shard_fails_loudly(ray_head):
    # --corrupt-rank is the trainer's fault injection: rank 1 perturbs its own w1 shard
    # after sharding, a fault the real interconnect cannot be made to produce here.
    run = run_trainer(["collectives", "--num-workers", "2", "--device", "cpu", "--corrupt-rank", "1"],
                      ray_head.env(), timeout=240)
    assert run.rc != 0
    result, failure = run.one("collectives"), run.one("failure")
    assert result["passed"] is False and result["bad_shards"] == [1]
    assert result["failed_ranks"] == [0, 1]  # every rank sees the wrong TP output
    assert result["tp_max_abs_err"] > 1e-2
    assert failure["type"] == "CollectivesError" and "[1]" in failure["message"]
    assert "verified" not in run.output


def test_the_bus_bandwidth_is_measured_and_a_floor_above_it_fails(ray_head):
    run = run_trainer(["collectives", "--num-workers", "2", "--device", "cpu", "--bandwidth-mib", "8",
                       "--min-bus-bandwidth-gbps", "1000000"], ray_head.env(), timeout=240)
    assert run.rc != 0
    result, failure = run.one("collectives"), run.one("failure")
    assert result["passed"] is False and result["failed_ranks"] == []  # the checks agreed; the link is slow
    assert 0 < result["bus_bandwidth_gbps"] < 1000000 and result["min_bus_bandwidth_gbps"] == 1000000
    assert result["hosts"] == 1 and sum(result["devices_per_host"].values()) == 2
    assert failure["type"] == "CollectivesError" and "under the floor" in failure["message"]


def test_a_host_short_of_tpu_devices_is_named():
    from tpufinetune_trainer.collectives import devices_per_host, short_hosts

    places = [{"node_ip": "10.0.0.1", "device_files": 4}] * 4 + [{"node_ip": "10.0.0.2", "device_files": 2}] * 4
    assert short_hosts(places, 4) == {"10.0.0.2": 2}
    assert devices_per_host(places) == {"10.0.0.1": 4, "10.0.0.2": 4}
    assert short_hosts([{"node_ip": "10.0.0.1", "device_files": None}] * 2, None) == {}  # off TPU
