"""A newer CRD beside this operator (an operator rollback, or CRDs upgraded first), on a
real kube-apiserver (docs/architecture.md, "Upgrades and version skew").

While the CRD is this version's, the API server never lets an unknown field through:
kubectl's strict field validation refuses it, and a client that skips validation has it
pruned. Only a newer CRD stores fields this operator does not know; then a run proceeds
without them and says which (condition SpecFieldsIgnored, a Warning Event), and the
status keys a newer operator wrote stay as they are.

Real parts: the kube-apiserver and its CRD pruning, the operator's KubeBackend and
driver.Run. No KubeRay runs on the bare control plane, so the run is stepped only up to
Provisioning (its RayCluster created), which is all that depends on the spec here.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
import yaml

from tpufinetune.adapters.kube import KubeBackend
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.core.api import parse_stored_spec
from tpufinetune.crdgen import CRD_FILENAME
from tpufinetune.driver import Run
from tpufinetune.settings import Settings

pytestmark = [pytest.mark.cluster]
CRD = Path(__file__).resolve().parents[2] / "crds" / CRD_FILENAME
SPEC = {"tpu": {"generation": "cpu", "topology": "2"}, "image": "registry.example/tpufinetune-trainer:test",
        "checkpoint": {"storagePath": "gs://tpufinetune-ground/ckpt"}}


class Backend(KubeBackend):
    """The operator's KubeBackend; Events go to a list (kopf posts them only from inside a
    running operator)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.events: list[tuple[str, str, str]] = []

    def record(self, ident, type_, reason, message):
        self.events.append((type_, reason, message))


def newer_crd(tmp_path: Path) -> Path:
    """This CRD plus what a later release might add: a spec field at the top and one
    nested, and a status key."""
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    schema["spec"]["properties"]["futureKnob"] = {"type": "integer"}
    schema["spec"]["properties"]["tpu"]["properties"]["multislicePolicy"] = {"type": "string"}
    schema["status"]["properties"]["rayTokenNewer"] = {
        "type": "object", "properties": {"secretName": {"type": "string"}}}
    path = tmp_path / "newer-crd.yaml"
    path.write_text(yaml.safe_dump(crd))
    return path


def manifest(name: str, spec: dict) -> str:
    return yaml.safe_dump({"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune",
                           "metadata": {"name": name}, "spec": spec})


def test_this_crd_never_lets_an_unknown_field_reach_the_operator(control_plane, namespace):
    newer = dict(SPEC, futureKnob=3)
    refused = control_plane.kubectl("-n", namespace, "apply", "-f", "-", input=manifest("strict", newer), check=False)
    assert refused.returncode != 0 and 'unknown field "spec.futureKnob"' in refused.stderr
    # A client that skips field validation: stored, and pruned.
    control_plane.kubectl("-n", namespace, "apply", "--validate=false", "-f", "-", input=manifest("pruned", newer))
    stored = json.loads(control_plane.kubectl("-n", namespace, "get", "tpufinetune", "pruned", "-o", "json").stdout)
    assert "futureKnob" not in stored["spec"]
    assert parse_stored_spec(stored["spec"])[1] == ()  # nothing unknown reaches the operator


def test_under_a_newer_crd_a_run_proceeds_and_names_the_fields_it_ignored(
        control_plane, kuberay_crd, k8s_api, namespace, tmp_path):
    kubectl = control_plane.kubectl
    control_plane.install_crd(newer_crd(tmp_path))
    try:
        spec = copy.deepcopy(SPEC)
        spec["futureKnob"] = 3
        spec["tpu"]["multislicePolicy"] = "strict"
        kubectl("-n", namespace, "apply", "-f", "-", input=manifest("newer", spec))  # the newer CRD knows them
        # What a newer operator wrote before it was rolled back.
        kubectl("-n", namespace, "patch", "tpufinetune", "newer", "--subresource=status", "--type=merge",
                "-p", '{"status": {"rayTokenNewer": {"secretName": "newer-ray-token"}}}')
        body = json.loads(kubectl("-n", namespace, "get", "tpufinetune", "newer", "-o", "json").stdout)
        settings = Settings(poll_interval=1, operator_namespace=namespace)  # the signing key there
        backend = Backend(k8s_api, settings)
        run = Run(body, backend, RayJobs(settings.ray_headers(), settings.ray_timeout), settings)

        async def until_provisioning() -> None:
            for _ in range(5):
                await run.step()
                if run.status.get("phase") == phases.PROVISIONING:
                    return
            raise AssertionError(run.status)

        asyncio.run(until_provisioning())
        stored = json.loads(kubectl("-n", namespace, "get", "tpufinetune", "newer", "-o", "json").stdout)
        status = stored["status"]
        assert status["phase"] == phases.PROVISIONING, status.get("message")
        assert kubectl("-n", namespace, "get", "raycluster", status["rayClusterName"], check=False).returncode == 0
        ignored = cond.find(status, cond.SPEC_FIELDS_IGNORED)
        assert ignored["status"] == "True" and ignored["reason"] == "UnknownFields"
        assert "spec.futureKnob" in ignored["message"] and "spec.tpu.multislicePolicy" in ignored["message"]
        assert [(t, r) for t, r, _ in backend.events if r == "SpecFieldsIgnored"] == [("Warning", "SpecFieldsIgnored")]
        assert status["rayTokenNewer"] == {"secretName": "newer-ray-token"}  # carried, not removed
        assert stored["spec"] == body["spec"] and stored["spec"]["futureKnob"] == 3  # the operator never writes spec

        # Deleting works too (on the previous code every step failed on the status key,
        # so the finalizer could never be released).
        decision = asyncio.run(run.step(deleting=True))
        assert decision.phase == phases.DELETING
    finally:
        control_plane.install_crd(CRD)
    # Why a rollback leaves the newer CRD in place: with this one back, the API server
    # prunes the newer fields and keys from what it reads out of etcd, silently.
    after = json.loads(kubectl("-n", namespace, "get", "tpufinetune", "newer", "-o", "json").stdout)
    assert "futureKnob" not in after["spec"] and "multislicePolicy" not in after["spec"]["tpu"]
    assert "rayTokenNewer" not in after["status"] and after["status"]["phase"] == phases.DELETING
