"""Argo CD: the TPUFineTune health check (deploy/argocd/health.lua) run in a real Lua 5.1
interpreter on objects the end-to-end tests watched live (testdata/argocd/, one per phase;
recaptured by TPUFT_CAPTURE_ARGOCD=1 on tests/operator/test_operator_e2e.py and
test_operator_deploy_e2e.py), the argocd-cm snippet that installs it, and the two
Application examples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from manifests import DEPLOY, ROOT, kustomize, load

from harness.argocd_health import HEALTH_LUA, health

ARGOCD = DEPLOY / "argocd"
CAPTURED = Path(__file__).parent / "testdata" / "argocd"
EXPECTED = {
    "pending": "Progressing", "provisioning": "Progressing", "submitting": "Progressing",
    "running": "Progressing", "deleting": "Progressing", "succeeded": "Healthy",
    "failed": "Degraded", "suspended": "Suspended",
    # Waiting for Kueue's quota (tests/ground/test_kueue.py captures it): not Degraded.
    "queued": "Progressing",
}


def captured(name: str) -> dict:
    return json.loads((CAPTURED / f"{name}.json").read_text())


def test_captured_objects_cover_every_phase():
    assert sorted(p.stem for p in CAPTURED.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_health_of_an_object_captured_in_each_phase(name):
    obj = captured(name)
    result = health(obj)
    assert result["status"] == EXPECTED[name]
    assert result["message"] == f"{obj['status']['phase']}: {obj['status']['message']}"


def test_health_before_the_operator_answers_and_for_a_phase_it_does_not_know():
    fresh = captured("pending")
    fresh.pop("status")
    assert health(fresh)["status"] == "Progressing"
    fresh["spec"]["suspend"] = True
    assert health(fresh)["status"] == "Suspended"
    odd = captured("running")
    odd["status"]["phase"] = "Exploded"
    assert health(odd) == {"status": "Unknown", "message": "unknown phase Exploded"}


def test_a_suspend_edit_on_a_running_resource_stays_progressing_until_the_slice_is_released():
    running = captured("running")
    running["spec"]["suspend"] = True
    assert health(running)["status"] == "Progressing"


def test_argocd_cm_snippet_installs_health_lua_verbatim():
    config = load((ARGOCD / "argocd-cm.yaml").read_text())
    crd = load((ROOT / "crds" / "tpufinetunes.tpufinetune.dev.yaml").read_text())
    key = f"resource.customizations.health.{crd['spec']['group']}_{crd['spec']['names']['kind']}"
    assert (config["kind"], config["metadata"]["name"]) == ("ConfigMap", "argocd-cm")
    assert config["data"] == {key: HEALTH_LUA.read_text()}
    # What Argo CD runs is what the tests run.
    assert health(captured("succeeded"), source=config["data"][key])["status"] == "Healthy"


@pytest.mark.cluster
def test_argocd_cm_snippet_is_a_valid_config_map(control_plane, namespace):
    config = load((ARGOCD / "argocd-cm.yaml").read_text())
    config["metadata"]["namespace"] = namespace
    result = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(config))
    assert "configmap/argocd-cm created (server dry run)" in result.stdout


def test_application_examples():
    operator = load((ARGOCD / "application-operator.yaml").read_text())
    finetunes = load((ARGOCD / "application-finetunes.yaml").read_text())
    for app in (operator, finetunes):
        assert (app["apiVersion"], app["kind"]) == ("argoproj.io/v1alpha1", "Application")
        assert app["spec"]["syncPolicy"]["automated"] == {"prune": True, "selfHeal": True}
    assert (ROOT / operator["spec"]["source"]["path"]).is_dir()
    assert operator["spec"]["destination"]["namespace"] == "tpufinetune-system"
    assert finetunes["spec"]["source"]["directory"]["recurse"] is True


@pytest.mark.cluster
def test_the_operator_application_builds_with_its_image_override(control_plane, tmp_path):
    """As Argo CD does: `kustomize edit set image` in a checkout of the source path, then build."""
    operator = load((ARGOCD / "application-operator.yaml").read_text())
    for folder in ("deploy", "crds"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    source = tmp_path / operator["spec"]["source"]["path"]
    (image,) = operator["spec"]["source"]["kustomize"]["images"]
    name, new = image.split("=", 1)
    with open(source / "kustomization.yaml", "a") as kustomization:
        kustomization.write(f"images:\n  - name: {name}\n    newName: {new.rsplit(':', 1)[0]}\n"
                            f"    newTag: \"{new.rsplit(':', 1)[1]}\"\n")
    objects = kustomize(control_plane, source)
    assert {o["kind"] for o in objects} >= {"CustomResourceDefinition", "ClusterRole", "Deployment", "Service"}
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == new
