"""The test ground: a small GKE-shaped cluster on this machine, every part real except the chips.

    etcd + kube-apiserver          (tests/controlplane, one k8s.io/kubernetes pin)
    kube-scheduler                 binds pods to nodes by resources, selectors and taints
    kube-controller-manager        garbage collector, namespaces, service accounts, endpoint slices,
                                   node lifecycle and taint eviction, pod GC, disruption budgets,
                                   persistent-volume binding and protection
    KubeRay ray-operator           (tests/kuberay) reconciles RayClusters into pods and Services
    GKE-shaped Node objects        one pool per TPU slice + CPU nodes (nodepools.py)
    node agent                     runs each bound pod as local processes in its own mount namespace
                                   and memory cgroup (nodeagent.py), provisions volumes, and
                                   sends each node's heartbeats (nodelife.py)
    the operator (optional)        as deploy/'s ServiceAccount, resolving Service names through
                                   the agent's hosts file in a mount namespace of its own
    Kueue (opt-in)                 (tests/kueue, harness/kueue.py) started by `start_kueue()`
                                   for the tests that queue RayClusters (the `kueue` fixture)
    Cloud Storage                  fake-gcs-server (tests/gcs, harness/gcs.py) with the bucket
                                   `tpufinetune-ground`; pods reach it through
                                   STORAGE_EMULATOR_HOST, as GKE pods reach GCS

The API server runs with the ExtendedResourceToleration admission plugin, so a pod that
requests google.com/tpu tolerates the TPU taint, as GKE arranges.

Nodes fail as GKE nodes do (`kill_node`, `delete_node`, `restore_node`, `preempt_node`,
`drain_node`, `set_maintenance`); the timings are nodelife.py's.

Used by the end-to-end fixtures (`ground`), `make cluster` and `make demo`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from controlplane import (  # noqa: E402
    ControlPlane,
    ControlPlaneError,
    kuberay_dir,
    kuberay_version,
    project_crd_files,
)
from gcs import GcsEmulator  # noqa: E402
from nodelife import APISERVER_FLAGS, CONTROLLER_FLAGS, CONTROLLERS, FAULT_ANNOTATION, KILLED, PREEMPTED  # noqa: E402
import images  # noqa: E402
import podcgroup  # noqa: E402
from ports import free_ports  # noqa: E402
from processes import spawn, stop_process, tail  # noqa: E402
from nodeagent import CLUSTERS_WITH_WORKERS, pod_log_path, ray_session_logs  # noqa: E402
from nodepools import MAINTENANCE_LABEL, NodePool, default_pools, node_manifest, node_status  # noqa: E402

# deploy/'s namespace (the Lease lives there) and the pod names the operator replicas get,
# as a Deployment's downward API would give them.
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
OPERATOR_NAMESPACE = "tpufinetune-system"
OPERATOR_PODS = ("tpufinetune-operator-0", "tpufinetune-operator-1")
DEPLOYMENT = "deployment"  # Ground(with_operator=DEPLOYMENT): the operator as deploy/'s pods

GC_CONTROLLERS = ",".join([
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    # kube-root-ca.crt in every namespace: the CA of each pod's kube-api-access volume.
    "root-ca-certificate-publisher-controller",
    "endpoints-controller",
    # The operator's own Deployment (make cluster; test_operator_deploy_e2e.py).
    "deployment-controller",
    "replicaset-controller",
    "endpointslice-controller",
    *CONTROLLERS,  # node lifecycle, taint eviction, pod GC, disruption budgets (nodelife.py)
    # Claims bound to volumes (the agent's provisioner makes them), and kept while in use.
    "persistentvolume-binder-controller",
    "persistentvolume-protection-controller",
    "persistentvolumeclaim-protection-controller",
])


def kuberay_crd_files() -> list[Path]:
    crds = sorted((kuberay_dir() / "crds").glob("ray.io_*.yaml"))
    if not crds or not (kuberay_dir() / "bin" / "ray-operator").exists():
        raise ControlPlaneError(
            f"KubeRay {kuberay_version()} is not built (.cache/kuberay/{kuberay_version()}): "
            "run `make kuberay` (builds ray-operator from its Go module; `make test` and "
            "`make cluster` run it for you)")
    return crds


def event_time(event: dict) -> str:
    """When an event last happened, as the API server wrote it (core/v1 or events.k8s.io)."""
    return event.get("lastTimestamp") or event.get("eventTime") or ""


class Ground:
    """start() returns once every component is up and the nodes are Ready."""

    def __init__(self, pools: list[NodePool] | None = None, workdir: Path | None = None,
                 with_operator: bool | str = False, operator_env: dict | None = None):
        self.pools = list(default_pools() if pools is None else pools)
        self.cp = ControlPlane(workdir=workdir)
        self.cp.extra_apiserver_args = ["--enable-admission-plugins=ExtendedResourceToleration", *APISERVER_FLAGS]
        # Every pod gets its ServiceAccount's token (kube-api-access-*: a bound token, the
        # cluster's CA, its namespace), which the node agent projects as a kubelet does.
        self.cp.disabled_admission = []
        # False, True (the operator as a process: the tests' fixture) or DEPLOYMENT (deploy/'s
        # Deployment's pods: make cluster).
        self.with_operator = with_operator
        self.operator_objects: list[dict] | None = None  # deploy/base as applied, in DEPLOYMENT mode
        self.operator_env = dict(operator_env or {})
        self.ground_id = secrets.token_hex(4)
        # One 127.N.0.0/16 per ground: two grounds at once (a test run beside `make cluster`)
        # never hand out the same pod address.
        self.ip_prefix = f"127.{secrets.randbelow(200) + 20}"
        self.processes: dict[str, subprocess.Popen] = {}
        self.operator = None
        self.replicas: list = []  # start_replica's
        self.kueue = None
        self.gcs: GcsEmulator | None = None
        self.timings: dict[str, float] = {}

    # -- paths
    @property
    def workdir(self) -> Path:
        return self.cp.workdir

    @property
    def hosts_file(self) -> Path:
        return self.workdir / "hosts"

    @property
    def gcs_root(self) -> Path:
        """The emulator's filesystem root: bucket B's objects are the files under `<root>/B`."""
        return self.workdir / "gcs"

    def kubectl(self, *args, **kwargs):
        return self.cp.kubectl(*args, **kwargs)

    def env(self) -> dict:
        return self.cp.env()

    # -- start / stop

    def start(self, timeout: float = 120.0) -> "Ground":
        crds = kuberay_crd_files()  # fail fast, before anything starts
        started = time.monotonic()
        self.cp.start(timeout=timeout)
        try:
            self._mark("control plane", started)
            t = time.monotonic()
            self.cp.install_crds(project_crd_files() + crds, timeout=timeout)
            self._mark("CRDs", t)
            self.hosts_file.write_text("127.0.0.1 localhost\n")
            t = time.monotonic()
            self.gcs = GcsEmulator(self.gcs_root, self.workdir / "gcs.log").start(timeout=timeout)
            self._start_scheduler()
            self._start_controller_manager()
            self._start_kuberay()
            self._start_agent()
            self.add_pools(self.pools)
            self._wait_component_health(timeout)
            self._mark("components", t)
            if self.with_operator == DEPLOYMENT:
                t = time.monotonic()
                self.deploy_operator(timeout)
                self._mark("operator", t)
            elif self.with_operator:
                t = time.monotonic()
                self.start_operator()
                self._mark("operator", t)
        except BaseException:
            self.stop()
            raise
        return self

    def _mark(self, what: str, since: float) -> None:
        self.timings[what] = round(time.monotonic() - since, 1)

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> None:
        self.processes[name] = spawn(argv, self.workdir / f"{name}.log", env=env)

    def _start_kube_component(self, name: str, flags: list[str]) -> str:
        """kube-scheduler or kube-controller-manager, as the admin, serving /healthz on a
        free loopback port (returned)."""
        port, = free_ports(1)
        kubeconfig = self.cp.kubeconfig
        self._spawn(name, [
            str(self.cp.bin_dir / name),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.workdir / (name + '-certs')}",
            "--v=1",
            *flags,
        ])
        return f"https://127.0.0.1:{port}/healthz"

    def _start_scheduler(self) -> None:
        self.scheduler_health = self._start_kube_component("kube-scheduler", [])

    def _start_controller_manager(self) -> None:
        pki = self.workdir / "pki"
        self.kcm_health = self._start_kube_component("kube-controller-manager", [
            f"--controllers={GC_CONTROLLERS}",
            *CONTROLLER_FLAGS,
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=false",
        ])

    def _start_kuberay(self) -> None:
        metrics, probe = free_ports(2)
        env = dict(os.environ, KUBECONFIG=str(self.cp.kubeconfig))
        self._spawn("kuberay-operator", [
            str(kuberay_dir() / "bin" / "ray-operator"),
            "-enable-leader-election=false",
            f"-metrics-addr=127.0.0.1:{metrics}",
            f"-health-probe-bind-address=127.0.0.1:{probe}",
            "-log-stdout-encoder=console",
            # Replica and host index labels on worker pods (the default since v1.5, named
            # because the node agent's TPU worker ids come from them).
            "-feature-gates=RayMultiHostIndexing=true",
        ], env=env)
        self.kuberay_health = f"http://127.0.0.1:{probe}/readyz"

    def _start_agent(self) -> None:
        trainer_image = images.ensure()  # built by `make images`; the project copy refreshed here
        operator_image = images.ensure_operator()  # deploy/'s Deployment runs it (make cluster)
        # The agent's own environment never reaches a pod (NodeAgent.environment).
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        (self.workdir / "pods").mkdir(exist_ok=True)
        self._spawn("node-agent", [
            sys.executable, str(HERE / "nodeagent.py"),
            f"--kubeconfig={self.cp.kubeconfig}", f"--workdir={self.workdir}",
            f"--hosts-file={self.hosts_file}", f"--ip-prefix={self.ip_prefix}",
            f"--ground-id={self.ground_id}",
            # Node-level additions, as GKE gives pods their credentials: every pod reaches
            # Cloud Storage at the emulator.
            "--node-env", f"STORAGE_EMULATOR_HOST={self.gcs.endpoint}",
            f"--gcs-root={self.gcs_root}",
            # The trainer's image: its environment, as Dockerfile.trainer builds it.
            *(f"--image-env={repository}={trainer_image}" for repository in images.TRAINER_REPOSITORIES),
            # The operator's image: its environment and its entrypoint, as Dockerfile.operator
            # builds them.
            *(f"--image-env={repository}={operator_image}" for repository in images.OPERATOR_REPOSITORIES),
            *(f"--image-dockerfile={repository}={images.OPERATOR_DOCKERFILE}" for repository in images.OPERATOR_REPOSITORIES),
        ], env=env)

    def _wait_component_health(self, timeout: float) -> None:
        insecure = ssl.create_default_context()  # the components' self-signed serving certs
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE

        def answers(url: str, context=None):
            def check() -> bool:
                try:
                    with urllib.request.urlopen(url, context=context, timeout=2) as response:
                        return response.status == 200
                except OSError:
                    return False
            return check

        pending = {
            "kube-scheduler": answers(self.scheduler_health, insecure),
            "kube-controller-manager": answers(self.kcm_health, insecure),
            "kuberay-operator": answers(self.kuberay_health),
            "node-agent": (self.workdir / "nodeagent.ready").exists,
        }
        deadline = time.monotonic() + timeout
        while pending:
            for name, ready in list(pending.items()):
                proc = self.processes[name]
                if proc.poll() is not None:
                    raise ControlPlaneError(f"{name} exited with {proc.returncode}; last log lines:\n"
                                            + tail(self.workdir / f"{name}.log"))
                if ready():
                    del pending[name]
            if pending and time.monotonic() > deadline:
                raise ControlPlaneError(f"not healthy within {timeout:.0f}s: {', '.join(pending)}")
            time.sleep(0.3)

    # -- nodes

    def add_pools(self, pools: list[NodePool], timeout: float = 60) -> None:
        """The pools' nodes registered as a kubelet registers them; returns once the
        node-lifecycle controller has seen them Ready (it lifts the not-ready taint the API
        server puts on every new node)."""
        for pool in pools:
            for name in pool.node_names():
                self._register(pool, name)
        self.pools += [p for p in pools if p not in self.pools]
        self._wait_schedulable([n for p in pools for n in p.node_names()], timeout)

    def _register(self, pool: NodePool, name: str) -> None:
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=str(self.cp.kubeconfig))
        try:
            core = client.CoreV1Api(api)
            core.create_node(node_manifest(pool, name))
            core.patch_node_status(name, {"status": node_status(pool, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))},
                                   _content_type="application/merge-patch+json")
        finally:
            api.close()

    def _wait_schedulable(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(names)
        while pending:
            for node in json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]:
                taints = {t["key"] for t in node["spec"].get("taints") or []}
                if node["metadata"]["name"] in pending and not any(t.startswith("node.kubernetes.io/") for t in taints):
                    pending.discard(node["metadata"]["name"])
            if pending and time.monotonic() > deadline:
                raise ControlPlaneError(f"nodes not Ready within {timeout:.0f}s: {', '.join(sorted(pending))}; "
                                        "last node-agent log lines:\n" + tail(self.workdir / "node-agent.log"))
            if pending:
                time.sleep(0.5)

    def remove_pool(self, pool: NodePool) -> None:
        for name in pool.node_names():
            self.kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
        if pool in self.pools:
            self.pools.remove(pool)

    # -- node failures, as GKE has them (the node agent plays them: nodelife.py)

    def kill_node(self, name: str, timeout: float = 30) -> None:
        """The node's VM stops dead: its pods' processes get SIGKILL at once and it sends no
        more heartbeats. The Node stays registered: the node-lifecycle controller marks it
        NotReady and evicts its pods, which stay Terminating while no kubelet confirms them
        (`delete_node` is GKE's answer to a VM that is gone). Returns once the processes are
        gone."""
        pods = self._pods_on(name)
        self._annotate(name, KILLED)
        from waiting import wait_for

        wait_for(lambda: not any(self.ray_processes(uid) for uid in pods), timeout,
                 f"the processes of {name}'s pods killed")

    def preempt_node(self, name: str) -> None:
        """GKE's Spot preemption (nodelife.py): NotReady at once, the pods get SIGTERM and,
        after their share of the 30 s notice, SIGKILL; then the Node is deleted. Returns at
        once: the notice runs in the node agent."""
        self._annotate(name, PREEMPTED)

    def delete_node(self, name: str) -> None:
        """What GKE does when a node's VM is gone: the Node is deleted (its Lease goes with
        it), and the pod garbage collector removes its pods once the node has been missing
        for its quarantine (40 s)."""
        self.kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")

    def restore_node(self, name: str, timeout: float = 60) -> None:
        """A fresh VM under the same name, as GKE's auto-repair or a Spot pool's refill
        brings one: the Node is registered again (a still registered one is deleted first)."""
        pool = next((p for p in self.pools if name in p.node_names()), None)
        if pool is None:
            raise ValueError(f"no pool of this ground has a node {name!r}")
        self.kubectl("delete", "node", name, "--ignore-not-found", "--wait=true")
        self._register(pool, name)
        self._wait_schedulable([name], timeout)

    def drain_node(self, name: str, timeout: float = 60):
        """`kubectl drain`: the node cordoned, its pods evicted through the Eviction API (a
        PodDisruptionBudget can refuse, and drain retries until `timeout`). Returns kubectl's
        CompletedProcess (check=False: a refused drain is an answer, not an error)."""
        return self.kubectl("drain", name, "--ignore-daemonsets", "--delete-emptydir-data",
                            f"--timeout={int(timeout)}s", check=False, timeout=timeout + 30)

    def set_maintenance(self, name: str, start: float) -> None:
        """GKE's announcement of a host maintenance event on the node: the label
        cloud.google.com/scheduled-maintenance-time, its start in seconds since the epoch."""
        self.kubectl("label", "node", name, f"{MAINTENANCE_LABEL}={int(start)}", "--overwrite")

    def _annotate(self, name: str, fault: str) -> None:
        self.kubectl("annotate", "node", name, f"{FAULT_ANNOTATION}={fault}", "--overwrite")

    def _pods_on(self, name: str) -> list[str]:
        listing = json.loads(self.kubectl("get", "pods", "-A", "--field-selector", f"spec.nodeName={name}",
                                          "-o", "json").stdout)
        return [pod["metadata"]["uid"] for pod in listing["items"]]

    # -- the operator

    def operator_environment(self, kubeconfig: Path) -> dict:
        env = dict(os.environ)
        env.pop("TPUFT_DASHBOARD_URL", None)  # the operator reaches each head by its Service name
        # A developer's shell proxy is not the pod's: through it no head's Service name answers
        # (a Deployment's pod carries only what its spec gives).
        for name in PROXY_VARIABLES:
            env.pop(name, None)
            env.pop(name.upper(), None)
        env.update(
            KUBECONFIG=str(kubeconfig),
            # Stray Ray address variables must not redirect any run (the operator drops
            # them); every run on the ground proves it.
            RAY_ADDRESS="http://127.0.0.1:9",
            RAY_API_SERVER_ADDRESS="http://127.0.0.1:9",
            TPUFT_POLL_INTERVAL="1",
            HF_HUB_OFFLINE="1",
        )
        env.update(self.operator_env)
        return env

    def start_operator(self, kubeconfig: Path | None = None, extra_env: dict | None = None):
        """The operator as deployed: deploy/'s ServiceAccount, cluster DNS from the ground,
        leader election on (the pod name and namespace a Deployment's downward API gives).
        Starts as the leader unless another replica holds the Lease (`start_replica`)."""
        from operator_process import OperatorProcess
        from service_account import WATCHED, service_account_kubeconfig

        kubeconfig = kubeconfig or service_account_kubeconfig(self.cp, self.workdir / "operator-kubeconfig")
        env = self.operator_environment(kubeconfig)
        env.setdefault("TPUFT_NAMESPACE", WATCHED)  # each namespace bound when made (ground_fixtures)
        env.update(POD_NAME=OPERATOR_PODS[0], TPUFT_OPERATOR_NAMESPACE=OPERATOR_NAMESPACE)
        env.update(extra_env or {})
        self.operator = OperatorProcess(env, self.workdir / "operator.log", hosts_file=self.hosts_file)
        self.operator.start()
        return self.operator

    def deploy_operator(self, timeout: float = 180) -> list[dict]:
        """The operator as deploy/'s Deployment (operator_deployment.py): its two pods Ready,
        one of them leading."""
        import operator_deployment
        from waiting import wait_for

        self.operator_objects = operator_deployment.apply(self.cp)
        pods = operator_deployment.wait_ready(self.cp, timeout=timeout)
        wait_for(lambda: operator_deployment.leading_pod(self.cp), timeout, "an operator pod leading")
        return pods

    def start_replica(self, pod_name: str = OPERATOR_PODS[1]):
        """A second operator replica beside `start_operator`'s, with the same ServiceAccount
        and settings but its own pod name (so its own Lease identity) and log. It answers
        /healthz at once and stands by until the Lease is free. Stopped with the ground."""
        from operator_process import OperatorProcess

        if self.operator is None:
            raise RuntimeError("start_operator first: a replica copies its settings")
        env = {**self.operator.env, "POD_NAME": pod_name}
        metrics_port = free_ports(1)[0] if env.get("TPUFT_METRICS_PORT") else None
        if metrics_port:  # its own port, as each pod has
            env["TPUFT_METRICS_PORT"] = str(metrics_port)
        replica = OperatorProcess(env, self.workdir / f"{pod_name}.log", hosts_file=self.hosts_file)
        replica.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None
        self.replicas.append(replica)
        replica.start()
        return replica

    # -- Kueue (opt-in)

    def start_kueue(self):
        """Kueue with its queues (harness/kueue.py); once per ground, then left running: it
        touches only RayClusters that carry its queue label."""
        from kueue import Kueue

        if self.kueue is None:
            t = time.monotonic()
            self.kueue = Kueue(self).start()
            self._mark("kueue", t)
        return self.kueue

    # -- inspection

    def ray_processes(self, pod_uid: str | None = None) -> list[int]:
        """Pids of the processes of one pod (by uid), or of the whole ground: its cgroup's."""
        root = podcgroup.ground_cgroup(self.ground_id)
        return podcgroup.procs(root / pod_uid if pod_uid else root)

    def pod_report(self, namespace: str) -> str:
        """For a failed test: each pod of `namespace` still on the ground, its memory (now,
        peak, limit, times the limit was hit) and the tail of its Ray logs; what shows a
        head that stopped answering (starved, near its limit, or hung)."""
        status, body = self.cp.get_json(f"/api/v1/namespaces/{namespace}/pods")
        if status != 200:
            return f"(pods of {namespace}: {status})"
        lines = []
        root = podcgroup.ground_cgroup(self.ground_id)
        events = self.pod_events(namespace)
        for pod in body["items"]:
            meta = pod["metadata"]
            lines.append(f"pod {meta['name']} ({pod['status'].get('phase')}, node {pod['spec'].get('nodeName')})")
            for c in (pod["status"].get("initContainerStatuses") or []) + (pod["status"].get("containerStatuses") or []):
                last = (c.get("lastState") or {}).get("terminated")
                lines.append(f"  {c['name']}: {c.get('state')}, ready {c.get('ready')}")
                if c.get("restartCount") or last:
                    lines.append(f"  {c['name']}: restarted {c.get('restartCount', 0)} times; last ended: {last}")
            # What the node and the controllers said of it (Killing, Unhealthy, BackOff...):
            # before the logs, so that a cut report still shows it.
            lines.extend(f"  event {line}" for line in events.get(meta["name"], [])[-12:])
            lines.append("  -- its log --\n" + tail(pod_log_path(self.workdir, meta["namespace"], meta["name"]), 15))
            for container in sorted(p for p in (root / meta["uid"]).glob("*") if p.is_dir()):
                usage = {key: podcgroup.read_number(container / f"memory.{key}")
                         for key in ("usage_in_bytes", "max_usage_in_bytes", "limit_in_bytes", "failcnt")}
                lines.append(f"  {container.name}: memory now {usage['usage_in_bytes'] >> 20} MiB, "
                             f"peak {usage['max_usage_in_bytes'] >> 20} MiB, limit "
                             f"{usage['limit_in_bytes'] >> 20} MiB, hit {usage['failcnt']} times; "
                             f"{len(podcgroup.procs(container))} processes")
            for logs in ray_session_logs(self.workdir, meta["uid"]):
                for name in ("ray_process_exit.log", "dashboard.log", "gcs_server.out", "raylet.out", "monitor.log"):
                    try:
                        text = (logs / name).read_text(errors="replace").splitlines()
                    except OSError:
                        continue
                    text = [line for line in text if not line.startswith("[state-dump]")][-12:]
                    lines.append(f"  -- {logs.parent.name}/{name} --\n" + "\n".join(text))
        return "\n".join(lines) or f"(no pods in {namespace})"

    def events(self, namespace: str) -> list[dict]:
        """The events of `namespace`, oldest first (none when they cannot be read)."""
        status, body = self.cp.get_json(f"/api/v1/namespaces/{namespace}/events")
        return sorted(body.get("items", []) if status == 200 else [], key=event_time)

    def pod_events(self, namespace: str) -> dict[str, list[str]]:
        """The events of each pod of `namespace`, oldest first, one line each."""
        found: dict[str, list[str]] = {}
        for event in self.events(namespace):
            involved = event.get("involvedObject") or {}
            if involved.get("kind") == "Pod":
                found.setdefault(involved.get("name", ""), []).append(
                    f"{event_time(event)} {event.get('reason')} x{event.get('count') or 1}: {event.get('message')}")
        return found

    def alive(self) -> bool:
        return self.cp.etcd.poll() is None and self.cp.apiserver.poll() is None and all(
            p.poll() is None for p in self.processes.values()) and (
            self.gcs is None or (self.gcs.proc is not None and self.gcs.proc.poll() is None))

    @property
    def pids(self) -> dict[str, int]:
        return {**self.cp.pids, **{n: p.pid for n, p in self.processes.items()},
                **({"kueue": self.kueue.proc.pid} if self.kueue and self.kueue.proc else {}),
                **({"gcs": self.gcs.proc.pid} if self.gcs and self.gcs.proc else {}),
                **({"operator": self.operator.proc.pid} if self.operator and self.operator.proc else {})}

    def clusters_with_workers(self) -> list[str]:
        """"namespace/name uid" of each RayCluster whose workers ran here (the node agent's
        count): a RayCluster that never trains is applied suspended or has no workers."""
        try:
            return (self.workdir / CLUSTERS_WITH_WORKERS).read_text().split("\n")[:-1]
        except OSError:
            return []

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()
        if self.operator is not None:
            self.operator.stop()
        if self.kueue is not None:
            self.kueue.stop()
        # The agent first: it stops every Ray process it started.
        agent = self.processes.pop("node-agent", None)
        if agent is not None:
            stop_process(agent, grace=20)
        podcgroup.remove(podcgroup.ground_cgroup(self.ground_id))  # whatever the agent could not reach
        shutil.rmtree(Path("/dev/shm") / f"tpuft-{self.ground_id}", ignore_errors=True)
        for name in ("kuberay-operator", "kube-controller-manager", "kube-scheduler"):
            proc = self.processes.pop(name, None)
            if proc is not None:
                stop_process(proc)
        if self.gcs is not None:
            self.gcs.stop()
        self.cp.stop()

    def __enter__(self) -> "Ground":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
