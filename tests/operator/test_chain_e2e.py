"""A chained run on the test ground (spec.model.initFrom): a DPO run with LoRA is applied
before its SFT run exists and says so; while the SFT run trains it holds no RayCluster and says
what it waits for, updated from the SFT run's own changes; once the SFT run has Succeeded it
records the SFT's export in status.initFrom, its trainer loads that export (the job's argv and
its driver's log name it), and it Succeeds. Both runs: one epoch of a few steps."""

from __future__ import annotations

import json
import time

import pytest

from tpufinetune.core import conditions as cond
from tpufinetune.core.sizing import raycluster_name

from harness.timing import within
from ground_runs import resource
from test_node_failures_e2e import preference_rows

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

SFT, DPO = "chain-sft", "chain-dpo"


def test_a_dpo_run_waits_holding_nothing_for_its_sft_run_then_trains_from_its_export(
        operator, ground, kube, ground_assets, storage, tmp_path):
    started = time.monotonic()
    rows = [json.loads(line) for line in ground.gcs.read(ground_assets.data).decode().splitlines()]
    local = tmp_path / "pairs.jsonl"
    local.write_text("".join(json.dumps(pair) + "\n" for pair in preference_rows(rows, 48)))
    pairs = ground.gcs.upload(local, ground.gcs.unique_uri("data", "pairs") + "/pairs.jsonl")
    dpo = resource(DPO, ground_assets, storage, epochs=1, dataset={"id": pairs},
                   training={"method": "dpo", "lora": {"rank": 8}}, model={"initFrom": {"run": SFT}})
    del dpo["spec"]["model"]["id"]  # the source's base is the model: nothing else to say
    sft = resource(SFT, ground_assets, storage, epochs=1, rows=96)

    # Applied first, the DPO run names what is missing, and holds nothing.
    kube.apply(dpo)
    missing = f"no TPUFineTune {SFT} in namespace {kube.ns} yet; waiting for it to be applied and to succeed"
    status = kube.wait_for(lambda: (s := kube.status(DPO)).get("message") == missing and s, "the DPO run's wait named",
                           timeout=within(60), details=lambda: str(kube.status(DPO)))
    assert status["phase"] == "Pending" and "rayClusterName" not in status and "attempt" not in status

    kube.apply(sft)
    dpo_cluster = raycluster_name(DPO)
    kube.wait_for(lambda: kube.status(SFT).get("phase") == "Running", "the SFT run Running", timeout=300)
    seen_running = time.monotonic()
    # The SFT run's own change wakes the waiting run (no poll of a minute): it says so at once.
    waiting = kube.wait_for(
        lambda: (s := kube.status(DPO)).get("message", "").startswith(
            f"waiting for TPUFineTune {SFT} to succeed: it is Running, epoch 1 of 1") and s,
        "the DPO run naming the SFT run's epoch", timeout=within(20), details=lambda: str(kube.status(DPO)))
    print(f"the DPO run followed the SFT run's Running in {time.monotonic() - seen_running:.1f} s: {waiting['message']}")
    ready = cond.find(waiting, cond.INIT_FROM_READY)
    assert (ready["status"], ready["reason"]) == ("False", "SourceRunning")
    while kube.status(SFT).get("phase") not in ("Succeeded", "Failed"):  # all the while: no slice held
        assert kube.get("raycluster", dpo_cluster) is None and kube.status(DPO).get("phase") == "Pending"
        assert time.monotonic() - seen_running < 600, "the SFT run did not end"
        time.sleep(2)
    sft_status = kube.status(SFT)
    assert sft_status["phase"] == "Succeeded", sft_status.get("message")
    export = sft_status["exportedModelURI"]

    # Resolved once, from the SFT run's status; then the DPO run provisions and trains from it.
    recorded = kube.wait_for(lambda: kube.status(DPO).get("initFrom"), "status.initFrom", timeout=within(30))
    assert recorded == {"run": SFT, "uid": kube.get("tpufinetune", SFT)["metadata"]["uid"], "artifact": "export",
                        "uri": export, "modelId": ground_assets.model}
    uid = kube.get("tpufinetune", DPO)["metadata"]["uid"]
    cluster = kube.wait_for(lambda: kube.status(DPO).get("rayClusterName"), "the DPO run's RayCluster", timeout=60)

    def loaded():  # read while the run lasts: its RayCluster goes when it ends
        try:
            client = kube.head_job_client(cluster)
            return (client.get_job_info(f"tft-{uid}-1").entrypoint, client.get_job_logs(f"tft-{uid}-1"))
        except Exception:  # the head not up yet, or the job not submitted yet
            return None
    entrypoint, log = kube.wait_for(lambda: (got := loaded()) and f"model={export}" in got[1] and got,
                                    "the DPO trainer loading the SFT export", timeout=300, interval=2)
    assert f"--model-id={export}" in entrypoint and "--method=dpo" in entrypoint and "--dpo-lora=true" in entrypoint

    final = kube.wait_for(lambda: (s := kube.status(DPO)).get("phase") in ("Succeeded", "Failed") and s,
                          "the DPO run to end", timeout=600, interval=2)
    assert final["phase"] == "Succeeded", final.get("message")
    assert final["initFrom"] == recorded and cond.is_true(final, cond.INIT_FROM_READY)
    assert [e["epoch"] for e in final["history"]] == [1] and final["history"][0].get("dpo")
    reasons = [e.get("reason") for e in ground.events(kube.ns)
               if (e.get("involvedObject") or {}).get("name") == DPO]
    assert "WaitingForSource" in reasons and "InitFromResolved" in reasons, reasons
    print(f"chain e2e: {time.monotonic() - started:.0f} s; DPO trained from {export}")
