"""`collectives` on a real Ray head: Ray Core actors, gloo, DTensor tensor parallelism."""

from __future__ import annotations

import re

import pytest

from trainer_helpers import run_trainer

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("ranks", [2, 4])
def test_collectives_pass(ray_head, ranks):
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
