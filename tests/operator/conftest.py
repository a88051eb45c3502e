"""The operator as users run it (`tpufinetune operator`), against the real control plane
and a real local Ray head. The tests play KubeRay's part: nothing runs pods here, so they
mark a RayCluster ready the way KubeRay would, and the operator reaches the Ray head
through its documented TPUFT_DASHBOARD_URL setting.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import yaml

from harness.operator_process import OperatorProcess
from harness.service_account import refusals, service_account_kubeconfig


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def operator(control_plane, kuberay_crd, ray_head, tmp_path_factory):
    """The operator as deployed: the ServiceAccount and ClusterRole of deploy/base (not the
    admin), metrics on, no Forbidden response all session (checked when it ends)."""
    workdir = tmp_path_factory.mktemp("operator")
    env = control_plane.env()
    metrics_port = _free_port()
    env.update(
        KUBECONFIG=str(service_account_kubeconfig(control_plane, workdir / "kubeconfig")),
        TPUFT_DASHBOARD_URL=ray_head.dashboard_url,
        TPUFT_RAY_TOKEN=ray_head.token or "",
        TPUFT_POLL_INTERVAL="1",
        TPUFT_PROVISION_TIMEOUT="600",
        TPUFT_METRICS_PORT=str(metrics_port),
        HF_HUB_OFFLINE="1",
    )
    process = OperatorProcess(env, workdir / "operator.log")
    process.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    process.start()
    yield process
    process.stop()
    refused = refusals(process.log_path)
    if refused:
        pytest.fail(f"the operator's ServiceAccount was refused {len(refused)} time(s); "
                    "deploy/base/clusterrole.yaml lacks a rule:\n" + "\n".join(refused[:20]), pytrace=False)


@pytest.fixture(autouse=True)
def _operator_log_on_failure(request):
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed and "operator" in request.fixturenames:
        print("---- operator log tail ----\n" + request.getfixturevalue("operator").log_tail())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


class Kube:
    """Small helpers over the real kubectl, for one namespace."""

    def __init__(self, control_plane, namespace: str):
        self.cp = control_plane
        self.ns = namespace

    def kubectl(self, *args, **kwargs):
        return self.cp.kubectl("-n", self.ns, *args, **kwargs)

    def apply(self, manifest: dict):
        return self.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))

    def get(self, kind: str, name: str) -> dict | None:
        result = self.kubectl("get", kind, name, "-o", "json", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def wait_for(self, predicate, what: str, timeout: float = 120, interval: float = 0.5):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")

    def status(self, name: str) -> dict:
        return (self.get("tpufinetune", name) or {}).get("status") or {}

    def mark_cluster_ready(self, cluster: str) -> dict:
        """Play KubeRay: once the RayCluster exists, report it ready on its status."""
        body = self.wait_for(lambda: self.get("raycluster", cluster), f"RayCluster {cluster}")
        patch = {"status": {"state": "ready", "head": {"serviceName": f"{cluster}-head-svc"}}}
        self.kubectl("patch", "raycluster", cluster, "--subresource=status", "--type=merge", "-p", json.dumps(patch))
        return body


@pytest.fixture
def kube(control_plane, namespace):
    return Kube(control_plane, namespace)
