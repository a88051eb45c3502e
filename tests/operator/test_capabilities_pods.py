"""Pod-level reasons while Provisioning (pure): the worst pod state, in the scheduler's or
the kubelet's own words, on status.message and the ClusterReady condition, with the
hosts that are ready."""

from datetime import timedelta

from phase_helpers import IDENT, T0, step

from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.core.phases import ClusterView, Plan
from tpufinetune.core.podstatus import PodProblem, hosts_ready, routine_wait, worst_problem

PLAN = Plan(cluster_name="demo-rc", epochs=2, hosts=4)


def pod(name, worker=True, ready=False, scheduled=None, waiting=None, last_exit=None, last_reason="Error"):
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if scheduled:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": scheduled})
    container = {"name": "ray-worker", "restartCount": 3 if last_exit else 0,
                 "state": {"waiting": waiting} if waiting else {"running": {}}}
    if last_exit is not None:
        container["lastState"] = {"terminated": {"exitCode": last_exit, "reason": last_reason}}
    return {"metadata": {"name": name, "labels": {"ray.io/node-type": "worker" if worker else "head"}},
            "status": {"conditions": conditions, "containerStatuses": [container]}}


UNSCHEDULABLE = pod("rc-w-3", scheduled="0/12 nodes are available: 3 Insufficient google.com/tpu.")
PULL = pod("rc-w-2", waiting={"reason": "ErrImagePull", "message": 'failed to pull image "x.invalid/t:1"'})
BACKOFF = pod("rc-w-1", waiting={"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x.invalid/t:1"'})
CRASH = pod("rc-head", worker=False, waiting={"reason": "CrashLoopBackOff", "message": "back-off 40s"}, last_exit=1)
CREATING = pod("rc-w-0", waiting={"reason": "ContainerCreating"})
MISSING_SECRET = pod("rc-w-4", waiting={"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'})


def test_routine_start_up_is_no_problem():
    assert worst_problem([CREATING, pod("rc-w-9", ready=True)]) is None


def test_each_reason_in_its_owners_words():
    assert worst_problem([CREATING, UNSCHEDULABLE]) == PodProblem(
        "Unschedulable", "pod rc-w-3 is Unschedulable: 0/12 nodes are available: 3 Insufficient google.com/tpu.")
    assert worst_problem([PULL]) == PodProblem("ErrImagePull", 'pod rc-w-2 is ErrImagePull: failed to pull image "x.invalid/t:1"')
    assert worst_problem([MISSING_SECRET]) == PodProblem(
        "CreateContainerConfigError", 'pod rc-w-4 is CreateContainerConfigError: secret "hf" not found')
    # A crash loop's own message names only the back-off: the last exit says why.
    assert worst_problem([CRASH]).message == (
        "pod rc-head is CrashLoopBackOff: container ray-worker exited 1 (Error), restarted 3 times; back-off 40s")
    bare_crash = pod("rc-head", worker=False, waiting={"reason": "CrashLoopBackOff"}, last_exit=137)
    assert worst_problem([bare_crash]).message == (
        "pod rc-head is CrashLoopBackOff: container ray-worker exited 137 (Error), restarted 3 times")


def test_an_oom_killed_container_is_named_while_it_crash_loops_and_after_its_restart():
    expected = PodProblem("OOMKilled", "pod rc-w-6 is OOMKilled: container ray-worker exceeded its memory limit "
                                       "(limits.memory), restarted 3 times")
    looping = pod("rc-w-6", waiting={"reason": "CrashLoopBackOff", "message": "back-off 20s"}, last_exit=137,
                  last_reason="OOMKilled")
    running_again = pod("rc-w-6", last_exit=137, last_reason="OOMKilled")
    assert worst_problem([looping]) == expected and worst_problem([running_again]) == expected
    ended = pod("rc-w-6")
    ended["status"]["containerStatuses"][0].update(state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                                                   restartCount=3)
    assert worst_problem([ended]) == expected
    # Before a crash loop elsewhere: the limit is what the user must change.
    assert worst_problem([CRASH, UNSCHEDULABLE, looping]).reason == "OOMKilled"


def test_the_worst_state_wins_whatever_the_pod_order():
    """What waiting will never fix (a missing Secret, a bad image) comes before a crash
    loop, which comes before capacity the scheduler may still find."""
    pods = [UNSCHEDULABLE, CRASH, BACKOFF, PULL, CREATING]
    assert worst_problem(pods).reason == "ErrImagePull"
    assert worst_problem(list(reversed(pods))).reason == "ErrImagePull"
    assert worst_problem([UNSCHEDULABLE, CRASH]).reason == "CrashLoopBackOff"
    assert worst_problem([UNSCHEDULABLE, pod("rc-w-5", waiting={"reason": "RunContainerError"})]).reason == "RunContainerError"
    assert worst_problem([PULL, MISSING_SECRET]).reason == "CreateContainerConfigError"


def test_hosts_ready_counts_ready_workers_only():
    pods = [pod("rc-head", worker=False, ready=True), pod("a", ready=True), pod("b", ready=True),
            pod("c", ready=True), UNSCHEDULABLE]
    assert hosts_ready(pods) == 3


def provisioning():
    return step(step({}, plan=PLAN).status, plan=PLAN).status


def test_provisioning_names_the_worst_pod_state_and_the_hosts_ready():
    view = ClusterView(exists=True, ready=False, hosts_ready=3, pod_problem=worst_problem([UNSCHEDULABLE]))
    d = step(provisioning(), plan=PLAN, cluster=view)
    assert d.phase == phases.PROVISIONING
    expected = "hosts ready 3/4; pod rc-w-3 is Unschedulable: 0/12 nodes are available: 3 Insufficient google.com/tpu."
    assert d.status["message"] == expected
    ready = cond.find(d.status, cond.CLUSTER_READY)
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "Unschedulable", expected)
    assert phases.RecordEvent("Warning", "Unschedulable", expected) in d.actions
    # the same reason again: the condition follows the counts, no new Event
    again = step(d.status, plan=PLAN, cluster=ClusterView(exists=True, ready=False, hosts_ready=2,
                                                          pod_problem=worst_problem([UNSCHEDULABLE])))
    assert again.status["message"].startswith("hosts ready 2/4; ")
    assert not any(isinstance(a, phases.RecordEvent) for a in again.actions)
    # a worse state: a new reason, a new Event
    worse = step(again.status, plan=PLAN, cluster=ClusterView(
        exists=True, ready=False, hosts_ready=2, pod_problem=worst_problem([UNSCHEDULABLE, PULL])))
    assert cond.find(worse.status, cond.CLUSTER_READY)["reason"] == "ErrImagePull"
    assert [a.reason for a in worse.actions if isinstance(a, phases.RecordEvent)] == ["ErrImagePull"]


def test_provisioning_without_a_problem_shows_the_progress():
    d = step(provisioning(), plan=PLAN, cluster=ClusterView(exists=True, ready=False, hosts_ready=1))
    assert d.status["message"] == "waiting for RayCluster demo-rc to be ready: hosts ready 1/4"
    assert cond.find(d.status, cond.CLUSTER_READY)["message"] == d.status["message"]


def test_a_routine_wait_shows_what_the_pod_waits_for_in_the_kubelets_words():
    held = pod("rc-w-1", waiting={"reason": "PodInitializing",
                                  "message": "the node waits for head pod rc-head to answer"})
    creating = pod("rc-w-2", waiting={"reason": "ContainerCreating"})  # no message: nothing to add
    assert worst_problem([held, creating]) is None  # routine: neither a problem nor an Event
    wait = routine_wait([creating, held])
    assert wait == "pod rc-w-1 is PodInitializing: the node waits for head pod rc-head to answer"
    d = step(provisioning(), plan=PLAN, cluster=ClusterView(exists=True, ready=False, hosts_ready=0, routine_wait=wait))
    assert d.status["message"] == f"waiting for RayCluster demo-rc to be ready: hosts ready 0/4; {wait}"
    assert cond.find(d.status, cond.CLUSTER_READY)["reason"] == "Waiting"
    assert not [a for a in d.actions if isinstance(a, phases.RecordEvent)]
    assert routine_wait([creating]) == ""


def test_the_provisioning_timeout_names_the_last_pod_state():
    view = ClusterView(exists=True, ready=False, hosts_ready=0, pod_problem=worst_problem([BACKOFF]))
    d = step(provisioning(), plan=PLAN, now=T0 + timedelta(minutes=31), cluster=view)
    assert d.phase == phases.FAILED
    assert d.status["message"] == ('RayCluster demo-rc not ready after 30 min: hosts ready 0/4; '
                                   'pod rc-w-1 is ImagePullBackOff: Back-off pulling image "x.invalid/t:1"')
    assert IDENT.generation == cond.find(d.status, cond.FAILED)["observedGeneration"]
