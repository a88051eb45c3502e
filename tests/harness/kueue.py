"""Kueue on the test ground, started only for the tests that ask for it (the `kueue` fixture).

The real Kueue controller manager (`make kueue`, tests/kueue/build.sh: built from
sigs.k8s.io/kueue/cmd/kueue at the pinned version, CRDs from the same module) runs with:

- the `ray.io/raycluster` integration only, and `manageJobsWithoutQueueName: false`: a
  RayCluster without the queue label is none of its business, so every other test on the
  ground sees no difference;
- **its webhooks off** (no Mutating/ValidatingWebhookConfiguration is registered, the CRDs
  are served without conversion webhooks). The operator never relies on them: it creates
  each queued RayCluster already suspended with the queue label (what Kueue's RayCluster
  webhook would default), the queue objects below are written valid, and everyone reads
  Kueue's storage version (v1beta2). On a real cluster Kueue's own install keeps its
  webhooks; nothing here depends on them being absent either.
  Kueue's webhook and metrics servers still want a certificate at start (the metrics one at
  the fixed path /etc/kueue/metrics/certs): Kueue runs in a mount namespace of its own where
  /etc is an overlay of the machine's /etc and a folder of the ground's workdir holding
  that certificate, so nothing on the machine changes.

Queues (`QUEUE_OBJECTS`): ResourceFlavors `default-flavor` (no node labels: CPU and memory)
and `tpu-v6e-4x4` (the simulated v6e pool's node labels); ClusterQueue `tpu-v6e` with a quota
of one v6e 4x4 slice (16 google.com/tpu) and CPU/memory far beyond the ground; ClusterQueue
`cpu` with the CPU of exactly one `CPU_RUN` (a cpu generation run that really trains and
checkpoints on the ground); preemption of lower priorities within each; WorkloadPriorityClasses
`low` and `high`. `local_queues(namespace)` gives a namespace its LocalQueues `tpu-queue` and
`cpu-queue`.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from controlplane import ROOT, ControlPlaneError  # noqa: E402
from processes import in_private_mount_namespace  # noqa: E402
from ports import free_ports  # noqa: E402
from processes import spawn, stop_process, tail  # noqa: E402

KUEUE_BUILD = ROOT / "tests" / "kueue" / "build.sh"
KUEUE_NAMESPACE = "kueue-system"
API = "kueue.x-k8s.io/v1beta2"

TPU_QUEUE, CPU_QUEUE = "tpu-queue", "cpu-queue"
V6E_FLAVOR_LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                     "cloud.google.com/gke-tpu-topology": "4x4"}
V6E_4X4_TPU = 16
# The cpu ClusterQueue holds one cpu run of topology "1": head 1 CPU + one worker 1 CPU
# (core/sizing.py, core/generations.py), and no more.
CPU_RUN_CPU = 2
PRIORITIES = {"low": 100, "high": 1000}


def kueue_version() -> str:
    """The Kueue release pinned in tests/kueue/build.sh (e.g. 'v0.17.0')."""
    for line in KUEUE_BUILD.read_text().splitlines():
        if line.startswith("KUEUE_VERSION="):
            return line.split("=", 1)[1].split()[0]
    raise RuntimeError(f"no KUEUE_VERSION= line in {KUEUE_BUILD}")


def kueue_dir() -> Path:
    """Where `make kueue` puts the kueue binary (bin/) and the CRDs of the same module (crds/)."""
    return ROOT / ".cache" / "kueue" / kueue_version()


def kueue_crd_files() -> list[Path]:
    crds = sorted((kueue_dir() / "crds").glob("kueue.x-k8s.io_*.yaml"))
    if not crds or not (kueue_dir() / "bin" / "kueue").exists():
        raise ControlPlaneError(
            f"Kueue {kueue_version()} is not built (.cache/kueue/{kueue_version()}): run `make kueue` "
            "(builds it from its Go module; `make test` runs it for you)")
    return crds


def _flavor(name: str, labels: dict | None = None) -> dict:
    return {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": name},
            "spec": {"nodeLabels": labels} if labels else {}}


def _cluster_queue(name: str, groups: list[dict]) -> dict:
    return {"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": {"namespaceSelector": {},
                     "preemption": {"withinClusterQueue": "LowerPriority"},
                     "resourceGroups": groups}}


def _group(flavor: str, quotas: dict) -> dict:
    return {"coveredResources": list(quotas),
            "flavors": [{"name": flavor, "resources": [{"name": r, "nominalQuota": q} for r, q in quotas.items()]}]}


QUEUE_OBJECTS: list[dict] = [
    _flavor("default-flavor"),
    _flavor("tpu-v6e-4x4", V6E_FLAVOR_LABELS),
    _cluster_queue("tpu-v6e", [
        _group("default-flavor", {"cpu": 1000, "memory": "10Ti"}),
        _group("tpu-v6e-4x4", {"google.com/tpu": V6E_4X4_TPU}),
    ]),
    _cluster_queue("cpu", [_group("default-flavor", {"cpu": CPU_RUN_CPU, "memory": "100Gi"})]),
    *({"apiVersion": API, "kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value,
       "description": f"{name} priority for the ground's Kueue tests"} for name, value in PRIORITIES.items()),
]


def local_queues(namespace: str) -> list[dict]:
    return [{"apiVersion": API, "kind": "LocalQueue", "metadata": {"name": local, "namespace": namespace},
             "spec": {"clusterQueue": cluster}}
            for local, cluster in ((TPU_QUEUE, "tpu-v6e"), (CPU_QUEUE, "cpu"))]


def private_etc_argv(etc_extra: Path, argv: list[str]) -> list[str]:
    """argv where /etc is the machine's /etc with `etc_extra` laid over it (read-only
    overlay): files at fixed /etc paths for this one process."""
    return in_private_mount_namespace('mount -t overlay overlay -o "lowerdir=$1:/etc" /etc', etc_extra, argv)


class Kueue:
    """The Kueue controller manager on a started ground (admin credentials, like KubeRay)."""

    def __init__(self, ground):
        self.ground = ground
        self.proc = None
        self.dir = ground.workdir / "kueue"

    def start(self, timeout: float = 120) -> "Kueue":
        crds = kueue_crd_files()
        self.ground.cp.install_crds(crds, timeout=timeout)
        self.ground.kubectl("create", "namespace", KUEUE_NAMESPACE, check=False)
        config = self._write_files()
        env = dict(os.environ, KUBECONFIG=str(self.ground.cp.kubeconfig))
        argv = private_etc_argv(self.dir / "etc", [str(kueue_dir() / "bin" / "kueue"), f"--config={config}"])
        self.proc = spawn(argv, self.ground.workdir / "kueue.log", env=env)
        self._wait_ready(timeout)
        self.ground.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(QUEUE_OBJECTS))
        return self

    def _write_files(self) -> Path:
        """The serving certificate (the ground's own, for 127.0.0.1; nothing calls these
        servers) and the configuration."""
        pki = self.ground.workdir / "pki"
        certs = self.dir / "certs"
        metrics_certs = self.dir / "etc" / "kueue" / "metrics" / "certs"
        for folder in (certs, metrics_certs):
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(pki / "apiserver.crt", folder / "tls.crt")
            shutil.copy(pki / "apiserver.key", folder / "tls.key")
        probe, webhook = free_ports(2)
        self.ready_url = f"http://127.0.0.1:{probe}/readyz"
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": KUEUE_NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{probe}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": "127.0.0.1", "port": webhook, "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": ["ray.io/raycluster"]},
            # The on-demand visibility API is an aggregated API server: not needed here.
            "featureGates": {"VisibilityOnDemand": False},
        }
        path = self.dir / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ControlPlaneError(f"kueue exited with {self.proc.returncode}; last log lines:\n"
                                        + tail(self.ground.workdir / "kueue.log"))
            try:
                with urllib.request.urlopen(self.ready_url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"kueue not ready within {timeout:.0f}s; last log lines:\n"
                                        + tail(self.ground.workdir / "kueue.log"))
            time.sleep(0.5)

    def add_local_queues(self, namespace: str) -> None:
        self.ground.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(local_queues(namespace)))

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
