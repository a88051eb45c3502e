"""Faults and notices in sequence on one cpu run (gs:// storage), each its own attempt:
- the trainer's driver killed (an application crash on a healthy slice): attempt 2 runs on the
  same RayCluster, from the last checkpoint;
- GKE's maintenance label on a node of the run: the operator asks the trainer for a
  checkpoint now, and training goes on;
- a worker pod of slice 1 (the run has two slices) deleted mid-epoch with a 30 s grace (the
  cloud taking a host): its preStop hook has the trainer save the step before the pod goes,
  the attempt's message names the slice, and attempt 3, on a rebuilt RayCluster (later than
  the same-cluster retry), resumes both slices from that very step;
- the kept cluster's head killed, then the run deleted: the delete never waits on Ray.
(training.targetEvalLoss through the operator is the end of the Spot run in
test_node_failures_e2e.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import pytest

from tpufinetune.core import conditions as cond
from tpufinetune.core.sizing import REPLICA_INDEX_LABEL
from tpufinetune_trainer.events import parse_text
from ground_runs import events_of_attempt, jobs_of, released, resource, start_run, workers
from harness.controlplane import TEST_USER
from harness.timing import within

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"


def training(kube, cluster: str, uid: str, attempt: int) -> None:
    """The attempt's workers are stepping (its plan is out)."""
    kube.wait_for(lambda: any(e.kind == "plan" for e in events_of_attempt(kube, cluster, uid, attempt)),
                  f"attempt {attempt}'s plan", timeout=300, interval=1)


def head_pod(kube, cluster: str) -> dict:
    return next(p for p in kube.pods_of(cluster) if p["metadata"]["labels"]["ray.io/node-type"] == "head")


def note_ready(kube, cluster: str, seen: dict) -> None:
    """Each worker pod's Ready time, as the pod's condition says."""
    for p in workers(kube, cluster):
        ready = next((c for c in (p.get("status") or {}).get("conditions") or []
                      if c["type"] == "Ready" and c["status"] == "True"), None)
        if ready:
            seen.setdefault(p["metadata"]["uid"], cond.parse_time(ready["lastTransitionTime"]))


def retry_to_running(kube, name: str, attempt: int) -> float:
    """Seconds from the previous attempt's end to `attempt` Running (both from the status)."""
    status = kube.wait_for(lambda: (s := kube.status(name)).get("phase") == "Running"
                           and s.get("attempt") == attempt and s, f"{name}: attempt {attempt} Running",
                           timeout=400, interval=1)
    ended = cond.parse_time(status["attempts"][attempt - 2]["endTime"])
    return (cond.parse_time(status["phaseTransitionTime"]) - ended).total_seconds()


def logs_argv(kube, *args: str) -> list[str]:
    """`tpufinetune logs notice` as the test user, who may only `get` TPUFineTunes here."""
    return [sys.executable, "-m", "tpufinetune.cli", "logs", "notice", "-n", kube.ns,
            "--kubeconfig", str(kube.cp.user_kubeconfig), *args]


def logs_env(ground) -> dict:
    return {**os.environ, "STORAGE_EMULATOR_HOST": ground.gcs.endpoint}  # the bucket, as the trainer reaches it


def shipped_events(ground, logs_uri: str, stream: str) -> list:
    """The events of one stream of an attempt's logs in the bucket, read as the trainer ships them."""
    probe = ("import sys\nfrom tpufinetune_trainer.logship import StreamReader\n"
             "sys.stdout.buffer.write(b''.join(StreamReader(sys.argv[1], sys.argv[2]).read()))\n")
    read = subprocess.run([sys.executable, "-c", probe, logs_uri, stream], capture_output=True, env=logs_env(ground),
                          timeout=60)
    return parse_text(read.stdout.decode("utf-8", errors="replace"))


def only_get_tpufinetunes(kube) -> None:
    kube.kubectl("create", "role", "logs-reader", "--verb=get", "--resource=tpufinetunes.tpufinetune.dev")
    kube.kubectl("create", "rolebinding", "logs-reader", "--role=logs-reader", f"--user={TEST_USER}")


class Following:
    """`tpufinetune logs --follow` running: its lines as they come, with when they came."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def test_a_crash_maintenance_then_a_deleted_worker_each_get_their_attempt_and_the_last_retry_loses_no_step(
        operator, ground, kube, ground_assets, storage):
    # ttlSecondsAfterFinished keeps the head after the end, to read attempt 3's log. Every
    # checkpoint is kept: with the default of one, Ray Train deletes the notice's checkpoint
    # (reported without an evaluation, so ranked last) once the epoch's next one completes,
    # which can come before the bucket is looked at below.
    every = 4  # steps between checkpoints: the crash has one to resume from early
    # 160 steps: the three faults come within the first ~60 (about 40 s of training here),
    # and the last attempt trains the rest (about 60 s; 110 s at 6 epochs, 190 s at 10).
    # Two slices of one host each (HSDP, the same two devices and global batch as one slice
    # of two): the deleted worker below is slice 1's, and the run resumes as a whole.
    manifest = resource("notice", ground_assets, storage, epochs=4, rows=640, maxRetries=2,
                        tpu={"topology": "1", "slices": 2},
                        terminationGracePeriodSeconds=30, ttlSecondsAfterFinished=300,
                        checkpoint={"keep": 100}, training={"checkpointEverySteps": every})
    uid, cluster = start_run(kube, manifest)
    cluster_uid = kube.wait_for(lambda: (kube.get("raycluster", cluster) or {}).get("metadata", {}).get("uid"),
                                "the RayCluster")
    ready_at: dict = {}  # the first RayCluster's worker pods: when each was Ready

    # 1. The driver dies (every pod stays Ready): attempt 2 on the same RayCluster.
    kube.wait_for(lambda: (note_ready(kube, cluster, ready_at), kube.status("notice").get("checkpointURI"))[1],
                  "a first checkpoint", timeout=400, interval=1)
    checkpoint = kube.status("notice")["checkpointURI"]
    # A worker's log is shipped every few seconds (logship.FLUSH_S), and the crash kills the
    # workers with the driver: it comes once attempt 1's shipped worker log holds its plan,
    # which the end of this test reads again, through `tpufinetune logs`, after attempt 1's
    # cluster is gone. Read here from the bucket (the test user may not read the run yet).
    logs_uri = kube.status("notice")["attempts"][0]["logsURI"]
    kube.wait_for(lambda: any(e.kind == "plan" for e in shipped_events(ground, logs_uri, "worker-0")),
                  "attempt 1's shipped worker log to hold its plan event", timeout=60, interval=2)
    driver = kube.head_job_client(cluster).get_job_info(f"tft-{uid}-1").driver_info
    os.kill(int(driver.pid), signal.SIGKILL)
    crashed_at = datetime.now(timezone.utc)
    reuse = retry_to_running(kube, "notice", 2)
    crashed = kube.status("notice")["attempts"][0]
    assert crashed["reason"] == "AppFailed" and "log tail:" in crashed["message"], crashed
    assert crashed["rayClusterUID"] == cluster_uid
    events = kube.items("events", "--field-selector", "involvedObject.name=notice")
    assert any(e["reason"] == "AttemptFailed" and "AppFailed" in e["message"] for e in events)
    training(kube, cluster, uid, 2)
    # The steps lost to the crash, from the trainer's own words: the last step attempt 1's job
    # reported, less the step attempt 2 restored. The restored one can be newer than any step
    # reported: the workers outlive their killed driver a moment, and a checkpoint they finish
    # then is the run directory's newest (none lost).
    reported = max(e["step"] for e in events_of_attempt(kube, cluster, uid, 1)
                   if e.kind in ("progress", "epoch", "checkpoint", "notice") and isinstance(e.get("step"), int))
    restored = next(e for e in events_of_attempt(kube, cluster, uid, 2) if e.kind == "plan")["resumed_step"]
    assert restored, restored
    crashed, second = kube.wait_for(lambda: (a := kube.status("notice")["attempts"])[1].get("resumedStep") and a[:2],
                                    "attempt 2's restored step in status")
    assert second["resumedStep"] == restored, second
    assert (crashed["lastStep"], crashed["lostSteps"]) == (reported, max(0, reported - restored)), crashed

    # 2. Maintenance scheduled on a node of the run.
    node = workers(kube, cluster)[0]["spec"]["nodeName"]
    when = str(int(time.time()) + 3600)
    labelled = time.monotonic()
    ground.kubectl("label", "node", node, f"{MAINTENANCE_LABEL}={when}")
    try:
        kube.wait_for(lambda: (kube.status("notice").get("notice") or {}).get("requestedBy") == "Maintenance",
                      "a checkpoint on notice", timeout=120, interval=0.5)
        saved_s = time.monotonic() - labelled
    finally:
        ground.kubectl("label", "node", node, f"{MAINTENANCE_LABEL}-")
    status = kube.status("notice")
    assert status["phase"] == "Running" and status["attempt"] == 2  # the request stopped nothing
    assert status["maintenance"]["nodes"] == [node] and status["maintenance"]["requests"] == 1
    assert status["notice"]["reason"] == "Requested" and node in status["notice"]["detail"]
    assert ground.gcs.list(status["notice"]["checkpointURI"])
    # The operator's poll (woken by the node watch at once), the request job's start on the
    # head, the trainer's next read (1 s) and one step: generous for two slow cores.
    assert saved_s < 90, saved_s
    request_jobs = [j.submission_id for j in jobs_of(kube, cluster, uid) if "checkpoint" in j.submission_id]
    assert request_jobs == [f"tft-{uid}-2-checkpoint-1"]

    # 3. Slice 1's worker pod deleted (as the cloud takes a host), mid-epoch.
    victim = next(p["metadata"]["name"] for p in workers(kube, cluster)
                  if p["metadata"]["labels"].get(REPLICA_INDEX_LABEL) == "1")
    deleted = time.monotonic()
    kube.kubectl("delete", "pod", victim, "--grace-period=30", "--wait=true", timeout=90)
    gone_s = time.monotonic() - deleted
    assert gone_s < within(30), gone_s  # the hook returned once the step was saved, before the grace ran out

    second = kube.head_job_client(cluster).get_job_logs(f"tft-{uid}-2")
    notices = [e for e in parse_text(second) if e.kind == "notice"]
    assert notices, second[-6000:]
    notice = notices[-1]  # the driver's, from the failure (rank 0's may have gone with its pod)
    assert notice["reason"] == "SIGTERM" and notice["step"] >= 1
    assert ground.gcs.list(notice["uri"]), notice["uri"]  # the step's shards are in the bucket
    rebuild = retry_to_running(kube, "notice", 3)
    print(f"\nretry to Running: same RayCluster {reuse:.0f} s, rebuilt {rebuild:.0f} s")
    assert reuse < rebuild, (reuse, rebuild)
    # The logs of the running attempt, followed from the bucket while it writes them.
    only_get_tpufinetunes(kube)
    following = Following(logs_argv(kube, "--follow"), logs_env(ground))
    follow_started = time.monotonic()
    try:
        kube.wait_for(lambda: following.lines or following.proc.poll() is not None,
                      "tpufinetune logs --follow to print", timeout=60, interval=0.5)
        first_line_at = time.monotonic()
        assert following.lines, following.proc.stderr.read()
        assert kube.status("notice")["phase"] == "Running" and following.proc.poll() is None
        status = kube.wait_for(lambda: (s := kube.status("notice")).get("phase") in ("Succeeded", "Failed") and s,
                               "the run to end", timeout=600)
        assert following.proc.wait(60) == 0, following.proc.stderr.read()
    finally:
        following.proc.kill()
    following.reader.join(10)
    streamed = following.text()
    print(f"logs --follow: first line {first_line_at - follow_started:.1f} s after attempt 3 was Running, "
          f"{len(following.lines)} lines until the end")
    assert "Training completed!" in streamed, streamed[-3000:]  # the driver's last lines, followed to the end
    assert sum(1 for at, _ in following.lines if at - first_line_at > 20) > 0  # lines kept coming, not one read
    # Attempt 1's RayCluster is gone (attempt 3 runs on a rebuilt one): its logs are still read.
    assert kube.get("raycluster", cluster)["metadata"]["uid"] != cluster_uid
    first = subprocess.run(logs_argv(kube, "--attempt", "1"), capture_output=True, text=True, env=logs_env(ground),
                           timeout=60)
    assert first.returncode == 0 and "Starting Ray Train FSDP2 SFT job" in first.stdout, first.stderr or first.stdout
    worker = subprocess.run(logs_argv(kube, "--attempt", "1", "--worker", "0"), capture_output=True, text=True,
                            env=logs_env(ground), timeout=60)
    assert worker.returncode == 0 and any(e.kind == "plan" for e in parse_text(worker.stdout)), worker.stdout[-3000:]
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["attempt"] == 3 and status["notice"]["step"] == notice["step"]
    plan = next(e for e in events_of_attempt(kube, cluster, uid, 3) if e.kind == "plan")
    assert plan["resumed_from"] == notice["uri"]
    assert notice["step"] - plan["resumed_step"] == 0  # lost steps
    # The attempts say the same: an app failure resumed on the same cluster, then a
    # preemption resumed from the notice's checkpoint on a rebuilt one, at most one step lost
    # (the one in flight when the notice came, if it was not finished).
    crashed, preempted, last = status["attempts"]
    # From the last checkpoint attempt 1 reported: the one seen before the kill, or a later one.
    resumed, seen = preempted["resumedFrom"].rsplit("/", 1), checkpoint.rsplit("/", 1)
    assert resumed[0] == seen[0] and resumed[1] >= seen[1], (resumed, seen)
    assert preempted["rayClusterUID"] == cluster_uid != last["rayClusterUID"], status["attempts"]
    # The pod is gone when the operator looks: it names it, or its replacement.
    assert preempted["reason"] == "Preempted", preempted
    assert victim in preempted["message"] or "was replaced" in preempted["message"], preempted
    assert "of slice 1" in preempted["message"], preempted  # the lost host's slice is named
    # Attempt 3 ran both slices again, from the one checkpoint.
    assert "HSDP over 2 slices" in kube.head_job_client(cluster).get_job_logs(f"tft-{uid}-3")
    assert last["reason"] == "Succeeded" and last["resumedFrom"] == notice["uri"]
    assert preempted["lostSteps"] <= 1, preempted
    wide = kube.kubectl("get", "tpufinetunes", "notice", "-o", "wide").stdout.splitlines()
    assert wide[1][wide[0].index("ATTEMPTS"):].split()[0] == "3", wide  # kubectl aligns columns
    reasons = [e["reason"] for e in kube.items("events") if e["involvedObject"]["name"] == "notice"]
    assert "Maintenance" in reasons and reasons.count("CheckpointOnNotice") >= 2, reasons
    # Host-hours of attempt 1: its two worker pods, from Ready (as the pods say) to the crash
    # (as the test made it), and the operator's notice of the failed job: a poll and a step.
    assert len(ready_at) == 2, ready_at
    pods_lived = sum((crashed_at - ready).total_seconds() for ready in ready_at.values()) / 3600
    usage = crashed["usage"]
    assert usage["chipHours"] == 0 and usage["provisioningSeconds"] > 0, usage
    noticed = 2 * 20 / 3600  # two hosts, up to 20 s after the crash
    assert pods_lived * 0.9 <= usage["hostHours"] <= pods_lived * 1.1 + noticed, (usage, pods_lived)

    # 4. The kept cluster's head dies; deleting the run then never waits on Ray: the
    # finalizer goes within 30 s and every pod and Ray process of the slice is released.
    pods = kube.pods_of(cluster)
    uid_of_head = head_pod(kube, cluster)["metadata"]["uid"]
    for pid in ground.ray_processes(uid_of_head):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    started = time.monotonic()
    kube.kubectl("delete", "tpufinetune", "notice", "--wait=false")
    kube.wait_for(lambda: kube.get("tpufinetune", "notice") is None, "notice's finalizer removed", timeout=within(30))
    assert time.monotonic() - started < within(30)
    released(kube, ground, cluster, [p["metadata"]["uid"] for p in pods])
    # Every attempt links its logs, beside the run's checkpoints.
    run_dir = f"{storage}/tft-notice-{uid.split('-')[0]}"
    assert [a.get("logsURI") for a in status["attempts"]] == [f"{run_dir}/logs/attempt-{n}" for n in (1, 2, 3)], \
        status["attempts"]

