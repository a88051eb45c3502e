"""Queueing on TPU quota with the real Kueue (harness/kueue.py) on the test ground.

- Two v6e 4x4 runs in one queue with the quota of one slice: the first holds the slice, the
  second is Queued with Kueue's message and is admitted when the first ends; at no time do
  more than 16 google.com/tpu of pods exist.
  A third run deleted while Queued leaves nothing behind and takes nothing from the quota;
  the second, deleted once admitted, gives its quota back.
- Preemption: a higher-priority run (a collectives check: it needs the quota, not training)
  evicts a running one, which goes back to Queued and,
  admitted again, resumes from its checkpoint as a new attempt that is not a failure. On the
  ground TPU workers stop for want of a chip, so this one uses cpu runs, which really train
  and checkpoint, in a ClusterQueue whose CPU quota holds one such run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml
from kubernetes.utils import parse_quantity

from harness.argocd_health import health
from harness.kueue import API as KUEUE_API, CPU_QUEUE, TPU_QUEUE, V6E_4X4_TPU
from harness.kubewatch import KubeWatch
from harness.waiting import wait_for
from tpufinetune.core import conditions as cond
from tpufinetune.core.generations import TPU_RESOURCE

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]
ARGOCD_CAPTURE = Path(__file__).resolve().parents[1] / "deploy" / "testdata" / "argocd" / "queued.json"


def tpu_run(name: str, assets, storage, **spec) -> dict:
    return {
        "apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name},
        "spec": {
            "tpu": {"generation": "v6e", "topology": "4x4"},
            "image": "registry.example/tpufinetune-trainer:test",
            "model": {"id": assets.model},
            "dataset": {"id": assets.data, "split": "train[:64]"},
            "training": {"epochs": 1, "batchSizePerDevice": 1, "maxSeqLen": 64},
            "checkpoint": {"storagePath": storage},
            "queueName": TPU_QUEUE,
            **spec,
        },
    }


def cpu_run(name: str, assets, storage, training: dict, rows: int, **spec) -> dict:
    """A one-worker cpu run in the cpu queue, on the data's first `rows` rows (short epochs)."""
    return {
        "apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name},
        "spec": {
            "tpu": {"generation": "cpu", "topology": "1"},
            "image": "registry.example/tpufinetune-trainer:test",
            "model": {"id": assets.model},
            "dataset": {"id": assets.data, "split": f"train[:{rows}]"},
            # 8 examples a step: about the steps per epoch these runs took when a step was four
            # 128-token blocks (the ground's examples average ~90 tokens), so runs stay short.
            "training": {"batchSizePerDevice": 8, "maxSeqLen": 128, **training},
            "checkpoint": {"storagePath": storage},
            "queueName": CPU_QUEUE,
            **spec,
        },
    }


# A run's workers that exit at once, again and again: the run stays in Provisioning (under the
# ground's TPUFT_PROVISION_TIMEOUT, 600 s) with its RayCluster admitted and its quota held.
HELD_IN_PROVISIONING = {"annotations": {"ground.tpufinetune.dev/exit-code": "1"}}


def phase_is(kube, name: str, *phases: str):
    return lambda: kube.status(name) if kube.status(name).get("phase") in phases else None


def tpu_of(pods: list[dict]) -> int:
    return sum(int(parse_quantity((c.get("resources", {}).get("requests") or {}).get(TPU_RESOURCE, 0)))
               for pod in pods for c in pod["spec"]["containers"])


def live_tpu_of(pods: list[dict]) -> int:
    """google.com/tpu of the pods not being deleted. A Pending pod counts (it holds its
    request); a pod being deleted does not: Kueue returns the quota when the RayCluster is
    deleted, so at the hand-over the next cluster's pods may be created while the last
    one's are still terminating."""
    return tpu_of([p for p in pods if not p["metadata"].get("deletionTimestamp")])


def capture_for_argocd(obj: dict, scrub: dict[str, str]) -> None:
    """TPUFT_CAPTURE_ARGOCD=1: keep the live Queued object as the Lua health test's data
    (tests/deploy/test_argocd.py), machine paths scrubbed, like the deploy end-to-end test."""
    if os.environ.get("TPUFT_CAPTURE_ARGOCD") != "1":
        return
    obj = {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "managedFields"}}
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    for real, placeholder in scrub.items():
        text = text.replace(real, placeholder)
    ARGOCD_CAPTURE.write_text(text)


def cluster_queue_usage(kube, name: str) -> dict:
    """The ClusterQueue's reserved quota by resource, and its admitted/pending counts."""
    status_code, body = kube.cp.get_json(f"/apis/{KUEUE_API}/clusterqueues/{name}")  # polled: no kubectl fork
    assert status_code == 200, body
    status = body.get("status") or {}
    usage = {r["name"]: str(r["total"]) for flavor in status.get("flavorsReservation") or []
             for r in flavor.get("resources") or []}
    return {"usage": usage, "admitted": status.get("admittedWorkloads", 0),
            "pending": status.get("pendingWorkloads", 0), "reserving": status.get("reservingWorkloads", 0)}


def workloads_of(kube, cluster_uid: str) -> list[dict]:
    return kube.items("workloads.kueue.x-k8s.io", "-l", f"kueue.x-k8s.io/job-uid={cluster_uid}")


def test_two_v6e_slices_in_one_queue_run_one_after_the_other(operator, kueue, queued_namespace, kube, ground,
                                                             ground_assets, storage):
    with KubeWatch(kube.cp.kubeconfig, kube.ns, live=live_tpu_of, with_terminating=tpu_of) as watch:
        # The first holds the slice until the test ends it: its workers crash-loop (the
        # ground's exit-code annotation), so it waits in Provisioning with its quota reserved.
        # A first run that reached its trainer failed for want of a chip within a minute or two,
        # a race with the checks below (a cold run saw it end as the third run was applied, and
        # Kueue admitted the third before the second).
        kube.apply(tpu_run("first", ground_assets, f"{storage}/first", workers=HELD_IN_PROVISIONING))
        # The operator created the RayCluster suspended, and Kueue (not its webhook) admitted it.
        kube.wait_for(lambda: cond.is_true(kube.status("first"), cond.ADMITTED),
                      "first admitted", timeout=120)
        kube.apply(tpu_run("second", ground_assets, f"{storage}/second"))
        queued = kube.wait_for(phase_is(kube, "second", "Queued"), "second Queued", timeout=60)
        second_cluster = queued["rayClusterName"]
        # Kueue writes why on the Workload once its scheduler has tried it (on two busy
        # cores, over a minute in a full suite); the operator copies it to status.
        def quota_message():
            message = kube.status("second").get("message", "")
            return message if "google.com/tpu" in message else False
        second_uid = kube.get("raycluster", second_cluster)["metadata"]["uid"]
        wait_for(quota_message, 180, "Kueue's quota message on second",
                 details=lambda: f"status: {kube.status('second').get('message')!r}; its Workload's conditions: "
                                 f"{[w.get('status', {}).get('conditions') for w in workloads_of(kube, second_uid)]}")
        # When Kueue wrote it and when the operator showed it, for the suite's log.
        (workload,) = workloads_of(kube, second_uid)
        reserved = next(c for c in workload["status"]["conditions"] if c["type"] == "QuotaReserved")
        print(f"second: Workload created {workload['metadata']['creationTimestamp']}, QuotaReserved "
              f"{reserved['status']} since {reserved['lastTransitionTime']}, seen in status by "
              f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        status = kube.status("second")
        assert status["message"].startswith(f"queued in {TPU_QUEUE}: "), status["message"]
        assert cond.find(status, cond.ADMITTED)["status"] == "False"
        assert kube.get("raycluster", second_cluster)["spec"]["suspend"] is True
        assert not kube.pods_of(second_cluster)
        table = kube.kubectl("get", "tpufinetunes").stdout
        assert any(line.split()[0] == "second" and "Queued" in line.split() for line in table.splitlines()), table
        live = kube.get("tpufinetune", "second")
        assert health(live) == {"status": "Progressing", "message": f"Queued: {live['status']['message']}"}
        capture_for_argocd(live, {ground_assets.root: "gs://tpufinetune-ground/assets", storage: "gs://tpufinetune-ground/runs/gitops",
                                  kube.ns: "ml-team"})

        # A third run queued behind them and deleted while Queued leaves nothing behind and
        # takes nothing from the quota.
        before = kube.wait_for(lambda: (u := cluster_queue_usage(kube, "tpu-v6e"))["usage"].get(TPU_RESOURCE)
                               == str(V6E_4X4_TPU) and u["pending"] == 1 and u, "16 google.com/tpu reserved", 60)
        kube.apply(tpu_run("deleted", ground_assets, f"{storage}/deleted"))
        deleted_cluster = kube.wait_for(phase_is(kube, "deleted", "Queued"), "deleted Queued", 60)["rayClusterName"]
        deleted_uid = kube.get("raycluster", deleted_cluster)["metadata"]["uid"]
        kube.wait_for(lambda: workloads_of(kube, deleted_uid), "Kueue's Workload for the queued cluster", 60)
        kube.wait_for(lambda: cluster_queue_usage(kube, "tpu-v6e")["pending"] == 2, "two pending workloads", 60)
        kube.kubectl("delete", "tpufinetune", "deleted", "--timeout=60s", timeout=70)
        kube.wait_for(lambda: kube.get("raycluster", deleted_cluster) is None, "queued RayCluster deleted", 60)
        kube.wait_for(lambda: not workloads_of(kube, deleted_uid), "its Workload gone", 90)
        assert not kube.pods_of(deleted_cluster)
        after = kube.wait_for(lambda: (u := cluster_queue_usage(kube, "tpu-v6e"))["pending"] == 1 and u,
                              "one pending again", 60)
        assert after["usage"] == before["usage"] and after["admitted"] == before["admitted"], (before, after)

        # The first ends (deleted, as its owner ends a run that holds the slice): the quota comes
        # back with its RayCluster, and the second is admitted and its pods come up. Deleting
        # the second, admitted, releases the quota as well. (That a run ending on its own gives
        # its quota back is the preemption test's: the higher-priority run succeeds and the
        # evicted one is admitted again.)
        def held():
            status = kube.status("first")
            ready = cond.find(status, cond.CLUSTER_READY) or {}
            return (status.get("phase") == "Provisioning" and cond.is_true(status, cond.ADMITTED)
                    and ready.get("reason") == "CrashLoopBackOff" and "exited 1" in ready.get("message", "")
                    and status)
        kube.wait_for(held, "first held in Provisioning, its workers' exits named", 120)
        ended_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        kube.kubectl("delete", "tpufinetune", "first", "--timeout=90s", timeout=100)
        kube.wait_for(lambda: cond.is_true(kube.status("second"), cond.ADMITTED),
                      "second admitted after the first ended", timeout=180)
        assert cond.find(kube.status("second"), cond.ADMITTED)["lastTransitionTime"] >= ended_at
        kube.wait_for(lambda: len(kube.pods_of(second_cluster)) == 5, "second's head and four workers", 120)
        kube.kubectl("delete", "tpufinetune", "second", "--timeout=90s", timeout=100)
        kube.wait_for(lambda: kube.get("raycluster", second_cluster) is None, "second's RayCluster released", 60)
        kube.wait_for(lambda: not kube.pods_of(second_cluster), "second's pods gone", 120)
    assert watch.events > 10  # every pod of both runs came and went under the watch
    assert watch.most["live"] == V6E_4X4_TPU, f"at most {watch.most['live']} google.com/tpu of pods at once"
    print(f"google.com/tpu of pods at once: {watch.most['live']}, terminating ones included: "
          f"{watch.most['with_terminating']}")
    kube.wait_for(lambda: cluster_queue_usage(kube, "tpu-v6e")["reserving"] == 0, "quota released", timeout=90)


def test_a_higher_priority_run_evicts_a_running_one_which_resumes_from_its_checkpoint(
        operator, kueue, queued_namespace, kube, ground_assets, storage):
    slow = {"epochs": 2, "checkpointEverySteps": 2}
    kube.apply(cpu_run("low", ground_assets, f"{storage}/low", slow, 320, workloadPriorityClassName="low"))
    # Running, with a checkpoint reported: there is something to resume from.
    kube.wait_for(lambda: kube.status("low").get("phase") == "Running" and kube.status("low").get("checkpointURI"),
                  "low running with a checkpoint", timeout=400, interval=1)

    # The higher priority needs the quota, not training: a collectives check, which ends sooner.
    kube.apply(cpu_run("high", ground_assets, f"{storage}/high", {}, 160, mode="collectives",
                       workloadPriorityClassName="high"))
    evicted = kube.wait_for(phase_is(kube, "low", "Queued"), "low evicted back to Queued", timeout=120)
    assert evicted["attempt"] == 2 and evicted["evictions"] == 1
    assert not cond.is_true(evicted, cond.FAILED)

    kube.kubectl("wait", "tpufinetune/high", "--for=condition=Succeeded", "--timeout=400s", timeout=420)
    # The high run's cluster is released, Kueue admits the low one again, and attempt 2 is
    # submitted with --resume-from the newest checkpoint attempt 1 reported (its last lines,
    # read after the eviction, may name a newer one than status had then); the trainer resumes.
    uid = kube.get("tpufinetune", "low")["metadata"]["uid"]
    resumed = kube.wait_for(lambda: (s := kube.status("low")).get("phase") == "Running" and s,
                            "low admitted again and running", timeout=300, interval=1)
    assert resumed["jobId"] == f"tft-{uid}-2"
    assert cond.is_true(resumed, cond.ADMITTED)
    client = kube.head_job_client(resumed["rayClusterName"])
    entrypoint = client.get_job_info(resumed["jobId"]).entrypoint
    resume_from = next(arg.split("=", 1)[1] for arg in entrypoint.split() if arg.startswith("--resume-from="))
    assert resume_from.startswith(f"{storage}/low"), entrypoint
    # The trainer checks that it is a checkpoint (it refuses one that is gone), then resumes.
    kube.wait_for(lambda: "Resumed from" in client.get_job_logs(resumed["jobId"]), "the trainer's resume line",
                  timeout=300, interval=2)

    kube.kubectl("wait", "tpufinetune/low", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
    low = kube.status("low")
    assert low["attempt"] == 2 and low["evictions"] == 1
    assert [entry["epoch"] for entry in low["history"]] == [1, 2]
    events = json.loads(kube.kubectl("get", "events", "--field-selector", "involvedObject.name=low", "-o", "json").stdout)
    evictions = [item["message"] for item in events["items"] if item["reason"] == "Evicted"]
    assert len(evictions) == 1 and "Preempted" in evictions[0], evictions
    assert "Admitted" in {item["reason"] for item in events["items"]}


def test_make_cluster_queues_the_queued_sample_in_default(kueue, ground):
    """`make cluster` (supervisor.start_queues) leaves Kueue running with LocalQueues in
    `default`: the queued sample's queue is there and active, and the sample applies as it is."""
    from harness.supervisor import start_queues

    start_queues(ground)
    sample = Path(__file__).resolve().parents[2] / "deploy" / "samples" / "finetune-v6e-4x4-queued.yaml"
    queue = yaml.safe_load(sample.read_text())["spec"]["queueName"]

    def active():
        result = ground.kubectl("-n", "default", "get", "localqueue", queue, "-o", "json", check=False)
        return result.returncode == 0 and cond.is_true(json.loads(result.stdout).get("status") or {}, "Active")
    wait_for(active, 60, f"LocalQueue {queue} Active in default")
    ground.kubectl("-n", "default", "apply", "--dry-run=server", "-f", str(sample))
