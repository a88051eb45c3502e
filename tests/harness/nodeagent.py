"""The ground's node agent: plays the kubelet (and GKE's TPU device plugin) for the pods the
scheduler binds to simulated nodes, by running each pod's container as local processes that
get what a GKE pod gets and nothing else.

- One sync loop (as a kubelet's syncPod) moves every pod a step: mount its volumes, run its
  init containers in order, start its container, report it; a missing Secret, ConfigMap or
  volume is retried until it appears (CreateContainerConfigError, FailedMount meanwhile).
  A container it has not created yet always says why, as a kubelet does: ContainerCreating
  or PodInitializing, an error's reason and message with a Failed event, or, while another
  process prepares its image's environment (images.py), ContainerCreating with Pulling.
  Where the node itself holds it, the message names what for: the process preparing the
  image's environment (past IMAGE_PULL_DEADLINE the pull fails, ErrImagePull then
  ImagePullBackOff, and is tried again), a worker's head, a volume that cannot be set up, an
  error of the node's own; a pod it cannot set up at all still gets a status saying why.
- Each container runs through `podsandbox.py` (the ground's runc): in the pod's cgroups
  (`podcgroup.py`: memory with `limits.memory`, CPU with `cpu.shares` from the requests, as a
  kubelet sets them), in a mount namespace of its own with the pod's own /tmp,
  HOME (/home/ray, also the working directory), /dev/shm, its volumes (`podspec.py`: emptyDir,
  Secret, ConfigMap, PVC, hostPath, GCS FUSE CSI from `--gcs-root`) and the ground's cluster
  DNS as /etc/hosts; the checkout and its venv are the image. Its environment is the image's,
  the node's (`node_env`), the spec's and the kubelet's service variables.
- A KubeRay container's `ray start …` line runs with the addresses and ports this machine
  needs (each pod has its own loopback address as podIP; all share one port space); other
  containers run their command as given. KubeRay's `wait-gcs-ready` init container asks the
  head's real GCS port. A head's workers start once it answers (its dashboard, asked
  directly, never through an HTTP proxy of the agent's environment).
- Probes as a kubelet runs them (`podprobes.py`): startup, liveness and readiness probes of
  the spec (exec inside the container, httpGet and tcpSocket at the pod's address; a Ray
  container's ports as the agent moved them) with their delays, periods, timeouts and
  thresholds. Readiness makes the container and the pod Ready (at once without a probe); a
  liveness or startup failure past its threshold kills the container (Unhealthy, Killing)
  and it restarts per restartPolicy. KubeRay injects such probes into every Ray container.
- An OOM kill in a container's cgroup kills the whole container (OOMKilled, exit 137); a
  container that exits is reported terminated and restarted per restartPolicy with back-off
  (CrashLoopBackOff; Init:CrashLoopBackOff blocks the pod). Deleting the pod SIGTERMs its
  cgroup, SIGKILLs it after the grace period, removes its files and confirms the deletion.
- Faults on request: an image under the reserved `.invalid` domain (RFC 2606) fails to pull
  (ErrImagePull, then ImagePullBackOff); a pod annotated `ground.tpufinetune.dev/exit-code: "N"`
  exits N at once (CrashLoopBackOff).
- Workers on TPU nodes get the environment GKE gives TPU pods (TPU_WORKER_ID, TPU_NAME,
  TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, TPU_WORKER_HOSTNAMES), so Ray's own TPU code advertises
  the slice head resource and the slice labels; the TPU count is the `TPU` resource KubeRay
  puts into `ray start` from the pod's `google.com/tpu` request.
- Cluster DNS: every Service's ready pods (picked by its selector, as the endpoint-slice
  controller does) go into a hosts file, every pod's (and the operator's) /etc/hosts.
- The ground's volume provisioner (`provisioner.py`, StorageClass `standard-rwx`) runs here.

Where this differs from GKE is listed in tests/README.md. Run as a process by `Ground`:

    python tests/harness/nodeagent.py --kubeconfig K --workdir D --hosts-file H --ip-prefix 127.N \
        --ground-id G [--gcs-root DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
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
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kubernetes import client, config  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

import images  # noqa: E402
import podbind  # noqa: E402
import podcgroup  # noqa: E402
from images import dockerfile_command  # noqa: E402
import podprobes  # noqa: E402
from kubernetes.utils import parse_quantity  # noqa: E402
from gke_shapes import ACCELERATOR_LABEL, TOPOLOGY_LABEL, chips_in, family_by_label, tpu_pod_environment  # noqa: E402
from listwatch import list_and_watch  # noqa: E402
from nodelife import NodeLife  # noqa: E402
from nodepools import SIMULATED_LABEL, tpu_host  # noqa: E402
from podprobes import DIRECT, LIVENESS, STARTUP, ContainerProbes, Outcome, Probe  # noqa: E402
from podspec import (  # noqa: E402
    ConfigError, MountError, VolumePlan, container_cpu_shares, container_env, expand, mount_targets, pod_cpu_shares,
    service_env, volume_plan)
from ports import free_ports  # noqa: E402
from provisioner import Provisioner  # noqa: E402

log = logging.getLogger("nodeagent")

POD_HOME = "/home/ray"  # HOME and working directory of the Ray image (rayproject/ray), the pod's own
DASHBOARD_PORT = 8265
UNRESOLVABLE_DOMAIN = ".invalid"  # RFC 2606: no registry there ever resolves
# A pull that has made no progress this long fails (ErrImagePull, then ImagePullBackOff, and
# tried again), as a kubelet's does: an image environment another process keeps locked
# (images.py) shows in the pod's status and the operator's, not only as a Pulling event.
IMAGE_PULL_DEADLINE = 60
EXIT_CODE_ANNOTATION = "ground.tpufinetune.dev/exit-code"
# A pod's grace period is honoured up to this (the operator's Ray pods ask for 60 s, to
# checkpoint on notice); longer ones are cut, so a stuck pod cannot hold a test.
MAX_GRACE_SECONDS = 120
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


# Where a pod's files are, under the agent's workdir (Ground.pod_report reads them too).
PODS_DIR = Path("kubelet", "pods")  # one directory per pod uid: its /tmp, HOME; removed with the pod
CLUSTERS_WITH_WORKERS = "clusters-with-workers.txt"  # in the ground's workdir
BIND_ENV = ("LD_PRELOAD", "GROUND_POD_IP")  # podbind.c's library and the pod's address
RAY_TEMP_DIR = "/tmp/ray"  # `ray start --temp-dir`, inside the pod's own /tmp


def pod_log_path(workdir: Path, namespace: str, name: str) -> Path:
    """The pod's log (each container's output in turn); it stays after the pod is gone."""
    return workdir / "pods" / f"{namespace}_{name}.log"


def waiting_states(status: dict) -> list[dict]:
    """Each waiting container's state ({"reason", "message"}) in a pod's status, init
    containers first."""
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    return [c["state"]["waiting"] for c in containers if "waiting" in (c.get("state") or {})]


def ray_session_logs(workdir: Path, pod_uid: str) -> list[Path]:
    """The log directory of every Ray session a pod started (a restarted container starts a
    new one beside the old), oldest first."""
    temp = workdir / PODS_DIR / pod_uid / Path(RAY_TEMP_DIR).relative_to("/")
    return sorted(temp.glob("session_2*/logs"))  # not session_latest, a link to the newest


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# The agent asks a head's dashboard directly (podprobes.DIRECT), never through an HTTP proxy:
# from a shell with a proxy set, no head would ever answer and its workers would wait for it
# forever.

# The kubelet's waiting reasons for a container that is not created yet (its
# defaultWaitingState): PodInitializing in a pod with init containers, else ContainerCreating.
CONTAINER_CREATING, POD_INITIALIZING = "ContainerCreating", "PodInitializing"


def waiting(reason: str, message: str = "") -> dict:
    """A waiting container state; a kubelet never writes one without a reason."""
    if not reason:
        raise ValueError("a waiting container state needs its reason")
    return {"waiting": {"reason": reason, "message": message} if message else {"reason": reason}}


def kubelet_state(state: dict, default_reason: str) -> dict:
    """A container state as a kubelet reports it: running, terminated, or waiting with a
    reason (its default one when nothing more is known), never an empty one."""
    if state.get("running") is not None or state.get("terminated") is not None:
        return state
    if (state.get("waiting") or {}).get("reason"):
        return state
    log.warning("a container state without a reason: %s; reported as %s", state, default_reason)
    return waiting(default_reason, (state.get("waiting") or {}).get("message", ""))


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
                    accelerator_label: str) -> dict[str, str]:
    """What GKE gives a pod on a TPU slice node (the node's variables and the KubeRay TPU
    webhook's), from GKE's published facts in gke_shapes.py, never from the product's table:
    TPU_ACCELERATOR_TYPE is GKE's name for the slice (v6e-16, tpu7x-16), which Ray's TPU code
    reads. ValueError (the pod's CreateContainerError) for a node label no GKE TPU carries,
    or a topology of the wrong shape for it."""
    return tpu_pod_environment(family_by_label(accelerator_label), topology, worker_id, slice_name, hostnames)


def image_repository(image: str) -> str:
    """The repository's last path part of an image reference, without tag or digest
    ('us-docker.pkg.dev/p/tpufinetune/trainer:0.1.0' -> 'trainer')."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


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
    """DNS name -> pod IP for every Service with a selector and a ready pod it selects (any
    pod it selects with `publishNotReadyAddresses`, as KubeRay's headless head Service has:
    the head's name resolves before its readiness probe passes, as on GKE)."""
    entries: dict[str, str] = {}
    live = [p for p in pods if p.status and p.status.pod_ip and p.metadata.deletion_timestamp is None]
    ready = [p for p in live if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
    for service in services:
        selector = service.spec.selector or {}
        if not selector:
            continue
        for pod in live if service.spec.publish_not_ready_addresses else ready:
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




def health_check_to_gcs(text: str, gcs_address: str) -> str:
    """KubeRay's `wait-gcs-ready` init container asks `ray health-check --address
    <head service>:<head port>`: the port is the one the head's GCS listens on elsewhere,
    so it gets the head's real GCS address, as the worker's own `ray start --address`."""
    return re.sub(r"(ray\s+health-check\s+--address[ =])[^\s;&|]+", lambda m: m.group(1) + gcs_address, text)


# Ports a Ray container declares (its `ray start` flags, else Ray's defaults; KubeRay always
# writes --dashboard-agent-listen-port) that the agent moves: probes of them reach the moved ones.
RAY_DECLARED_PORTS = {  # the agent's name -> (flag, Ray's default, on the head only)
    "gcs": ("--port", 6379, True), "client": ("--ray-client-server-port", 10001, True),
    "dashboard": ("--dashboard-port", DASHBOARD_PORT, True),
    "metrics": ("--metrics-export-port", 8080, False),
    "agent_http": ("--dashboard-agent-listen-port", 52365, False),
}


def ray_port_map(args: list[str], head: bool, moved: dict[str, int]) -> dict[int, int]:
    """Declared port -> the port it really is on the ground, for a `ray start` line's flags
    (`args`, as ray_start_args gives them) and the ports the agent gave (`moved`)."""
    flags = {}
    for i, token in enumerate(args):
        name, sep, value = token.partition("=")
        if not sep and i + 1 < len(args):
            value = args[i + 1]
        flags.setdefault(name, value)
    ports = {}
    for name, (flag, default, head_only) in RAY_DECLARED_PORTS.items():
        if name in moved and (head or not head_only):
            declared = flags.get(flag, "")
            ports[int(declared) if declared.isdigit() else default] = moved[name]
    return ports


def probe_command(command: list[str], ip: str, ports: dict[int, int]) -> list[str]:
    """An exec probe of a Ray container (KubeRay's `wget … http://localhost:52365/…` before
    Ray 2.53) asks the pod's own address at the ports the agent moved."""
    def moved(match: re.Match) -> str:
        port = int(match.group(2))
        return f"{ip}:{ports[port]}" if port in ports else match.group(0)
    return [re.sub(r"\b(localhost|127\.0\.0\.1):(\d+)\b", moved, word) for word in command]


def plain_command(container: dict, env: dict, image_command: tuple[list[str], list[str]] | None = None) -> list[str]:
    """A non-Ray container's command and args, with $(VAR) expanded as a kubelet does. With
    no `command`, the image's ENTRYPOINT, then `args` or else its CMD (`image_command`, from
    the image's Dockerfile: images.dockerfile_command), as a container runtime does."""
    command, args = container.get("command") or [], container.get("args") or []
    if command:
        return [expand(word, env) for word in [*command, *args]]
    if image_command is None:  # an image the ground knows no Dockerfile of
        raise ValueError("the ground's image has no entrypoint: give the container a command")
    entrypoint, cmd = image_command
    if not entrypoint and not (args or cmd):
        raise ValueError("the image has neither ENTRYPOINT nor CMD: give the container a command")
    # $(VAR) is the pod spec's syntax: the image's own words are taken as they are.
    return [*entrypoint, *([expand(word, env) for word in args] if args else cmd)]


def last_line(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            lines = f.read()[-2000:].decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


def exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


# ---- the agent -----------------------------------------------------------------------------


@dataclass
class ContainerState:
    """One container's status as a kubelet reports it."""
    name: str
    image: str
    state: dict = field(default_factory=lambda: waiting(CONTAINER_CREATING))
    last: dict | None = None
    restarts: int = 0
    ready: bool = False
    started: bool = True  # its startup probe has passed (true without one)
    container_id: str = ""

    def as_status(self, default_reason: str = CONTAINER_CREATING) -> dict:
        status = {"name": self.name, "image": self.image, "imageID": "", "ready": self.ready,
                  "started": self.started and "running" in self.state, "restartCount": self.restarts,
                  "state": kubelet_state(self.state, default_reason)}
        if self.last:
            status["lastState"] = self.last
        if self.container_id:
            status["containerID"] = self.container_id
        return status


@dataclass
class PodRun:
    namespace: str
    name: str
    uid: str
    ip: str
    node: str
    head: bool
    ray: bool  # its container runs `ray start` (a KubeRay pod)
    cluster: str
    cluster_uid: str  # the RayCluster object: a rebuilt cluster keeps its name, not its uid
    dir: Path  # the pod's own directories (tmp, home, volumes), as /var/lib/kubelet/pods/<uid>
    shm: Path  # its memory-backed ones (host /dev/shm is a tmpfs)
    cgroup: Path
    log_path: Path
    pod: object
    restart_policy: str = "Always"
    started_at: str = field(default_factory=now)
    stage: str = "setup"  # pull | setup | init | main | done
    init_index: int = 0
    inits: list[ContainerState] = field(default_factory=list)
    mains: list[ContainerState] = field(default_factory=list)
    volumes: dict[str, str] | None = None  # volume name -> its path, once set up
    main_env: dict | None = None
    proc: subprocess.Popen | None = None
    log_offset: int = 0
    oom: bool = False
    next_try: float = 0.0  # monotonic: back-off or retry
    crashed: bool = False  # the last container exit is reported; the back-off comes next
    tries: int = 0
    gcs_address: str = ""
    answering: bool = False  # its process answers (answers()): a head's workers may start
    ready: bool = False  # its readiness (probe) has passed
    probes: ContainerProbes | None = None  # the running main container's probe workers
    probing: dict = field(default_factory=dict)  # probe kind -> the probe running now (a Future)
    ports: dict = field(default_factory=dict)  # a Ray container's declared port -> its port here
    kill_deadline: float | None = None  # a kill for a failed probe under way: SIGKILL then
    deleting: bool = False
    stop_deadline: float | None = None
    hook: subprocess.Popen | None = None  # the preStop hook, while it runs
    event_messages: set = field(default_factory=set)
    pulling: dict = field(default_factory=dict)  # image -> when its Pulling event was sent (monotonic)
    pulling_since: dict = field(default_factory=dict)  # image -> the same, as a timestamp for its message
    waits: set = field(default_factory=set)  # what the pod's log already says it waits for
    # Why its containers are not created yet while its volumes are set up (the last
    # FailedMount), shown as their waiting message; "" once nothing holds them.
    wait_message: str = ""
    conditions: dict = field(default_factory=dict)  # type -> (status, since)
    written: str = ""  # the last status written

    @property
    def container(self) -> ContainerState:
        return self.inits[self.init_index] if self.stage == "init" else self.mains[0]

    @property
    def default_reason(self) -> str:
        """What a kubelet reports for a container it has not created yet."""
        return POD_INITIALIZING if self.inits else CONTAINER_CREATING


class NodeAgent:
    def __init__(self, api: client.ApiClient, workdir: Path, hosts_file: Path, ip_prefix: str,
                 ground_id: str, gcs_root: Path | None = None, node_env: dict | None = None,
                 images: dict[str, Path] | None = None, image_dockerfiles: dict[str, Path] | None = None):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.workdir = workdir
        self.hosts_file = hosts_file
        self.ip_prefix = ip_prefix  # "127.N": pods get 127.N.x.y
        self.ground_id = ground_id
        self.gcs_root = gcs_root  # the GCS emulator's objects as files, one directory per bucket
        # Image repository name -> the environment built as its Dockerfile builds it
        # (images.py); any other image runs this machine's own environment.
        self.images = dict(images or {})
        # Image repository name -> its ENTRYPOINT and CMD (from its Dockerfile).
        self.image_commands = {repository: dockerfile_command(Path(path))
                               for repository, path in (image_dockerfiles or {}).items()}
        # A pod's wildcard binds on its own address, as in its own network namespace.
        self.bind_library = podbind.library()
        if self.bind_library is None:
            log.warning("no C compiler: pods' binds on 0.0.0.0 share the machine's ports")
        # The kubelet's kubepods: every pod's cgroup below it (podcgroup.py).
        self.cgroup = podcgroup.create(podcgroup.ground_cgroup(ground_id), shares=podcgroup.node_cpu_shares())
        self.pods_dir = workdir / PODS_DIR
        self.shm_dir = Path("/dev/shm") / f"tpuft-{ground_id}"
        # What the ground adds to every pod, as GKE's nodes add credentials and endpoints
        # (tests/README.md lists them): nothing can be downloaded or reported from here.
        self.node_env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                         "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
        if os.environ.get("PYTHONPATH"):  # a development tree the agent itself runs from
            self.node_env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        self.node_env.update(node_env or {})
        server = urllib.parse.urlsplit(api.configuration.host)
        self.api_server = (server.hostname or "127.0.0.1", str(server.port or 443))
        self.runs: dict[str, PodRun] = {}  # by pod uid
        self.clusters_with_workers: set[str] = set()
        self.heads: dict[str, PodRun] = {}  # RayCluster uid -> head run
        self.life = NodeLife(self)  # the nodes' heartbeats and failures (nodelife.py)
        # Every pod, as the watch last delivered it: the sync loop and cluster DNS read it.
        self.pods: dict[str, object] = {}
        self.pods_listed = threading.Event()  # the pod watch has listed once: the agent sees every pod
        self.next_ip = 1
        # Every port number a Ray container was given (ray_ports): never given twice.
        self.ports_given: set[int] = set()
        self.admit_after: dict[str, float] = {}  # pod uid -> when to try again a pod the node could not set up
        self.stop_event = threading.Event()
        self.wake = threading.Event()
        # Probes run beside the sync loop (a kubelet's probe workers): one may take its timeout.
        self.prober = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="probe")

    def allocate_ip(self) -> str:
        n = self.next_ip
        self.next_ip += 1
        return f"{self.ip_prefix}.{n // 250}.{n % 250 + 1}"

    def node(self, name: str) -> tuple[dict, int] | None:
        """A node's labels and TPU chips, as the node watch last saw them."""
        node = self.life.node(name)
        if node is None:
            return None
        allocatable = (node.status and node.status.allocatable) or {}
        return node.metadata.labels or {}, int(allocatable.get("google.com/tpu", "0"))

    def signal_pod(self, run: PodRun, sig: int) -> None:
        """`sig` to every process of a pod (nodelife.py: a node killed or shut down)."""
        podcgroup.signal_all(run.cgroup, sig)

    def forget_node(self, name: str) -> None:
        """A node is gone with its VM: its pods' processes, runs and files go too."""
        for run in [r for r in list(self.runs.values()) if r.node == name]:
            self.remove(run)

    # -- the sync loop: every pod of our nodes moved one step, as a kubelet's syncPod

    def sync_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.sync_all()
            except Exception:  # the API server restarting: next round
                log.exception("sync")
            self.wake.wait(0.5)
            self.wake.clear()

    def sync_all(self) -> None:
        live = dict(self.pods)
        for uid in [u for u in self.admit_after if u not in live or u in self.runs]:
            del self.admit_after[uid]
        for uid, pod in live.items():
            run = self.runs.get(uid)
            if run is None:
                if time.monotonic() < self.admit_after.get(uid, 0.0):
                    continue
                try:
                    self.admit(pod)
                except Exception as error:  # one pod never holds up the others
                    log.exception("admitting pod %s/%s", pod.metadata.namespace, pod.metadata.name)
                    self.admission_failed(pod, error)
                    self.admit_after[uid] = time.monotonic() + 5
            elif pod.metadata.deletion_timestamp is not None and not run.deleting:
                # The deletion's own grace period (kubectl delete --grace-period), else the pod's.
                grace = pod.metadata.deletion_grace_period_seconds
                if grace is None:
                    grace = pod.spec.termination_grace_period_seconds
                self.begin_stop(run, 30 if grace is None else grace)
            elif run is not None:
                run.pod = pod
        for run in list(self.runs.values()):
            if self.life.is_down(run.node):
                continue  # a node that is down does nothing: its kubelet is gone
            if run.uid not in live and not run.deleting:  # deleted at once (grace 0)
                self.begin_stop(run, 0)
            try:
                self.sync(run)
            except Exception as error:  # never take the agent down with one pod
                log.exception("pod %s/%s", run.namespace, run.name)
                self.sync_failed(run, error)

    def sync_failed(self, run: PodRun, error: Exception) -> None:
        """The node could not take the pod a step: a container not running says why (the
        kubelet's CreateContainerError, with the error) instead of keeping an older state,
        and the step is tried again."""
        run.next_try = time.monotonic() + 5
        if run.deleting or run.stage == "done" or run.proc is not None:
            return
        try:
            if run.stage == "setup":
                run.wait_message = f"{type(error).__name__}: {error}"
            else:
                self.container_error(run, "CreateContainerError", f"{type(error).__name__}: {error}", retry=5)
            self.write_status(run)
        except Exception:
            log.exception("status of %s/%s", run.namespace, run.name)

    def admit(self, pod) -> None:
        meta, spec = pod.metadata, pod.spec
        if not spec.node_name or self.life.is_down(spec.node_name):
            return  # a node that is down does nothing, as its kubelet is gone
        node = self.node(spec.node_name)
        if node is None or node[0].get(SIMULATED_LABEL) != "true":
            return
        if meta.deletion_timestamp is not None:
            self.confirm_deletion(meta.namespace, meta.name, meta.uid)
            return
        if pod.status.phase not in (None, "Pending"):
            return
        body = self.api.sanitize_for_serialization(pod)
        try:
            ray_start_args(body["spec"]["containers"][0])
            ray = True
        except ValueError:
            ray = False
        labels = meta.labels or {}
        cluster = labels.get("ray.io/cluster", "")
        run = PodRun(
            namespace=meta.namespace, name=meta.name, uid=meta.uid, ip=self.allocate_ip(), node=spec.node_name,
            head=ray and labels.get("ray.io/node-type") == "head", ray=ray, cluster=cluster,
            cluster_uid=next((ref.uid for ref in meta.owner_references or [] if ref.controller), f"{meta.namespace}/{cluster}"),
            dir=self.pods_dir / meta.uid, shm=self.shm_dir / meta.uid, cgroup=self.cgroup / meta.uid,
            log_path=pod_log_path(self.workdir, meta.namespace, meta.name), pod=pod,
            restart_policy=spec.restart_policy or "Always",
            inits=[ContainerState(c.name, c.image, waiting(POD_INITIALIZING)) for c in spec.init_containers or []],
            mains=[ContainerState(c.name, c.image, waiting(POD_INITIALIZING if spec.init_containers else CONTAINER_CREATING))
                   for c in spec.containers],
        )
        if registry_host(spec.containers[0].image).endswith(UNRESOLVABLE_DOMAIN):
            run.stage = "pull"
        self.runs[meta.uid] = run
        if run.head:
            self.heads[run.cluster_uid] = run
        for path in (run.dir / "tmp", run.dir / "home", run.shm):
            path.mkdir(parents=True, exist_ok=True)
        podcgroup.create(run.cgroup, shares=pod_cpu_shares(body["spec"]))
        self.write_status(run)

    def admission_failed(self, pod, error: Exception) -> None:
        """A pod bound here that the node could not set up: never left without a status
        (its containers waiting with the kubelet's default reason and the error as their
        message); admission is tried again on the next round."""
        run = self.runs.pop(pod.metadata.uid, None)
        if run is not None and self.heads.get(run.cluster_uid) is run:
            del self.heads[run.cluster_uid]
        message = f"the node could not set up the pod: {type(error).__name__}: {error}"
        reason = POD_INITIALIZING if pod.spec.init_containers else CONTAINER_CREATING
        statuses = [{"name": c.name, "image": c.image, "imageID": "", "ready": False, "started": False,
                     "restartCount": 0, "state": waiting(reason, message)} for c in pod.spec.containers]
        try:
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace,
                                                  {"status": {"phase": "Pending", "containerStatuses": statuses}})
        except ApiException as failure:
            if failure.status != 404:
                log.warning("status of %s/%s: %s", pod.metadata.namespace, pod.metadata.name, failure)

    def sync(self, run: PodRun) -> None:
        if run.deleting:
            self.sync_stop(run)
            return
        if run.stage == "done" or time.monotonic() < run.next_try:
            return
        if run.proc is not None:
            self.sync_running(run)
            if run.proc is None and not run.crashed and run.stage in ("init", "main"):
                self.sync_start(run)  # an init container done: the next step at once, as a kubelet's syncPod
        elif run.crashed:  # the exit was reported (Error / Init:Error); now the back-off
            run.crashed = False
            c = run.container
            c.last, c.state = c.state, waiting("CrashLoopBackOff", (
                f"back-off {self.backoff(c.restarts)}s restarting failed container={c.name} "
                f"pod={run.name}_{run.namespace}({run.uid})"))
            run.next_try = time.monotonic() + self.backoff(c.restarts)
            c.restarts += 1
        elif run.stage == "pull":
            self.sync_pull(run)
        elif run.stage == "setup":
            self.sync_volumes(run)
        else:
            self.sync_start(run)
        self.write_status(run)

    def sync_start(self, run: PodRun) -> None:
        """The current container pulled and started, or the reason it waits."""
        if self.image_present(run, run.container):
            try:
                self.start_container(run)
            except Exception as error:  # the runtime failed to create it: the kubelet's CreateContainerError
                log.exception("pod %s/%s: creating container %s", run.namespace, run.name, run.container.name)
                self.container_error(run, "CreateContainerError", f"{type(error).__name__}: {error}", retry=5)

    @staticmethod
    def backoff(restarts: int) -> int:
        return min(10, 2 ** (restarts + 1))  # the kubelet's crash-loop back-off (10 s .. 5 min), shortened

    def sync_pull(self, run: PodRun) -> None:
        """What a kubelet reports for an image it cannot pull: ErrImagePull, then
        ImagePullBackOff until the next try, with a growing back-off (shortened here)."""
        c = run.mains[0]
        host = registry_host(c.image)
        if c.state.get("waiting", {}).get("reason") == "ErrImagePull":
            c.state = waiting("ImagePullBackOff", f'Back-off pulling image "{c.image}"')
            run.next_try = time.monotonic() + min(10, 2 ** run.tries)
        else:
            run.tries += 1
            c.state = waiting("ErrImagePull", (
                f'failed to pull and unpack image "{c.image}": failed to resolve reference "{c.image}": '
                f"dial tcp: lookup {host}: no such host"))
            run.next_try = time.monotonic() + 1

    def image_present(self, run: PodRun, c: ContainerState) -> bool:
        """A kubelet pulls a container's image before it creates it, and says so. On the
        ground an image's environment (images.py) may be being built or refreshed by
        another process (`make images`, a ground starting beside this one): the container
        waits, with the kubelet's reason and its `Pulling` event, until that is done
        (`Pulled` then); one nobody builds fails to pull, as an image a registry lacks."""
        venv = self.images.get(image_repository(c.image))
        state = images.READY if venv is None else images.state(venv)  # other images: this machine's own
        if state == images.READY:
            started = run.pulling.pop(c.image, None)
            if started is not None:
                took = time.monotonic() - started
                self.event(run, "Pulled", f'Successfully pulled image "{c.image}" in {took:.3f}s '
                                          f"({took:.3f}s including waiting)", kind="Normal")
            return True
        if state == images.PREPARING:
            if c.image not in run.pulling:
                run.pulling[c.image] = time.monotonic()
                run.pulling_since[c.image] = now()
                self.event(run, "Pulling", f'Pulling image "{c.image}"', kind="Normal")
            took = time.monotonic() - run.pulling[c.image]
            why = (f'pulling image "{c.image}": its environment {venv} is being prepared by '
                   f'{images.preparer(venv) or "another process"} (images.py)')
            if took < IMAGE_PULL_DEADLINE:
                c.state = waiting(run.default_reason, f"{why}, since {run.pulling_since[c.image]}")
                run.next_try = time.monotonic() + 1
            elif (c.state.get("waiting") or {}).get("reason") == "ErrImagePull":
                c.state = waiting("ImagePullBackOff", f'Back-off pulling image "{c.image}": {why}')
                run.next_try = time.monotonic() + 5
            else:  # no progress within the deadline: the kubelet gives up this try and says so
                self.container_error(run, "ErrImagePull", f"{why}: no progress within {IMAGE_PULL_DEADLINE}s", retry=1)
        else:
            self.container_error(run, "ErrImagePull", (
                f'failed to pull image "{c.image}": the ground has not built this image\'s environment '
                f"{venv} (make images)"), retry=5)
        return False

    def container_error(self, run: PodRun, reason: str, message: str, retry: float = 2) -> None:
        """The container cannot be created yet: the kubelet's waiting reason and message,
        its `Failed` event (once per message), and another try later."""
        run.container.state = waiting(reason, message)
        self.event(run, "Failed", f"Error: {message}")
        run.next_try = time.monotonic() + retry

    def say_waiting(self, run: PodRun, what: str) -> None:
        """A wait the agent holds a container in, written once to the pod's log (where a
        container that polled for it would have said so)."""
        if what in run.waits:
            return
        run.waits.add(what)
        log.info("pod %s/%s: waiting for %s", run.namespace, run.name, what)
        run.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(run.log_path, "ab") as out:
            out.write(f"---- {now()} the node waits for {what}\n".encode())

    # -- volumes and environment

    def lookup(self, namespace: str):
        readers = {
            "Secret": lambda name: self.core.read_namespaced_secret(name, namespace),
            "ConfigMap": lambda name: self.core.read_namespaced_config_map(name, namespace),
            "PersistentVolumeClaim": lambda name: self.core.read_namespaced_persistent_volume_claim(name, namespace),
            "PersistentVolume": lambda name: self.core.read_persistent_volume(name),
        }

        def read(kind: str, name: str) -> dict | None:
            try:
                return self.api.sanitize_for_serialization(readers[kind](name))
            except ApiException as error:
                if error.status == 404:
                    return None
                raise
        return read

    def sync_volumes(self, run: PodRun) -> None:
        """Every volume of the pod set up, or a FailedMount event and a retry."""
        body = self.api.sanitize_for_serialization(run.pod)
        paths = {}
        try:
            for volume in body["spec"].get("volumes") or []:
                plan = volume_plan(volume, run.namespace, self.lookup(run.namespace),
                                   str(self.gcs_root) if self.gcs_root else None, pod=body,
                                   fields=self.downward_fields(run, body), token=self.token_for(run, body))
                paths[volume["name"]] = self.materialize(run, volume["name"], plan)
        except Exception as error:  # MountError, or the node failing to write it (a kubelet says FailedMount too)
            if not isinstance(error, MountError):
                log.exception("pod %s/%s: volume %s", run.namespace, run.name, volume["name"])
            run.wait_message = f'MountVolume.SetUp failed for volume "{volume["name"]}" : {error}'
            self.event(run, "FailedMount", run.wait_message)
            run.next_try = time.monotonic() + 2
            return
        run.volumes = paths
        run.wait_message = ""
        run.stage = "init" if run.inits else "main"

    def materialize(self, run: PodRun, name: str, plan: VolumePlan) -> str:
        if plan.kind == "host":
            if not Path(plan.path).is_dir():
                raise MountError(f"{plan.path} is not a directory on the node")
            return plan.path
        path = (run.shm if plan.kind == "memory" else run.dir / "volumes") / name
        path.mkdir(parents=True, exist_ok=True)
        for relative, (data, mode) in plan.files.items():
            target = path / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(mode)
        return str(path)

    def mounts(self, run: PodRun, container: dict, env: dict) -> list[dict]:
        """The pod's own /tmp, HOME and /dev/shm, the cluster's names as /etc/hosts, then the
        container's volumeMounts (podspec.mount_targets)."""
        own = [{"source": str(run.dir / "tmp"), "target": "/tmp"},
               {"source": str(run.dir / "home"), "target": POD_HOME},
               {"source": str(run.shm), "target": "/dev/shm"},
               {"source": str(self.hosts_file), "target": "/etc/hosts", "readOnly": True}]
        # The image's filesystem (this checkout, its environments, the Python they link to)
        # stays visible when it lies under one of the pod's own directories (a checkout in
        # /tmp): bound back at its own path, above the pod's /tmp.
        private = [Path(m["target"]) for m in own[:3]]
        own += [{"source": str(path), "target": str(path)} for path in self.image_roots()
                if any(path.is_relative_to(p) for p in private)]
        volume_mounts = mount_targets(container, run.volumes or {}, env)
        for m in volume_mounts:  # a kubelet creates a missing subPath in the volume
            if m.pop("subPath") and not os.path.lexists(m["source"]):
                os.makedirs(m["source"], exist_ok=True)
        return own + volume_mounts

    def image_roots(self) -> list[Path]:
        """Where the images' files are on this machine: the checkout (the dev venv and
        every image environment live in it) and the Python installations they run."""
        roots = {HERE.parents[1], Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
                 *(Path(venv).resolve() for venv in self.images.values())}
        # Only the outermost of nested roots: binding the checkout brings its venvs.
        return sorted(r for r in roots if not any(r != o and r.is_relative_to(o) for o in roots))

    def image_bin(self, image: str) -> Path:
        """Where the image's Python and console scripts (ray, tpufinetune-train) are."""
        venv = self.images.get(image_repository(image))
        return venv / "bin" if venv else Path(sys.executable).parent

    def environment(self, run: PodRun, pod, container: dict, node_labels: dict, tpu: bool = True) -> dict:
        """What a kubelet gives the container, never the agent's own environment: the
        image's, the ground's node-level additions (self.node_env), the pod spec's env
        (podspec.container_env) and the service variables. Raises ConfigError for a missing
        Secret, ConfigMap or key."""
        # The pod's image is this machine's environment: its Python and its console scripts.
        image = container.get("image") or ""
        base = {"PATH": f"{self.image_bin(image)}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
                "HOME": POD_HOME, "LANG": "C.UTF-8", "HOSTNAME": pod.spec.hostname or run.name,
                **self.node_env}
        if image_repository(image) in self.images:
            base.pop("PYTHONPATH", None)  # the image carries its own copy of the project
        body = self.api.sanitize_for_serialization(pod)
        env = container_env(body, container, base=base, fields=self.downward_fields(run, body),
                            services=self.service_variables(pod), lookup=self.lookup(run.namespace))
        accelerator = node_labels.get(ACCELERATOR_LABEL)
        if tpu and accelerator and not run.head:
            topology = node_labels.get(TOPOLOGY_LABEL, "")
            hosts = max(1, chips_in(topology) // max(1, (self.node(run.node) or ({}, 1))[1]))
            host = tpu_host(pod.metadata.labels or {}, hosts)  # as GKE's TPU webhook: from KubeRay's labels
            env.update(tpu_environment(topology, host.worker_id, host.slice_name, list(host.hostnames), accelerator))
        return env

    @staticmethod
    def downward_fields(run: PodRun, body: dict) -> dict:
        """The downward API's fieldRef values (env and volumes), for the pod as a dict."""
        return {
            "metadata.name": run.name, "metadata.namespace": run.namespace, "metadata.uid": run.uid,
            "status.podIP": run.ip, "status.podIPs": run.ip, "spec.nodeName": run.node,
            "spec.serviceAccountName": (body.get("spec") or {}).get("serviceAccountName") or "default",
            "status.hostIP": "127.0.0.1", "status.hostIPs": "127.0.0.1",
        }

    def token_for(self, run: PodRun, body: dict):
        """A serviceAccountToken projection's token, as a kubelet gets it: a TokenRequest for
        the pod's ServiceAccount, bound to the pod (gone with it). The API server's default
        audience when the projection names none."""
        def request(audience: str, seconds: int) -> str:
            spec = {"expirationSeconds": seconds,
                    "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": run.name, "uid": run.uid}}
            if audience:
                spec["audiences"] = [audience]
            account = (body.get("spec") or {}).get("serviceAccountName") or "default"
            try:
                answer = self.core.create_namespaced_service_account_token(
                    account, run.namespace, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
            except ApiException as error:  # the kubelet's words: FailedMount, tried again
                raise MountError(f"failed to fetch token: {error.reason}: {(error.body or '')[:300]}") from error
            return answer.status.token
        return request

    def service_variables(self, pod) -> dict:
        """The Services of the pod's namespace (with enableServiceLinks) and the API
        server's, as a kubelet injects them; KUBERNETES_SERVICE_* name the real API server
        (no ClusterIP routes on the ground)."""
        services = []
        if pod.spec.enable_service_links is not False:
            services = self.api.sanitize_for_serialization(
                self.core.list_namespaced_service(pod.metadata.namespace)).get("items") or []
        services = [s for s in services if s["metadata"]["name"] != "kubernetes"]
        host, port = self.api_server
        services.append({"metadata": {"name": "kubernetes"}, "spec": {
            "clusterIP": host, "ports": [{"name": "https", "port": int(port), "protocol": "TCP"}]}})
        return service_env(services)

    # -- containers

    def waits_for_head(self, run: PodRun) -> bool:
        """A worker's container reaches its head's GCS. On a cluster it would start and poll
        (wait-gcs-ready, `ray start --address`); here it starts once the head's address is
        known (and, for the main container, once the head answers): until then it waits in
        the kubelet's state with a message naming what it waits for, also written to the
        pod's log."""
        if not run.ray or run.head:
            return False
        init = run.stage == "init"
        head = self.heads.get(run.cluster_uid)
        if head is not None and head.gcs_address and (init or head.answering):
            run.gcs_address = head.gcs_address
            return False
        what = (f"the head of RayCluster {run.namespace}/{run.cluster} to start its GCS"
                if init or head is None or not head.gcs_address else
                f"head pod {head.name} of RayCluster {run.namespace}/{run.cluster} to answer "
                f"at http://{head.ip}:{DASHBOARD_PORT}")
        self.say_waiting(run, what)
        run.container.state = waiting(run.default_reason, f"the node waits for {what}")
        run.next_try = time.monotonic() + 0.5
        return True

    def start_container(self, run: PodRun) -> None:
        if self.waits_for_head(run):
            return
        pod = run.pod
        body = self.api.sanitize_for_serialization(pod)
        node_labels = self.node(run.node)[0]
        c = run.container
        init = run.stage == "init"
        spec = body["spec"]["initContainers"][run.init_index] if init else body["spec"]["containers"][0]
        try:
            if init:
                env = self.environment(run, pod, spec, node_labels, tpu=False)
            else:
                if run.main_env is None:  # once: the TPU worker id is handed out here
                    run.main_env = self.environment(run, pod, spec, node_labels)
                env = dict(run.main_env)
            argv = self.command(run, spec, env, init)
            mounts = self.mounts(run, spec, env)
            if not run.ray and self.bind_library is not None:  # its own 0.0.0.0 (podbind.c)
                env.update(dict(zip(BIND_ENV, (str(self.bind_library), run.ip))))
        except ConfigError as error:
            self.container_error(run, "CreateContainerConfigError", str(error))
            return
        except (MountError, ValueError) as error:  # a subPath outside its volume, no command
            self.container_error(run, "CreateContainerError", str(error))
            return
        cgroup = run.cgroup / spec["name"]
        podcgroup.remove(cgroup)  # a restarted container starts with a fresh one
        limit = ((spec.get("resources") or {}).get("limits") or {}).get("memory")
        podcgroup.create(cgroup, int(parse_quantity(limit)) if limit else None, shares=container_cpu_shares(spec))
        sandbox = run.dir / f"{spec['name']}.json"
        sandbox.write_text(json.dumps({"cgroup": str(cgroup), "mounts": mounts,
                                       "cwd": spec.get("workingDir") or POD_HOME, "argv": argv}))
        run.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(run.log_path, "ab") as out:
            out.write(f"\n---- {now()} {spec['name']}: {shlex.join(argv)}\n".encode())
            out.flush()
            run.log_offset = out.tell()
            run.proc = self.sandboxed(run, spec["name"], sandbox, env, stdout=out, stderr=subprocess.STDOUT)
        run.oom = False
        c.state = {"running": {"startedAt": now()}}
        c.container_id = f"ground://{run.proc.pid}"
        if not init:
            run.probes = ContainerProbes(spec, time.monotonic())
            c.started = run.probes.started
            if run.ray and not run.head:
                self.count_cluster_with_workers(run)

    def count_cluster_with_workers(self, run: PodRun) -> None:
        """Each RayCluster whose workers ran on this ground, one line the first time
        (CLUSTERS_WITH_WORKERS): the suite's count of clusters that trained or checked."""
        key = f"{run.namespace}/{run.cluster} {run.cluster_uid}"
        if key not in self.clusters_with_workers:
            self.clusters_with_workers.add(key)
            with open(self.workdir / CLUSTERS_WITH_WORKERS, "a") as out:
                out.write(key + "\n")

    def sandboxed(self, run: PodRun, container: str, sandbox: Path, env: dict, **streams) -> subprocess.Popen:
        """A process in the container (podsandbox.py: its memory cgroup, mounts and working
        directory; its CPU cgroup joined before exec), as the runtime starts or execs one."""
        with podcgroup.CpuJoin(run.cgroup / container) as join:
            return subprocess.Popen([sys.executable, "-I", str(HERE / "podsandbox.py"), str(sandbox)], env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=join, **streams)

    def command(self, run: PodRun, spec: dict, env: dict, init: bool) -> list[str]:
        if init:
            argv = plain_command(spec, env)
            return [health_check_to_gcs(word, run.gcs_address) for word in argv] if run.ray and run.gcs_address else argv
        exit_with = (run.pod.metadata.annotations or {}).get(EXIT_CODE_ANNOTATION)
        if exit_with is not None:  # asked to crash: the container's command fails at once
            return [str(self.image_bin(spec.get("image") or "") / "python"), "-c",
                    f"import sys; print('asked to exit {int(exit_with)}'); sys.exit({int(exit_with)})"]
        if not run.ray:
            return plain_command(spec, env, self.image_commands.get(image_repository(spec.get("image") or "")))
        # On every address: Ray's GCS and some agents listen on 0.0.0.0.
        names = ("gcs", "metrics", "agent_http", "agent_grpc", "runtime_env", "client")
        ports = dict(zip(names, self.ray_ports(len(names))))
        if run.head:
            run.gcs_address = f"{run.ip}:{ports['gcs']}"
        run.ports = ray_port_map(ray_start_args(spec), run.head, {**ports, "dashboard": DASHBOARD_PORT})
        # KubeRay's RAY_ADDRESS / RAY_PORT name port 6379 on the head; here the GCS
        # listens where the agent put it.
        env.update(RAY_ADDRESS=run.gcs_address, RAY_PORT=run.gcs_address.rsplit(":", 1)[1])
        return [str(self.image_bin(spec.get("image") or "") / "ray"), "start",
                *rewrite_ray_start(ray_start_args(spec), head=run.head, ip=run.ip, temp_dir=RAY_TEMP_DIR,
                                   gcs_address=run.gcs_address, ports=ports)]

    def ray_ports(self, count: int) -> list[int]:
        """Ports for a Ray container's servers, free now and never given to another
        container of this ground. Ray's GCS and some agents listen on 0.0.0.0, so a port is
        the machine's, not the pod's (on GKE every pod has its own): two containers starting
        at once were once given the same number, one worker's agent HTTP port was another's
        gRPC port, its readiness probe read gRPC's bytes (BadStatusLine), and its pod never
        became Ready. Free ports are asked of the kernel, which may hand a number out again
        as soon as it is released; this agent does not."""
        while True:
            picked = free_ports(count, "0.0.0.0")
            if not self.ports_given.intersection(picked):
                self.ports_given.update(picked)
                return picked

    def sync_running(self, run: PodRun) -> None:
        c = run.container
        cgroup = run.cgroup / c.name
        if not run.oom and podcgroup.oom_kills(cgroup):
            # Kubernetes (cgroup v2, memory.oom.group) kills the whole container.
            run.oom = True
            podcgroup.kill_all(cgroup)
        code = run.proc.poll()
        if code is None:
            if run.kill_deadline is not None:
                self.sync_kill(run, cgroup)
            elif self.head_moved(run):
                log.info("pod %s/%s: container %s reaches for GCS %s, but its head's container restarted and "
                         "listens at %s (on GKE, its Service's port stays): ended, to restart", run.namespace,
                         run.name, c.name, run.gcs_address, self.heads[run.cluster_uid].gcs_address)
                run.kill_deadline = time.monotonic() + 5
                self.terminate_main(run)
            elif run.stage == "main":
                if not run.answering and self.answers(run):
                    run.answering = True
                self.sync_probes(run, c)
            return
        run.proc = None
        run.ready = c.ready = run.answering = False
        run.probes, run.probing, run.kill_deadline = None, {}, None  # a probe still running is forgotten
        if run.hook is not None:  # a probe's kill ran the preStop hook; the container ended first
            self.end_pre_stop(run, run.hook)
            run.hook = None
        podcgroup.kill_all(cgroup)  # the container's processes end with its main one
        code = 137 if run.oom else exit_code(code)
        reason = "OOMKilled" if run.oom else "Error" if code else "Completed"
        log.info("pod %s/%s: container %s exited %s (%s): %s", run.namespace, run.name, c.name, code, reason,
                 last_line(run.log_path, run.log_offset))
        c.state = {"terminated": {"exitCode": code, "reason": reason, "startedAt": c.state["running"]["startedAt"],
                                  "finishedAt": now(), "containerID": c.container_id}}
        if run.stage == "init" and code == 0:
            run.init_index += 1
            if run.init_index == len(run.inits):
                run.stage = "main"
            return
        if run.restart_policy == "Always" or (run.restart_policy == "OnFailure" and code != 0):
            run.crashed = True
            run.next_try = time.monotonic() + 1
        else:
            run.stage = "done"

    # -- probes (podprobes.py): a kubelet's prober workers for the main container

    def sync_probes(self, run: PodRun, c: ContainerState) -> None:
        """Each probe's outcome taken in, the probes due started beside the sync loop; the
        container's started and ready follow them."""
        for kind, future in list(run.probing.items()):
            if future.done():
                del run.probing[kind]
                self.probe_result(run, c, run.probes.workers[kind], future.result())
                if run.kill_deadline is not None:
                    return
        for worker in run.probes.due(time.monotonic()):
            kind = worker.probe.kind
            if kind not in run.probing:  # one at a time: a slow one delays the next tick
                run.probing[kind] = self.prober.submit(self.probe, run, worker.probe)
                run.probing[kind].add_done_callback(lambda _: self.wake.set())
        c.started = run.probes.started
        run.ready = c.ready = run.probes.ready

    def probe_result(self, run: PodRun, c: ContainerState, worker, outcome: Outcome) -> None:
        """The kubelet's events for a failed probe (Unhealthy, each distinct message once per
        container), and for a liveness or startup failure past its threshold the kill
        (Killing), after which the container restarts per restartPolicy."""
        kind = worker.probe.kind
        if not outcome.success:
            self.event(run, "Unhealthy", f"{kind} probe failed: {outcome.output}", key=c.container_id)
        if worker.record(outcome.success) is False and kind in (LIVENESS, STARTUP):
            restarted = ", will be restarted" if run.restart_policy != "Never" else ""
            self.event(run, "Killing", f"Container {c.name} failed {kind.lower()} probe{restarted}", kind="Normal",
                       key=c.container_id)
            grace = worker.probe.termination_grace
            if grace is None:
                grace = run.pod.spec.termination_grace_period_seconds
            self.kill_container(run, 30 if grace is None else grace)

    def probe(self, run: PodRun, probe: Probe) -> Outcome:
        """One probe, on a prober thread: an exec one inside the container, HTTP and TCP
        ones at the pod's address (a Ray container's moved ports: run.ports)."""
        try:
            spec = self.api.sanitize_for_serialization(run.pod)["spec"]["containers"][0]
            if probe.handler == "exec":
                return self.exec_probe(run, spec, probe)
            port = podprobes.port_number(probe.action.get("port"), spec)
            port = run.ports.get(port, port)
            host = probe.action.get("host") or run.ip
            if probe.handler == "tcpSocket":
                return podprobes.tcp_socket(host, port, probe.timeout)
            path = probe.action.get("path") or "/"
            scheme = (probe.action.get("scheme") or "HTTP").lower()
            headers = {h["name"]: h["value"] for h in probe.action.get("httpHeaders") or []}
            return podprobes.http_get(f"{scheme}://{host}:{port}{'' if path.startswith('/') else '/'}{path}",
                                      headers, probe.timeout)
        except Exception as error:  # the probe could not run: a failure that says why
            log.exception("pod %s/%s: %s probe", run.namespace, run.name, probe.kind)
            return Outcome(False, f"{type(error).__name__}: {error}")

    def exec_probe(self, run: PodRun, spec: dict, probe: Probe) -> Outcome:
        """An exec probe as the runtime execs it: in the container's cgroups, mounts,
        working directory and environment; killed with what it started past its timeout."""
        command = list(probe.action.get("command") or [])
        if run.ray:
            command = probe_command(command, run.ip, run.ports)
        sandbox = run.dir / f"{spec['name']}.json"
        probe_spec = run.dir / f"{spec['name']}-{probe.kind.lower()}-probe.json"
        probe_spec.write_text(json.dumps({**json.loads(sandbox.read_text()), "argv": command}))
        proc = self.sandboxed(run, spec["name"], probe_spec, dict(run.main_env or {}),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            output, _ = proc.communicate(timeout=probe.timeout)
            return podprobes.exec_outcome(command, proc.returncode, output)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # something it started left its group and holds the pipe
                proc.wait()
            return podprobes.exec_outcome(command, None, b"")

    def kill_container(self, run: PodRun, grace: float) -> None:
        """A kubelet's killContainer for a failed probe: the preStop hook, then SIGTERM to the
        main process, SIGKILL to the container once the grace period is over (sync_kill)."""
        run.kill_deadline = time.monotonic() + max(1.0, min(grace, MAX_GRACE_SECONDS))
        run.ready = run.container.ready = False
        run.hook = self.start_pre_stop(run)
        if run.hook is None:
            self.terminate_main(run)

    def sync_kill(self, run: PodRun, cgroup: Path) -> None:
        now_ = time.monotonic()
        if run.hook is not None:
            if run.hook.poll() is None and now_ < run.kill_deadline:
                return
            self.end_pre_stop(run, run.hook)
            run.hook = None
            run.kill_deadline = max(run.kill_deadline, now_ + 2)  # SIGTERM still gets 2 s (the kubelet's)
            self.terminate_main(run)
        elif now_ >= run.kill_deadline:
            podcgroup.kill_all(cgroup)

    def head_moved(self, run: PodRun) -> bool:
        """A worker's container was started against its head's GCS, and the head's container
        (or pod) has since started again. Here a new head gets new ports (tests/README.md); on
        GKE the head's Service keeps 6379, so a worker still starting reaches the new head at
        once and a registered raylet, refused by the new GCS, exits within seconds. Left
        alone, the worker would wait on the dead address until Ray's own timeouts (minutes
        for a `ray start` that has not registered), so the agent ends it and it restarts."""
        if not run.ray or run.head or not run.gcs_address:
            return False
        head = self.heads.get(run.cluster_uid)
        return head is not None and bool(head.gcs_address) and head.gcs_address != run.gcs_address

    def answers(self, run: PodRun) -> bool:
        """Whether the container's process answers, decided by the agent: the head's
        dashboard answers, a worker's `ray start` registered it, any other container has
        started. A head's workers start once it answers (their readiness is the pod's
        probes')."""
        if not run.ray:
            return True
        if run.head:
            token = (run.main_env or {}).get("RAY_AUTH_TOKEN", "")  # KubeRay's secretKeyRef
            request = urllib.request.Request(f"http://{run.ip}:{DASHBOARD_PORT}/api/version",
                                             headers={"Authorization": f"Bearer {token}"} if token else {})
            try:
                with DIRECT.open(request, timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False
        try:
            with open(run.log_path, "rb") as f:
                f.seek(run.log_offset)
                return b"Ray runtime started" in f.read()
        except OSError:
            return False

    # -- status and events: one builder, written when it changes

    def pod_status(self, run: PodRun) -> dict:
        initialized = run.stage in ("main", "done") and not (run.stage == "done" and run.init_index < len(run.inits))
        ready = run.stage == "main" and run.ready
        if run.stage == "done":
            codes = [c.state.get("terminated", {}).get("exitCode", 1) for c in (run.mains if initialized else run.inits)]
            phase = "Succeeded" if initialized and not any(codes) else "Failed"
        elif run.stage == "main" and (run.proc is not None or run.mains[0].restarts or run.crashed):
            phase = "Running"
        else:
            phase = "Pending"
        stamp = now()
        for kind, value in (("PodScheduled", True), ("Initialized", initialized),
                            ("ContainersReady", ready), ("Ready", ready)):
            if run.conditions.get(kind, (None,))[0] != value:
                run.conditions[kind] = (value, stamp)
        mains = run.mains
        if run.stage in ("setup", "init"):
            state = waiting(POD_INITIALIZING if run.stage == "init" else run.default_reason,
                            "" if run.stage == "init" else run.wait_message)
            mains = [dataclasses.replace(c, state=state) for c in run.mains]
        elif len(run.mains) > 1:  # only the first container runs; the others report as it does
            mains = [run.mains[0]] + [dataclasses.replace(run.mains[0], name=c.name, image=c.image) for c in run.mains[1:]]
        status = {"phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
                  "startTime": run.started_at, "podIP": run.ip, "podIPs": [{"ip": run.ip}],
                  "conditions": [{"type": kind, "status": "True" if value else "False", "lastTransitionTime": since,
                                  "lastProbeTime": None} for kind, (value, since) in run.conditions.items()],
                  "containerStatuses": [c.as_status(run.default_reason) for c in mains]}
        if run.inits:
            status["initContainerStatuses"] = [c.as_status(run.default_reason) for c in run.inits]
        return status

    def write_status(self, run: PodRun) -> None:
        status = self.pod_status(run)
        text = json.dumps(status, sort_keys=True)
        if text == run.written:
            return
        try:
            self.core.patch_namespaced_pod_status(run.name, run.namespace, {"status": status})
            run.written = text
        except ApiException as error:
            if error.status != 404:
                log.warning("status of %s/%s: %s", run.namespace, run.name, error)

    def patch_status(self, run: PodRun, patch: dict) -> None:
        """A status written by another part of the kubelet (nodelife.py: the node shutdown
        manager's Failed/Terminated), not by pod_status."""
        try:
            self.core.patch_namespaced_pod_status(run.name, run.namespace, patch)
        except ApiException as error:
            if error.status != 404:
                log.warning("status of %s/%s: %s", run.namespace, run.name, error)

    def event(self, run: PodRun, reason: str, message: str, kind: str = "Warning", key: str = "") -> None:
        """An event on the pod from the kubelet, once per distinct message (a kubelet
        repeats them), or once per message and `key` (a probe's: once per container)."""
        if (key, message) in run.event_messages:
            return
        run.event_messages.add((key, message))
        log.info("pod %s/%s: %s: %s", run.namespace, run.name, reason, message)
        stamp = now()
        try:
            self.core.create_namespaced_event(run.namespace, {
                "metadata": {"generateName": f"{run.name}."},
                "involvedObject": {"kind": "Pod", "namespace": run.namespace, "name": run.name, "uid": run.uid,
                                   "apiVersion": "v1"},
                "reason": reason, "message": message, "type": kind, "count": 1,
                "firstTimestamp": stamp, "lastTimestamp": stamp,
                "source": {"component": "kubelet", "host": run.node}})
        except ApiException as error:
            log.warning("event on %s/%s: %s", run.namespace, run.name, error)

    # -- deletion: one path

    def begin_stop(self, run: PodRun, grace: float) -> None:
        """A kubelet's killContainer: the preStop hook first, then SIGTERM to the container's
        main process (PID 1 of a container), SIGKILL to all that is left once it has exited
        or the grace period is over (sync_stop)."""
        run.deleting = True
        run.stop_deadline = time.monotonic() + max(1.0, min(grace, MAX_GRACE_SECONDS))
        if run.hook is None:  # else a probe's kill has run it already: it goes on
            run.hook = self.start_pre_stop(run)
        if run.hook is None:
            self.terminate_main(run)

    def start_pre_stop(self, run: PodRun) -> subprocess.Popen | None:
        """The main container's preStop exec hook, run as a kubelet execs it: inside the
        container (its mount namespace, cgroup and environment), before any signal."""
        if run.stage != "main" or run.proc is None or run.proc.poll() is not None or run.main_env is None:
            return None
        spec = self.api.sanitize_for_serialization(run.pod)["spec"]["containers"][0]
        command = (((spec.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
        sandbox = run.dir / f"{spec['name']}.json"
        if not command or not sandbox.exists():
            return None
        hook = run.dir / f"{spec['name']}-prestop.json"
        hook.write_text(json.dumps({**json.loads(sandbox.read_text()), "argv": list(command)}))
        with open(run.log_path, "ab") as out:
            out.write(f"\n---- {now()} {spec['name']}: preStop {shlex.join(command)}\n".encode())
            out.flush()
            return self.sandboxed(run, spec["name"], hook, dict(run.main_env), stdout=out, stderr=subprocess.STDOUT)

    def run_pre_stop(self, run: PodRun, grace: float) -> None:
        """The hook, waited for (graceful node shutdown runs it from its own thread)."""
        hook = self.start_pre_stop(run)
        if hook is not None:
            try:
                hook.wait(max(grace, 1.0))
            except subprocess.TimeoutExpired:
                pass
            self.end_pre_stop(run, hook)

    def end_pre_stop(self, run: PodRun, hook: subprocess.Popen) -> None:
        if hook.poll() is None:  # past the grace period: the kubelet stops waiting for it
            hook.kill()
            outcome = "killed at the end of the grace period"
        else:
            outcome = f"exited {hook.returncode}"
        hook.wait()
        log.info("pod %s/%s: preStop hook %s", run.namespace, run.name, outcome)

    @staticmethod
    def terminate_main(run: PodRun) -> None:
        if run.proc is not None and run.proc.poll() is None:
            os.kill(run.proc.pid, signal.SIGTERM)

    def sync_stop(self, run: PodRun) -> None:
        now_ = time.monotonic()
        if run.hook is not None:
            if run.hook.poll() is None and now_ < run.stop_deadline:
                return
            self.end_pre_stop(run, run.hook)
            run.hook = None
            # A hook that took the whole grace period still leaves SIGTERM 2 s (the kubelet's).
            run.stop_deadline = max(run.stop_deadline, now_ + 2)
            self.terminate_main(run)
        if run.proc is not None and run.proc.poll() is None and now_ < run.stop_deadline:
            return
        # The main process has exited: as when a container's PID 1 ends, the kernel kills
        # the rest of its processes (remove).
        self.remove(run)
        self.confirm_deletion(run.namespace, run.name, run.uid)

    def remove(self, run: PodRun) -> None:
        """The pod's processes, cgroups and files go with it, as a kubelet removes them
        (its log stays under the ground's workdir)."""
        podcgroup.remove(run.cgroup)
        if run.proc is not None:
            run.proc.wait()
        shutil.rmtree(run.dir, ignore_errors=True)
        shutil.rmtree(run.shm, ignore_errors=True)
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

    # -- the watch loops

    def watch_pods(self) -> None:
        def listed(items) -> None:
            self.pods = {pod.metadata.uid: pod for pod in items}
            self.pods_listed.set()
            self.wake.set()

        def event(kind: str, pod) -> None:
            if kind == "DELETED":
                self.pods.pop(pod.metadata.uid, None)
            else:
                self.pods[pod.metadata.uid] = pod
            self.wake.set()

        list_and_watch(self.core.list_pod_for_all_namespaces, listed, event, self.stop_event, "pod")

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
        self.wake.set()
        self.prober.shutdown(wait=False, cancel_futures=True)
        podcgroup.signal_all(self.cgroup, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while podcgroup.procs(self.cgroup) and time.monotonic() < deadline:
            time.sleep(0.2)
        podcgroup.remove(self.cgroup)
        shutil.rmtree(self.pods_dir, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--hosts-file", required=True, type=Path)
    parser.add_argument("--ip-prefix", required=True, help="127.N: pods get 127.N.x.y")
    parser.add_argument("--ground-id", required=True)
    parser.add_argument("--node-env", action="append", default=[], metavar="KEY=VALUE",
                        help="a variable every pod gets, as the node adds it (repeatable)")
    parser.add_argument("--image-env", action="append", default=[], metavar="REPOSITORY=VENV",
                        help="pods of images named REPOSITORY run the environment VENV (repeatable)")
    parser.add_argument("--image-dockerfile", action="append", default=[], metavar="REPOSITORY=DOCKERFILE",
                        help="a container of REPOSITORY with no command runs its Dockerfile's ENTRYPOINT and CMD")
    parser.add_argument("--gcs-root", type=Path, default=None,
                        help="the GCS emulator's directory of buckets: gcsfuse CSI volumes mount <dir>/<bucket>")
    args = parser.parse_args(argv)
    node_env = {}
    for item in args.node_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--node-env {item!r}: use KEY=VALUE")
        node_env[key] = value
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config.load_kube_config(args.kubeconfig)
    api = client.ApiClient()
    agent = NodeAgent(api, args.workdir, args.hosts_file, args.ip_prefix, args.ground_id,
                      gcs_root=args.gcs_root, node_env=node_env,
                      images={k: Path(v) for k, _, v in (item.partition("=") for item in args.image_env)},
                      image_dockerfiles={k: Path(v) for k, _, v in (item.partition("=") for item in args.image_dockerfile)})
    provisioner = Provisioner(api, args.workdir / "volumes")
    provisioner.install()
    signal.signal(signal.SIGTERM, lambda *_: agent.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: agent.stop_event.set())
    for loop in (agent.watch_pods, agent.sync_loop, agent.resolve_services, lambda: provisioner.run(agent.stop_event)):
        threading.Thread(target=loop, daemon=True).start()
    agent.life.start()
    # Ready once it sees every pod (the ground waits for this file before it registers nodes).
    if not agent.pods_listed.wait(60):
        log.warning("the pod watch has not listed within 60s")
    # The node-level variables every pod gets, for tests to tell them from the spec's.
    (args.workdir / "nodeagent.ready").write_text(json.dumps({
        "pid": os.getpid(), "node_env": sorted(agent.node_env),
        # What the runtime adds to a non-Ray container for its own address (podbind.c).
        "bind_env": list(BIND_ENV) if agent.bind_library is not None else []}))
    agent.stop_event.wait()
    agent.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
