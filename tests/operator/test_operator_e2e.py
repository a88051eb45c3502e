"""End to end: kubectl apply -> RayCluster (validated by KubeRay's real CRD) -> the test
marks it ready as KubeRay would -> the operator submits through the real Ray Job API ->
the trainer runs for real on CPU -> status, conditions, printer columns, Events.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow]


def resource(name: str, assets, storage, mode: str = "finetune", epochs: int = 2, **extra) -> dict:
    spec = {
        "tpu": {"generation": "cpu", "topology": "2"},
        "mode": mode,
        "image": "registry.example/tpufinetune-trainer:test",
        "model": {"id": str(assets.model)},
        "dataset": {"id": str(assets.data), "split": "train"},
        "training": {"epochs": epochs, "batchSizePerDevice": 4, "maxSeqLen": 128},
        "checkpoint": {"storagePath": str(storage)},
    }
    for key, value in extra.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name}, "spec": spec}


def jobs_of(ray_head, uid: str) -> list:
    client = ray_head.job_client()
    return [job for job in client.list_jobs() if (job.submission_id or "").startswith(f"tft-{uid}-")]


def start_run(kube, manifest) -> tuple[str, str]:
    kube.apply(manifest)
    name = manifest["metadata"]["name"]
    uid = kube.get("tpufinetune", name)["metadata"]["uid"]
    cluster = kube.wait_for(lambda: kube.status(name).get("rayClusterName"), "rayClusterName in status")
    kube.mark_cluster_ready(cluster)
    return uid, cluster


def test_finetune_runs_to_succeeded_with_every_epoch_in_status(operator, kube, ray_head, trainer_assets, tmp_path):
    manifest = resource("tiny-finetune", trainer_assets, tmp_path / "ckpt")
    uid, cluster = start_run(kube, manifest)

    body = kube.get("raycluster", cluster)
    assert body["metadata"]["ownerReferences"][0]["uid"] == uid
    assert body["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 2  # cpu topology "2": two CPU workers

    kube.kubectl("wait", "tpufinetune/tiny-finetune", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
    status = kube.status("tiny-finetune")
    assert status["phase"] == "Succeeded"
    assert [entry["epoch"] for entry in status["history"]] == [1, 2]
    assert all(entry["loss"] > 0 and entry["tokensPerSecond"] > 0 for entry in status["history"])
    assert status["history"][-1]["loss"] < status["history"][0]["loss"]
    assert status["epochProgress"] == "2/2"
    assert status["checkpointURI"] and str(tmp_path / "ckpt") in status["checkpointURI"]
    assert status["jobId"] == f"tft-{uid}-1"
    assert status["observedGeneration"] == 1
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Succeeded"] == "True" and conditions["ClusterReady"] == "True"

    table = kube.kubectl("get", "tpufinetunes").stdout
    header = table.splitlines()[0].split()
    for column in ("NAME", "GENERATION", "TOPOLOGY", "MODE", "PHASE", "EPOCH", "LOSS", "AGE"):
        assert column in header, table
    row = table.splitlines()[1].split()
    assert row[:6] == ["tiny-finetune", "cpu", "2", "finetune", "Succeeded", "2/2"]
    assert "CHECKPOINT" in kube.kubectl("get", "tpufinetunes", "-o", "wide").stdout

    # nothing expensive is left running, and the spec is exactly what was applied
    kube.wait_for(lambda: kube.get("raycluster", cluster) is None, "RayCluster released")
    assert kube.get("tpufinetune", "tiny-finetune")["metadata"]["generation"] == 1
    events = kube.kubectl("get", "events", "--field-selector", "involvedObject.name=tiny-finetune", "-o", "json").stdout
    reasons = {item["reason"] for item in json.loads(events)["items"]}
    assert {"Accepted", "ClusterReady", "JobSubmitted", "Succeeded"} <= reasons
    assert len(jobs_of(ray_head, uid)) == 1


def test_collectives_check_passes(operator, kube, ray_head, trainer_assets, tmp_path):
    uid, _ = start_run(kube, resource("tiny-collectives", trainer_assets, tmp_path / "ckpt", mode="collectives"))
    kube.kubectl("wait", "tpufinetune/tiny-collectives", "--for=condition=Succeeded", "--timeout=300s", timeout=320)
    status = kube.status("tiny-collectives")
    assert status["collectives"]["passed"] is True
    assert status["collectives"]["ranks"] == 2


def test_deleting_mid_run_stops_the_job_and_removes_the_cluster(operator, kube, ray_head, trainer_assets, tmp_path):
    uid, cluster = start_run(kube, resource("tiny-delete", trainer_assets, tmp_path / "ckpt", epochs=20))
    kube.wait_for(lambda: kube.status("tiny-delete").get("phase") == "Running", "phase Running", timeout=120)
    kube.kubectl("delete", "tpufinetune", "tiny-delete", "--wait=true", "--timeout=120s", timeout=130)
    assert kube.get("raycluster", cluster) is None
    jobs = jobs_of(ray_head, uid)
    assert len(jobs) == 1
    assert str(jobs[0].status) == "STOPPED"


def test_operator_restart_mid_run_reattaches_without_a_second_submission(operator, kube, ray_head, trainer_assets, tmp_path):
    uid, _ = start_run(kube, resource("tiny-restart", trainer_assets, tmp_path / "ckpt", epochs=3))
    kube.wait_for(lambda: kube.status("tiny-restart").get("phase") == "Running", "phase Running", timeout=120)
    before = kube.status("tiny-restart")["jobId"]
    operator.kill()
    operator.start()
    kube.kubectl("wait", "tpufinetune/tiny-restart", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
    status = kube.status("tiny-restart")
    assert status["jobId"] == before == f"tft-{uid}-1"
    assert [entry["epoch"] for entry in status["history"]] == [1, 2, 3]
    assert len(jobs_of(ray_head, uid)) == 1


def test_a_problem_only_the_trainer_can_see_ends_failed_with_its_reason(operator, kube, ray_head, trainer_assets, tmp_path):
    manifest = resource("tiny-baddata", trainer_assets, tmp_path / "ckpt", dataset={"id": str(tmp_path / "missing.jsonl")})
    start_run(kube, manifest)
    kube.kubectl("wait", "tpufinetune/tiny-baddata", "--for=condition=Failed", "--timeout=300s", timeout=320)
    status = kube.status("tiny-baddata")
    assert status["phase"] == "Failed"
    assert "missing.jsonl" in status["message"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "TrainerFailed"
