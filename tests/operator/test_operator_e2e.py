"""End to end on the test ground: kubectl apply -> RayCluster -> the real KubeRay makes a
head and worker pods -> the scheduler binds them -> the node agent runs them as Ray
processes -> KubeRay reports ready -> the operator submits through the real Ray Job API at
the head's Service name -> the trainer runs for real on CPU in the worker pods -> status,
conditions, printer columns, Events -> the cluster and every Ray process are released.

The finetune run also carries what a deployment depends on: two operator replicas (the
leader SIGKILLed mid-run, the standby takes over within the Lease and reattaches without a
second submission), GitOps sees no drift after it (the spec as applied, only kubectl ever
wrote spec fields), the Argo CD health check reads every phase of the object as a live watch
saw it, and /metrics moves with the run in the operator process that saw each step. The
election rules and the elector alone are in test_leader_election.py. It also asks for
notices (spec.notify): a receiver pod that refuses twice, then accepts, gets the Succeeded
CloudEvent with the run's summary, and status.notifications records the delivery.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from cloudevents.v1.http import from_http

from tpufinetune.core import conditions as cond
from tpufinetune.core import runmetrics
from tpufinetune.settings import Settings
from tpufinetune_trainer.checkpoint import WRITE_THREADS

from harness.ground import OPERATOR_NAMESPACE, OPERATOR_PODS
from harness.nodeagent import pod_log_path
from harness.timing import within
from ground_runs import (Watch, by_phase, capture, check_health, delta, jobs_of, reconciles, released,
                         holds_applied, resource, scrape, start_run)

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

DEFAULTS = Settings()  # the ground runs the deployed defaults: 15 s lease, 2 s retry
LEASE = DEFAULTS.lease_name
# The ground shares two cores with a training run (three Ray pods, the control plane,
# KubeRay): a standby's tries and kopf's start can each lag by seconds. Takeover must still
# come within the lease duration plus one jittered retry period, times the suite's one load
# factor (harness/timing.py).


# A notice receiver as a pod's command: it listens on its pod IP (the ground's pods share
# one port space: a port of its own), refuses its first two requests with 503 and accepts
# the rest, and prints each request as a JSON line (its log is the record).
RECEIVER = """
import json, os
from http.server import BaseHTTPRequestHandler, HTTPServer
refusals = [2]
class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        code = 503 if refusals[0] > 0 else 200
        refusals[0] -= 1
        print(json.dumps({"code": code, "headers": dict(self.headers.items()), "body": body}), flush=True)
        self.send_response(code)
        self.end_headers()
    def log_message(self, *args):
        pass
server = HTTPServer((os.environ["POD_IP"], 0), Receiver)
print(json.dumps({"listening": server.server_address[1]}), flush=True)
server.serve_forever()
"""


def lease(kube) -> dict:
    return json.loads(kube.cp.kubectl("-n", OPERATOR_NAMESPACE, "get", "lease", LEASE, "-o", "json").stdout)["spec"]


def answers(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as answer:
        assert answer.status == 200, url
        return answer.read().decode()


def test_finetune_runs_to_succeeded_with_every_epoch_in_status_and_the_standby_takes_over_its_killed_leader(
        operator, ground, kube, ground_assets, trainer_assets, storage, tmp_path):
    """Model, data and checkpoints all in the ground's bucket (gs://), as on GKE. Two operator
    replicas, as deploy/ runs them: the leader is SIGKILLed mid-run and the standby takes
    over once the Lease ran out; it reattaches without a second submission. The memory plan
    is made again from the model's own config.json, as the trainer read it from the bucket."""
    kube.wait_for(lambda: lease(kube).get("holderIdentity") == OPERATOR_PODS[0], "the session's operator leads")
    # The watch first: kubectl's watch is established while the standby starts, before the
    # run exists, so it sees every phase (Pending lasts a moment).
    watch = Watch(ground.cp, kube.ns)
    # The admin's sinks: the standby, which will lead when the run ends, reads them.
    operator.env["TPUFT_NOTIFY_SINKS_FILE"] = str(_start_receiver(ground, kube, tmp_path))
    try:
        standby = ground.start_replica()
    finally:
        operator.env.pop("TPUFT_NOTIFY_SINKS_FILE")  # the first operator restarts as it was
    try:
        # A standby is healthy (Kubernetes must not restart it) and serves its metrics.
        assert json.loads(answers(f"http://127.0.0.1:{standby.port}/healthz")) == {"leader": False}
        assert "tpufinetune" in answers(standby.metrics_url)
        kube.wait_for(lambda: "standing by" in standby.log_tail(), "the replica stands by", timeout=30)
        assert lease(kube)["holderIdentity"] == OPERATOR_PODS[0]
        _finetune_with_a_takeover(operator, standby, watch, ground, kube, ground_assets, storage, tmp_path,
                                  json.loads((trainer_assets.model / "config.json").read_text()))
        assert "leading as" in standby.log_tail(200)
    finally:
        # A clean stop releases the Lease: the session's operator leads again at its
        # first try instead of after a lease duration.
        standby.stop()
        given_back = time.monotonic()
        if operator.proc.poll() is not None:  # killed below (not when the test failed earlier)
            operator.start()
        kube.wait_for(lambda: lease(kube).get("holderIdentity") == OPERATOR_PODS[0],
                      "the session's operator leads again", timeout=3 * DEFAULTS.lease_duration, interval=0.2)
        back = time.monotonic() - given_back
    assert standby.proc.returncode == 0
    assert back < DEFAULTS.lease_duration, back  # the release, not the expiry


def _finetune_with_a_takeover(operator, standby, watch, ground, kube, ground_assets, storage, tmp_path,
                              model_config: dict) -> None:
    manifest = resource("tiny-finetune", ground_assets, storage, epochs=3, rows=800)
    manifest["spec"]["notify"] = [{"sink": "receiver", "events": ["Succeeded", "AttemptEnded"]}]
    assert all(v.startswith("gs://") for v in (manifest["spec"]["model"]["id"], manifest["spec"]["dataset"]["id"],
                                                manifest["spec"]["checkpoint"]["storagePath"]))
    metrics_before = scrape(operator)
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
    assert reconciles(standby, "Running") == 0  # standing by: it took no step

    transitions = lease(kube).get("leaseTransitions", 0)
    operator.kill()  # SIGKILL: no release, the Lease is left to run out
    killed = time.monotonic()
    kube.wait_for(lambda: lease(kube).get("holderIdentity") == OPERATOR_PODS[1],
                  "the standby holds the Lease", timeout=3 * DEFAULTS.lease_duration, interval=0.2)
    took = time.monotonic() - killed
    assert lease(kube)["leaseTransitions"] == transitions + 1
    # Not before the lease ran out (as the standby watched it: the leader's last renewal was
    # up to one retry period before the kill), and not long after.
    assert took >= DEFAULTS.lease_duration - DEFAULTS.retry_period * 1.2, took
    assert took <= within(DEFAULTS.lease_duration + DEFAULTS.retry_period * 1.2), took
    print(f"takeover {took:.1f} s after SIGKILL (lease {DEFAULTS.lease_duration:g} s, "
          f"retry {DEFAULTS.retry_period:g} s)")
    # The new leader counts its own steps from 0: once it has completed two of the running
    # run's (each after its status write and its actions), any second submission would be
    # on the head.
    kube.wait_for(lambda: reconciles(standby, "Running") >= 2, "two steps of the new leader", timeout=120)
    assert [job.submission_id for job in jobs_of(kube, cluster, uid)] == [before]
    actors = _train_worker_ips(kube, cluster)
    assert actors and actors <= worker_ips, (actors, worker_ips)

    kube.kubectl("wait", "tpufinetune/tiny-finetune", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
    status = kube.status("tiny-finetune")
    assert status["phase"] == "Succeeded"
    assert status["attempt"] == 1
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
    _check_startup(kube, status)

    # Nothing expensive is left running.
    released(kube, ground, cluster, [p["metadata"]["uid"] for p in pods])
    _check_gitops(kube, watch, manifest, created, ground_assets, storage)
    # The new leader saw the run end (its counters start at 0) and timed nothing again: it
    # created no RayCluster and submitted no job.
    after = scrape(standby)
    assert after.get(("tpufinetune_job_outcomes_total", (("outcome", "Succeeded"), ("reason", "Succeeded")))) == 1
    assert after.get(("tpufinetune_apply_to_raycluster_seconds_count", ()), 0) == 0
    assert after.get(("tpufinetune_apply_to_job_submitted_seconds_count", ()), 0) == 0
    assert after[("tpufinetune_resources", (("phase", "Succeeded"),))] >= 1
    # The run's own series (from the watch, so the new leader has them), labelled by
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
    # A bucket path is not in the planner's table: planned from its config.json once read.
    own = model_config.get("text_config") or model_config
    assert status["plan"]["basis"] == "config" and "config.json" in status["plan"]["widthsFrom"], status["plan"]
    assert (status["plan"]["modelConfig"]["hiddenSize"], status["plan"]["modelConfig"]["numHiddenLayers"]) == (
        own["hidden_size"], own["num_hidden_layers"])
    assert "PlannedFromModelConfig" in reasons
    _check_notices(ground, kube, uid)


def _check_startup(kube, status: dict) -> None:
    """Where the attempt's time before its first step went (status.attempts[].startup): the
    operator's figures from the attempt's start in the order they happen, the trainer's
    stages in theirs (no compile stage on cpu), and the wide listing's column."""
    (entry,) = status["attempts"]
    startup = entry["startup"]
    stages = startup["trainer"]
    assert 0 <= stages["dataReadySeconds"] <= stages["workersReadySeconds"] <= stages["modelLoadedSeconds"] \
        <= stages["firstStepSeconds"], startup
    assert "firstStepCompiledSeconds" not in stages, startup
    assert 0 < startup["clusterReadySeconds"] <= startup["jobSubmittedSeconds"] <= startup["driverStartedSeconds"] \
        <= startup["firstStepSeconds"], startup
    ran = cond.parse_time(entry["endTime"]) - cond.parse_time(entry["startTime"])
    assert startup["firstStepSeconds"] < ran.total_seconds(), (startup, entry)
    wide = kube.kubectl("get", "tpufinetunes", "-o", "wide").stdout
    header, row = wide.splitlines()[0], wide.splitlines()[1]
    column = header.index("FIRST STEP (S)")
    assert float(row[column:].split()[0]) == pytest.approx(startup["firstStepSeconds"]), wide


def _receiver_lines(ground, kube) -> list[dict]:
    path = pod_log_path(ground.workdir, kube.ns, "notice-receiver")
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _start_receiver(ground, kube, tmp_path: Path) -> Path:
    """The receiver pod, and the operator's sinks file naming it (type cloudevents, binary)."""
    kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "notice-receiver"}, "spec": {
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [{
            "name": "main", "image": "python:3.11", "command": ["python", "-c", RECEIVER],
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}]}})
    port = kube.wait_for(lambda: next((line["listening"] for line in _receiver_lines(ground, kube)
                                       if "listening" in line), None), "the receiver listens", timeout=90)
    ip = kube.get("pod", "notice-receiver")["status"]["podIP"]
    sinks = tmp_path / "sinks.yaml"
    sinks.write_text(json.dumps({"sinks": [{"name": "receiver", "type": "cloudevents",
                                            "url": f"http://{ip}:{port}/events", "namespaces": [kube.ns]}]}))
    return sinks


def _check_notices(ground, kube, uid: str) -> None:
    """Both notices delivered through two refusals, each once, and recorded in status."""
    def settled():
        records = kube.status("tiny-finetune").get("notifications") or []
        return records if len(records) == 2 and all(r["state"] == "Delivered" for r in records) else None
    records = kube.wait_for(settled, "both notices delivered", timeout=120)
    assert {(r["event"], r["attempt"], r["sink"]) for r in records} == {("Succeeded", 1, "receiver"),
                                                                     ("AttemptEnded", 1, "receiver")}
    assert sum(r["tries"] for r in records) == 4  # two refused, then one delivery each
    got = [line for line in _receiver_lines(ground, kube) if "code" in line]
    # The operator's requests, as the receiver saw them: four (none after a delivery), and
    # each refused notice sent again under its one id (a receiver dedupes by it).
    assert len(got) == 4, got
    sent = [from_http(line["headers"], line["body"])["id"] for line in got]
    accepted = [from_http(line["headers"], line["body"]) for line in got if line["code"] == 200]
    assert set(sent) == {event["id"] for event in accepted} and len(accepted) == 2, (sent, got)
    assert sorted(event["type"] for event in accepted) == ["tpufinetune.dev.attempt.ended",
                                                           "tpufinetune.dev.run.succeeded"]
    succeeded = next(event for event in accepted if event["type"].endswith("succeeded"))
    status = kube.status("tiny-finetune")
    assert succeeded["id"] == f"{uid}.Succeeded.1"
    assert succeeded["source"] == f"/apis/tpufinetune.dev/v1alpha1/namespaces/{kube.ns}/tpufinetunes/tiny-finetune"
    assert succeeded["subject"] == "tiny-finetune" and succeeded["time"] == status["completionTime"]
    summary = succeeded.data
    assert (summary["phase"], summary["reason"], summary["attempt"], summary["uid"]) == (
        "Succeeded", cond.find(status, "Succeeded")["reason"], 1, uid)
    assert summary["loss"] == status["loss"] and summary.get("evalLoss") == status.get("evalLoss")
    assert summary.get("chipHours") == (status.get("usage") or {}).get("chipHours")
    assert summary["checkpointURI"] == status["checkpointURI"]
    assert summary["exportedModelURI"] == status["exportedModelURI"]
    assert summary.get("logsURI") == status["attempts"][-1].get("logsURI")
    kube.kubectl("delete", "pod", "notice-receiver", "--wait=false", check=False)


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
    # The driver (head pod) published its prepared examples for the workers on other nodes:
    # one complete entry, its marker beside its files.
    published = gcs.list(f"{checkpoint.rsplit('/', 1)[0]}/data")
    (entry,) = {name.split("/")[0] for name in published}
    assert {f"{entry}/{name}" for name in ("meta.json", "train.tokens", "train.labels", "train.offsets")} \
        <= set(published), published
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
