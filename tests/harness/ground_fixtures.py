"""Fixtures for the test ground (harness/ground.py): a real control plane with kube-scheduler,
kube-controller-manager, KubeRay and GKE-shaped nodes whose pods are real Ray processes.

- `ground` (session): a started `Ground` with the default pools (v6e 4x4, v7x 2x2x2, CPU).
- `operator` (session): the operator on the ground, as deploy/'s ServiceAccount, reaching
  each Ray head by its Service name through the ground's cluster DNS; metrics on. At the end
  of the session it fails if the ServiceAccount was ever refused (a missing RBAC rule).
- `ground_namespace` (function): a fresh namespace on the ground, where the operator is
  bound as in any namespace it watches (service_account.bind_namespace), deleted afterwards
  (the real namespace controller empties it; `delete_namespace`).
- `kube` (function): kubectl helpers bound to that namespace.
- `ground_assets` (session): the trainer's offline assets (`trainer_assets`) uploaded to the
  ground's bucket: `.model`, `.data` and `.root` are gs:// URIs (pods never read host paths).
- `storage` (function): a fresh gs:// prefix in the ground's bucket for one test's checkpoints.

Tests that use them are marked `ground` (and `cluster`) automatically.
"""

from __future__ import annotations

import base64
import json
import re
import urllib.request
from dataclasses import dataclass
from datetime import datetime

import pytest
import yaml

from harness import session_order
from harness.ports import free_port
from harness.processes import tail
from harness.waiting import wait_for
from harness.ground import Ground, event_time
from harness.k8s_fixtures import namespace_name
from harness.service_account import bind_namespace, refusals

_GROUND_FIXTURES = {"ground", "operator", "ground_namespace", "kube", "ground_assets", "storage"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _GROUND_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ground)
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def ground(request):
    # One ground at a time on this machine: under xdist only the "ground" lane (one worker,
    # session_order.py) may start it; the test that starts it must be of that lane.
    refusal = session_order.ground_lane_refusal(request.config, request._pyfuncitem.nodeid)
    if refusal:
        pytest.fail(refusal, pytrace=False)
    g = Ground()
    g.start(timeout=180)
    try:
        yield g
    finally:
        report_clusters_with_workers(request.config, g.clusters_with_workers())
        g.stop()


CLUSTERS_KEY = "ground_clusters_with_workers"


def report_clusters_with_workers(config, clusters: list[str]) -> None:
    """For the session's summary (conftest.py): on the controller, or through xdist's
    worker output."""
    if hasattr(config, "workeroutput"):
        config.workeroutput[CLUSTERS_KEY] = clusters
    else:
        config.stash[CLUSTERS_STASH] = clusters


CLUSTERS_STASH = pytest.StashKey[list]()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist: a worker's ground count reaches the controller."""
    clusters = getattr(node, "workeroutput", {}).get(CLUSTERS_KEY)
    if clusters is not None:
        node.config.stash[CLUSTERS_STASH] = clusters


@dataclass(frozen=True)
class StoredAssets:
    root: str  # gs:// URIs
    model: str
    data: str  # the JSONL object


@pytest.fixture(scope="session")
def ground_assets(ground, trainer_assets) -> StoredAssets:
    root = ground.gcs.upload(trainer_assets.root, ground.gcs.unique_uri("assets"))
    return StoredAssets(root=root, model=f"{root}/model", data=f"{root}/data/train.jsonl")


@pytest.fixture
def storage(request, ground) -> str:
    return ground.gcs.unique_uri("runs", re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40].strip("-"))


@pytest.fixture(scope="session")
def operator(ground):
    metrics_port = free_port()
    process = ground.start_operator(extra_env={
        "TPUFT_METRICS_PORT": str(metrics_port),
        "TPUFT_PROVISION_TIMEOUT": "600",
    })
    process.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield process
    process.stop()
    refused = refusals(process.log_path, DELETED_NAMESPACES)
    if refused:
        pytest.fail(f"the operator's ServiceAccount was refused {len(refused)} time(s); "
                    "deploy/base/clusterrole.yaml lacks a rule:\n" + "\n".join(refused[:20]), pytrace=False)


# Each namespace this process deleted, and when (local time, as the operator's log writes
# it): refusals there after that are the namespace controller's doing (service_account.py).
DELETED_NAMESPACES: dict[str, datetime] = {}


def delete_namespace(ground, name: str) -> None:
    """Delete a test's namespace without waiting: its Ray pods drain for up to 30 s after
    SIGTERM (Ray's own drain), idle, while the next test starts. Waiting for them cost about
    45 s a test (measured), the suite's budget cannot hold that."""
    DELETED_NAMESPACES.setdefault(name, datetime.now())
    ground.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def ground_namespace(request, ground):
    name = namespace_name(request)
    bind_namespace(ground.cp, name, create=True)  # the operator watches t-* and acts where it is bound
    yield name
    delete_namespace(ground, name)


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
    if report.when == "call" and report.failed and "kube" in item.funcargs:
        # Before teardown deletes the namespace: its pods are still there to look at.
        kube = item.funcargs["kube"]
        try:
            pods = kube.ground.pod_report(kube.ns)
        except Exception as error:  # a report, never a second failure
            pods = f"(no report: {error!r})"
        report.sections.append(("ground pods", pods))
        try:
            nodes = _nodes_and_evictions(kube)
        except Exception as error:  # a report, never a second failure
            nodes = f"(no report: {error!r})"
        report.sections.append(("ground nodes and evictions", nodes))
        report.sections.append(("node agent log tail", tail(kube.ground.workdir / "node-agent.log", 40)))


def _nodes_and_evictions(kube) -> str:
    """Each node's Ready condition and taints, and the namespace's eviction and preemption
    events: whether the test's pods lost their node before its failure."""
    lines = []
    for node in json.loads(kube.ground.kubectl("get", "nodes", "-o", "json").stdout)["items"]:
        ready = next((c for c in node["status"].get("conditions") or [] if c["type"] == "Ready"), {})
        taints = ",".join(f"{t['key']}:{t['effect']}" for t in node["spec"].get("taints") or [])
        lines.append(f"{node['metadata']['name']}: Ready={ready.get('status')} {ready.get('reason', '')} "
                     f"since {ready.get('lastTransitionTime')} taints=[{taints}]")
    for e in kube.ground.events(kube.ns):
        if e.get("reason") in ("TaintManagerEviction", "Evicted", "Preempted", "Preempting", "NodeNotReady",
                               "Killing", "FailedScheduling"):
            lines.append(f"{event_time(e)} {e['involvedObject']['kind']}/"
                         f"{e['involvedObject']['name']}: {e['reason']}: {e.get('message', '')}")
    return "\n".join(lines)


# Reads go to the API server's REST API (ControlPlane.get_json): the waits poll them every
# half second, and a forked kubectl costs CPU the trainer needs on two cores.
# kind -> (API prefix, plural, namespaced); any other kind is read through kubectl.
_READS = {
    "pod": ("api/v1", "pods", True), "pods": ("api/v1", "pods", True),
    "pvc": ("api/v1", "persistentvolumeclaims", True), "secret": ("api/v1", "secrets", True),
    "events": ("api/v1", "events", True), "nodes": ("api/v1", "nodes", False),
    "pdb": ("apis/policy/v1", "poddisruptionbudgets", True),
    "raycluster": ("apis/ray.io/v1", "rayclusters", True),
    "tpufinetune": ("apis/tpufinetune.dev/v1alpha1", "tpufinetunes", True),
}


def _selectors(args: tuple[str, ...]) -> dict | None:
    """kubectl's -l / --field-selector arguments as list query parameters (None for others)."""
    query, rest = {}, list(args)
    while rest:
        flag = rest.pop(0)
        if flag in ("-l", "--selector") and rest:
            query["labelSelector"] = rest.pop(0)
        elif flag == "--field-selector" and rest:
            query["fieldSelector"] = rest.pop(0)
        else:
            return None
    return query


class Kube:
    """Small helpers for one namespace of the ground: reads through the API server's REST
    API, everything else through the real kubectl."""

    def __init__(self, ground: Ground, namespace: str):
        self.ground = ground
        self.cp = ground.cp
        self.ns = namespace

    def _read(self, kind: str, name: str = "", query: dict | None = None) -> dict | None:
        """GET one object (None when it does not exist) or a list, as kubectl -o json gives
        it (list items carry apiVersion and kind)."""
        prefix, plural, namespaced = _READS[kind]
        path = f"/{prefix}/" + (f"namespaces/{self.ns}/" if namespaced else "") + plural + (f"/{name}" if name else "")
        status, body = self.cp.get_json(path, query)
        if status == 404 and name:
            return None
        if status != 200:
            raise AssertionError(f"GET {path} answered {status}: {body}")
        if not name:
            for item in body["items"]:
                item.setdefault("apiVersion", body.get("apiVersion"))
                item.setdefault("kind", body.get("kind", "").removesuffix("List"))
        return body

    def kubectl(self, *args, **kwargs):
        return self.cp.kubectl("-n", self.ns, *args, **kwargs)

    def apply(self, manifest: dict):
        return self.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))

    def get(self, kind: str, name: str) -> dict | None:
        if kind in _READS:
            return self._read(kind, name)
        result = self.kubectl("get", kind, name, "-o", "json", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def items(self, kind: str, *selector: str) -> list[dict]:
        query = _selectors(selector)
        if kind in _READS and query is not None:
            return self._read(kind, query=query)["items"]
        return json.loads(self.kubectl("get", kind, *selector, "-o", "json").stdout)["items"]

    def pods_of(self, cluster: str) -> list[dict]:
        return self.items("pods", "-l", f"ray.io/cluster={cluster}")

    def wait_for(self, predicate, what: str, timeout: float = 120, interval: float = 0.5, details=None):
        return wait_for(predicate, timeout, what, interval, details=details)

    def run_state(self, name: str) -> str:
        """A run's phase, its message and its conditions' reasons: what a failed wait says."""
        status = self.status(name)
        reasons = ", ".join(f"{c.get('type')}={c.get('status')} ({c.get('reason')})"
                            for c in status.get("conditions") or [])
        return f"run {name}: phase {status.get('phase')!r}, message {status.get('message')!r}; {reasons}"

    def status(self, name: str) -> dict:
        return (self.get("tpufinetune", name) or {}).get("status") or {}

    def head_dashboard(self, cluster: str) -> str | None:
        """The cluster's Ray dashboard at its head pod's IP (None until the pod has one)."""
        head = next((p for p in self.pods_of(cluster) if p["metadata"]["labels"].get("ray.io/node-type") == "head"), None)
        ip = ((head or {}).get("status") or {}).get("podIP")
        return f"http://{ip}:8265" if ip else None

    def head_get(self, cluster: str, path: str) -> dict:
        """GET a dashboard path on the cluster's head, authenticated (OSError if it does
        not answer)."""
        base = self.head_dashboard(cluster)
        if base is None:
            raise OSError(f"the head of {cluster} has no pod IP yet")
        request = urllib.request.Request(base + path, headers=self.ray_headers(cluster))
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def ray_token(self, cluster: str) -> str:
        """The run's own Ray token, read as the admin from the Secret its RayCluster's
        authOptions name (the operator itself never reads it back); "" for a RayCluster
        without token auth (one an older operator made)."""
        body = self.get("raycluster", cluster)
        auth = body["spec"].get("authOptions") or {}
        if auth.get("mode") != "token":
            return ""
        secret = self.get("secret", auth["secretName"])
        return base64.b64decode(secret["data"]["auth_token"]).decode()

    def ray_headers(self, cluster: str) -> dict:
        token = self.ray_token(cluster)
        return {"Authorization": f"Bearer {token}"} if token else {}

    def head_job_client(self, cluster: str):
        """A Job API client on the cluster's head pod (by its pod IP), with its own token."""
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.head_dashboard(cluster), headers=self.ray_headers(cluster))


@pytest.fixture
def kube(ground, ground_namespace):
    return Kube(ground, ground_namespace)
