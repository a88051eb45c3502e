"""Status writes refused around the end of a real job lose nothing.

Real parts: the kube-apiserver (its status subresource, and a ValidatingAdmissionPolicy
that refuses every write of tpufinetunes/status in the test's namespace, as a
misbehaving policy or webhook would), the operator's KubeBackend, a local Ray head, the
trainer's real finetune job. No KubeRay runs on the bare control plane: the test marks
the RayCluster the run created as ready (what KubeRay would write), and the local head
stands in for its head (TPUFT_DASHBOARD_URL).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import yaml

from tpufinetune.adapters.kube import KubeBackend
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import phases
from tpufinetune.driver import Run
from tpufinetune.settings import Settings

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow]
REFUSAL = "status writes are refused by the test's admission policy"


def refuse_status_writes(namespace: str) -> list[dict]:
    name = f"refuse-status-{namespace}"
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{
                      "apiGroups": ["tpufinetune.dev"], "apiVersions": ["*"], "operations": ["UPDATE"],
                      "resources": ["tpufinetunes/status"]}]},
                  "validations": [{"expression": "false", "message": REFUSAL}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": name},
         "spec": {"policyName": name, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {
                      "matchLabels": {"kubernetes.io/metadata.name": namespace}}}}},
    ]


class Backend(KubeBackend):
    """The operator's KubeBackend; its Events go to a list, since kopf posts them only
    from inside a running operator (and they are not what this test is about)."""

    events: list[str] = []

    def record(self, ident, type_, reason, message):
        self.events.append(reason)


def test_refused_status_writes_around_the_job_end_lose_no_epoch_and_no_result(
        control_plane, kuberay_crd, k8s_api, namespace, ray_head, trainer_assets, tmp_path):
    kubectl = control_plane.kubectl
    manifest = {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "refused"},
                "spec": {"tpu": {"generation": "cpu", "topology": "2"}, "mode": "finetune",
                         "image": "registry.example/tpufinetune-trainer:test",
                         "model": {"id": str(trainer_assets.model)},
                         "dataset": {"id": str(trainer_assets.data), "split": "train"},
                         "training": {"epochs": 2, "batchSizePerDevice": 4, "maxSeqLen": 128},
                         "checkpoint": {"storagePath": str(tmp_path / "ckpt")}}}
    kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(manifest))
    body = json.loads(kubectl("-n", namespace, "get", "tpufinetune", "refused", "-o", "json").stdout)
    # A fixed dashboard (the local head, its own token); the run's token Secret and signing
    # key still get created, the key in the test's namespace.
    settings = Settings(dashboard_url=ray_head.dashboard_url, poll_interval=1, ray_token=ray_head.token or "",
                        operator_namespace=namespace)
    run = Run(body, Backend(k8s_api, settings), RayJobs(settings.ray_headers(), settings.ray_timeout), settings)
    policy = yaml.safe_dump_all(refuse_status_writes(namespace))
    jobs = ray_head.job_client()

    async def drive() -> int:
        refused, policy_on, steps_after_end = 0, False, 0
        deadline = time.monotonic() + 600
        while run.status.get("phase") not in phases.TERMINAL:
            assert time.monotonic() < deadline, run.status
            try:
                await run.step()
            except Exception as error:
                assert REFUSAL in str(error), error
                refused += 1
            phase = run.status.get("phase")
            if phase == phases.PROVISIONING:  # what KubeRay would report
                kubectl("-n", namespace, "patch", "raycluster", run.status["rayClusterName"], "--subresource=status",
                        "--type=merge", "-p", '{"status": {"state": "ready"}}', check=False)
            if phase == phases.RUNNING and not policy_on:
                kubectl("apply", "-f", "-", input=policy)
                policy_on = True
            if policy_on and refused:
                ended = str(jobs.get_job_status(run.status["jobId"]).value) not in phases.JOB_ACTIVE
                steps_after_end += ended
                if steps_after_end == 3:  # the job's last events and its end, all refused: lift it
                    kubectl("delete", "-f", "-", input=policy)
            await asyncio.sleep(0.5)
        return refused

    refused = asyncio.run(drive())
    assert refused >= 3
    status = json.loads(kubectl("-n", namespace, "get", "tpufinetune", "refused", "-o", "json").stdout)["status"]
    assert status["phase"] == phases.SUCCEEDED, status.get("message")
    assert [entry["epoch"] for entry in status["history"]] == [1, 2]
    assert status["epochProgress"] == "2/2"
    assert status["checkpointURI"] and str(tmp_path / "ckpt") in status["checkpointURI"]
    assert status["exportedModelURI"]
