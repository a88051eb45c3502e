"""The operator on the test ground under Ray faults: a refused token, a head killed mid-run
and then the RayCluster deleted in the same run. Deletion never waits on Ray; a head that
refuses every key of the keyring is rebuilt at once with a token of the current key; a retry
after a lost head or a lost
cluster resumes from the last checkpoint. The application crash, the lost pod and the delete
behind a dead head share the notice run (test_notice_e2e.py).

That a retry never runs beside its previous attempt is shown where that attempt is still
alive on the head (a killed head comes back with an empty job table, so it cannot be seen
here): test_ray_faults.py, test_a_retry_stops_the_previous_attempt_before_it_submits and
test_a_retry_never_overlaps_its_previous_attempt_and_leaves_no_task_behind."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from contextlib import contextmanager

import pytest

from tpufinetune.core import conditions as cond
from tpufinetune.core.raytoken import SIGNING_KEY_SECRET
from tpufinetune.settings import Settings
from ground_runs import jobs_of, operator_with, resource, running, start_run
from harness.operator_process import RESTART_BACKOFF_S
from harness.timing import within

LEASE = Settings()  # the ground runs the deployed lease timings

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]


def head_pod(kube, cluster: str) -> dict:
    return next(p for p in kube.pods_of(cluster) if p["metadata"]["labels"]["ray.io/node-type"] == "head")


def kill_head(ground, kube, cluster: str) -> None:
    """SIGKILL every Ray process of the head pod, as a crash would (the node agent then
    reports the container terminated and restarts it, as a kubelet would)."""
    uid = head_pod(kube, cluster)["metadata"]["uid"]
    pids = ground.ray_processes(uid)
    assert pids, "the head pod has no Ray process"
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def other_signing_key(ground):
    """The operator's Ray token signing key replaced by another, the old one not kept (a
    rotation done too early), restored afterwards; the operator started inside reads it."""
    secret = ["-n", "tpufinetune-system", "secret", SIGNING_KEY_SECRET]
    saved = json.loads(ground.kubectl("get", *secret, "-o", "json").stdout)["data"]
    other = base64.b64encode(b"another key, not the one the heads' tokens come from").decode()
    ground.kubectl("patch", *secret, "--type=merge", "-p", json.dumps({"data": {"key": other}}))
    try:
        yield
    finally:
        ground.kubectl("patch", *secret, "--type=merge", "-p", json.dumps({"data": saved}))


def delete_within_30s(kube, operator, name: str) -> None:
    """The finalizer is gone within the product's 30 s. When the operator stepped down
    meanwhile (it could not renew its Lease within the renew deadline: on this ground, the
    API server starved by both test lanes on two cores), the kubelet's restart, the Lease's
    lapse and the new lead are not the delete's: the 30 s then count from the restarted
    operator's lead, and the test says so."""
    started, restarts = time.monotonic(), operator.restarts
    logged = operator.log_path.stat().st_size
    led_again: list[float] = []

    def note_a_new_lead() -> None:
        if operator.restarts != restarts and not led_again:
            text = operator.log_path.read_bytes()[logged:].decode(errors="replace")
            exited = text.rfind("[harness] the operator exited")
            if exited >= 0 and "leading as" in text[exited:]:
                led_again.append(time.monotonic())

    def gone() -> bool:
        note_a_new_lead()
        return kube.get("tpufinetune", name) is None

    kube.kubectl("delete", "tpufinetune", name, "--wait=false")
    # Room for one restart: its backoff, its start, the killed one's Lease lapsing, a lead.
    room = within(30) + RESTART_BACKOFF_S + within(60) + within(LEASE.lease_duration)
    kube.wait_for(gone, f"{name}'s finalizer removed", timeout=room, details=lambda: operator.log_tail(60))
    done = time.monotonic()
    note_a_new_lead()  # a lead between the last two polls counts from the last poll
    if operator.restarts == restarts:
        assert done - started < within(30), (done - started, operator.log_tail(30))
    else:
        print(f"the operator stepped down and was restarted during the delete; the finalizer went "
              f"{done - started:.1f} s after the delete")
        since_lead = done - (led_again[0] if led_again else started)
        assert since_lead < within(30), (since_lead, operator.log_tail(30))


def test_a_refused_token_rebuilds_the_run_with_a_new_token_and_never_blocks_a_delete(
        operator, ground, kube, ground_assets, storage):
    _, refused_cluster = start_run(kube, resource("token-refused", ground_assets, f"{storage}/a", epochs=50))
    _, deleted_cluster = start_run(kube, resource("token-delete", ground_assets, f"{storage}/b", epochs=50))
    running(kube, "token-refused")
    running(kube, "token-delete")
    old_pods = {p["metadata"]["uid"] for p in kube.pods_of(refused_cluster)}
    # The signing key replaced without keeping the old one (a rotation done too early): the
    # running heads refuse every key the operator has.
    logged = operator.log_path.stat().st_size
    with operator_with(operator, other_signing_key(ground), TPUFT_RAY_UNREACHABLE_TIMEOUT="600") as restarted:
        # The restarted operator acts once it leads (the stopped one handed its Lease back):
        # the 30 s of a delete are a leading operator's (and its own step-downs, as the
        # delete counts them, are the restarted operator's, not the stopped one's).
        kube.wait_for(lambda: "leading as" in restarted.log_path.read_bytes()[logged:].decode(errors="replace"),
                      "the restarted operator leading", timeout=within(LEASE.lease_duration) + 30)
        delete_within_30s(kube, restarted, "token-delete")
        # At once (not after the unreachable bound): a new RayCluster with a token of the
        # current key, no retry used (maxRetries is 0 here).
        status = kube.wait_for(lambda: (s := kube.status("token-refused")).get("attempt") == 2 and s,
                               "token-refused rebuilt on a new RayCluster", timeout=120)
        assert not cond.find(status, cond.FAILED) and int(status.get("retries") or 0) == 0
        first = status["attempts"][0]
        assert first["reason"] == "ClusterLost", first
        assert first["message"].startswith("the Ray head refused the run's token"), first
        kube.wait_for(lambda: not old_pods & {p["metadata"]["uid"] for p in kube.pods_of(refused_cluster)},
                      "the refused cluster's pods gone", timeout=120)
        running(kube, "token-refused")  # the new head takes the new key's token
        # Gone before the old key comes back (its head would refuse again).
        kube.kubectl("delete", "tpufinetune", "token-refused", "--wait=false")
        kube.wait_for(lambda: kube.get("raycluster", deleted_cluster) is None, "the deleted run's RayCluster gone")


def test_a_killed_head_then_a_deleted_raycluster_are_each_retried_from_the_last_checkpoint(
        operator, ground, kube, ground_assets, storage):
    """Two faults in sequence on one run (maxRetries 2): its head killed mid-run (the new head
    has an empty job table: a lost job, and a lost cluster is never trusted again: attempt 2
    on a new RayCluster of the same name, from attempt 1's checkpoint),
    then, once attempt 2 runs, its RayCluster deleted by someone else (a lost job: attempt 3
    on a new cluster, from the newest checkpoint reported). The run ends Succeeded with every
    epoch once."""
    # Attempt 1's workers outlive its killed head until the operator deletes their cluster,
    # and may train and checkpoint several more epochs meanwhile (attempt 2 then resumes from
    # the newest): enough epochs that attempt 2 still has some left for the second fault.
    epochs = 8
    manifest = resource("head-killed", ground_assets, storage, epochs=epochs, rows=400, maxRetries=2)
    uid, cluster = start_run(kube, manifest)
    kube.wait_for(lambda: kube.status("head-killed").get("checkpointURI"), "a first checkpoint", timeout=400)
    assert kube.status("head-killed")["epoch"] < epochs
    kill_head(ground, kube, cluster)
    kube.wait_for(lambda: kube.status("head-killed").get("attempt") == 2, "the retry", timeout=300)
    checkpoint = kube.status("head-killed")["checkpointURI"]  # attempt 1's last one

    def retry_on_the_new_head():
        """The new head's jobs of this run, once it holds attempt 2 (the operator saw it
        running there); None while that head's dashboard does not answer yet."""
        if kube.status("head-killed").get("phase") != "Running" or kube.head_dashboard(cluster) is None:
            return None
        try:
            jobs = jobs_of(kube, cluster, uid)
        except OSError:  # a head still starting: "Failed to connect to Ray", or it closed the connection
            return None
        return jobs if any(j.submission_id == f"tft-{uid}-2" for j in jobs) else None

    jobs = kube.wait_for(retry_on_the_new_head, "attempt 2 on the new head", timeout=300, interval=1)
    assert [j.submission_id for j in jobs] == [f"tft-{uid}-2"]  # nothing else was submitted there
    assert checkpoint in jobs[0].entrypoint  # resumed from the checkpoint attempt 1 reported

    # Then, once attempt 2 wrote a checkpoint of its own, its RayCluster deleted outside the
    # operator: attempt 3 must resume from that one, not from attempt 1's.
    # A checkpoint name ends with the start that wrote it (resume.py: epoch_0002-<start>):
    # attempt 2's replay of attempt 1's epochs reports attempt 1's checkpoints again.
    def start_of(uri: str) -> str:
        return uri.rsplit("/", 1)[1].split("-", 1)[1]

    kube.wait_for(lambda: start_of(kube.status("head-killed").get("checkpointURI") or checkpoint)
                  != start_of(checkpoint), "attempt 2's first checkpoint", timeout=300)
    assert kube.status("head-killed")["epoch"] < epochs, ("the run ended before its second fault",
                                                          kube.status("head-killed")["attempts"])
    old_pods = [p["metadata"]["uid"] for p in kube.pods_of(cluster)]
    old_cluster = kube.get("raycluster", cluster)["metadata"]["uid"]
    kube.kubectl("delete", "raycluster", cluster, "--wait=false")  # someone else's delete
    # Used to fail step after step until RayUnreachable (ten minutes by default).
    at_retry = kube.wait_for(lambda: (s := kube.status("head-killed")).get("attempt") == 3 and s,
                             "the second retry", timeout=120)
    newest = at_retry["checkpointURI"]  # the last one reported before attempt 3 started: attempt 2's

    def third_on_its_head():
        """Attempt 3's job on the new cluster's head; None until that head lists it."""
        body = kube.get("raycluster", cluster)
        if body is None or body["metadata"]["uid"] == old_cluster or kube.head_dashboard(cluster) is None:
            return None
        try:
            jobs = jobs_of(kube, cluster, uid)
        except OSError:  # a head still starting: "Failed to connect to Ray", or it closed the connection
            return None
        return next((j for j in jobs if j.submission_id == f"tft-{uid}-3"), None)

    third = kube.wait_for(third_on_its_head, "attempt 3 on the new head", timeout=300, interval=1)
    assert f"--resume-from={newest}" in third.entrypoint, (newest, third.entrypoint)  # what was submitted
    assert kube.status("head-killed")["retries"] == 2
    status = kube.wait_for(lambda: (s := kube.status("head-killed")).get("phase") in ("Succeeded", "Failed") and s,
                           "the run to end", timeout=600, interval=2)
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["attempt"] == 3 and status["jobId"] == f"tft-{uid}-3"
    assert [entry["epoch"] for entry in status["history"]] == list(range(1, epochs + 1))
    first, lost, last = status["attempts"]
    # The head's restart lost attempt 1's job, the delete attempt 2's: both are ClusterLost.
    assert [a["reason"] for a in status["attempts"]] == ["ClusterLost", "ClusterLost", "Succeeded"], status["attempts"]
    # Attempt 2 was submitted with attempt 1's last reported checkpoint; the trainer takes the
    # newest complete one of the run's folder, which may be newer: attempt 1's workers outlive
    # its killed head and can finish a checkpoint no job reported (train.py resume_choice).
    def step_of(uri: str) -> int:
        """step_0000040-<start>: 40; epoch_0002-<start>: the step epoch 2 ended at (history)."""
        kind, number = uri.rsplit("/", 1)[1].split("-", 1)[0].split("_")
        return int(number) if kind == "step" else next(e["step"] for e in status["history"]
                                                        if e["epoch"] == int(number))

    reported_step = step_of(checkpoint)
    assert lost["resumedFrom"].rsplit("/", 1)[0] == checkpoint.rsplit("/", 1)[0], (checkpoint, status["attempts"])
    assert lost["resumedStep"] >= reported_step, (checkpoint, reported_step, status["attempts"])
    assert lost["resumedFrom"] == checkpoint or lost["resumedStep"] > reported_step, status["attempts"]
    assert first["lostSteps"] == max(0, first["lastStep"] - lost["resumedStep"]), status["attempts"]
    # From attempt 2's work: the checkpoint reported last, or a newer complete one that
    # attempt 2's workers finished as its cluster went (the trainer takes the newest).
    assert start_of(newest) != start_of(checkpoint), (newest, checkpoint)
    assert start_of(last["resumedFrom"]) != start_of(checkpoint), (checkpoint, status["attempts"])
    assert last["resumedStep"] >= step_of(newest), (newest, status["attempts"])
    assert last["resumedFrom"] == newest or last["resumedStep"] > step_of(newest), status["attempts"]
    assert lost["lostSteps"] == max(0, lost["lastStep"] - last["resumedStep"]), status["attempts"]
    # A lost cluster is never trusted again: each retry ran on a RayCluster of its own.
    assert len({a["rayClusterUID"] for a in (first, lost, last)}) == 3, status["attempts"]
    lost_events = [e for e in kube.items("events", "--field-selector", "involvedObject.name=head-killed")
                   if e["reason"] == "ClusterLost"]
    assert any(e["type"] == "Warning" and "deleted outside the operator" in e["message"] for e in lost_events), \
        lost_events
    assert not any(ground.ray_processes(pod) for pod in old_pods)
