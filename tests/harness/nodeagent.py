"""The ground's node agent: plays the kubelet (and GKE's TPU device plugin) for the pods the
scheduler binds to simulated nodes, by running each pod as a real local Ray process.

- A pod bound to a node labelled `tpufinetune.dev/simulated-node` gets its own loopback
  address (127.x.y.z) as its podIP, and its container's `ray start …` line (the one KubeRay
  wrote, with the pod's rayStartParams) runs for real: the head with its own GCS, the
  workers joined to their head.
- The pod is reported Running and Ready only once its process answers: the head's
  dashboard serves `/api/version`, a worker's `ray start` has registered its node.
- Deleting the pod stops the process (SIGTERM, then SIGKILL after the grace period, every
  descendant included) before the agent confirms the deletion, as a kubelet does. A process
  that dies on its own is reported as a terminated container (restarted when the pod's
  restartPolicy asks for it), so KubeRay sees it.
- Faults a kubelet reports, on request, so the operator's pod-level reasons are tested end
  to end: an image on a registry under the reserved `.invalid` top-level domain (RFC 2606:
  it never resolves) fails to pull (ErrImagePull, then ImagePullBackOff, retried with
  back-off, as a kubelet does); a pod annotated `ground.tpufinetune.dev/exit-code: "N"`
  runs a container that exits N at once, restarted with back-off (CrashLoopBackOff).
- Workers on TPU nodes get the environment GKE gives TPU pods (TPU_WORKER_ID, TPU_NAME,
  TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, TPU_WORKER_HOSTNAMES), so Ray's own TPU code advertises
  the slice head resource and the slice labels; the TPU count is the `TPU` resource KubeRay
  puts into `ray start` from the pod's `google.com/tpu` request.
- It also plays cluster DNS for the ground: every Service's ready pods (picked by its
  selector, as the endpoint-slice controller does) go into a hosts file, which processes
  that should resolve Service names (the operator) see as their /etc/hosts.

Where this differs from GKE is listed in tests/README.md. Run as a process by `Ground`:

    python tests/harness/nodeagent.py --kubeconfig K --workdir D --hosts-file H --ip-prefix 127.N
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kubernetes import client, config, watch  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

from nodepools import SIMULATED_LABEL  # noqa: E402
from ports import free_ports  # noqa: E402
from tpufinetune.core.generations import ACCELERATOR_LABEL, GENERATIONS, TOPOLOGY_LABEL, chips_in  # noqa: E402

log = logging.getLogger("nodeagent")

# Every process the agent starts carries this variable (Ray passes the environment down to
# raylet, GCS and workers), so a sweep can find them all even after they re-parent.
MARKER_ENV = "TPUFT_GROUND_POD"
DASHBOARD_PORT = 8265
UNRESOLVABLE_DOMAIN = ".invalid"  # RFC 2606: no registry there ever resolves
EXIT_CODE_ANNOTATION = "ground.tpufinetune.dev/exit-code"
OBJECT_STORE_BYTES = 100 * 1024 * 1024  # Ray's default (30% of RAM per node) is for real hosts

# `ray start` flags the agent decides itself: addresses and ports (every pod shares this
# machine's port space) and where Ray keeps its files.
_OWN_FLAGS = {
    "--address", "--node-ip-address", "--port", "--dashboard-host", "--dashboard-port",
    "--metrics-export-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port", "--ray-client-server-port", "--node-manager-port",
    "--object-manager-port", "--min-worker-port", "--max-worker-port", "--temp-dir",
    "--object-store-memory", "--block", "--dashboard-grpc-port", "--gcs-server-port",
}


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- pure parts ----------------------------------------------------------------------------


def ray_start_args(container: dict) -> list[str]:
    """The flags of the `ray start` in a container's command line (KubeRay writes
    `ulimit -n 65536; ray start --head … --num-cpus=0 …`), without the words `ray start`."""
    words = [*(container.get("command") or []), *(container.get("args") or [])]
    text = " ".join(w for w in words if w not in ("/bin/bash", "bash", "/bin/sh", "sh", "-c", "-lc", "--"))
    # KubeRay may keep its generated line in an env var ($KUBERAY_GEN_RAY_START_CMD) when the
    # user brings a command of their own: expand the container's plain variables first.
    plain = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
    text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: plain.get(m.group(1), m.group(0)), text)
    for part in re.split(r";|&&|\|\|", text):
        tokens = shlex.split(part)
        for i in range(len(tokens) - 1):
            if tokens[i].endswith("ray") and tokens[i + 1] == "start":
                return tokens[i + 2:]
    raise ValueError(f"container {container.get('name')!r} runs no `ray start`: {text[:200]!r}")


def rewrite_ray_start(args: list[str], *, head: bool, ip: str, temp_dir: str,
                      gcs_address: str | None, ports: dict[str, int]) -> list[str]:
    """The pod's own flags (resources, labels, num-cpus, memory …) kept, and the addresses,
    ports and directories this machine needs put in their place."""
    kept: list[str] = []
    skip_value = False
    for token in args:
        if skip_value:
            skip_value = False
            continue
        name = token.split("=", 1)[0]
        if name in _OWN_FLAGS:
            # `--flag value` form: the value is the next token (except for bare switches).
            skip_value = "=" not in token and name != "--block"
            continue
        if name == "--head":
            continue
        kept.append(token)
    own = [
        f"--node-ip-address={ip}",
        f"--temp-dir={temp_dir}",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        f"--metrics-export-port={ports['metrics']}",
        f"--dashboard-agent-listen-port={ports['agent_http']}",
        f"--dashboard-agent-grpc-port={ports['agent_grpc']}",
        f"--runtime-env-agent-port={ports['runtime_env']}",
        "--block",
    ]
    if head:
        own = ["--head", f"--port={ports['gcs']}", f"--dashboard-host={ip}",
               f"--dashboard-port={DASHBOARD_PORT}", f"--ray-client-server-port={ports['client']}", *own]
    else:
        own = [f"--address={gcs_address}", *own]
    return own + kept


def tpu_environment(topology: str, worker_id: int, slice_name: str, hostnames: list[str],
                    ray_accelerator: str) -> dict[str, str]:
    """What GKE gives a pod on a TPU slice node, as Ray's TPU code reads it."""
    from ray._private.accelerators.tpu import infer_tpu_pod_type_from_topology

    pod_type = infer_tpu_pod_type_from_topology(topology, ray_accelerator) or ""
    return {
        "TPU_WORKER_ID": str(worker_id),
        "TPU_WORKER_HOSTNAMES": ",".join(hostnames),
        "TPU_NAME": slice_name,
        "TPU_ACCELERATOR_TYPE": pod_type,
        "TPU_TOPOLOGY": topology,
    }


# The node label GKE puts on a slice's nodes -> Ray's accelerator type, from the one TPU table.
RAY_ACCELERATOR_BY_LABEL = {g.accelerator_label: g.ray_accelerator_type for g in GENERATIONS if g.is_tpu}


def registry_host(image: str) -> str:
    """The registry an image reference names ('' for Docker Hub's short names)."""
    first, _, rest = image.partition("/")
    return first if rest and ("." in first or ":" in first or first == "localhost") else ""


def hosts_file_text(entries: dict[str, str]) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    by_ip: dict[str, list[str]] = {}
    for name, ip in sorted(entries.items()):
        by_ip.setdefault(ip, []).append(name)
    lines += [f"{ip} {' '.join(names)}" for ip, names in sorted(by_ip.items())]
    return "\n".join(lines) + "\n"


def service_endpoints(services, pods) -> dict[str, str]:
    """DNS name -> pod IP for every Service with a selector and a ready pod it selects."""
    entries: dict[str, str] = {}
    ready = [p for p in pods if p.status and p.status.pod_ip and p.metadata.deletion_timestamp is None
             and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
    for service in services:
        selector = service.spec.selector or {}
        if not selector:
            continue
        for pod in ready:
            labels = pod.metadata.labels or {}
            if pod.metadata.namespace == service.metadata.namespace and all(
                    labels.get(k) == v for k, v in selector.items()):
                for name in service_names(service.metadata.name, service.metadata.namespace):
                    entries[name] = pod.status.pod_ip
                break
    return entries


def service_names(service: str, namespace: str) -> list[str]:
    """The names cluster DNS answers for a Service."""
    return [f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


# ---- processes -----------------------------------------------------------------------------


def processes_marked(marker: str) -> list[int]:
    """Pids whose environment carries MARKER_ENV=marker (or any value when marker == '*')."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(MARKER_ENV.encode() + b"="):
                value = item.split(b"=", 1)[1].decode(errors="replace")
                if marker == "*" or value == marker or value.startswith(marker + "/"):
                    found.append(int(entry))
                break
    return found


def kill_marked(marker: str, grace: float) -> int:
    """SIGTERM every process of `marker`, SIGKILL what is left after `grace` seconds."""
    pids = processes_marked(marker)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive_any(pids):
        time.sleep(0.1)
    _signal_all(processes_marked(marker), signal.SIGKILL)
    return len(pids)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive_any(pids: list[int]) -> bool:
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            return True
    return False


# ---- the agent -----------------------------------------------------------------------------


@dataclass
class PodRun:
    namespace: str
    name: str
    uid: str
    ip: str
    node: str
    head: bool
    cluster: str
    cluster_uid: str  # the RayCluster object: a rebuilt cluster keeps its name, not its uid
    marker: str
    temp_dir: Path
    log_path: Path
    restart_policy: str = "Always"
    proc: subprocess.Popen | None = None
    stopping: bool = False
    restarts: int = 0
    gcs_address: str = ""
    ready: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class NodeAgent:
    def __init__(self, api: client.ApiClient, workdir: Path, hosts_file: Path, ip_prefix: str,
                 ground_id: str):
        self.core = client.CoreV1Api(api)
        self.workdir = workdir
        self.hosts_file = hosts_file
        self.ip_prefix = ip_prefix  # "127.N": pods get 127.N.x.y
        self.ground_id = ground_id
        self.runs: dict[str, PodRun] = {}  # by pod uid
        self.heads: dict[str, PodRun] = {}  # RayCluster uid -> head run
        self.slice_ids: dict[tuple[str, str], list[str]] = {}  # (cluster uid, group) -> pod uids in order
        self.nodes: dict[str, tuple[dict, int]] = {}  # name -> (labels, google.com/tpu allocatable)
        # Every pod, as the watch last delivered it: cluster DNS reads it, never re-lists.
        self.pods: dict[str, object] = {}
        self.started = 0
        self.lock = threading.Lock()
        self.next_ip = 1
        self.stop_event = threading.Event()

    # -- pods

    def allocate_ip(self) -> str:
        with self.lock:
            n = self.next_ip
            self.next_ip += 1
        return f"{self.ip_prefix}.{n // 250}.{n % 250 + 1}"

    def node(self, name: str) -> tuple[dict, int] | None:
        """A node's labels and TPU chips (read once: simulated nodes never change)."""
        if name not in self.nodes:
            try:
                node = self.core.read_node(name)
            except ApiException as error:
                if error.status == 404:
                    return None
                raise
            chips = int((node.status.allocatable or {}).get("google.com/tpu", "0"))
            self.nodes[name] = (node.metadata.labels or {}, chips)
        return self.nodes[name]

    def handle(self, pod) -> None:
        meta, spec = pod.metadata, pod.spec
        if not spec.node_name:
            return
        node = self.node(spec.node_name)
        if node is None or node[0].get(SIMULATED_LABEL) != "true":
            return
        labels = node[0]
        run = self.runs.get(meta.uid)
        if meta.deletion_timestamp is not None:
            if run is not None and not run.stopping:
                run.stopping = True
                grace = spec.termination_grace_period_seconds
                threading.Thread(target=self.terminate, args=(run, 30 if grace is None else grace),
                                 daemon=True).start()
            elif run is None:
                self.confirm_deletion(meta.namespace, meta.name, meta.uid)
            return
        if run is None and (pod.status.phase in (None, "Pending")):
            self.start(pod, labels)

    def start(self, pod, node_labels: dict) -> None:
        meta, spec = pod.metadata, pod.spec
        pod_labels = meta.labels or {}
        head = pod_labels.get("ray.io/node-type") == "head"
        cluster = pod_labels.get("ray.io/cluster", "")
        self.started += 1
        index = self.started
        temp_dir = Path(f"/tmp/tpuft-{self.ground_id}-{index}")
        run = PodRun(
            namespace=meta.namespace, name=meta.name, uid=meta.uid, ip=self.allocate_ip(),
            node=spec.node_name, head=head, cluster=cluster,
            cluster_uid=next((ref.uid for ref in meta.owner_references or [] if ref.controller), f"{meta.namespace}/{cluster}"),
            marker=f"{self.ground_id}/{meta.uid}", temp_dir=temp_dir,
            log_path=self.workdir / "pods" / f"{meta.namespace}_{meta.name}.log",
            restart_policy=spec.restart_policy or "Always",
        )
        self.runs[meta.uid] = run
        if head:
            self.heads[run.cluster_uid] = run
        threading.Thread(target=self.supervise, args=(run, pod, node_labels), daemon=True).start()

    def supervise(self, run: PodRun, pod, node_labels: dict) -> None:
        try:
            self._supervise(run, pod, node_labels)
        except Exception:  # never take the agent down with one pod
            log.exception("pod %s/%s", run.namespace, run.name)

    def _supervise(self, run: PodRun, pod, node_labels: dict) -> None:
        container = pod.spec.containers[0]
        started_at = now()
        self.patch_status(run, self.pending_status(run, pod, started_at))
        if registry_host(container.image).endswith(UNRESOLVABLE_DOMAIN):
            self.fail_pull(run, pod, started_at)
            return
        env = self.environment(run, pod, container, node_labels)
        if env is None:
            return
        args = ray_start_args(client.ApiClient().sanitize_for_serialization(container))
        exit_code = (pod.metadata.annotations or {}).get(EXIT_CODE_ANNOTATION)
        while not run.stopping:
            if not run.head:
                head = self.wait_for_head(run)
                if head is None:
                    return
                run.gcs_address = head.gcs_address
            # On every address: Ray's GCS and some agents listen on 0.0.0.0.
            names = ("gcs", "metrics", "agent_http", "agent_grpc", "runtime_env", "client")
            ports = dict(zip(names, free_ports(len(names), "0.0.0.0")))
            if run.head:
                run.gcs_address = f"{run.ip}:{ports['gcs']}"
            # KubeRay's RAY_ADDRESS / RAY_PORT name port 6379 on the head; here the GCS
            # listens where the agent put it.
            env.update(RAY_ADDRESS=run.gcs_address, RAY_PORT=run.gcs_address.rsplit(":", 1)[1])
            argv = [str(Path(sys.executable).parent / "ray"), "start",
                    *rewrite_ray_start(args, head=run.head, ip=run.ip, temp_dir=str(run.temp_dir),
                                       gcs_address=run.gcs_address, ports=ports)]
            if exit_code is not None:  # asked to crash: the container's command fails at once
                argv = [sys.executable, "-c", f"import sys; print('asked to exit {int(exit_code)}'); sys.exit({int(exit_code)})"]
            run.log_path.parent.mkdir(parents=True, exist_ok=True)
            with run.lock:
                if run.stopping:
                    return
                with open(run.log_path, "ab") as out:
                    out.write(f"\n---- {now()} {shlex.join(argv)}\n".encode())
                    out.flush()
                    run.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True,
                                                cwd=str(self.workdir))
            container_started = now()
            if self.wait_ready(run, env):
                run.ready = True
                self.patch_status(run, self.running_status(run, pod, started_at, container_started))
            code = run.proc.wait()
            run.ready = False
            if run.stopping:
                return
            # The container's main process ended by itself: a kubelet reports it and
            # restarts it when restartPolicy says so.
            kill_marked(run.marker, grace=2)
            log.info("pod %s/%s: ray exited %s", run.namespace, run.name, code)
            restart = run.restart_policy == "Always" or (run.restart_policy == "OnFailure" and code != 0)
            self.patch_status(run, self.terminated_status(run, pod, started_at, container_started, code, restart))
            if not restart:
                return
            run.restarts += 1
            time.sleep(min(10, 2 ** run.restarts))  # the kubelet's crash-loop back-off, shortened

    def fail_pull(self, run: PodRun, pod, started_at: str) -> None:
        """What a kubelet reports for an image it cannot pull: ErrImagePull, then
        ImagePullBackOff until the next try, with a growing back-off (shortened here)."""
        image = pod.spec.containers[0].image
        host = registry_host(image)
        tries = 0
        while not run.stopping and not self.stop_event.is_set():
            tries += 1
            self.patch_status(run, self.waiting_status(run, pod, started_at, "ErrImagePull", (
                f'failed to pull and unpack image "{image}": failed to resolve reference "{image}": '
                f"dial tcp: lookup {host}: no such host")))
            if self.stop_event.wait(1) or run.stopping:
                return
            self.patch_status(run, self.waiting_status(run, pod, started_at, "ImagePullBackOff",
                                                       f'Back-off pulling image "{image}"'))
            self.stop_event.wait(min(10, 2 ** tries))

    def wait_for_head(self, run: PodRun) -> PodRun | None:
        while not run.stopping and not self.stop_event.is_set():
            head = self.heads.get(run.cluster_uid)
            if head is not None and head.ready and head.gcs_address:
                return head
            time.sleep(0.5)
        return None

    def wait_ready(self, run: PodRun, env: dict) -> bool:
        # The head's own token, from its resolved environment (KubeRay's secretKeyRef).
        token = env.get("RAY_AUTH_TOKEN", "")
        while run.proc.poll() is None and not run.stopping:
            if run.head:
                request = urllib.request.Request(
                    f"http://{run.ip}:{DASHBOARD_PORT}/api/version",
                    headers={"Authorization": f"Bearer {token}"} if token else {})
                try:
                    with urllib.request.urlopen(request, timeout=2) as response:
                        if response.status == 200:
                            return True
                except OSError:
                    pass
            else:
                try:
                    if b"Ray runtime started" in run.log_path.read_bytes()[-20000:]:
                        return True
                except OSError:
                    pass
            time.sleep(0.5)
        return False

    def environment(self, run: PodRun, pod, container, node_labels: dict) -> dict | None:
        """What a kubelet gives the container, never the agent's own environment: a minimal
        base, the kubelet's additions and the pod spec's env. The node-level additions
        (HF_*_OFFLINE, PYTHONPATH of a development tree) are listed in tests/README.md."""
        home = run.temp_dir / "home"
        home.mkdir(parents=True, exist_ok=True)
        # The pod's image is this machine's environment: its Python and its console scripts.
        env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
               "HOME": str(home), "TMPDIR": str(run.temp_dir), "LANG": "C.UTF-8",
               "HOSTNAME": run.name, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "443",
               "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
               # Nothing can be downloaded on the ground: models and datasets are local.
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if os.environ.get("PYTHONPATH"):  # a development tree the agent itself runs from
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env[MARKER_ENV] = run.marker
        field_values = {
            "metadata.name": run.name, "metadata.namespace": run.namespace,
            "metadata.uid": run.uid, "status.podIP": run.ip, "spec.nodeName": run.node,
            "status.hostIP": "127.0.0.1",
        }
        for item in container.env or []:
            if item.value is not None:
                env[item.name] = _expand(item.value, env)
            elif item.value_from is not None and item.value_from.field_ref is not None:
                path = item.value_from.field_ref.field_path
                if path in field_values:
                    env[item.name] = field_values[path]
                elif path.startswith("metadata.labels['"):
                    env[item.name] = (pod.metadata.labels or {}).get(path[17:-2], "")
            elif item.value_from is not None and item.value_from.secret_key_ref is not None:
                ref = item.value_from.secret_key_ref
                try:
                    secret = self.core.read_namespaced_secret(ref.name, run.namespace)
                    env[item.name] = base64.b64decode((secret.data or {})[ref.key]).decode()
                except (ApiException, KeyError):
                    if ref.optional:
                        continue
                    self.patch_status(run, {"status": {"containerStatuses": [{
                        "name": container.name, "ready": False, "restartCount": 0, "image": container.image,
                        "imageID": "", "state": {"waiting": {"reason": "CreateContainerConfigError",
                        "message": f'secret "{ref.name}" key "{ref.key}" not found'}}}]}})
                    return None
        accelerator = node_labels.get(ACCELERATOR_LABEL)
        if accelerator and not run.head:
            topology = node_labels.get(TOPOLOGY_LABEL, "")
            slice_key = (run.cluster_uid, pod.metadata.labels.get("ray.io/group", ""))
            members = self.slice_ids.setdefault(slice_key, [])
            members.append(run.uid)
            # GKE numbers the hosts of a slice 0..n-1; one slice per worker-group replica.
            hosts = max(1, chips_in(topology) // max(1, self.nodes[run.node][1]))
            replica, worker_id = divmod(len(members) - 1, hosts)
            slice_name = f"{run.cluster}-{slice_key[1]}-{replica}"
            env.update(tpu_environment(topology, worker_id, slice_name,
                                       [f"host-{i}" for i in range(hosts)],
                                       RAY_ACCELERATOR_BY_LABEL.get(accelerator, "")))
        return env

    def terminate(self, run: PodRun, grace: float) -> None:
        with run.lock:
            run.stopping = True
        _sigterm_main(run)
        kill_marked(run.marker, grace=max(1.0, min(grace, 30.0)))
        if run.proc is not None:
            try:
                run.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        # The container's files go with it, as a kubelet removes them (the pod's log stays
        # under the ground's workdir).
        shutil.rmtree(run.temp_dir, ignore_errors=True)
        self.confirm_deletion(run.namespace, run.name, run.uid)
        self.runs.pop(run.uid, None)
        if self.heads.get(run.cluster_uid) is run:
            del self.heads[run.cluster_uid]

    def confirm_deletion(self, namespace: str, name: str, uid: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0,
                                            body=client.V1DeleteOptions(grace_period_seconds=0,
                                                                        preconditions=client.V1Preconditions(uid=uid)))
        except ApiException as error:
            if error.status not in (404, 409):
                log.warning("confirming deletion of %s/%s: %s", namespace, name, error)

    # -- pod status

    def patch_status(self, run: PodRun, patch: dict) -> None:
        try:
            self.core.patch_namespaced_pod_status(run.name, run.namespace, patch)
        except ApiException as error:
            if error.status != 404:
                log.warning("status of %s/%s: %s", run.namespace, run.name, error)

    def _base(self, run: PodRun, pod, started_at: str) -> dict:
        return {"hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "podIP": run.ip,
                "podIPs": [{"ip": run.ip}], "startTime": started_at,
                "initContainerStatuses": [
                    {"name": c.name, "ready": True, "restartCount": 0, "image": c.image, "imageID": "",
                     "started": False, "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                                                "startedAt": started_at, "finishedAt": started_at}}}
                    for c in pod.spec.init_containers or []]}

    def pending_status(self, run: PodRun, pod, started_at: str) -> dict:
        status = self._base(run, pod, started_at)
        status.update(phase="Pending", conditions=_conditions(started_at, initialized=True, ready=False),
                      containerStatuses=[_container(c, False, {"waiting": {"reason": "ContainerCreating"}}, 0)
                                         for c in pod.spec.containers])
        return {"status": status}

    def waiting_status(self, run: PodRun, pod, started_at: str, reason: str, message: str) -> dict:
        status = self._base(run, pod, started_at)
        status.update(phase="Pending", conditions=_conditions(started_at, initialized=True, ready=False),
                      containerStatuses=[_container(c, False, {"waiting": {"reason": reason, "message": message}}, 0)
                                         for c in pod.spec.containers])
        return {"status": status}

    def running_status(self, run: PodRun, pod, started_at: str, container_started: str) -> dict:
        status = self._base(run, pod, started_at)
        pid = run.proc.pid if run.proc else 0
        status.update(phase="Running", conditions=_conditions(now(), initialized=True, ready=True),
                      containerStatuses=[_container(c, True, {"running": {"startedAt": container_started}},
                                                    run.restarts, f"ray-process://{pid}")
                                         for c in pod.spec.containers])
        return {"status": status}

    def terminated_status(self, run: PodRun, pod, started_at: str, container_started: str, code: int,
                          restarting: bool) -> dict:
        status = self._base(run, pod, started_at)
        terminated = {"exitCode": code if code >= 0 else 128 - code, "reason": "Error" if code else "Completed",
                      "startedAt": container_started, "finishedAt": now()}
        if restarting:
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"ray exited {code}; restarting"}}
            containers = [dict(_container(c, False, state, run.restarts + 1), lastState={"terminated": terminated})
                          for c in pod.spec.containers]
            phase = "Running"
        else:
            containers = [_container(c, False, {"terminated": terminated}, run.restarts) for c in pod.spec.containers]
            phase = "Failed" if code else "Succeeded"
        status.update(phase=phase, conditions=_conditions(now(), initialized=True, ready=False),
                      containerStatuses=containers)
        return {"status": status}

    # -- the watch loops

    def watch_pods(self) -> None:
        resource_version = None
        while not self.stop_event.is_set():
            try:
                if resource_version is None:
                    listing = self.core.list_pod_for_all_namespaces()
                    self.pods = {pod.metadata.uid: pod for pod in listing.items}
                    for pod in listing.items:
                        self.handle(pod)
                    resource_version = listing.metadata.resource_version
                stream = watch.Watch().stream(self.core.list_pod_for_all_namespaces,
                                              resource_version=resource_version, timeout_seconds=60)
                for event in stream:
                    pod = event["object"]
                    resource_version = pod.metadata.resource_version
                    if event["type"] == "DELETED":
                        self.pods.pop(pod.metadata.uid, None)
                        run = self.runs.get(pod.metadata.uid)
                        if run is not None and not run.stopping:
                            run.stopping = True
                            threading.Thread(target=self.terminate, args=(run, 0), daemon=True).start()
                        continue
                    self.pods[pod.metadata.uid] = pod
                    self.handle(pod)
            except ApiException as error:
                if error.status == 410:  # expired: list again
                    resource_version = None
                else:
                    log.warning("pod watch: %s", error)
                    time.sleep(1)
            except Exception as error:  # the API server restarting, a dropped stream
                log.warning("pod watch: %s", error)
                time.sleep(1)

    def resolve_services(self) -> None:
        """Cluster DNS: each Service name -> the IPs of the ready pods its selector picks
        (what the endpoint-slice controller computes; the API server refuses EndpointSlices
        with loopback addresses, so the ground resolves from the selector itself). Pod IPs,
        not ClusterIPs: the ground has no kube-proxy."""
        written = None
        while not self.stop_event.is_set():
            try:
                entries = service_endpoints(
                    self.core.list_service_for_all_namespaces().items, list(self.pods.values()))
                text = hosts_file_text(entries)
                if text != written:
                    # In place, never by rename: the file is bind-mounted over /etc/hosts.
                    with open(self.hosts_file, "r+" if self.hosts_file.exists() else "w") as f:
                        f.seek(0)
                        f.write(text)
                        f.truncate()
                    written = text
            except Exception as error:
                log.warning("cluster DNS: %s", error)
            self.stop_event.wait(0.5)

    def shutdown(self) -> None:
        self.stop_event.set()
        for run in list(self.runs.values()):
            run.stopping = True
            _sigterm_main(run)
        kill_marked(self.ground_id, grace=10)
        for run in list(self.runs.values()):
            shutil.rmtree(run.temp_dir, ignore_errors=True)


def _sigterm_main(run: PodRun) -> None:
    """What a kubelet does first: SIGTERM the container's main process (its group)."""
    if run.proc is not None and run.proc.poll() is None:
        try:
            os.killpg(run.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _expand(value: str, env: dict) -> str:
    # $(VAR) references, as the kubelet expands them.
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _conditions(at: str, initialized: bool, ready: bool) -> list[dict]:
    def condition(kind: str, value: bool) -> dict:
        return {"type": kind, "status": "True" if value else "False", "lastTransitionTime": at,
                "lastProbeTime": None}
    return [condition("PodScheduled", True), condition("Initialized", initialized),
            condition("ContainersReady", ready), condition("Ready", ready)]


def _container(c, ready: bool, state: dict, restarts: int, container_id: str = "") -> dict:
    status = {"name": c.name, "ready": ready, "started": ready, "restartCount": restarts,
              "image": c.image, "imageID": "", "state": state}
    if container_id:
        status["containerID"] = container_id
    return status


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--hosts-file", required=True, type=Path)
    parser.add_argument("--ip-prefix", required=True, help="127.N: pods get 127.N.x.y")
    parser.add_argument("--ground-id", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config.load_kube_config(args.kubeconfig)
    agent = NodeAgent(client.ApiClient(), args.workdir, args.hosts_file, args.ip_prefix, args.ground_id)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: agent.stop_event.set())
    threading.Thread(target=agent.watch_pods, daemon=True).start()
    threading.Thread(target=agent.resolve_services, daemon=True).start()
    (args.workdir / "nodeagent.ready").write_text(json.dumps({"pid": os.getpid()}))
    agent.stop_event.wait()
    agent.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
