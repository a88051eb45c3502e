"""Several slices on the test ground (spec.tpu.slices: 2), through the operator, the real
KubeRay and the real scheduler.

- Two v6e 2x2 slices (single-host) on two node pools of two nodes each: KubeRay makes one
  worker per replica, the scheduler puts the two replicas on different pools (a pool could
  hold both), and each worker's processes find their slice, KubeRay's replica index, in
  TPUFT_SLICE_INDEX. The ground has no chips, so this run is deleted once placed.
- A fine-tune across two cpu slices of two hosts each runs to Succeeded with an HSDP mesh
  whose rows are the replicas, and releases both slices. That its loss is one slice's over
  the same devices and global batch is tests/trainer/test_trainer_hsdp.py's check (a second
  ground run to compare with cost two minutes of the suite and proved nothing more).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ground_runs import released, resource, start_run
from harness.nodepools import REPLICA_INDEX_LABEL, tpu_pool
from tpufinetune.core.sizing import SLICE_INDEX_ENV

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

def workers(kube, cluster: str) -> list[dict]:
    return [p for p in kube.pods_of(cluster) if p["metadata"]["labels"].get("ray.io/node-type") == "worker"]


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


@pytest.mark.timeout(600)
def test_two_tpu_slices_take_one_node_pool_each_and_every_worker_knows_its_slice(
        operator, ground, kube, ground_assets, storage):
    pools = [tpu_pool(f"v6e-2x2-slice-{i}", "v6e", "2x2", nodes=2) for i in range(2)]
    ground.add_pools(pools)
    pool_of = {node: pool.name for pool in pools for node in pool.node_names()}
    try:
        manifest = resource("two-tpu-slices", ground_assets, storage,
                            tpu={"generation": "v6e", "topology": "2x2", "slices": 2})
        _, cluster = start_run(kube, manifest)

        def placed():
            pods = workers(kube, cluster)
            ready = [p for p in pods if p["spec"].get("nodeName") and p.get("status", {}).get("phase") == "Running"]
            return pods if len(ready) == 2 == len(pods) else None

        pods = kube.wait_for(placed, "both slices' workers Running", timeout=240)
        by_replica = {p["metadata"]["labels"][REPLICA_INDEX_LABEL]: pool_of.get(p["spec"]["nodeName"]) for p in pods}
        assert sorted(by_replica) == ["0", "1"], by_replica
        assert set(by_replica.values()) == {p.name for p in pools}, by_replica  # one pool each
        for pod in pods:
            replica = pod["metadata"]["labels"][REPLICA_INDEX_LABEL]
            uid = pod["metadata"]["uid"]
            kube.wait_for(lambda: process_env(ground, uid, SLICE_INDEX_ENV), "the worker's Ray processes", timeout=60)
            assert process_env(ground, uid, SLICE_INDEX_ENV) == {replica}
        pod_uids = [p["metadata"]["uid"] for p in kube.pods_of(cluster)]
        kube.kubectl("delete", "tpufinetune", "two-tpu-slices", "--wait=false")
        released(kube, ground, cluster, pod_uids)
    finally:
        for pool in pools:
            ground.remove_pool(pool)


def _start(kube, ground_assets, storage, name: str, topology: str, slices: int) -> str:
    """A cpu run of 4 devices in all, 8 examples per device: 32 per step. Returns its
    RayCluster's name once the RayCluster exists (status names it before it is created)."""
    manifest = resource(name, ground_assets, storage, epochs=1, rows=160,
                        tpu={"topology": topology, "slices": slices}, training={"seed": 7})
    _, cluster = start_run(kube, manifest)
    kube.wait_for(lambda: kube.get("raycluster", cluster), f"RayCluster {cluster} created", timeout=60)
    return cluster


def _hsdp_line(kube, name: str, cluster: str) -> str:
    """The trainer's HSDP line in the run's job log."""
    def logged():
        job_id = kube.status(name).get("jobId")
        if not job_id:
            return None
        try:
            logs = kube.head_job_client(cluster).get_job_logs(job_id)
        except Exception:  # the head or the job not answering yet
            return None
        return next((line for line in logs.splitlines() if "HSDP over" in line), None)

    return kube.wait_for(logged, "the trainer's HSDP mesh in the job log", timeout=300, interval=2)


def _finished(kube, ground, name: str, cluster: str) -> dict:
    """The run's final status, once Succeeded and its slice released."""
    pod_uids = [p["metadata"]["uid"] for p in kube.pods_of(cluster)]
    kube.kubectl("wait", f"tpufinetune/{name}", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
    status = kube.status(name)
    released(kube, ground, cluster, pod_uids)
    return status


@pytest.mark.timeout(900)
def test_a_finetune_across_two_slices_of_two_hosts_succeeds_with_a_mesh_row_per_slice(
        operator, ground, kube, ground_assets, storage):
    cluster = _start(kube, ground_assets, storage, "two-slices", "2", 2)
    group = kube.get("raycluster", cluster)["spec"]["workerGroupSpecs"][0]
    assert (group["replicas"], group["numOfHosts"]) == (2, 2), group
    hsdp_line = _hsdp_line(kube, "two-slices", cluster)
    assert "over 2 slices" in hsdp_line and "('replicate', 'shard')" in hsdp_line, hsdp_line
    rows = json.loads(hsdp_line.rsplit("rows (ranks by slice) ", 1)[1])
    assert len(rows) == 2 and sorted(r for row in rows for r in row) == [0, 1, 2, 3], rows
    two = _finished(kube, ground, "two-slices", cluster)
    assert two["phase"] == "Succeeded" and two["attempt"] == 1, two.get("message")
    (loss,) = [entry["loss"] for entry in two["history"]]
    assert loss == loss and loss > 0, two["history"]  # a real number came back from the trainer
    print(f"two slices of 2 devices: epoch loss {loss!r}; mesh rows {rows}")
