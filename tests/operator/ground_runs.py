"""Shared steps of the operator's end-to-end tests on the test ground (test_*_e2e.py): a
TPUFineTune manifest, applying it, its jobs on the head, its release, and the operator's
own metrics (what it has done, observed from outside)."""

from __future__ import annotations

import urllib.request
from contextlib import contextmanager, nullcontext

from prometheus_client.parser import text_string_to_metric_families

from harness.operator_process import OperatorProcess


def resource(name: str, assets, storage: str, mode: str = "finetune", epochs: int = 2, **extra) -> dict:
    """A cpu run of topology "2". `assets` is the `ground_assets` fixture and `storage` a gs://
    prefix (the `storage` fixture): pods read nothing from this machine's paths."""
    spec = {
        "tpu": {"generation": "cpu", "topology": "2"},
        "mode": mode,
        "image": "registry.example/tpufinetune-trainer:test",
        "model": {"id": assets.model},
        "dataset": {"id": assets.data, "split": "train"},
        "training": {"epochs": epochs, "batchSizePerDevice": 4, "maxSeqLen": 128},
        "checkpoint": {"storagePath": storage},
    }
    for key, value in extra.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name}, "spec": spec}


def jobs_of(kube, cluster: str, uid: str) -> list:
    client = kube.head_job_client(cluster)
    return [job for job in client.list_jobs() if (job.submission_id or "").startswith(f"tft-{uid}-")]


def start_run(kube, manifest) -> tuple[str, str]:
    kube.apply(manifest)
    name = manifest["metadata"]["name"]
    uid = kube.get("tpufinetune", name)["metadata"]["uid"]
    cluster = kube.wait_for(lambda: kube.status(name).get("rayClusterName"), "rayClusterName in status")
    return uid, cluster


def released(kube, ground, cluster: str, pod_uids: list[str]) -> None:
    """The RayCluster and its pods are gone (the real garbage collector took the pods) and
    no Ray process of those pods is left on the machine."""
    kube.wait_for(lambda: kube.get("raycluster", cluster) is None, "RayCluster deleted", timeout=60)
    kube.wait_for(lambda: not kube.pods_of(cluster), "pods collected", timeout=90)
    kube.wait_for(lambda: not any(ground.ray_processes(uid) for uid in pod_uids),
                  "Ray processes of the cluster stopped", timeout=60)


def scrape(operator) -> dict[tuple[str, tuple], float]:
    """Every sample the operator's /metrics serves, by (name, sorted labels)."""
    with urllib.request.urlopen(operator.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def reconciles(operator, phase: str) -> float:
    """Steps the operator process has completed from `phase` (tpufinetune_reconciles_total;
    counted once the step's status write and actions are done)."""
    return scrape(operator).get(("tpufinetune_reconciles_total", (("phase", phase),)), 0.0)


@contextmanager
def operator_with(operator, setup=None, **env):
    """The operator restarted with other settings (a short bound), and `setup` (a context
    manager) in force only while the session's operator is down; the session's operator
    comes back afterwards."""
    operator.kill()
    try:
        with setup or nullcontext():
            other = OperatorProcess({**operator.env, **env}, operator.log_path, hosts_file=operator.hosts_file)
            other.start()
            try:
                yield other
            finally:
                other.kill()
    finally:
        operator.start()


def running(kube, name: str, timeout: float = 300) -> None:
    kube.wait_for(lambda: kube.status(name).get("phase") == "Running", f"{name} Running", timeout=timeout)
