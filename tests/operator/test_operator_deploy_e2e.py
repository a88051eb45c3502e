"""What a deployment depends on, end to end on the test ground with the operator running as
deploy/'s ServiceAccount (the `operator` fixture): GitOps sees no drift after a run, the Argo CD
health check (deploy/argocd/health.lua, in a real Lua interpreter) reads every phase of
objects watched live, and /metrics moves with the run.

TPUFT_CAPTURE_ARGOCD=1 also writes the watched objects, one per phase, to
tests/deploy/testdata/argocd/ (the fast Lua tests' data; machine paths scrubbed).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from ground_runs import scrape
from harness.argocd_health import health
from tpufinetune.core import runmetrics

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

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


def within(applied, live) -> bool:
    """Everything applied is in the live object unchanged (the schema may add defaults)."""
    if isinstance(applied, dict):
        return isinstance(live, dict) and all(k in live and within(v, live[k]) for k, v in applied.items())
    return applied == live


def manifest(name: str, spec: dict) -> dict:
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name}, "spec": spec}


def test_a_full_run_leaves_the_spec_as_applied_and_reports_health_and_metrics(
        operator, kube, ground, ground_assets, storage):
    metrics_before = scrape(operator)
    watch = Watch(ground.cp, kube.ns)
    applied = manifest("gitops-run", {
        "tpu": {"generation": "cpu", "topology": "2"},
        "image": "registry.example/tpufinetune-trainer:test",
        "model": {"id": ground_assets.model},
        "dataset": {"id": ground_assets.data, "split": "train[:64]"},
        "training": {"epochs": 1, "batchSizePerDevice": 4, "maxSeqLen": 64},
        "checkpoint": {"storagePath": storage},
    })
    kube.apply(applied)
    created = kube.get("tpufinetune", "gitops-run")
    cluster = kube.wait_for(lambda: kube.status("gitops-run").get("rayClusterName"), "rayClusterName")
    kube.kubectl("wait", "tpufinetune/gitops-run", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
    kube.wait_for(lambda: kube.get("raycluster", cluster) is None, "RayCluster released")
    final = json.loads(kube.kubectl("get", "tpufinetune", "gitops-run", "-o", "json", "--show-managed-fields").stdout)
    seen = by_phase(watch.stop(), "gitops-run")

    # No drift: what Argo CD compares is exactly what was applied (the API server's schema
    # defaults included), and only kubectl ever wrote spec fields.
    assert final["spec"] == created["spec"]
    assert within(applied["spec"], final["spec"])
    assert final["metadata"]["generation"] == created["metadata"]["generation"] == 1
    assert set(final["metadata"].get("annotations") or {}) <= {"kubectl.kubernetes.io/last-applied-configuration"}
    spec_writers = {entry["manager"] for entry in final["metadata"]["managedFields"]
                    if "f:spec" in (entry.get("fieldsV1") or {})}
    assert spec_writers == {"kubectl-client-side-apply"}, final["metadata"]["managedFields"]

    assert {"Pending", "Provisioning", "Submitting", "Running", "Succeeded"} <= set(seen), sorted(seen)
    check_health(seen)
    capture(seen, {ground_assets.root: "gs://tpufinetune-ground/assets", storage: "gs://tpufinetune-ground/runs/gitops",
                   kube.ns: "ml-team"})

    after = scrape(operator)
    for phase in ("New", "Pending", "Provisioning", "Submitting", "Running"):
        assert delta(metrics_before, after, "tpufinetune_reconciles_total", phase=phase) >= 1, phase
    assert delta(metrics_before, after, "tpufinetune_job_outcomes_total", outcome="Succeeded", reason="Succeeded") == 1
    assert delta(metrics_before, after, "tpufinetune_apply_to_raycluster_seconds_count") == 1
    assert delta(metrics_before, after, "tpufinetune_apply_to_job_submitted_seconds_count") == 1
    assert after[("tpufinetune_resources", (("phase", "Succeeded"),))] >= 1
    # The run's own series, labelled by namespace and name: what its final status says.
    run = (("name", "gitops-run"), ("namespace", kube.ns))
    assert after[("tpufinetune_run_phase", (*run, ("phase", "Succeeded")))] == 1
    assert [key for key in after if key[0] == "tpufinetune_run_phase" and dict(key[1])["name"] == "gitops-run"] == [
        ("tpufinetune_run_phase", (*run, ("phase", "Succeeded")))]
    expected = runmetrics.values(final["status"])
    assert {"tpufinetune_run_loss", "tpufinetune_run_epoch", "tpufinetune_run_attempts"} <= set(expected)
    for metric in ("tpufinetune_run_loss", "tpufinetune_run_epoch", "tpufinetune_run_attempts"):
        assert after[(metric, run)] == pytest.approx(expected[metric]), metric


def test_suspended_deleted_and_invalid_resources_report_their_health(operator, kube, ground):
    metrics_before = scrape(operator)
    watch = Watch(ground.cp, kube.ns)
    base = {"tpu": {"generation": "cpu", "topology": "1"}, "mode": "collectives", "image": "registry.example/t:1"}
    kube.apply(manifest("held", {**base, "suspend": True}))
    kube.wait_for(lambda: kube.status("held").get("message", "").startswith("suspended"), "suspended message")
    kube.kubectl("delete", "tpufinetune", "held", "--wait=true", "--timeout=60s", timeout=70)
    # Valid for the schema, refused by the operator: a request above its limit.
    kube.apply(manifest("refused", {**base, "workers": {"resources": {
        "requests": {"memory": "4Gi"}, "limits": {"memory": "2Gi"}}}}))
    kube.kubectl("wait", "tpufinetune/refused", "--for=condition=Failed", "--timeout=60s", timeout=70)
    objects = watch.stop()
    held, refused = by_phase(objects, "held"), by_phase(objects, "refused")

    assert {"Suspended", "Deleting"} <= set(held), sorted(held)
    assert "Failed" in refused, sorted(refused)
    assert "exceeds the limit" in refused["Failed"]["status"]["message"]
    check_health(held)
    check_health(refused)
    capture({"Suspended": held["Suspended"], "Deleting": held["Deleting"], "Failed": refused["Failed"]},
            {kube.ns: "ml-team"})

    after = scrape(operator)
    assert delta(metrics_before, after, "tpufinetune_job_outcomes_total", outcome="Failed", reason="InvalidSpec") == 1
    # A deleted run's series are gone; a failed one keeps its phase.
    assert not [key for key in after if key[0].startswith("tpufinetune_run_") and ("name", "held") in key[1]]
    assert after[("tpufinetune_run_phase", (("name", "refused"), ("namespace", kube.ns), ("phase", "Failed")))] == 1
    assert delta(metrics_before, after, "tpufinetune_apply_to_raycluster_seconds_count") == 0
