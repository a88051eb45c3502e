"""End to end on the test ground: kubectl apply -> RayCluster -> the real KubeRay makes a
head and worker pods -> the scheduler binds them -> the node agent runs them as Ray
processes -> KubeRay reports ready -> the operator submits through the real Ray Job API at
the head's Service name -> the trainer runs for real on CPU in the worker pods -> status,
conditions, printer columns, Events -> the cluster and every Ray process are released.

The finetune run also carries what a deployment depends on: GitOps sees no drift after it
(the spec as applied, only kubectl ever wrote spec fields), the Argo CD health check reads
every phase of the object as a live watch saw it, and /metrics moves with the run in the
operator process that saw each step (the run outlives one operator restart).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tpufinetune.core import conditions as cond
from tpufinetune.core import runmetrics
from tpufinetune_trainer.checkpoint import WRITE_THREADS

from ground_runs import (Watch, by_phase, capture, check_health, delta, jobs_of, reconciles, released,
                         holds_applied, resource, scrape, start_run)
from harness.timing import within

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]


def test_finetune_runs_to_succeeded_with_every_epoch_in_status(operator, ground, kube, ground_assets, storage,
                                                               tmp_path):
    """Model, data and checkpoints all in the ground's bucket (gs://), as on GKE. The operator
    is restarted mid-run: it reattaches without a second submission."""
    manifest = resource("tiny-finetune", ground_assets, storage, epochs=3, rows=800)
    assert all(v.startswith("gs://") for v in (manifest["spec"]["model"]["id"], manifest["spec"]["dataset"]["id"],
                                                manifest["spec"]["checkpoint"]["storagePath"]))
    metrics_before = scrape(operator)
    watch = Watch(ground.cp, kube.ns)
    uid, cluster = start_run(kube, manifest)
    created = kube.get("tpufinetune", "tiny-finetune")

    body = kube.wait_for(lambda: kube.get("raycluster", cluster), "RayCluster")
    assert body["metadata"]["ownerReferences"][0]["uid"] == uid
    assert body["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 2  # cpu topology "2": two CPU workers
    kube.wait_for(lambda: kube.status("tiny-finetune").get("phase") == "Running", "phase Running", timeout=300)
    pods = kube.pods_of(cluster)
    assert sorted(p["metadata"]["labels"]["ray.io/node-type"] for p in pods) == ["head", "worker", "worker"]
    assert all(p["spec"]["nodeName"].startswith("gke-ground-cpu-pool-") for p in pods)
    # The trainer's Ray Train workers run in the worker pods, never on the head (num-cpus 0).
    worker_ips = {p["status"]["podIP"] for p in pods if p["metadata"]["labels"]["ray.io/node-type"] == "worker"}
    (job,) = jobs_of(kube, cluster, uid)
    assert job.status in ("PENDING", "RUNNING")
    before = kube.status("tiny-finetune")["jobId"]
    # The first operator process took every step up to Running and timed apply -> RayCluster
    # and apply -> job submitted once each.
    first_process = scrape(operator)
    for phase in ("New", "Pending", "Provisioning", "Submitting"):
        assert delta(metrics_before, first_process, "tpufinetune_reconciles_total", phase=phase) >= 1, phase
    assert delta(metrics_before, first_process, "tpufinetune_apply_to_raycluster_seconds_count") == 1
    assert delta(metrics_before, first_process, "tpufinetune_apply_to_job_submitted_seconds_count") == 1
    operator.kill()
    operator.start()
    # The new process counts its own steps from 0: once it has completed two of the
    # running run's (each after its status write and its actions), any second submission
    # would be on the head.
    kube.wait_for(lambda: reconciles(operator, "Running") >= 2, "two steps of the restarted operator", timeout=120)
    assert [job.submission_id for job in jobs_of(kube, cluster, uid)] == [before]
    actors = _train_worker_ips(kube, cluster)
    assert actors and actors <= worker_ips, (actors, worker_ips)

    kube.kubectl("wait", "tpufinetune/tiny-finetune", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
    status = kube.status("tiny-finetune")
    assert status["phase"] == "Succeeded"
    assert [entry["epoch"] for entry in status["history"]] == [1, 2, 3]
    assert all(entry["loss"] > 0 and entry["tokensPerSecond"] > 0 for entry in status["history"])
    assert status["history"][-1]["loss"] < status["history"][0]["loss"]
    assert status["epochProgress"] == "3/3"
    _check_storage(ground.gcs, storage, status, tmp_path)
    assert status["jobId"] == before == f"tft-{uid}-1"
    assert status["observedGeneration"] == 1
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Succeeded"] == "True" and conditions["ClusterReady"] == "True"

    table = kube.kubectl("get", "tpufinetunes").stdout
    header = table.splitlines()[0].split()
    for column in ("NAME", "GENERATION", "TOPOLOGY", "MODE", "PHASE", "EPOCH", "LOSS", "AGE"):
        assert column in header, table
    row = table.splitlines()[1].split()
    assert row[:6] == ["tiny-finetune", "cpu", "2", "finetune", "Succeeded", "3/3"]
    assert "CHECKPOINT" in kube.kubectl("get", "tpufinetunes", "-o", "wide").stdout

    # Nothing expensive is left running.
    released(kube, ground, cluster, [p["metadata"]["uid"] for p in pods])
    _check_gitops(kube, watch, manifest, created, ground_assets, storage)
    # The restarted process saw the run end (its counters start at 0) and timed nothing
    # again: it created no RayCluster and submitted no job.
    after = scrape(operator)
    assert after.get(("tpufinetune_job_outcomes_total", (("outcome", "Succeeded"), ("reason", "Succeeded")))) == 1
    assert after.get(("tpufinetune_apply_to_raycluster_seconds_count", ()), 0) == 0
    assert after.get(("tpufinetune_apply_to_job_submitted_seconds_count", ()), 0) == 0
    assert after[("tpufinetune_resources", (("phase", "Succeeded"),))] >= 1
    # The run's own series (from the watch, so the restarted process has them), labelled by
    # namespace and name: what its final status says, one phase series.
    run = (("name", "tiny-finetune"), ("namespace", kube.ns))
    assert [key for key in after if key[0] == "tpufinetune_run_phase" and dict(key[1])["name"] == "tiny-finetune"] == [
        ("tpufinetune_run_phase", (*run, ("phase", "Succeeded")))]
    assert after[("tpufinetune_run_phase", (*run, ("phase", "Succeeded")))] == 1
    expected = runmetrics.values(kube.status("tiny-finetune"))
    for metric in ("tpufinetune_run_loss", "tpufinetune_run_eval_loss", "tpufinetune_run_epoch",
                   "tpufinetune_run_step", "tpufinetune_run_progress_ratio", "tpufinetune_run_attempts"):
        assert after[(metric, run)] == pytest.approx(expected[metric]), metric
    events = kube.kubectl("get", "events", "--field-selector", "involvedObject.name=tiny-finetune", "-o", "json").stdout
    reasons = {item["reason"] for item in json.loads(events)["items"]}
    assert {"Accepted", "ClusterReady", "JobSubmitted", "Succeeded"} <= reasons


def _check_gitops(kube, watch, manifest: dict, created: dict, ground_assets, storage: str) -> None:
    """No drift: what Argo CD compares is exactly what was applied (the API server's schema
    defaults included), and only kubectl ever wrote spec fields; Argo CD's health of every
    phase the watch saw."""
    final = json.loads(kube.kubectl("get", "tpufinetune", "tiny-finetune", "-o", "json",
                                    "--show-managed-fields").stdout)
    seen = by_phase(watch.stop(), "tiny-finetune")
    assert final["spec"] == created["spec"]
    assert holds_applied(manifest["spec"], final["spec"])
    assert final["metadata"]["generation"] == created["metadata"]["generation"] == 1
    assert set(final["metadata"].get("annotations") or {}) <= {"kubectl.kubernetes.io/last-applied-configuration"}
    spec_writers = {entry["manager"] for entry in final["metadata"]["managedFields"]
                    if "f:spec" in (entry.get("fieldsV1") or {})}
    assert spec_writers == {"kubectl-client-side-apply"}, final["metadata"]["managedFields"]
    assert {"Pending", "Provisioning", "Submitting", "Running", "Succeeded"} <= set(seen), sorted(seen)
    check_health(seen)
    capture(seen, {ground_assets.root: "gs://tpufinetune-ground/assets", storage: "gs://tpufinetune-ground/runs/gitops",
                   kube.ns: "ml-team"})


def _check_storage(gcs, storage: str, status: dict, tmp_path: Path) -> None:
    """The checkpoints and the export are objects in the bucket, read back from the emulator:
    each checkpoint holds both ranks' shards, and the export loads with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, export = status["checkpointURI"], status["exportedModelURI"]
    assert checkpoint.startswith(storage + "/") and export.startswith(storage + "/"), (checkpoint, export)
    assert export.rsplit("/", 1) == [checkpoint.rsplit("/", 1)[0], "export"], (checkpoint, export)
    shards = {name for name in gcs.list(checkpoint) if name.endswith(".distcp")}
    # Rank 0's and rank 1's, each in the writer's WRITE_THREADS files.
    assert shards == {f"__{rank}_{i}.distcp" for rank in (0, 1) for i in range(WRITE_THREADS)}, gcs.list(checkpoint)
    assert ".metadata" in gcs.list(checkpoint)
    assert json.loads(gcs.read(f"{checkpoint}/trainer_state.json"))["epoch"] in (1, 2, 3)  # the best of the three
    local = gcs.download(export, tmp_path / "export")
    assert {"config.json", "model.safetensors"} <= {p.name for p in local.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(local)
    tokenizer = AutoTokenizer.from_pretrained(local)
    assert model.num_parameters() > 0 and tokenizer("hello")["input_ids"]


def _train_worker_ips(kube, cluster: str) -> set[str]:
    """Node IPs of the live Ray Train worker actors, from the head's state API."""

    def worker_nodes():
        actors = kube.head_get(cluster, "/api/v0/actors?filter_keys=state&filter_predicates=%3D&filter_values=ALIVE&limit=1000")
        ids = {a["node_id"] for a in actors["data"]["result"]["result"]
               if "TrainWorker" in (a.get("class_name") or "") or "RayTrainWorker" in (a.get("class_name") or "")}
        return ids

    node_ids = kube.wait_for(worker_nodes, "Ray Train worker actors", timeout=300, interval=1)
    nodes = kube.head_get(cluster, "/api/v0/nodes?limit=100")["data"]["result"]["result"]
    return {n["node_ip"] for n in nodes if n["node_id"] in node_ids}


def test_collectives_check_passes_in_pods_that_carry_the_users_pod_settings(operator, kube, ground_assets, storage):
    settings = {"annotations": {"example.com/team": "ml"}, "labels": {"team": "ml"},
                "env": [{"name": "TEAM_NAME", "value": "ml"}]}
    _, cluster = start_run(kube, resource("tiny-collectives", ground_assets, storage, mode="collectives",
                                          workers=settings))
    workers = kube.wait_for(lambda: [p for p in kube.pods_of(cluster)
                                     if p["metadata"]["labels"].get("ray.io/node-type") == "worker"],
                            "worker pods", timeout=120)
    # KubeRay carried the settings from the RayCluster into the pods it made.
    for pod in workers:
        assert pod["metadata"]["annotations"]["example.com/team"] == "ml"
        assert pod["metadata"]["labels"]["team"] == "ml"
        assert {"name": "TEAM_NAME", "value": "ml"} in pod["spec"]["containers"][0]["env"]
    kube.kubectl("wait", "tpufinetune/tiny-collectives", "--for=condition=Succeeded", "--timeout=400s", timeout=420)
    status = kube.status("tiny-collectives")
    assert status["collectives"]["passed"] is True
    assert status["collectives"]["ranks"] == 2


def test_deleting_mid_run_stops_everything_and_the_finalizer_goes_within_30s(operator, ground, kube, ground_assets, storage):
    uid, cluster = start_run(kube, resource("tiny-delete", ground_assets, storage, epochs=50))
    kube.wait_for(lambda: kube.status("tiny-delete").get("epoch", 0) >= 1 or
                  kube.status("tiny-delete").get("phase") == "Running", "phase Running", timeout=300)
    pods = kube.pods_of(cluster)
    assert len(pods) == 3 and all(ground.ray_processes(p["metadata"]["uid"]) for p in pods)
    started = time.monotonic()
    kube.kubectl("delete", "tpufinetune", "tiny-delete", "--wait=false")
    kube.wait_for(lambda: kube.get("tpufinetune", "tiny-delete") is None, "finalizer removed", timeout=within(30))
    assert time.monotonic() - started < within(30)
    # The head died with its cluster, as in production; the garbage collector took the pods.
    released(kube, ground, cluster, [p["metadata"]["uid"] for p in pods])
    # A normal delete is not an error: no Error-type event was posted for it.
    events = json.loads(kube.kubectl("get", "events", "--field-selector", "involvedObject.name=tiny-delete",
                                     "-o", "json").stdout)["items"]
    assert not [e for e in events if e["type"] not in ("Normal", "Warning")], events


def test_a_problem_only_the_trainer_can_see_ends_failed_with_its_reason(operator, kube, ground_assets, storage):
    manifest = resource("tiny-baddata", ground_assets, storage, dataset={"id": f"{storage}/missing.jsonl"})
    _, cluster = start_run(kube, manifest)
    kube.kubectl("wait", "tpufinetune/tiny-baddata", "--for=condition=Failed", "--timeout=400s", timeout=420)
    status = kube.status("tiny-baddata")
    assert status["phase"] == "Failed"
    assert "missing.jsonl" in status["message"]
    failed = cond.find(status, cond.FAILED)
    assert failed["reason"] == "TrainerFailed"
    kube.wait_for(lambda: kube.get("raycluster", cluster) is None, "RayCluster released", timeout=60)
