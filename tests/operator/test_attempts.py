"""status.attempts and status.usage, pure: each attempt's reason (from what the operator
observed), its log tail, its lost steps and its cost; a retry that keeps a healthy slice."""

from datetime import timedelta

import pytest

from tpufinetune.core import attempts, phases
from tpufinetune.core.phases import ClusterView, JobView, Plan, QueueView
from tpufinetune.core.podstatus import HEALTHY, SliceHealth, hosts_ready_since, slice_health
from tpufinetune.core.status import checked_status

from phase_helpers import ENDED, READY, T0, V6E, at, running_with_slice, step

FAILURE = ({"event": "failure", "type": "RuntimeError", "message": "boom"},)


def test_a_run_that_succeeds_has_one_attempt_with_its_cost():
    status = running_with_slice()
    (entry,) = status["attempts"]
    assert entry["attempt"] == 1 and entry["startTime"] == "2026-01-01T12:00:00Z" and "endTime" not in entry
    assert entry["sliceReadyTime"] == "2026-01-01T12:10:00Z" and entry["rayClusterUID"] == "rc-uid-1"
    d = step(status, plan=V6E, now=at(70), cluster=READY, job=JobView("SUCCEEDED"))
    (entry,) = d.status["attempts"]
    assert (entry["reason"], entry["endTime"], entry["lostSteps"]) == ("Succeeded", "2026-01-01T13:10:00Z", 0)
    assert entry["sliceReleaseTime"] == "2026-01-01T13:10:00Z"  # ttl 0: deleted at once
    # 16 chips x 1 h held; 4 hosts x 1 h; 10 min waiting for the slice.
    assert entry["usage"] == {"chipHours": 16.0, "hostHours": 4.0, "provisioningSeconds": 600.0}
    assert d.status["usage"] == entry["usage"]
    assert checked_status(d.status) is d.status
    # Later steps (the cluster still going) change nothing: the cost is final.
    assert step(d.status, plan=V6E, now=at(90), cluster=READY).status["usage"] == entry["usage"]


def test_usage_is_brought_up_to_date_with_a_change_not_with_every_idle_step():
    status = step(running_with_slice(), plan=V6E, now=at(20), cluster=READY, job=JobView("RUNNING")).status
    idle = step(status, plan=V6E, now=at(40), cluster=READY, job=JobView("RUNNING"))
    assert idle.status == status  # nothing to write while nothing else changed
    moved = step(status, plan=V6E, now=at(40), cluster=READY, job=JobView("RUNNING"),
                 events=({"event": "progress", "step": 3, "total_steps": 10},))
    assert moved.status["usage"]["chipHours"] == 8.0  # 16 chips x 30 min
    assert moved.status["attempts"][0]["lastStep"] == 3


def test_an_app_failure_on_a_healthy_slice_retries_on_the_same_raycluster_with_its_log_tail():
    status = running_with_slice()
    events = ({"event": "progress", "step": 7, "total_steps": 20},
              {"event": "checkpoint", "epoch": 1, "step": 5, "uri": "gs://b/run/step_0000005", "epoch_end": False},
              *FAILURE)
    d = step(status, plan=V6E, now=at(40), cluster=READY, job=JobView("FAILED"), events=events)
    assert d.phase == phases.RUNNING and phases.ReadSliceHealth("2026-01-01T12:10:00Z") in d.actions
    d = step(status, plan=V6E, now=at(40), cluster=READY, job=JobView("FAILED"), events=events,
             log_tail="Traceback ... | RuntimeError: boom", slice_health=HEALTHY)
    assert d.phase == phases.SUBMITTING and not any(isinstance(a, phases.DeleteCluster) for a in d.actions)
    first, second = d.status["attempts"]
    assert first["reason"] == "AppFailed" and "RuntimeError: boom" in first["message"]
    assert "log tail: Traceback" in first["message"]
    assert first["sliceReleaseTime"] == second["startTime"] == second["sliceReadyTime"]  # handed over
    assert second["rayClusterUID"] == first["rayClusterUID"] == "rc-uid-1"
    assert first["usage"] == {"chipHours": 8.0, "hostHours": 2.0, "provisioningSeconds": 600.0}
    event = [a for a in d.actions if isinstance(a, phases.RecordEvent) and a.reason == "AttemptFailed"]
    assert event and "AppFailed" in event[0].message and "Traceback" in event[0].message
    # The retry is submitted from the checkpoint; attempt 1 lost the steps after it.
    d = step(d.status, plan=V6E, now=at(41), cluster=READY, job=None)
    assert d.actions == [phases.SubmitJob("tft-uid-1-2", 2)]
    first, second = d.status["attempts"]
    assert second["resumedFrom"] == "gs://b/run/step_0000005" and first["lostSteps"] == 2
    assert "usage" in second and second["usage"]["provisioningSeconds"] == 0.0
    assert checked_status(d.status) is d.status


def test_lost_steps_are_counted_from_the_step_the_retry_restored_not_the_last_one_reported():
    """The retry restores the run directory's newest complete checkpoint, which can be newer
    than the last one attempt 1's driver reported (a save that landed after the driver died):
    its trainer's first plan says which step, and no step was lost."""
    status = running_with_slice()
    events = ({"event": "progress", "step": 7, "total_steps": 20},
              {"event": "checkpoint", "epoch": 1, "step": 5, "uri": "gs://b/run/step_0000005", "epoch_end": False},
              *FAILURE)
    step(status, plan=V6E, now=at(40), cluster=READY, job=JobView("FAILED"), events=events)
    d = step(status, plan=V6E, now=at(40), cluster=READY, job=JobView("FAILED"), events=events,
             log_tail="RuntimeError: boom", slice_health=HEALTHY)
    d = step(d.status, plan=V6E, now=at(41), cluster=READY, job=None)
    d = step(d.status, plan=V6E, now=at(41), cluster=READY, job=JobView("RUNNING"))
    assert d.status["attempts"][0]["lostSteps"] == 2  # from the checkpoint reported, for now
    plan = {"event": "plan", "total_steps": 20, "resumed_step": 8, "resumed_from": "gs://b/run/step_0000008"}
    d = step(d.status, plan=V6E, now=at(42), cluster=READY, job=JobView("RUNNING"), events=(plan,))
    first, second = d.status["attempts"]
    assert (second["resumedStep"], second["resumedFrom"]) == (8, "gs://b/run/step_0000008")
    assert first["lostSteps"] == 0
    # A worker group restarted inside the job plans again from a later step: that is the
    # second attempt's own loss, not a change to the first's.
    later = {"event": "plan", "total_steps": 20, "resumed_step": 12, "resumed_from": "gs://b/run/step_0000012"}
    d = step(d.status, plan=V6E, now=at(43), cluster=READY, job=JobView("RUNNING"),
             events=({"event": "progress", "step": 10, "total_steps": 20}, later))
    first, second = d.status["attempts"]
    assert (second["resumedStep"], first["lostSteps"]) == (8, 0)
    assert checked_status(d.status) is d.status


def test_a_retry_that_starts_afresh_loses_every_step_of_the_attempt_before():
    status = running_with_slice()
    events = ({"event": "progress", "step": 7, "total_steps": 20}, *FAILURE)
    d = step(status, plan=V6E, now=at(40), cluster=READY, job=JobView("FAILED"), events=events,
             log_tail="RuntimeError: boom", slice_health=HEALTHY)
    d = step(d.status, plan=V6E, now=at(41), cluster=READY, job=None)
    d = step(d.status, plan=V6E, now=at(41), cluster=READY, job=JobView("RUNNING"))
    d = step(d.status, plan=V6E, now=at(42), cluster=READY, job=JobView("RUNNING"),
             events=({"event": "plan", "total_steps": 20, "resumed_step": None, "resumed_from": None},))
    first, second = d.status["attempts"]
    assert (second["resumedStep"], first["lostSteps"]) == (0, 7)


@pytest.mark.parametrize("health, reason", [
    (SliceHealth(False, "Preempted", "pod demo-rc-worker-1 was deleted"), "Preempted"),
    (SliceHealth(False, "NodeLost", "node n1 of pod w is gone"), "NodeLost"),
    (SliceHealth(False, "Maintenance", "node n1 has maintenance scheduled"), "Maintenance"),
    (SliceHealth(False, "", "pod demo-rc-worker-0 is not Ready"), "AppFailed"),
])
def test_a_slice_that_lost_a_pod_or_is_not_well_is_rebuilt_for_the_retry(health, reason):
    d = step(running_with_slice(), plan=V6E, now=at(40), cluster=READY, job=JobView("FAILED"), events=FAILURE,
             log_tail="(tail)", slice_health=health)
    assert d.phase == phases.PENDING and phases.DeleteCluster("demo-rc") in d.actions
    first, second = d.status["attempts"]
    assert first["reason"] == reason and health.detail in first["message"]
    assert first["sliceReleaseTime"] == "2026-01-01T12:40:00Z"
    assert second["startTime"] == "2026-01-01T12:40:00Z" and "sliceReadyTime" not in second


def test_a_spec_that_changes_the_cluster_rebuilds_even_after_an_app_failure():
    edited = Plan(**{**V6E.__dict__, "cluster_hash": "other"})
    d = step(running_with_slice(), plan=edited, now=at(40), cluster=READY, job=JobView("FAILED"), events=FAILURE, **ENDED)
    assert d.phase == phases.PENDING and phases.DeleteCluster("demo-rc") in d.actions
    assert d.status["attempts"][0]["reason"] == "AppFailed"


def test_a_job_the_head_lost_or_someone_stopped_is_not_an_app_failure():
    d = step(running_with_slice(), plan=V6E, now=at(40), cluster=READY, job=None, slice_health=HEALTHY)
    assert d.status["attempts"][0]["reason"] == "ClusterLost"
    d = step(running_with_slice(), plan=V6E, now=at(40), cluster=READY, job=JobView("STOPPED"), **ENDED)
    assert d.status["attempts"][0]["reason"] == "Stopped"


def test_every_way_an_attempt_ends_has_its_reason():
    no_retry = Plan(**{**V6E.__dict__, "max_retries": 0})
    deadline = Plan(**{**no_retry.__dict__, "active_deadline": timedelta(minutes=30)})
    d = step(running_with_slice(deadline), plan=deadline, now=at(31), cluster=READY, job=JobView("RUNNING"))
    assert d.status["attempts"][-1]["reason"] == "DeadlineExceeded"
    d = step(running_with_slice(no_retry), plan=no_retry, now=at(40), cluster=ClusterView(exists=False))
    assert d.status["attempts"][-1]["reason"] == "ClusterLost"
    assert d.status["attempts"][-1]["sliceReleaseTime"] == "2026-01-01T12:40:00Z"
    suspended = Plan(**{**no_retry.__dict__, "suspended": True})
    d = step(running_with_slice(no_retry), plan=suspended, now=at(40), cluster=READY, job=JobView("RUNNING"))
    assert [e["reason"] for e in d.status["attempts"]] == ["Stopped"] and d.status["attempt"] == 2
    waiting = step(step({}, plan=no_retry).status, plan=no_retry, now=at(0)).status
    d = step(waiting, plan=no_retry, now=at(31), cluster=ClusterView(exists=True, ready=False))
    (entry,) = d.status["attempts"]
    assert entry["reason"] == "NotStarted" and entry["usage"]["provisioningSeconds"] == 31 * 60
    assert entry["usage"]["chipHours"] == 0.0
    d = step(running_with_slice(no_retry), plan=no_retry, now=at(40), cluster=READY, job=JobView("RUNNING"), deleting=True)
    assert d.status["attempts"][-1]["reason"] == "Stopped"


def test_a_kueue_eviction_ends_the_attempt_evicted_and_the_slice_costs_no_more():
    queued = Plan(**{**V6E.__dict__, "queue": "tpu-queue"})
    evicted = ClusterView(exists=True, owned=True, suspended=True, uid="rc-uid-1",
                          queue=QueueView(reason="Evicted", evicted="Preempted: a higher priority"))
    d = step(running_with_slice(queued), plan=queued, now=at(40), cluster=evicted, job=JobView("RUNNING"))
    assert d.phase == phases.QUEUED
    first, second = d.status["attempts"]
    assert first["reason"] == "Evicted" and "higher priority" in first["message"]
    assert first["sliceReleaseTime"] == "2026-01-01T12:40:00Z" and first["usage"]["chipHours"] == 8.0
    assert second["attempt"] == 2 and "endTime" not in second


def test_only_the_last_attempts_are_kept_and_the_totals_count_every_one():
    plan = Plan(**{**V6E.__dict__, "max_retries": 30})
    status, minute = running_with_slice(plan), 10
    for _ in range(25):
        d = step(status, plan=plan, now=at(minute + 6), cluster=READY, job=JobView("FAILED"), events=FAILURE, **ENDED)
        d = step(d.status, plan=plan, now=at(minute + 6), cluster=READY, job=None)
        status, minute = step(d.status, plan=plan, now=at(minute + 6), cluster=READY, job=JobView("RUNNING")).status, minute + 6
    assert len(status["attempts"]) == attempts.LIMIT and status["attempts"][0]["attempt"] == 7
    assert status["attempt"] == 26
    # 25 attempts of 6 min each on 16 chips, each handed over: 40 chip-hours; 10 min of provisioning.
    assert status["usage"] == {"chipHours": 40.0, "hostHours": 10.0, "provisioningSeconds": 600.0}
    assert checked_status(status) is status


def test_a_long_log_tail_is_cut_in_the_middle_keeping_the_reason_and_the_last_lines():
    message = "RuntimeError: boom; log tail: " + "x" * 5000 + " | the last line"
    cut = attempts.bounded(message)
    assert len(cut) <= attempts.MESSAGE_LIMIT
    assert cut.startswith("RuntimeError: boom") and cut.endswith("the last line")


# ---- the slice's pods and nodes ----------------------------------------------------------------

SINCE = T0


def pod(name, kind="worker", node="n1", created="2026-01-01T11:59:00Z", ready=True, **status):
    return {"metadata": {"name": name, "labels": {"ray.io/node-type": kind}, "creationTimestamp": created,
                         **status.pop("meta", {})},
            "spec": {"nodeName": node},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}, *status.pop("conditions", [])],
                       **status}}


def node(name, ready="True", labels=None):
    return {"metadata": {"name": name, "labels": labels or {}},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}}


HEAD = pod("rc-head", kind="head", node="c1")
NODES = {"n1": node("n1"), "n2": node("n2"), "c1": node("c1")}


def judge(*workers, nodes=NODES, hosts=2):
    return slice_health([HEAD, *workers], nodes, SINCE, hosts)


def test_a_slice_whose_pods_are_all_ready_and_unchanged_is_healthy():
    assert judge(pod("w0"), pod("w1", node="n2")) == HEALTHY


@pytest.mark.parametrize("why, reason", [
    ("TerminationByKubelet", "Preempted"), ("PreemptionByScheduler", "Preempted"),
    ("EvictionByEvictionAPI", "Maintenance"), ("DeletionByTaintManager", "NodeLost"), ("DeletionByPodGC", "NodeLost"),
])
def test_a_pods_disruption_target_says_who_took_it(why, reason):
    taken = pod("w1", node="n2", meta={"deletionTimestamp": "2026-01-01T12:30:00Z"},
                conditions=[{"type": "DisruptionTarget", "status": "True", "reason": why, "message": "m"}])
    health = judge(pod("w0"), taken)
    assert (health.healthy, health.reason) == (False, reason) and why in health.detail


def test_a_spot_notice_on_a_node_under_maintenance_is_maintenance():
    taken = pod("w1", node="n2", conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}])
    nodes = {**NODES, "n2": node("n2", labels={"cloud.google.com/scheduled-maintenance-time": "1767000000"})}
    assert judge(pod("w0"), taken, nodes=nodes).reason == "Maintenance"


def test_a_pod_shut_down_with_its_spot_node_is_preempted_once_the_node_is_gone():
    """The kubelet's graceful shutdown (a Spot VM's notice) marks the pod, then the VM goes:
    the node's absence is the sequel of the preemption, not a lost node."""
    taken = pod("w1", node="n9", conditions=[{"type": "DisruptionTarget", "status": "True",
                                              "reason": "TerminationByKubelet", "message": "Pod was terminated"}])
    health = judge(pod("w0"), taken)
    assert (health.healthy, health.reason) == (False, "Preempted") and "TerminationByKubelet" in health.detail
    # Without the kubelet's word the gone node is the reason.
    assert judge(pod("w0"), pod("w1", node="n9")).reason == "NodeLost"


def test_a_node_in_its_graceful_shutdown_is_a_preemption_before_its_pods_are_marked():
    """The kubelet reports the node NotReady ("node is shutting down") first, then shuts the
    pods down: a job that ends in between was preempted; a node silent for other reasons is lost."""
    shutting = node("n2", ready="False")
    shutting["status"]["conditions"][0]["message"] = "node is shutting down"
    health = judge(pod("w0"), pod("w1", node="n2"), nodes={**NODES, "n2": shutting})
    assert (health.reason, "shutting down" in health.detail) == ("Preempted", True)
    assert judge(pod("w0"), pod("w1", node="n2"), nodes={**NODES, "n2": node("n2", ready="False")}).reason == "NodeLost"


def test_pods_gone_replaced_or_on_a_lost_node():
    assert judge(pod("w0")).reason == "Preempted"  # one of two workers is gone
    replaced = judge(pod("w0"), pod("w1", created="2026-01-01T12:20:00Z"))
    assert replaced.reason == "Preempted" and "replaced" in replaced.detail
    gone = judge(pod("w0"), pod("w1", node="n9"))
    assert gone.reason == "NodeLost" and "n9" in gone.detail
    not_ready = judge(pod("w0"), pod("w1", node="n2"), nodes={**NODES, "n2": node("n2", ready="Unknown")})
    assert not_ready.reason == "NodeLost"


def test_on_several_slices_a_lost_host_names_its_slice():
    def in_slice(name, index, **kw):
        worker = pod(name, **kw)
        worker["metadata"]["labels"]["ray.io/worker-group-replica-index"] = index
        return worker

    taken = in_slice("w1", "1", node="n2", meta={"deletionTimestamp": "2026-01-01T12:30:00Z"})
    health = judge(in_slice("w0", "0"), taken)
    assert health.reason == "Preempted" and health.detail == "pod w1 of slice 1 was deleted", health
    # One slice: the label is there too (index 0), and the words stay the pod's alone.
    one = judge(in_slice("w0", "0"), in_slice("w1", "0", node="n2", meta={"deletionTimestamp": "2026-01-01T12:30:00Z"}))
    assert one.detail == "pod w1 was deleted", one


def test_a_restarted_container_or_a_pod_not_ready_is_a_slice_not_well_without_a_cloud_reason():
    restarted = pod("w1", containerStatuses=[{"name": "ray-worker", "restartCount": 1, "lastState": {
        "terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": "2026-01-01T12:30:00Z"}}}])
    health = judge(pod("w0"), restarted)
    assert (health.healthy, health.reason) == (False, "") and "OOMKilled" in health.detail
    # A restart before the attempt's slice was ready is not this attempt's.
    earlier = pod("w1", containerStatuses=[{"name": "ray-worker", "restartCount": 1, "lastState": {
        "terminated": {"exitCode": 1, "finishedAt": "2026-01-01T11:59:30Z"}}}])
    assert judge(pod("w0"), earlier).healthy
    assert judge(pod("w0"), pod("w1", ready=False)) == SliceHealth(False, "", "pod w1 is not Ready")


def test_a_run_an_older_operator_started_gets_an_entry_whose_slice_is_ready_from_now():
    older = {k: v for k, v in running_with_slice().items() if k not in ("attempts", "usage")}
    d = step(older, plan=V6E, now=at(30), cluster=READY, job=JobView("RUNNING"),
             events=({"event": "progress", "step": 1, "total_steps": 10},))
    (entry,) = d.status["attempts"]
    assert entry["startTime"] == entry["sliceReadyTime"] == "2026-01-01T12:30:00Z"
    d = step(d.status, plan=V6E, now=at(60), cluster=READY, job=JobView("SUCCEEDED"))
    assert d.status["usage"] == {"chipHours": 8.0, "hostHours": 2.0, "provisioningSeconds": 0.0}


def test_the_slice_counts_from_its_last_host_being_ready_when_the_pods_say_so():
    hosts_ready = ClusterView(**{**READY.__dict__, "hosts_ready_since": "2026-01-01T12:08:30Z"})
    (entry,) = running_with_slice(cluster=hosts_ready)["attempts"]
    assert entry["sliceReadyTime"] == "2026-01-01T12:08:30Z"
    # A time outside the attempt (a clock far off) is not taken: the operator's own is.
    skewed = ClusterView(**{**READY.__dict__, "hosts_ready_since": "2026-01-01T11:00:00Z"})
    assert running_with_slice(cluster=skewed)["attempts"][0]["sliceReadyTime"] == "2026-01-01T12:10:00Z"
    assert hosts_ready_since([HEAD, pod("w0"), pod("w1")]) == ""  # conditions without times
    timed = [pod(n, conditions=[]) for n in ("w0", "w1")]
    for p, t in zip(timed, ("2026-01-01T12:01:00Z", "2026-01-01T12:02:00Z")):
        p["status"]["conditions"][0]["lastTransitionTime"] = t
    assert hosts_ready_since([HEAD, *timed]) == "2026-01-01T12:02:00Z"
    assert hosts_ready_since([HEAD, timed[0], pod("w1", ready=False)]) == ""
