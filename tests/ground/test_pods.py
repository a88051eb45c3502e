"""Pods on the test ground get what GKE gives them and nothing else: their own /tmp, HOME
and /dev/shm, the env their spec gives (with a kubelet's additions), the volumes they
declare, init containers that really run, their memory limit (an OOM kill ends the
container with OOMKilled), CPU shares from their requests, and their probes (a failed
liveness probe restarts the container, readiness decides Ready). Plain pods with small
commands, and a TPUFineTune run whose worker is OOM-killed.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import images, podbind, podcgroup
from harness.nodeagent import (
    CONTAINER_CREATING, PODS_DIR, POD_INITIALIZING, ContainerState, NodeAgent, PodRun, health_check_to_gcs,
    plain_command, pod_log_path, probe_command, ray_port_map, service_endpoints, waiting, waiting_states)
from harness.kubewatch import KubeWatch
from harness.service_account import refusals
from harness.ports import free_ports
from harness.processes import tail
from harness.podprobes import (
    LIVENESS, READINESS, STARTUP, ContainerProbes, ProbeWorker, http_get, probes_of, tcp_socket)
from harness.podsandbox import mount_order
from harness.podspec import (
    ConfigError, MountError, container_cpu_shares, container_env, milli_cpu_to_shares, mount_targets, pod_cpu_shares,
    service_env, volume_plan)
from tpufinetune_trainer.checkpoint import WRITE_THREADS

# ---- pure: the kubelet's derivations -------------------------------------------------------

POD = {"metadata": {"name": "p", "namespace": "ns", "labels": {"app": "x"}}}
OBJECTS = {
    ("ConfigMap", "settings"): {"data": {"mode": "fast", "bad key": "skipped"}},
    ("Secret", "creds"): {"data": {"token": "czNjcjN0"}},  # s3cr3t
}


def lookup(kind, name):
    return OBJECTS.get((kind, name))


def test_env_from_the_spec_alone_with_the_kubelets_rules():
    container = {"name": "c", "resources": {"limits": {"memory": "1Gi"}},
                 "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CM_"},
                             {"secretRef": {"name": "absent", "optional": True}}],
                 "env": [{"name": "A", "value": "$(CM_mode)-$(B)"}, {"name": "B", "value": "b"},
                         {"name": "T", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                         {"name": "M", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
                         {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                         {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
                         {"name": "NONE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "x", "optional": True}}}]}
    env = container_env(POD, container, base={"PATH": "/bin"}, fields={}, services={"WEB_SERVICE_HOST": "10.0.0.9", "B": "svc"},
                        lookup=lookup)
    assert env == {"PATH": "/bin", "CM_mode": "fast", "A": "fast-svc", "B": "b", "T": "s3cr3t", "M": "fast",
                   "APP": "x", "MEM": "1024", "WEB_SERVICE_HOST": "10.0.0.9"}


@pytest.mark.parametrize("ref, message", [
    ({"secretKeyRef": {"name": "missing", "key": "k"}}, 'secret "missing" not found'),
    ({"secretKeyRef": {"name": "creds", "key": "k"}}, "couldn't find key k in Secret ns/creds"),
    ({"configMapKeyRef": {"name": "settings", "key": "k"}}, "couldn't find key k in ConfigMap ns/settings"),
])
def test_a_missing_reference_is_a_config_error_in_the_kubelets_words(ref, message):
    with pytest.raises(ConfigError, match=message):
        container_env(POD, {"env": [{"name": "X", "valueFrom": ref}]}, base={}, fields={}, services={}, lookup=lookup)


def test_service_variables_as_a_kubelet_injects_them():
    env = service_env([{"metadata": {"name": "my-svc"}, "spec": {"clusterIP": "10.0.0.7", "ports": [
        {"name": "gcs", "port": 6379, "protocol": "TCP"}]}},
        {"metadata": {"name": "headless"}, "spec": {"clusterIP": "None", "ports": [{"port": 80}]}}])
    assert env["MY_SVC_SERVICE_HOST"] == "10.0.0.7" and env["MY_SVC_SERVICE_PORT"] == "6379"
    assert env["MY_SVC_SERVICE_PORT_GCS"] == "6379" and env["MY_SVC_PORT_6379_TCP_ADDR"] == "10.0.0.7"
    assert not any(name.startswith("HEADLESS") for name in env)


def test_volumes_resolve_to_their_sources():
    assert volume_plan({"name": "shm", "emptyDir": {"medium": "Memory"}}, "ns", lookup, None).kind == "memory"
    files = volume_plan({"name": "s", "secret": {"secretName": "creds", "items": [{"key": "token", "path": "t/tok"}]}},
                        "ns", lookup, None).files
    assert files == {"t/tok": (b"s3cr3t", 0o644)}
    gcs = {"name": "g", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {"bucketName": "b1"}}}
    assert volume_plan(gcs, "ns", lookup, "/srv/gcs").path == "/srv/gcs/b1"
    with pytest.raises(MountError, match="driver name gcsfuse.csi.storage.gke.io not found"):
        volume_plan(gcs, "ns", lookup, None)
    with pytest.raises(MountError, match='persistentvolumeclaim "c" not found'):
        volume_plan({"name": "v", "persistentVolumeClaim": {"claimName": "c"}}, "ns", lookup, None)


def test_a_service_account_projection_gets_a_bound_token_the_ca_and_the_namespace():
    """kube-api-access-*, as the ServiceAccount admission plugin adds it to every pod."""
    volume = {"name": "kube-api-access-x", "projected": {"defaultMode": 0o644, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}
    asked = []
    roots = {("ConfigMap", "kube-root-ca.crt"): {"data": {"ca.crt": "PEM"}}}
    files = volume_plan(volume, "ns", lambda kind, name: roots.get((kind, name)), None,
                        pod={"metadata": {"labels": {"a": "1"}}}, fields={"metadata.namespace": "ns"},
                        token=lambda audience, seconds: asked.append((audience, seconds)) or "jwt").files
    assert files == {"token": (b"jwt", 0o644), "ca.crt": (b"PEM", 0o644), "namespace": (b"ns", 0o644)}
    assert asked == [("", 3607)]  # the API server's own audience
    labels = volume_plan({"name": "d", "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
                         "ns", lookup, None, pod={"metadata": {"labels": {"b": "2", "a": "1"}}}).files
    assert labels == {"labels": (b'a="1"\nb="2"', 0o644)}
    with pytest.raises(MountError, match="no token"):
        volume_plan(volume, "ns", lambda kind, name: roots.get((kind, name)), None)


def test_a_container_without_a_command_runs_its_images_entrypoint_as_a_runtime_does(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text('FROM x\nCMD ["old"]\nENTRYPOINT ["tpufinetune"]\nCMD ["operator", "--port=1"]\n')
    image = images.dockerfile_command(dockerfile)
    assert image == (["tpufinetune"], ["operator", "--port=1"])
    assert images.dockerfile_command(images.OPERATOR_DOCKERFILE)[0] == ["tpufinetune"]
    assert plain_command({}, {}, image) == ["tpufinetune", "operator", "--port=1"]
    assert plain_command({"args": ["operator", "--name=$(POD)"]}, {"POD": "p"}, image) == ["tpufinetune", "operator", "--name=p"]
    assert plain_command({"command": ["sh"], "args": ["-c", "x"]}, {}, image) == ["sh", "-c", "x"]
    with pytest.raises(ValueError, match="no entrypoint"):
        plain_command({"args": ["x"]}, {}, None)


def test_a_pods_wildcard_bind_lands_on_its_own_address():
    """Two pods on one fixed port, as two replicas of a Deployment listen on GKE."""
    library = podbind.library()
    if library is None:
        pytest.fail("no C compiler: the ground's pods share the machine's ports")
    port = free_ports(1, "0.0.0.0")[0]
    script = ("import socket, sys; s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); "
              "e = socket.socket(); e.bind(('0.0.0.0', 0)); print(s.getsockname()[0], e.getsockname()[0])")
    seen = []
    for ip in ("127.250.9.1", "127.250.9.2"):
        out = subprocess.run([sys.executable, "-c", script, str(port)], capture_output=True, text=True, check=True,
                             env={**os.environ, "LD_PRELOAD": str(library), "GROUND_POD_IP": ip})
        seen.append(out.stdout.split())
    assert seen == [["127.250.9.1", "0.0.0.0"], ["127.250.9.2", "0.0.0.0"]]  # an ephemeral port's bind is left


def test_mounts_with_sub_paths_and_parents_first():
    mounts = mount_targets({"volumeMounts": [{"name": "v", "mountPath": "/tmp/a/b", "subPath": "x", "readOnly": True},
                                             {"name": "v", "mountPath": "/tmp"}]}, {"v": "/src"}, {})
    assert [m["target"] for m in mount_order(mounts)] == ["/tmp", "/tmp/a/b"]
    assert mounts[0] == {"source": "/src/x", "target": "/tmp/a/b", "readOnly": True, "subPath": True}
    with pytest.raises(MountError, match="relative path inside the volume"):
        mount_targets({"volumeMounts": [{"name": "v", "mountPath": "/m", "subPath": "../etc"}]}, {"v": "/src"}, {})


def test_kuberays_gcs_wait_asks_the_heads_real_gcs_address():
    script = ("if ray health-check --address rc-head-svc.ns.svc.cluster.local:6379 > /dev/null 2>&1; then\n"
              "if ray health-check --address rc-head-svc.ns.svc.cluster.local:6379; then")
    assert health_check_to_gcs(script, "127.40.0.2:40123") == (
        "if ray health-check --address 127.40.0.2:40123 > /dev/null 2>&1; then\n"
        "if ray health-check --address 127.40.0.2:40123; then")


# ---- pure: CPU shares and probes, as a kubelet derives and times them ------------------------


@pytest.mark.parametrize("milli, shares", [(0, 2), (1, 2), (2, 2), (250, 256), (1000, 1024), (1500, 1536),
                                           (10**6, 262144)])
def test_millicpu_to_shares_as_the_kubelet(milli, shares):
    assert milli_cpu_to_shares(milli) == shares


def cpu(request: str | None = None, limit: str | None = None, **fields) -> dict:
    resources = {k: {"cpu": v} for k, v in (("requests", request), ("limits", limit)) if v}
    return {"name": "c", "resources": resources, **fields}


def test_pod_cpu_shares_sum_its_containers_or_its_largest_init_step():
    assert container_cpu_shares(cpu("250m")) == 256
    assert container_cpu_shares(cpu()) == 2  # no request: the minimum
    assert container_cpu_shares(cpu(limit="2")) == 2048  # the API server's default: request = limit
    assert container_cpu_shares(cpu("0.0001")) == 2  # 1 millicore, rounded up as MilliValue
    assert pod_cpu_shares({"containers": [cpu("250m"), cpu("1.5"), cpu()]}) == 1792
    assert pod_cpu_shares({"containers": [cpu()]}) == 2  # BestEffort
    assert pod_cpu_shares({"containers": [cpu("500m")], "initContainers": [cpu("3")]}) == 3072
    # a sidecar (restartable init container) runs beside the containers and later inits
    assert pod_cpu_shares({"containers": [cpu("1")], "overhead": {"cpu": "250m"},
                           "initContainers": [cpu("1", restartPolicy="Always"), cpu("1500m")]}) == 2816


def test_probes_take_the_api_servers_defaults():
    container = {"livenessProbe": {"exec": {"command": ["true"]}},
                 "readinessProbe": {"httpGet": {"port": 80}, "periodSeconds": 2, "failureThreshold": 1},
                 "startupProbe": {"grpc": {"port": 9}}}  # gRPC: not run on the ground
    probes = probes_of(container)
    assert set(probes) == {LIVENESS, READINESS}
    liveness = probes[LIVENESS]
    assert (liveness.initial_delay, liveness.period, liveness.timeout, liveness.success_threshold,
            liveness.failure_threshold) == (0, 10, 1, 1, 3)
    assert (probes[READINESS].handler, probes[READINESS].period, probes[READINESS].failure_threshold) == ("httpGet", 2, 1)


def ticks(worker: ProbeWorker, until: float, step: float = 0.5) -> list[float]:
    """When the worker probes, sampled every `step` (the agent's sync loop)."""
    return [t for t in (i * step for i in range(int(until / step) + 1)) if worker.tick(t)]


def test_a_probe_waits_its_initial_delay_then_runs_every_period():
    worker = ProbeWorker(probes_of({"readinessProbe": {"exec": {"command": ["x"]}, "initialDelaySeconds": 10,
                                                       "periodSeconds": 5}})[READINESS], started=0.0)
    assert ticks(worker, 21) == [10, 15, 20]  # ticks at 0 and 5 fall inside the delay
    late = ProbeWorker(worker.probe, started=0.0)
    assert late.tick(12.5) and not late.tick(14.5) and late.tick(15)  # a late tick is not made up


def test_readiness_is_reported_past_its_thresholds():
    probe = probes_of({"readinessProbe": {"exec": {"command": ["x"]}, "successThreshold": 2,
                                          "failureThreshold": 3}})[READINESS]
    worker = ProbeWorker(probe, 0.0)
    assert worker.result is False  # not Ready before a probe has passed
    assert [worker.record(ok) for ok in (True, True)] == [None, True] and worker.result
    assert [worker.record(ok) for ok in (False, False, True, False, False, False)] == [None, None, None, None, None, False]
    assert worker.result is False and not worker.on_hold  # readiness keeps probing


def test_a_liveness_failure_past_its_threshold_is_reported_once_then_held():
    probe = probes_of({"livenessProbe": {"exec": {"command": ["x"]}, "failureThreshold": 2, "periodSeconds": 1}})[LIVENESS]
    worker = ProbeWorker(probe, 0.0)
    assert worker.result is True  # live until proven otherwise
    assert [worker.record(ok) for ok in (False, True, False, False)] == [None, True, None, False]
    assert worker.on_hold and not worker.tick(100)  # the container is killed; a new one gets a new worker


def test_liveness_and_readiness_wait_for_the_startup_probe():
    probes = ContainerProbes({"startupProbe": {"tcpSocket": {"port": 80}, "periodSeconds": 1},
                              "livenessProbe": {"tcpSocket": {"port": 80}, "periodSeconds": 1},
                              "readinessProbe": {"tcpSocket": {"port": 80}, "periodSeconds": 1}}, started=0.0)
    assert not probes.started and not probes.ready
    assert [w.probe.kind for w in probes.due(0)] == [STARTUP]
    probes.workers[STARTUP].record(True)
    assert probes.started and not probes.ready
    assert sorted(w.probe.kind for w in probes.due(1)) == [LIVENESS, READINESS]
    probes.workers[READINESS].record(True)
    assert probes.ready
    assert ContainerProbes({}, 0.0).ready  # without probes: ready once running


def test_a_ray_containers_probes_reach_the_ports_the_agent_moved():
    """KubeRay's probes name Ray's declared ports (its `ray start` flags, else Ray's
    defaults); on the ground every pod shares one port space, so the agent moved them."""
    moved = {"gcs": 41001, "client": 41002, "metrics": 41003, "agent_http": 41004, "agent_grpc": 41005,
             "dashboard": 8265}
    args = ["--dashboard-agent-listen-port=52365", "--num-cpus=0", "--metrics-export-port", "9000"]
    assert ray_port_map(args, True, moved) == {6379: 41001, 10001: 41002, 9000: 41003, 52365: 41004, 8265: 8265}
    assert ray_port_map(args, False, moved) == {9000: 41003, 52365: 41004}
    wget = ("wget --tries 1 -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success && "
            "wget --tries 1 -T 10 -q -O- http://localhost:8265/api/gcs_healthz | grep success")
    assert probe_command(["bash", "-c", wget], "127.40.0.3", ray_port_map(args, True, moved))[2] == (
        "wget --tries 1 -T 2 -q -O- http://127.40.0.3:41004/api/local_raylet_healthz | grep success && "
        "wget --tries 1 -T 10 -q -O- http://127.40.0.3:8265/api/gcs_healthz | grep success")


def test_cluster_dns_publishes_a_pod_before_it_is_ready_only_where_the_service_says_so():
    """KubeRay's head Service is headless with publishNotReadyAddresses: its name resolves
    while the head's readiness probe has not passed yet; another Service's waits for Ready."""
    def obj(**fields):
        return SimpleNamespace(**fields)

    head = obj(metadata=obj(namespace="ns", labels={"node": "head"}, deletion_timestamp=None),
               status=obj(pod_ip="127.40.0.2", conditions=[obj(type="Ready", status="False")]))
    services = [obj(metadata=obj(name=name, namespace="ns"),
                    spec=obj(selector={"node": "head"}, publish_not_ready_addresses=publish))
                for name, publish in (("rc-head-svc", True), ("web", None))]
    assert service_endpoints(services, [head]) == {
        "rc-head-svc.ns": "127.40.0.2", "rc-head-svc.ns.svc": "127.40.0.2", "rc-head-svc.ns.svc.cluster.local": "127.40.0.2"}
    head.status.conditions[0].status = "True"
    assert service_endpoints(services, [head])["web.ns.svc"] == "127.40.0.2"


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 500)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def test_http_and_tcp_probes_in_the_kubelets_words(monkeypatch):
    server = ThreadingHTTPServer(("127.250.0.9", 0), _Health)  # 127.250/16: no ground's pods
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # never asked: probes go straight to the pod
    try:
        port = server.server_address[1]
        base = f"http://127.250.0.9:{port}"
        assert http_get(f"{base}/healthz", {}, 2).success
        assert http_get(f"{base}/other", {}, 2).output == "HTTP probe failed with statuscode: 500"
        assert tcp_socket("127.250.0.9", port, 1).success
    finally:
        server.shutdown()
        server.server_close()
    assert http_get(f"{base}/healthz", {}, 1).output == (
        f'Get "{base}/healthz": dial tcp 127.250.0.9:{port}: connect: connection refused')
    assert tcp_socket("127.250.0.9", port, 1).output == f"dial tcp 127.250.0.9:{port}: connect: connection refused"


# ---- pure: a waiting container always says why ---------------------------------------------


def a_run(tmp_path, stage: str = "main", inits: int = 0, image: str = "python:3.11", **fields) -> PodRun:
    fields = {"head": False, "ray": False, **fields}
    return PodRun(namespace="ns", name="p", uid="uid-1", ip="127.250.0.2", node="n", cluster="", cluster_uid="ns/",
                  dir=tmp_path, shm=tmp_path, cgroup=tmp_path, log_path=tmp_path / "p.log", pod=None, stage=stage,
                  inits=[ContainerState(f"init-{i}", image, waiting(POD_INITIALIZING)) for i in range(inits)],
                  mains=[ContainerState("main", image, waiting(POD_INITIALIZING if inits else CONTAINER_CREATING))],
                  **fields)


def waiting_reasons(status: dict) -> list[str]:
    """Each container's waiting reason ('' for one waiting without); running and terminated
    ones left out."""
    states = [c["state"] for c in [*status.get("initContainerStatuses", []), *status["containerStatuses"]]]
    assert all(len(state) == 1 for state in states), states
    return [(s["waiting"] or {}).get("reason", "") for s in states if "waiting" in s]


@pytest.mark.parametrize("stage, inits, expected", [
    ("setup", 0, [CONTAINER_CREATING]),
    ("setup", 1, [POD_INITIALIZING, POD_INITIALIZING]),  # the kubelet's default with init containers
    ("init", 2, [POD_INITIALIZING, POD_INITIALIZING, POD_INITIALIZING]),
    ("main", 0, [CONTAINER_CREATING]),
    ("main", 1, [POD_INITIALIZING]),  # init done (terminated), main not created yet
])
def test_a_container_not_created_yet_waits_with_the_kubelets_reason(tmp_path, stage, inits, expected):
    run = a_run(tmp_path, stage, inits)
    if stage == "main":
        for c in run.inits:
            c.state = {"terminated": {"exitCode": 0, "reason": "Completed"}}
    assert waiting_reasons(NodeAgent.pod_status(None, run)) == expected


def test_a_state_without_a_reason_is_never_written(tmp_path):
    run = a_run(tmp_path)
    run.mains[0].state = {"waiting": {}}
    assert waiting_reasons(NodeAgent.pod_status(None, run)) == [CONTAINER_CREATING]
    with pytest.raises(ValueError):
        waiting("")


class _Dashboard(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/api/version" else 404)
        self.end_headers()
        self.wfile.write(b'{"version": "4"}')

    def log_message(self, *args):
        pass


def test_a_heads_readiness_is_asked_of_the_pod_not_through_the_shells_proxy(tmp_path, monkeypatch):
    """`make cluster` from a shell with an HTTP proxy: the usual no_proxy (localhost,
    127.0.0.1) does not name the pods' 127.N.x.y addresses, so a probe through urllib's
    default opener asked the proxy, the head was never Ready, and its workers waited for it
    in PodInitializing for good (the operator: hosts ready 0/4, no reason). A kubelet's probe
    never takes a proxy."""
    run = a_run(tmp_path, head=True, ray=True, main_env={})
    server = ThreadingHTTPServer((run.ip, 8265), _Dashboard)  # 127.250/16: no ground's pods (127.20-219)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens: a proxy that cannot reach pods
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.setenv(name, "localhost,127.0.0.1")
        monkeypatch.setattr(urllib.request, "_opener", None)  # as in the agent: built on its first probe
        assert NodeAgent.answers(None, run)
    finally:
        server.shutdown()
        server.server_close()


class _Core:
    """The CoreV1Api calls image_present makes: events, kept."""

    def __init__(self):
        self.events = []
        self.statuses = []

    def create_namespaced_event(self, namespace, body):
        self.events.append((body["type"], body["reason"], body["message"]))

    def patch_namespaced_pod_status(self, name, namespace, body):
        self.statuses.append(body["status"])


def test_a_container_waits_pulling_while_its_images_environment_is_prepared(tmp_path):
    """Another process building or refreshing the trainer image's environment (images.ensure
    holds its lock) is this node pulling that image: the container waits in the kubelet's
    state with its Pulling event, and starts (Pulled) once it is done; an environment nobody
    built fails to pull."""
    env = tmp_path / "trainer-env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").touch()
    (env / ".project").write_text("key")
    image = "us-docker.pkg.dev/ground-project/tpufinetune/trainer:0.1.0"
    agent = NodeAgent.__new__(NodeAgent)
    agent.images, agent.core = {"trainer": env}, _Core()
    run = a_run(tmp_path, image=image)
    with open(images.lock_path(env), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as images.ensure() holds it while it works
        assert not agent.image_present(run, run.mains[0])
        assert not agent.image_present(run, run.mains[0])  # one Pulling event, not one per try
        assert waiting_reasons(NodeAgent.pod_status(None, run)) == [CONTAINER_CREATING]
        assert agent.core.events == [("Normal", "Pulling", f'Pulling image "{image}"')]
    assert agent.image_present(run, run.mains[0])
    assert agent.core.events[1][:2] == ("Normal", "Pulled")
    assert agent.core.events[1][2].startswith(f'Successfully pulled image "{image}" in ')

    (env / "bin" / "python").unlink()
    missing = a_run(tmp_path, image=image)
    assert not agent.image_present(missing, missing.mains[0])
    state = missing.mains[0].state["waiting"]
    assert state["reason"] == "ErrImagePull" and str(env) in state["message"] and "make images" in state["message"]


def an_agent(**fields) -> NodeAgent:
    """The agent's pure parts, with events and status writes kept (_Core)."""
    agent = NodeAgent.__new__(NodeAgent)
    agent.core, agent.heads, agent.runs, agent.images = _Core(), {}, {}, {}
    for name, value in fields.items():
        setattr(agent, name, value)
    return agent


def test_a_worker_held_for_its_head_says_what_it_waits_for(tmp_path):
    """The agent holds a Ray worker's containers until its head's GCS has an address and
    (for the main container) the head answers: a kubelet's waiting reason, and a message
    naming the head, as a container that polled for it would have logged. An empty reason
    here left the operator with 'hosts ready 0/4' and nothing more."""
    agent = an_agent()
    run = a_run(tmp_path, stage="init", inits=1, ray=True)
    run.cluster, run.cluster_uid = "rc", "rc-uid"
    assert agent.waits_for_head(run)
    [init, main] = waiting_states(NodeAgent.pod_status(None, run))
    assert init == {"reason": POD_INITIALIZING,
                    "message": "the node waits for the head of RayCluster ns/rc to start its GCS"}
    assert main == {"reason": POD_INITIALIZING}

    head = PodRun(**{**vars(a_run(tmp_path, head=True, ray=True)), "name": "rc-head", "ip": "127.250.0.3",
                     "gcs_address": "127.250.0.3:6379"})
    agent.heads["rc-uid"] = head
    assert not agent.waits_for_head(run) and run.gcs_address == "127.250.0.3:6379"
    run.stage = "main"
    run.inits[0].state = {"terminated": {"exitCode": 0, "reason": "Completed"}}
    assert agent.waits_for_head(run)
    [main] = waiting_states(NodeAgent.pod_status(None, run))
    assert main == {"reason": POD_INITIALIZING, "message": "the node waits for head pod rc-head of RayCluster ns/rc "
                                                           "to answer at http://127.250.0.3:8265"}
    assert "the node waits for head pod rc-head" in run.log_path.read_text()
    head.answering = True
    assert not agent.waits_for_head(run)


def test_a_worker_started_against_a_head_that_started_again_is_ended_to_reach_the_new_one(tmp_path):
    """A head's new container listens at new ports here (on GKE its Service keeps 6379): a
    worker's container still aimed at the old address is ended at once, to restart against
    the new one, instead of waiting minutes inside its `ray start` (a CI failure)."""
    agent = an_agent()
    head = PodRun(**{**vars(a_run(tmp_path, head=True, ray=True)), "name": "rc-head", "gcs_address": "127.250.0.3:40001"})
    agent.heads["rc-uid"] = head
    worker = a_run(tmp_path, ray=True)
    worker.cluster_uid, worker.gcs_address = "rc-uid", head.gcs_address
    worker.proc = subprocess.Popen(["sleep", "60"])
    worker.mains[0].state = {"running": {"startedAt": "2026-12-05T10:53:52Z"}}
    try:
        assert not agent.head_moved(worker)  # its head is where it was
        head.gcs_address = "127.250.0.3:40777"  # the head's container started again
        agent.sync_running(worker)
        assert worker.proc.wait(5) == -15 and worker.kill_deadline is not None
        agent.sync_running(worker)  # the exit reported: restarted per restartPolicy, after its back-off
        assert worker.proc is None and worker.crashed and worker.mains[0].state["terminated"]["exitCode"] == 143
    finally:
        if worker.proc is not None:
            worker.proc.kill()


def test_a_port_number_is_given_to_one_ray_container_only(monkeypatch):
    """The kernel may hand out a released port again at once; Ray binds some on 0.0.0.0, so
    the agent never gives one number to two containers (a worker's probe once read another
    pod's gRPC bytes on its agent's HTTP port)."""
    answers = iter([[41001, 41002], [41002, 41003], [41004, 41005]])
    monkeypatch.setattr("harness.nodeagent.free_ports", lambda count, host: next(answers))
    agent = an_agent(ports_given=set())
    assert agent.ray_ports(2) == [41001, 41002]
    assert agent.ray_ports(2) == [41004, 41005]  # 41002 was given already


def test_a_pull_without_progress_fails_naming_who_prepares_the_images_environment(tmp_path, monkeypatch):
    """While another process keeps the image's environment locked, the waiting container
    names that process; past the pull deadline the pull fails as a kubelet's does
    (ErrImagePull, ImagePullBackOff, tried again) and starts once the lock is gone."""
    from harness import nodeagent

    env = tmp_path / "trainer-env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").touch()
    (env / ".project").write_text("key")
    image = "us-docker.pkg.dev/ground-project/tpufinetune/trainer:0.1.0"
    agent = an_agent(images={"trainer": env})
    run = a_run(tmp_path, image=image)
    holder = f"pid {os.getpid()} ("
    with open(images.lock_path(env), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert not agent.image_present(run, run.mains[0])
        [state] = waiting_states(NodeAgent.pod_status(None, run))
        assert state["reason"] == CONTAINER_CREATING
        assert state["message"].startswith(f'pulling image "{image}": its environment {env} is being prepared by {holder}')
        monkeypatch.setattr(nodeagent, "IMAGE_PULL_DEADLINE", 0)
        reasons = []
        for _ in range(3):
            assert not agent.image_present(run, run.mains[0])
            reasons.append(run.mains[0].state["waiting"]["reason"])
        assert reasons == ["ErrImagePull", "ImagePullBackOff", "ErrImagePull"]
        [state] = waiting_states(NodeAgent.pod_status(None, run))
        assert holder in state["message"] and state["message"].endswith("no progress within 0s")
        failed = [e for e in agent.core.events if e[1] == "Failed"]
        assert len(failed) == 1 and holder in failed[0][2]  # one event per distinct message
    assert agent.image_present(run, run.mains[0])


class _Api:
    sanitize_for_serialization = staticmethod(lambda pod: pod)


def test_a_volume_that_cannot_be_set_up_is_the_waiting_containers_message(tmp_path):
    agent = an_agent(api=_Api(), gcs_root=None)
    volume = {"name": "data", "hostPath": {"path": str(tmp_path / "absent")}}
    run = a_run(tmp_path, stage="setup")
    run.pod = {"spec": {"volumes": [volume]}}
    agent.sync_volumes(run)
    [state] = waiting_states(NodeAgent.pod_status(None, run))
    assert state == {"reason": CONTAINER_CREATING, "message": f'MountVolume.SetUp failed for volume "data" : '
                                                              f"{tmp_path / 'absent'} is not a directory on the node"}
    (tmp_path / "absent").mkdir()
    agent.sync_volumes(run)
    assert run.stage == "main" and waiting_states(NodeAgent.pod_status(None, run)) == [{"reason": CONTAINER_CREATING}]


def test_a_step_the_node_cannot_take_is_the_containers_reason(tmp_path):
    """An unexpected error taking a pod a step (a kubelet's CreateContainerError), or
    setting it up at all: its containers say so; a pod bound here never stays without a
    status."""
    agent = an_agent()
    agent.write_status = lambda run: None
    run = a_run(tmp_path)
    agent.sync_failed(run, RuntimeError("no room left"))
    assert waiting_states(NodeAgent.pod_status(None, run)) == [
        {"reason": "CreateContainerError", "message": "RuntimeError: no room left"}]
    pod = SimpleNamespace(metadata=SimpleNamespace(name="p", namespace="ns", uid="u"),
                          spec=SimpleNamespace(init_containers=None, containers=[SimpleNamespace(name="main", image="x")]))
    agent.admission_failed(pod, OSError("read-only file system"))
    [status] = agent.core.statuses
    assert status["phase"] == "Pending" and waiting_states(status) == [
        {"reason": CONTAINER_CREATING, "message": "the node could not set up the pod: OSError: read-only file system"}]


# ---- on the ground: plain pods -------------------------------------------------------------

PROBE = """
import json, os, sys
print(json.dumps({"env": dict(os.environ), "tmp": sorted(os.listdir("/tmp")), "cwd": os.getcwd(),
                  "host_file": os.path.exists(sys.argv[1])}))
"""


def plain_pod(name: str, command: list[str], restart: str = "Never", **spec) -> dict:
    container = {"name": "main", "image": "python:3.11", "command": command}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 2, "containers": [container], **spec}}


def phase(kube, name: str) -> str:
    return ((kube.get("pod", name) or {}).get("status") or {}).get("phase", "")


def pod_log(ground, kube, name: str) -> str:
    path = pod_log_path(ground.workdir, kube.ns, name)
    return path.read_text() if path.exists() else ""


def printed(ground, kube, name: str, line: str) -> bool:
    """Whether a container printed this line (the log's header lines repeat each container's
    command, so a substring would match before the command ran)."""
    return line in pod_log(ground, kube, name).splitlines()


def last_json(ground, kube, name: str) -> dict:
    return json.loads([line for line in pod_log(ground, kube, name).splitlines() if line.startswith("{")][-1])


def wait_phase(kube, name: str, wanted: str, timeout: float = 90) -> None:
    try:
        kube.wait_for(lambda: phase(kube, name) == wanted, f"pod {name} {wanted}", timeout=timeout)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{kube.get('pod', name)}\n---- node agent log tail ----\n"
                             + tail(kube.ground.workdir / "node-agent.log", 30)) from None


@pytest.mark.ground
def test_a_pod_sees_its_own_tmp_and_only_the_env_its_spec_gives(ground, kube, tmp_path):
    host_file = tmp_path / "host-only"
    host_file.write_text("x")
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"mode": "fast"}})
    kube.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
                "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}})
    kube.apply(plain_pod("writer", ["sh", "-c", "touch /tmp/writers-file && echo written && sleep 600"]))
    kube.wait_for(lambda: printed(ground, kube, "writer", "written"), "the other pod's /tmp file written")
    kube.apply(plain_pod("reader", [sys.executable, "-c", PROBE, str(host_file)], container={
        "env": [{"name": "GIVEN", "value": "yes"},
                {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}}],
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CM_"}]}))
    wait_phase(kube, "reader", "Succeeded")
    seen = last_json(ground, kube, "reader")
    # Nothing of the machine's /tmp, nor the other pod's file; only the image's filesystem
    # (this checkout) is bound back where it lies, should it lie under /tmp.
    checkout = Path(__file__).resolve().parents[2]
    bound = [checkout.relative_to("/tmp").parts[0]] if checkout.is_relative_to("/tmp") else []
    assert seen["tmp"] == bound and not seen["host_file"] and seen["cwd"] == "/home/ray", seen["tmp"]
    env = seen["env"]
    assert env["GIVEN"] == "yes" and env["MODE"] == "fast" and env["CM_mode"] == "fast"
    assert env["HOSTNAME"] == "reader" and env["WEB_SERVICE_PORT"] == "80" and env["KUBERNETES_SERVICE_HOST"]
    agent = json.loads((ground.workdir / "nodeagent.ready").read_text())
    node_env = set(agent["node_env"]) | set(agent["bind_env"])  # the bind shim: the runtime's, for its own address
    image = {"PATH", "HOME", "LANG", "HOSTNAME"}
    services = {n for n in env if n.startswith(("KUBERNETES_", "WEB_"))}
    assert set(env) - image - node_env - services == {"GIVEN", "MODE", "CM_mode"}
    kube.kubectl("delete", "pod", "writer", "--wait=false")


@pytest.mark.ground
def test_a_pod_waits_for_its_secret_and_starts_once_it_exists(ground, kube):
    kube.apply(plain_pod("needs-secret", ["sh", "-c", "echo token=$TOKEN"], container={
        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "later", "key": "token"}}}]}))

    def waiting_reason():
        statuses = (kube.get("pod", "needs-secret").get("status") or {}).get("containerStatuses") or [{}]
        return (statuses[0].get("state") or {}).get("waiting", {})

    kube.wait_for(lambda: waiting_reason().get("reason") == "CreateContainerConfigError", "CreateContainerConfigError")
    assert waiting_reason()["message"] == 'secret "later" not found'
    kube.kubectl("create", "secret", "generic", "later", "--from-literal=token=abc")
    wait_phase(kube, "needs-secret", "Succeeded")
    assert "token=abc" in pod_log(ground, kube, "needs-secret")


class FileOpens:
    """Counts the opens of a file by any process (inotify's IN_OPEN), from entry on."""

    IN_OPEN, IN_CLOSE = 0x20, 0x08 | 0x10  # closes too: opens never sit side by side unread

    def __init__(self, path: Path):
        self.path = path
        self._count = 0
        self._libc = ctypes.CDLL(None, use_errno=True)

    def __enter__(self) -> "FileOpens":
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0 or self._libc.inotify_add_watch(self._fd, str(self.path).encode(),
                                                                      self.IN_OPEN | self.IN_CLOSE) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {self.path}")
        return self

    def count(self) -> int:
        """Opens so far (inotify merges identical events left unread; each open's close
        stands between two opens)."""
        while select.select([self._fd], [], [], 0)[0]:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            offset = 0
            while offset < len(data):
                _, mask, _, length = struct.unpack_from("iIII", data, offset)
                self._count += bool(mask & self.IN_OPEN)
                offset += 16 + length
        return self._count

    def __exit__(self, *exc) -> None:
        os.close(self._fd)


@pytest.mark.ground
def test_a_pod_waits_pulling_while_its_images_environment_is_prepared(ground, kube):
    """The agent and images.py across processes: while the trainer image's environment is
    locked (images.ensure() building or refreshing it), a pod of that image waits in
    ContainerCreating with the kubelet's Pulling event, then runs from it (Pulled)."""
    image = "us-docker.pkg.dev/ground-project/tpufinetune/trainer:0.1.0"
    env = images.trainer_env()
    pod = plain_pod("pulls", ["python", "-c", "import sys; print('prefix=' + sys.prefix)"], container={"image": image})

    def reasons(reason: str) -> list[dict]:
        return [e for e in kube.items("events") if e.get("reason") == reason
                and e["involvedObject"]["name"] == "pulls"]

    def started(pods: list[dict]) -> int:
        """1 once the pod is anything but Pending with its container waiting to be created."""
        return int(any((p.get("status") or {}).get("phase", "Pending") != "Pending"
                       or [w.get("reason") for w in waiting_states(p.get("status") or {})] not in ([], [CONTAINER_CREATING])
                       for p in pods))

    lock_file = images.lock_path(env)
    with open(lock_file, "a+") as lock, KubeWatch(ground.cp.kubeconfig, kube.ns, started=started) as watch, \
            FileOpens(lock_file) as looks:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kube.apply(pod)
        pulling = kube.wait_for(lambda: reasons("Pulling"), "a Pulling event", timeout=60)
        assert (pulling[0]["type"], pulling[0]["message"]) == ("Normal", f'Pulling image "{image}"')
        # The agent opens the environment's lock at each look (images.state): three more
        # looks after its Pulling event, each finding the lock held.
        after = looks.count()
        kube.wait_for(lambda: looks.count() >= after + 3, "three more looks of the agent at the held lock", timeout=30)
        status = kube.get("pod", "pulls")["status"]
        assert status["phase"] == "Pending" and waiting_reasons(status) == [CONTAINER_CREATING]
        assert watch.most["started"] == 0, "the pod went on while its image's environment was locked"
        assert len(reasons("Pulling")) == 1 and "prefix=" not in pod_log(ground, kube, "pulls")
    wait_phase(kube, "pulls", "Succeeded")
    assert reasons("Pulled")[0]["message"].startswith(f'Successfully pulled image "{image}" in ')
    assert f"prefix={env}" in pod_log(ground, kube, "pulls")


@pytest.mark.ground
def test_volumes_as_a_kubelet_mounts_them(ground, kube):
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "conf"}, "data": {"a.txt": "A", "b.txt": "B"}})
    kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"}, "stringData": {"key": "K"}})
    kube.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "shared"},
                "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    volumes = [{"name": "conf", "configMap": {"name": "conf", "items": [{"key": "a.txt", "path": "sub/a"}]}},
               {"name": "sec", "secret": {"secretName": "sec"}},
               {"name": "scratch", "emptyDir": {}},
               {"name": "shm", "emptyDir": {"medium": "Memory"}},
               {"name": "shared", "persistentVolumeClaim": {"claimName": "shared"}}]
    mounts = [{"name": "conf", "mountPath": "/etc/conf", "readOnly": True},
              {"name": "conf", "mountPath": "/tmp/a-file", "subPath": "sub/a"},
              {"name": "sec", "mountPath": "/var/run/sec", "readOnly": True},
              {"name": "scratch", "mountPath": "/scratch"},
              {"name": "shm", "mountPath": "/dev/shm"},
              {"name": "shared", "mountPath": "/data"}]
    script = ("set -e; test \"$(cat /etc/conf/sub/a)\" = A; test ! -e /etc/conf/b.txt; test \"$(cat /tmp/a-file)\" = A;"
              " test \"$(cat /var/run/sec/key)\" = K; ! touch /etc/conf/x 2>/dev/null;"
              " echo s > /scratch/s; echo m > /dev/shm/m; echo \"$1\" >> /data/log; echo mounted-ok")
    for name in ("first", "second"):
        kube.apply(plain_pod(name, ["sh", "-c", script, "sh", name], volumes=volumes,
                             container={"volumeMounts": mounts}))
    for name in ("first", "second"):
        wait_phase(kube, name, "Succeeded")
        assert "mounted-ok" in pod_log(ground, kube, name)
    claim = kube.get("pvc", "shared")
    host_dir = Path(kube.cp.kubectl("get", "pv", claim["spec"]["volumeName"], "-o",
                                    "jsonpath={.spec.hostPath.path}").stdout)
    assert sorted(host_dir.joinpath("log").read_text().split()) == ["first", "second"]
    assert str(host_dir).startswith(str(ground.workdir))


@pytest.mark.ground
def test_init_containers_run_in_order_and_a_failing_one_blocks_the_pod(ground, kube):
    scratch = {"volumes": [{"name": "s", "emptyDir": {}}]}
    mount = [{"name": "s", "mountPath": "/s"}]
    kube.apply(plain_pod("inits", ["sh", "-c", "cat /s/one /s/two"], **scratch, initContainers=[
        {"name": "one", "image": "x", "command": ["sh", "-c", "echo 1 > /s/one"], "volumeMounts": mount},
        {"name": "two", "image": "x", "command": ["sh", "-c", "test -e /s/one && echo 2 > /s/two"], "volumeMounts": mount}],
        container={"volumeMounts": mount}))
    kube.apply(plain_pod("blocked", ["sh", "-c", "echo main ran"], restart="Always", initContainers=[
        {"name": "fails", "image": "x", "command": ["sh", "-c", "exit 3"]}]))
    wait_phase(kube, "inits", "Succeeded")
    assert pod_log(ground, kube, "inits").split()[-2:] == ["1", "2"]

    def init_status():
        statuses = (kube.get("pod", "blocked").get("status") or {}).get("initContainerStatuses") or [{}]
        return statuses[0]

    kube.wait_for(lambda: (init_status().get("state") or {}).get("waiting", {}).get("reason") == "CrashLoopBackOff",
                  "Init:CrashLoopBackOff")
    status = init_status()
    assert status["lastState"]["terminated"]["exitCode"] == 3 and status["restartCount"] >= 1
    pod = kube.get("pod", "blocked")
    assert pod["status"]["phase"] == "Pending"
    assert pod["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    assert "main ran" not in pod_log(ground, kube, "blocked")


@pytest.mark.ground
def test_a_container_over_its_memory_limit_is_oom_killed(ground, kube):
    kube.apply(plain_pod("hungry", [sys.executable, "-c", "x = bytearray(300 * 2**20); print('surv' + 'ived')"],
                         container={"resources": {"limits": {"memory": "64Mi"}}}))
    wait_phase(kube, "hungry", "Failed")
    terminated = kube.get("pod", "hungry")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["reason"], terminated["exitCode"]) == ("OOMKilled", 137)
    assert "survived" not in pod_log(ground, kube, "hungry")


@pytest.mark.ground
def test_a_pods_cgroups_weigh_its_cpu_requests_as_a_kubelets(ground, kube):
    """cpu.shares of the pod's cgroup (its containers' and init containers' requests, as
    the kubelet sums them) and of its running container, whose processes are in it."""
    pod = plain_pod("weighed", ["sh", "-c", "echo started && exec sleep 600"], container={
        "resources": {"requests": {"cpu": "250m"}}},
        initContainers=[{"name": "init", "image": "x", "command": ["true"], "resources": {"requests": {"cpu": "100m"}}}])
    pod["spec"]["containers"].append(
        {"name": "second", "image": "python:3.11", "command": ["true"], "resources": {"requests": {"cpu": "1.5"}}})
    kube.apply(pod)
    kube.wait_for(lambda: printed(ground, kube, "weighed", "started"), "the container started")
    cgroup = podcgroup.ground_cgroup(ground.ground_id) / kube.get("pod", "weighed")["metadata"]["uid"]
    assert podcgroup.cpu_shares(cgroup) == 1792  # (250m + 1500m) * 1024 / 1000
    assert podcgroup.cpu_shares(cgroup / "main") == 256
    in_memory = set(podcgroup.procs(cgroup / "main"))
    in_cpu = {int(p) for p in (podcgroup.cpu_cgroup(cgroup / "main") / "cgroup.procs").read_text().split()}
    assert in_memory and in_cpu == in_memory  # the container's processes, in both of its cgroups


def pod_events(kube, name: str, reason: str) -> list[str]:
    return [e["message"] for e in kube.items("events") if e.get("reason") == reason and e["involvedObject"]["name"] == name]


def container_status(kube, name: str) -> dict:
    return ((kube.get("pod", name).get("status") or {}).get("containerStatuses") or [{}])[0]


def condition(kube, name: str, kind: str) -> str:
    return next((c["status"] for c in (kube.get("pod", name).get("status") or {}).get("conditions") or []
                 if c["type"] == kind), "")


@pytest.mark.ground
def test_a_failed_liveness_probe_restarts_the_container(ground, kube):
    """An exec liveness probe (run in the container: its env, working directory and /tmp)
    fails in the first container, which is killed past failureThreshold with the kubelet's
    events and restarted; the second container passes its probes and is left running."""
    start = ("if [ -e /tmp/started-once ]; then echo second-start; touch /tmp/healthy;"
             " else touch /tmp/started-once; echo first-start; fi; exec sleep 600")
    probe = ('test "$PROBED_ENV" = given && test "$(pwd)" = /home/ray && cat /tmp/healthy'
             " && echo passed >> /tmp/probes")
    threshold = 2
    kube.apply(plain_pod("liveness", ["sh", "-c", start], restart="Always", container={
        "env": [{"name": "PROBED_ENV", "value": "given"}],
        "livenessProbe": {"exec": {"command": ["sh", "-c", probe]}, "periodSeconds": 1,
                          "failureThreshold": threshold}}))
    kube.wait_for(lambda: container_status(kube, "liveness").get("restartCount") == 1
                  and "running" in container_status(kube, "liveness").get("state", {}), "the container restarted",
                  timeout=60)
    assert [m.rstrip("\n") for m in pod_events(kube, "liveness", "Unhealthy")] == [  # the command's output, as is
        "Liveness probe failed: cat: /tmp/healthy: No such file or directory"]
    assert pod_events(kube, "liveness", "Killing") == ["Container main failed liveness probe, will be restarted"]
    terminated = container_status(kube, "liveness")["lastState"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (143, "Error")  # SIGTERM, as a kubelet's kill
    output = pod_log(ground, kube, "liveness").splitlines()
    assert (output.count("first-start"), output.count("second-start")) == (1, 1)
    # The new container passes more probes in a row than the threshold: no second kill.
    probes = ground.workdir / PODS_DIR / kube.get("pod", "liveness")["metadata"]["uid"] / "tmp" / "probes"
    kube.wait_for(lambda: probes.exists() and len(probes.read_text().split()) > threshold, "passed liveness probes")
    assert container_status(kube, "liveness")["restartCount"] == 1
    assert len(pod_events(kube, "liveness", "Killing")) == 1


@pytest.mark.ground
def test_readiness_follows_the_probe_and_waits_for_startup(ground, kube):
    """An HTTP readiness probe (a named port, at the pod's address) keeps the pod not Ready
    while it fails, Ready once it passes, not Ready again when it fails; a TCP startup probe
    holds readiness until the server listens."""
    port = free_ports(1, "0.0.0.0")[0]
    serve = "sleep 2; exec python -m http.server $(PORT) --bind $(POD_IP) --directory /tmp"
    kube.apply(plain_pod("readiness", ["sh", "-c", serve], restart="Always", container={
        "ports": [{"name": "web", "containerPort": port}],
        "env": [{"name": "PORT", "value": str(port)},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "startupProbe": {"tcpSocket": {"port": "web"}, "periodSeconds": 1, "failureThreshold": 30},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "web"}, "periodSeconds": 1, "failureThreshold": 1}}))
    wait_phase(kube, "readiness", "Running")
    uid, ip = kube.get("pod", "readiness")["metadata"]["uid"], kube.get("pod", "readiness")["status"]["podIP"]
    kube.wait_for(lambda: "Readiness probe failed: HTTP probe failed with statuscode: 404"
                  in pod_events(kube, "readiness", "Unhealthy"), "the readiness probe answered 404")
    # The server started 2 s late: the startup probe was refused first.
    assert f"Startup probe failed: dial tcp {ip}:{port}: connect: connection refused" in pod_events(
        kube, "readiness", "Unhealthy")
    status = container_status(kube, "readiness")
    assert status["started"] and not status["ready"] and "running" in status["state"]
    assert condition(kube, "readiness", "Ready") == "False" and condition(kube, "readiness", "ContainersReady") == "False"
    ready_file = ground.workdir / PODS_DIR / uid / "tmp" / "ready"
    ready_file.write_text("ok")
    kube.wait_for(lambda: condition(kube, "readiness", "Ready") == "True", "the pod Ready", timeout=30)
    assert condition(kube, "readiness", "ContainersReady") == "True" and container_status(kube, "readiness")["ready"]
    ready_file.unlink()
    kube.wait_for(lambda: condition(kube, "readiness", "Ready") == "False", "the pod not Ready again", timeout=30)
    assert container_status(kube, "readiness")["restartCount"] == 0  # readiness never restarts


@pytest.mark.ground
def test_a_volume_that_cannot_be_mounted_keeps_the_pod_creating_with_the_kubelets_event(ground, kube):
    kube.apply(plain_pod("bucket", ["true"], volumes=[{"name": "b", "csi": {
        "driver": "no-such-driver.example.dev", "volumeAttributes": {"bucketName": "models"}}}],
        container={"volumeMounts": [{"name": "b", "mountPath": "/models"}]}))

    def failed_mount():
        return [e["message"] for e in kube.items("events") if e.get("reason") == "FailedMount"]

    messages = kube.wait_for(failed_mount, "a FailedMount event")
    assert messages[0] == ('MountVolume.SetUp failed for volume "b" : kubernetes.io/csi: driver name '
                           "no-such-driver.example.dev not found in the list of registered CSI drivers")
    assert phase(kube, "bucket") == "Pending"


@pytest.mark.ground
def test_an_oom_killed_worker_is_the_runs_reason(ground, operator, kube):
    """A worker whose limit is below what `ray start` needs is OOM-killed (the whole
    container, exit 137) and restarted; the run, still provisioning, says OOMKilled."""
    name = "oom"
    small = {"requests": {"memory": "100Mi"}, "limits": {"memory": "100Mi"}}
    kube.apply({"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name}, "spec": {
        "tpu": {"generation": "cpu", "topology": "2"}, "image": "registry.example/tpufinetune-trainer:test",
        "model": {"id": "/never-read/model"}, "dataset": {"id": "/never-read/data", "split": "train"},
        "checkpoint": {"storagePath": "gs://tpufinetune-ground/never-written"}, "workers": {"resources": small}}})
    cluster = kube.wait_for(lambda: kube.status(name).get("rayClusterName"), "rayClusterName in status")

    def oom_killed_worker():
        for pod in kube.pods_of(cluster):
            for status in (pod.get("status") or {}).get("containerStatuses") or []:
                terminated = (status.get("lastState") or status.get("state") or {}).get("terminated") or {}
                if terminated.get("reason") == "OOMKilled":
                    return terminated
        return None

    terminated = kube.wait_for(oom_killed_worker, "a worker container OOMKilled", timeout=180)
    assert terminated["exitCode"] == 137
    message = kube.wait_for(lambda: "OOMKilled" in kube.status(name).get("message", "") and kube.status(name)["message"],
                            "OOMKilled in the run's status message", timeout=120)
    assert "exceeded its memory limit" in message
    # Its namespace deleted while the run holds its RayCluster: the operator's RoleBinding
    # there goes in the namespace controller's first pass, yet the run's finalizer goes
    # (handlers.release), so the namespace is gone, with no refused call of the operator's.
    kube.cp.kubectl("delete", "namespace", kube.ns, "--wait=false")
    kube.wait_for(lambda: kube.cp.kubectl("get", "namespace", kube.ns, check=False).returncode != 0,
                  "the namespace gone", timeout=120, details=lambda: "\n".join((
                      kube.cp.kubectl("get", "namespace", kube.ns, "-o", "jsonpath={.status}", check=False).stdout,
                      kube.cp.kubectl("get", "tpufinetunes,rayclusters,pods", "-n", kube.ns, "-o",
                                      "custom-columns=KIND:.kind,NAME:.metadata.name,FIN:.metadata.finalizers,"
                                      "DEL:.metadata.deletionTimestamp", check=False).stdout,
                      operator.log_tail())))
    assert not [line for line in refusals(operator.log_path) if kube.ns in line]


@pytest.mark.ground
def test_a_run_on_a_shared_claim_succeeds_with_its_checkpoint_on_the_volume(ground, operator, kube, ground_assets):
    """A local checkpoint path is refused at apply unless it is shared (test_crd_admission);
    shared, it works: a ReadWriteMany claim of the ground's default class, mounted at the same
    path on the head and both workers, holds both ranks' shards of each checkpoint."""
    kube.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "checkpoints"},
                "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    group = {"volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints"}}],
             "volumeMounts": [{"name": "checkpoints", "mountPath": "/mnt/checkpoints"}]}
    kube.apply({"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "on-a-claim"},
                "spec": {"tpu": {"generation": "cpu", "topology": "2"},
                         "image": "registry.example/tpufinetune-trainer:test",
                         "model": {"id": ground_assets.model},
                         "dataset": {"id": ground_assets.data, "split": "train[:320]"},  # a short epoch
                         "training": {"epochs": 1, "batchSizePerDevice": 8, "maxSeqLen": 128},
                         "checkpoint": {"storagePath": "/mnt/checkpoints/run"}, "head": group, "workers": group}})
    kube.kubectl("wait", "tpufinetune/on-a-claim", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
    checkpoint = kube.status("on-a-claim")["checkpointURI"]
    assert checkpoint.startswith("/mnt/checkpoints/run/"), checkpoint
    claim = kube.get("pvc", "checkpoints")
    volume_dir = Path(kube.cp.kubectl("get", "pv", claim["spec"]["volumeName"], "-o",
                                      "jsonpath={.spec.hostPath.path}").stdout)
    on_volume = volume_dir / checkpoint.removeprefix("/mnt/checkpoints/")
    both_ranks = {f"__{rank}_{i}.distcp" for rank in (0, 1) for i in range(WRITE_THREADS)}  # the writer's files per rank
    assert {p.name for p in on_volume.glob("*.distcp")} == both_ranks, list(on_volume.iterdir())
    assert (on_volume / ".metadata").is_file()
