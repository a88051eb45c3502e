"""Shared steps of the operator's end-to-end tests on the test ground (test_*_e2e.py): a
TPUFineTune manifest, applying it, its jobs on the head, its release, and the operator's
own metrics (what it has done, observed from outside), and what GitOps sees of a run (a live
watch of the objects, Argo CD's health of each phase).

TPUFT_CAPTURE_ARGOCD=1 also writes the watched objects, one per phase, to
tests/deploy/testdata/argocd/ (the fast Lua tests' data; machine paths scrubbed)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.request
from contextlib import contextmanager, nullcontext
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from harness.argocd_health import health
from tpufinetune_trainer.events import parse_text
from harness.operator_process import OperatorProcess


def resource(name: str, assets, storage: str, mode: str = "finetune", epochs: int = 2, rows: int | None = None,
             **extra) -> dict:
    """A cpu run of topology "2". `assets` is the `ground_assets` fixture and `storage` a gs://
    prefix (the `storage` fixture): pods read nothing from this machine's paths. `rows` trains
    on the data's first rows only (the split `train[:rows]`): short epochs for a test that
    needs several of them, or a run that ends soon after the fault it is about."""
    spec = {
        "tpu": {"generation": "cpu", "topology": "2"},
        "mode": mode,
        "image": "registry.example/tpufinetune-trainer:test",
        "model": {"id": assets.model},
        "dataset": {"id": assets.data, "split": f"train[:{rows}]" if rows else "train"},
        # 8 examples a step: about the steps per epoch these runs took when a step was four
        # 128-token blocks (the ground's examples average ~90 tokens), so runs stay short.
        "training": {"epochs": epochs, "batchSizePerDevice": 8, "maxSeqLen": 128},
        "checkpoint": {"storagePath": storage},
    }
    for key, value in extra.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name}, "spec": spec}


def jobs_of(kube, cluster: str, uid: str) -> list:
    client = kube.head_job_client(cluster)
    return [job for job in client.list_jobs() if (job.submission_id or "").startswith(f"tft-{uid}-")]


def events_of_attempt(kube, cluster: str, uid: str, attempt: int) -> list:
    """The trainer's events in attempt `attempt`'s job log on the cluster's head."""
    client = kube.head_job_client(cluster)
    return parse_text(client.get_job_logs(f"tft-{uid}-{attempt}"))


def workers(kube, cluster: str) -> list[dict]:
    """The worker pods of a RayCluster (KubeRay's label ray.io/node-type)."""
    return [p for p in kube.pods_of(cluster) if p["metadata"]["labels"].get("ray.io/node-type") == "worker"]


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
    comes back afterwards. Each hand-over is a graceful stop (SIGTERM, as a rollout stops a
    pod): the stopped operator hands its Lease back, so the next leads at once instead of
    after the Lease's lapse."""
    operator.stop()
    try:
        with setup or nullcontext():
            other = OperatorProcess({**operator.env, **env}, operator.log_path, hosts_file=operator.hosts_file)
            other.start()
            try:
                yield other
            finally:
                other.stop()
    finally:
        operator.start()


def running(kube, name: str, timeout: float = 300) -> dict:
    """Waits for `name` Running; its status then."""
    return kube.wait_for(lambda: (s := kube.status(name)).get("phase") == "Running" and s, f"{name} Running",
                         timeout=timeout)


CAPTURE_DIR = Path(__file__).resolve().parents[1] / "deploy" / "testdata" / "argocd"
EXPECTED_HEALTH = {
    "Pending": "Progressing", "Provisioning": "Progressing", "Submitting": "Progressing",
    "Running": "Progressing", "Deleting": "Progressing", "Succeeded": "Healthy",
    "Failed": "Degraded", "Suspended": "Suspended",
}


class Watch:
    """`kubectl get tpufinetunes -w -o json` in one namespace: every version of every
    object, as the API server sends them."""

    def __init__(self, control_plane, namespace: str):
        self.objects: list[dict] = []
        self.proc = subprocess.Popen(
            [str(control_plane.kubectl_path), "-n", namespace, "get", "tpufinetunes", "-w", "-o", "json"],
            env=control_plane.env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        decoder, buffer = json.JSONDecoder(), ""
        for line in self.proc.stdout:
            buffer += line
            try:
                obj, end = decoder.raw_decode(buffer.strip())
            except ValueError:
                continue
            self.objects.append(obj)
            buffer = buffer.strip()[end:]

    def stop(self) -> list[dict]:
        self.proc.terminate()
        self.proc.wait(10)
        self.thread.join(10)
        return self.objects


def by_phase(objects: list[dict], name: str) -> dict[str, dict]:
    """The last version of `name` seen in each phase; a suspended Pending is 'Suspended'."""
    seen: dict[str, dict] = {}
    for obj in objects:
        if obj["metadata"]["name"] != name:
            continue
        phase = (obj.get("status") or {}).get("phase")
        if phase == "Pending" and (obj.get("spec") or {}).get("suspend"):
            phase = "Suspended"
        if phase:
            seen[phase] = obj
    return seen


def check_health(seen: dict[str, dict]) -> None:
    for phase, obj in seen.items():
        result = health(obj)
        assert result["status"] == EXPECTED_HEALTH[phase], (phase, result)
        assert obj["status"]["message"] in result["message"], (phase, result)


def capture(seen: dict[str, dict], scrub: dict[str, str]) -> None:
    if os.environ.get("TPUFT_CAPTURE_ARGOCD") != "1":
        return
    CAPTURE_DIR.mkdir(parents=True, exist_ok=True)
    for phase, obj in seen.items():
        obj = {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "managedFields"}}
        text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
        for real, placeholder in scrub.items():
            text = text.replace(real, placeholder)
        (CAPTURE_DIR / f"{phase.lower()}.json").write_text(text)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def holds_applied(applied, live) -> bool:
    """Everything applied is in the live object unchanged (the schema may add defaults)."""
    if isinstance(applied, dict):
        return isinstance(live, dict) and all(k in live and holds_applied(v, live[k]) for k, v in applied.items())
    return applied == live
