"""How Kueue's Workload is read for a suspended RayCluster: the reason it waits (Kueue's
own message), and an eviction's reason."""

from tpufinetune.adapters.kube import cluster_view, queue_view
from tpufinetune.settings import Settings

CLUSTER_UID = "rc-uid"


def workload(*conditions: dict, owner: str = CLUSTER_UID) -> dict:
    return {"metadata": {"name": "raycluster-tft-demo-1a2b3", "ownerReferences": [{"uid": owner}]},
            "status": {"conditions": list(conditions)}}


PENDING = {"type": "QuotaReserved", "status": "False", "reason": "Pending",
           "message": "couldn't assign flavors to pod set cpu-16: insufficient unused quota for "
                      "google.com/tpu in flavor tpu-v6e-slice, 16 more needed"}
EVICTED = {"type": "Evicted", "status": "True", "reason": "Preempted",
           "message": "Preempted to accommodate a workload (UID: 42) due to prioritization in the ClusterQueue"}


def test_a_pending_workload_gives_kueues_reason_and_message():
    view = queue_view([workload(PENDING)], CLUSTER_UID)
    assert view.reason == "Pending"
    assert view.message.endswith("16 more needed")
    assert view.evicted == ""


def test_an_evicted_workload_names_the_preemption():
    view = queue_view([workload(EVICTED, PENDING)], CLUSTER_UID)
    assert view.evicted.startswith("Preempted: Preempted to accommodate")
    assert view.message == PENDING["message"]
    just_evicted = queue_view([workload(EVICTED)], CLUSTER_UID)
    assert just_evicted.reason == "Evicted" and "Preempted" in just_evicted.message


def test_workloads_of_other_clusters_and_none_at_all_say_nothing():
    assert queue_view([workload(PENDING, owner="someone-else")], CLUSTER_UID).message == ""
    assert queue_view([], CLUSTER_UID).message == ""


def test_spec_suspend_is_read_as_suspended():
    body = {"metadata": {"name": "tft-demo", "namespace": "ns", "ownerReferences": [{"uid": "u"}]},
            "spec": {"suspend": True}}
    assert cluster_view(body, "u", Settings()).suspended
    body["spec"]["suspend"] = False
    assert not cluster_view(body, "u", Settings()).suspended
