"""Several slices on the test ground (spec.tpu.slices: 2), through the operator, the real
KubeRay and the real scheduler.

- Two v6e 2x2 slices (single-host). First only one pool exists, of two nodes: it could hold
  both, and only the product's anti-affinity keeps the second replica out of it (it waits,
  Unschedulable); a second pool then takes it. Each worker's processes find their slice,
  KubeRay's replica index, in TPUFT_SLICE_INDEX and MEGASCALE_SLICE_ID, and the slice count
  in MEGASCALE_NUM_SLICES. The ground has no chips, so this run is deleted once placed.
- A fine-tune across two cpu slices of two hosts each, with an HSDP mesh whose rows are the
  replicas. Every worker process holds the four MEGASCALE values of its own slice, the
  coordinator slice 0's first host; that host's pod is then deleted, the run retries on a
  rebuilt slice, and every new worker names the live coordinator; it resumes from its
  checkpoint and Succeeds. That its loss is one slice's over the same devices and global
  batch is tests/trainer/test_trainer_hsdp.py's check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ground_runs import released, resource, start_run, workers
from harness.nodepools import REPLICA_INDEX_LABEL, tpu_pool
from tpufinetune.core.sizing import SLICE_INDEX_ENV
from tpufinetune_trainer.backends import MEGASCALE_LOG_PREFIX

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]


def process_env(ground, pod_uid: str, name: str) -> set[str]:
    """`name`'s value in the environment of each process of a pod (read from /proc)."""
    values = set()
    for pid in ground.ray_processes(pod_uid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile
        values |= {entry.split(b"=", 1)[1].decode() for entry in environ if entry.startswith(name.encode() + b"=")}
    return values


def unschedulable(pod: dict) -> bool:
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
               for c in (pod.get("status") or {}).get("conditions") or [])


@pytest.mark.timeout(600)
def test_two_tpu_slices_take_one_node_pool_each_and_every_worker_knows_its_slice(
        operator, ground, kube, ground_assets, storage):
    first, second = (tpu_pool(f"v6e-2x2-slice-{i}", "v6e", "2x2", nodes=2) for i in range(2))
    ground.add_pools([first])
    pools = [first]
    try:
        manifest = resource("two-tpu-slices", ground_assets, storage,
                            tpu={"generation": "v6e", "topology": "2x2", "slices": 2})
        _, cluster = start_run(kube, manifest)

        def one_placed_one_kept_out():
            pods = workers(kube, cluster)
            placed = [p for p in pods if p["spec"].get("nodeName")]
            # Both on the one pool there is: nothing kept the slices apart. Fail now, not at the timeout.
            assert len(placed) < 2, f"both slices placed on the one pool {first.name}: {[p['spec']['nodeName'] for p in placed]}"
            return len(pods) == 2 and len(placed) == 1 and any(unschedulable(p) for p in pods)

        kube.wait_for(one_placed_one_kept_out, f"one slice on {first.name}, the other Unschedulable", timeout=180)
        ground.add_pools([second])
        pools.append(second)
        pool_of = {node: pool.name for pool in pools for node in pool.node_names()}

        def placed():
            pods = workers(kube, cluster)
            ready = [p for p in pods if p["spec"].get("nodeName") and p.get("status", {}).get("phase") == "Running"]
            return pods if len(ready) == 2 == len(pods) else None

        pods = kube.wait_for(placed, "both slices' workers Running", timeout=240)
        by_replica = {p["metadata"]["labels"][REPLICA_INDEX_LABEL]: pool_of.get(p["spec"]["nodeName"]) for p in pods}
        assert sorted(by_replica) == ["0", "1"], by_replica
        assert set(by_replica.values()) == {first.name, second.name}, by_replica  # one pool each
        for pod in pods:
            replica = pod["metadata"]["labels"][REPLICA_INDEX_LABEL]
            uid = pod["metadata"]["uid"]
            kube.wait_for(lambda: process_env(ground, uid, SLICE_INDEX_ENV), "the worker's Ray processes", timeout=60)
            assert process_env(ground, uid, SLICE_INDEX_ENV) == {replica}
            assert process_env(ground, uid, "MEGASCALE_SLICE_ID") == {replica}
            assert process_env(ground, uid, "MEGASCALE_NUM_SLICES") == {"2"}
        pod_uids = [p["metadata"]["uid"] for p in kube.pods_of(cluster)]
        kube.kubectl("delete", "tpufinetune", "two-tpu-slices", "--wait=false")
        released(kube, ground, cluster, pod_uids)
    finally:
        for pool in pools:
            ground.remove_pool(pool)


def _start(kube, ground_assets, storage, name: str) -> tuple[str, str]:
    """A cpu run of two slices of two hosts, 4 devices in all, 8 examples per device: 32 per
    step, 30 steps, a checkpoint every 2, one retry. Returns its uid and its RayCluster's
    name once the RayCluster exists (status names it before it is created)."""
    manifest = resource(name, ground_assets, storage, epochs=1, rows=960, maxRetries=1,
                        tpu={"topology": "2", "slices": 2}, terminationGracePeriodSeconds=30,
                        training={"seed": 7, "checkpointEverySteps": 2})
    uid, cluster = start_run(kube, manifest)
    kube.wait_for(lambda: kube.get("raycluster", cluster), f"RayCluster {cluster} created", timeout=60)
    return uid, cluster


def _logged_line(kube, cluster: str, job_id: str, marker: str) -> str:
    """The first line holding `marker` in a job's log on the cluster's head."""
    def logged():
        try:
            logs = kube.head_job_client(cluster).get_job_logs(job_id)
        except Exception:  # the head or the job not answering yet
            return None
        return next((line for line in logs.splitlines() if marker in line), None)

    return kube.wait_for(logged, f"{marker!r} in {job_id}'s log", timeout=300, interval=2)


def _megascale_seen(kube, cluster: str, job_id: str) -> list[dict]:
    """Each rank's MEGASCALE values as its worker process holds them (the trainer's line,
    printed at each start of the worker group), with the rank's node address."""
    line = _logged_line(kube, cluster, job_id, MEGASCALE_LOG_PREFIX)
    report, _ = json.JSONDecoder().raw_decode(line.split(MEGASCALE_LOG_PREFIX, 1)[1])
    return report


def _check_megascale(kube, cluster: str, report: list[dict]) -> dict:
    """Every rank holds its own pod's slice and, as coordinator, slice 0's first host, a live
    pod of the run; returns that pod. The first host is the trainer's: TPU_WORKER_ID, which
    the cpu stand-in's pods lack (all 0), so there slice 0's lowest rank."""
    pods = {p["status"]["podIP"]: p for p in workers(kube, cluster)
            if (p.get("status") or {}).get("podIP") and not p["metadata"].get("deletionTimestamp")}
    assert sorted(entry["rank"] for entry in report) == [0, 1, 2, 3], report
    for entry in report:
        pod = pods.get(entry["address"])
        assert pod is not None, (entry, sorted(pods))  # a live worker pod of the run
        assert entry["MEGASCALE_SLICE_ID"] == pod["metadata"]["labels"][REPLICA_INDEX_LABEL], (entry, pod["metadata"]["labels"])
        assert entry["MEGASCALE_NUM_SLICES"] == "2", entry
        assert entry["MEGASCALE_PORT"] == "8081", entry  # one process a pod here
    first = min((e for e in report if e["MEGASCALE_SLICE_ID"] == "0"), key=lambda e: e["rank"])
    assert {e["MEGASCALE_COORDINATOR_ADDRESS"] for e in report} == {f"{first['address']}:8081"}, report
    return pods[first["address"]]


@pytest.mark.timeout(900)
def test_a_finetune_across_two_slices_names_each_slice_and_the_live_coordinator_through_a_rebuild_and_succeeds(
        operator, ground, kube, ground_assets, storage):
    uid, cluster = _start(kube, ground_assets, storage, "two-slices")
    group = kube.get("raycluster", cluster)["spec"]["workerGroupSpecs"][0]
    assert (group["replicas"], group["numOfHosts"]) == (2, 2), group
    hsdp_line = _logged_line(kube, cluster, f"tft-{uid}-1", "HSDP over")
    assert "over 2 slices" in hsdp_line and "('replicate', 'shard')" in hsdp_line, hsdp_line
    rows = json.loads(hsdp_line.rsplit("rows (ranks by slice) ", 1)[1])
    assert len(rows) == 2 and sorted(r for row in rows for r in row) == [0, 1, 2, 3], rows
    first = _check_megascale(kube, cluster, _megascale_seen(kube, cluster, f"tft-{uid}-1"))

    # The coordinator's pod (slice 0's) deleted mid-run once a checkpoint is reported.
    kube.wait_for(lambda: kube.status("two-slices").get("checkpointURI"), "a first checkpoint", timeout=300)
    assert kube.status("two-slices")["phase"] == "Running", kube.run_state("two-slices")
    kube.kubectl("delete", "pod", first["metadata"]["name"], "--grace-period=30", "--wait=true", timeout=90)
    kube.wait_for(lambda: (s := kube.status("two-slices")).get("attempt") == 2 and s.get("phase") == "Running",
                  "attempt 2 Running", timeout=400, interval=1)
    live = _check_megascale(kube, cluster, _megascale_seen(kube, cluster, f"tft-{uid}-2"))
    assert live["status"]["podIP"] != first["status"]["podIP"]  # the deleted pod's address is gone
    print(f"coordinator {first['status']['podIP']} ({first['metadata']['name']}), after the rebuild "
          f"{live['status']['podIP']} ({live['metadata']['name']})")

    pod_uids = [p["metadata"]["uid"] for p in kube.pods_of(cluster)]
    kube.kubectl("wait", "tpufinetune/two-slices", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
    two = kube.status("two-slices")
    released(kube, ground, cluster, pod_uids)
    assert two["phase"] == "Succeeded" and two["attempt"] == 2, two.get("message")
    assert two["attempts"][1].get("resumedFrom"), two["attempts"]  # resumed, not started over
    (loss,) = [entry["loss"] for entry in two["history"]]
    assert loss == loss and loss > 0, two["history"]  # a real number came back from the trainer
    print(f"two slices of 2 devices: epoch loss {loss!r}; mesh rows {rows}")
