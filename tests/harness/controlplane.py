"""A real Kubernetes control plane (etcd + kube-apiserver) on loopback, for tests and by hand.

The binaries come from `make controlplane` (tests/controlplane/build.sh), which builds them
from Go modules into .cache/controlplane/<kubernetes version>/bin/. This module starts them
the way envtest does: a fresh temporary data directory, free loopback ports, self-signed
serving certificates and a service-account signing key (`pki.py`), RBAC with a token file
holding an admin identity (group system:masters) and a non-admin one, no controller-manager
and no scheduler (the test ground, `ground.py`, adds those).

Nothing it starts may outlive its owner: each binary runs in its own process group, with
the kernel told to kill it if the Python process that started it dies (`processes.py`),
and stop() / atexit / SIGTERM stop the whole group. `supervisor.py` keeps one running in
the background for `make cluster`.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from pki import write_pki  # noqa: E402
from ports import free_ports  # noqa: E402
from processes import alive, spawn, stop_process, tail  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GO_MODULE = ROOT / "tests" / "controlplane"
CRDS_DIR = ROOT / "crds"
KUBERAY_BUILD = ROOT / "tests" / "kuberay" / "build.sh"


def kuberay_version() -> str:
    """The KubeRay release pinned in tests/kuberay/build.sh (e.g. 'v1.6.2')."""
    for line in KUBERAY_BUILD.read_text().splitlines():
        if line.startswith("KUBERAY_VERSION="):
            return line.split("=", 1)[1].split()[0]
    raise RuntimeError(f"no KUBERAY_VERSION= line in {KUBERAY_BUILD}")


def kuberay_dir() -> Path:
    """Where `make kuberay` puts ray-operator (bin/) and the CRDs of the same module (crds/)."""
    return ROOT / ".cache" / "kuberay" / kuberay_version()


# KubeRay's RayCluster CRD, extracted from the pinned ray-operator module by `make kuberay`.
KUBERAY_CRD = kuberay_dir() / "crds" / "ray.io_rayclusters.yaml"
KUBERAY_CRD_DISPLAY = f".cache/kuberay/{kuberay_version()}/crds/ray.io_rayclusters.yaml (run `make kuberay`)"

ADMIN_USER = "admin"
TEST_USER = "tester"
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"


class ControlPlaneError(RuntimeError):
    pass


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl call; str() shows the command and its stderr."""

    def __str__(self) -> str:
        cmd = " ".join(str(a) for a in self.cmd)
        return f"kubectl exited {self.returncode}: {cmd}\n{(self.stderr or '').strip()}"


def module_pin(go_module: Path, module: str) -> str:
    """The version of `module` that go.mod in the `go_module` folder requires (e.g.
    'v1.37.2'): what each tool the tests build from Go modules is pinned to."""
    for line in (go_module / "go.mod").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == module and parts[1].startswith("v"):
            return parts[1]
    raise ControlPlaneError(f"no {module} requirement in {go_module / 'go.mod'}")


def pinned_version() -> str:
    """The Kubernetes release pinned in tests/controlplane/go.mod (e.g. 'v1.37.2')."""
    return module_pin(GO_MODULE, "k8s.io/kubernetes")


def default_bin_dir() -> Path:
    return ROOT / ".cache" / "controlplane" / pinned_version() / "bin"


def missing_binaries(bin_dir: Path) -> list[str]:
    return [b for b in ("etcd", "kube-apiserver", "kubectl") if not os.access(bin_dir / b, os.X_OK)]


def project_crd_files() -> list[Path]:
    return sorted(p for p in CRDS_DIR.glob("*.yaml") if p.is_file()) if CRDS_DIR.is_dir() else []


_WORKDIR_PREFIX = "tpuft-controlplane-"


def _remove_orphaned_workdirs() -> None:
    """Temporary data dirs left by an owner that was SIGKILLed (its children died with it)."""
    for d in Path(tempfile.gettempdir()).glob(_WORKDIR_PREFIX + "*"):
        try:
            owner = int((d / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not alive(owner):
            shutil.rmtree(d, ignore_errors=True)


_live: set["ControlPlane"] = set()
_live_lock = threading.Lock()


def _stop_all() -> None:
    with _live_lock:
        planes = list(_live)
    for cp in planes:
        cp.stop()


atexit.register(_stop_all)
_prev_sigterm = None


def _on_sigterm(signum, frame):
    _stop_all()
    prev = _prev_sigterm
    if callable(prev):
        prev(signum, frame)
    else:
        raise SystemExit(128 + signum)


def _install_sigterm_handler() -> None:
    """Stop every control plane on SIGTERM (whose default would skip atexit)."""
    global _prev_sigterm
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return
    _prev_sigterm = current if current not in (signal.SIG_DFL, signal.SIG_IGN, None) else None
    signal.signal(signal.SIGTERM, _on_sigterm)


# ---------------------------------------------------------------- the control plane


class ControlPlane:
    """One etcd + kube-apiserver pair. start() returns when /readyz answers 200."""

    def __init__(self, bin_dir: Path | None = None, workdir: Path | None = None):
        self.bin_dir = Path(bin_dir) if bin_dir else default_bin_dir()
        self.kubectl_path = self.bin_dir / "kubectl"
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else None
        self.etcd: subprocess.Popen | None = None
        self.apiserver: subprocess.Popen | None = None
        self.server = ""
        self.admin_token = secrets.token_hex(16)
        self.user_token = secrets.token_hex(16)
        self.user_name = TEST_USER
        self.version = pinned_version()
        self.extra_apiserver_args: list[str] = []
        # The bare control plane has no kubelet to mount a ServiceAccount's token, so its pods
        # get none; the ground (ground.py) turns the plugin on, as every GKE cluster has it.
        self.disabled_admission: list[str] = ["ServiceAccount"]

    # -- paths, set once started
    @property
    def ca_path(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def user_kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig-user"

    @property
    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in (("etcd", self.etcd), ("kube-apiserver", self.apiserver)) if p}

    def start(self, timeout: float = 90.0) -> "ControlPlane":
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise ControlPlaneError(
                f"control plane binaries missing ({', '.join(missing)} in "
                f"{self.bin_dir.relative_to(ROOT) if self.bin_dir.is_relative_to(ROOT) else self.bin_dir}): "
                "run `make controlplane` (needs Go 1.26+; `make test` runs it for you)"
            )
        if self.workdir is None:
            _remove_orphaned_workdirs()
            self.workdir = Path(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX))
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "owner.pid").write_text(str(os.getpid()))
        pki = self.workdir / "pki"
        pki.mkdir(exist_ok=True)
        write_pki(pki)
        (self.workdir / "tokens.csv").write_text(
            f'{self.admin_token},{ADMIN_USER},uid-{ADMIN_USER},"system:masters"\n'
            f"{self.user_token},{TEST_USER},uid-{TEST_USER}\n"
        )
        os.chmod(self.workdir / "tokens.csv", 0o600)

        _install_sigterm_handler()
        with _live_lock:
            _live.add(self)
        try:
            for attempt in range(3):
                try:
                    self._launch(timeout)
                    break
                except _PortTaken:
                    self._stop_processes()
                    if attempt == 2:
                        raise ControlPlaneError("could not find free loopback ports in 3 tries")
            self._write_kubeconfigs()
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, timeout: float) -> None:
        etcd_port, peer_port, api_port = free_ports(3)
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        data = self.workdir / "etcd-data"
        shutil.rmtree(data, ignore_errors=True)
        self.etcd = spawn(
            [
                str(self.bin_dir / "etcd"),
                "--name=default",
                f"--data-dir={data}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--unsafe-no-fsync=true",  # test data: durability is not wanted, speed is
                "--log-level=warn",
            ],
            self.workdir / "etcd.log",
        )
        pki = self.workdir / "pki"
        self.server = f"https://127.0.0.1:{api_port}"
        # kube-apiserver retries etcd until it answers, so both start at once.
        self.apiserver = spawn(
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                *([f"--disable-admission-plugins={','.join(self.disabled_admission)}"] if self.disabled_admission else []),
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--allow-privileged=true",
                # No nodes, no kube-proxy: nothing reads the kubernetes Service endpoints.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                "--v=0",
                *self.extra_apiserver_args,
            ],
            self.workdir / "kube-apiserver.log",
        )
        self._wait_ready(timeout)

    def _ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_path))

    def _wait_ready(self, timeout: float) -> None:
        ctx = self._ssl_context()
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in (("etcd", self.etcd), ("kube-apiserver", self.apiserver)):
                if proc.poll() is not None:
                    log = self.workdir / f"{name}.log"
                    text = tail(log)
                    if "address already in use" in text:
                        raise _PortTaken()
                    raise ControlPlaneError(f"{name} exited with {proc.returncode}; last log lines:\n{text}")
            req = urllib.request.Request(
                self.server + "/readyz", headers={"Authorization": f"Bearer {self.admin_token}"}
            )
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read()[-500:].decode(errors='replace')}"
            except (OSError, ssl.SSLError) as e:
                last = str(e)
            time.sleep(0.2)
        raise ControlPlaneError(
            f"kube-apiserver not ready within {timeout:.0f}s ({last}); last log lines:\n"
            + tail(self.workdir / "kube-apiserver.log")
        )

    def _write_kubeconfigs(self) -> None:
        # JSON is YAML, so kubectl and the Python client read these without a YAML writer here.
        def config(user: str, token: str) -> dict:
            return {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": {
                    "server": self.server, "certificate-authority": str(self.ca_path)}}],
                "users": [{"name": user, "user": {"token": token}}],
                "contexts": [{"name": f"{user}@test", "context": {
                    "cluster": "test", "user": user, "namespace": "default"}}],
                "current-context": f"{user}@test",
            }

        for path, user, token in (
            (self.kubeconfig, ADMIN_USER, self.admin_token),
            (self.user_kubeconfig, TEST_USER, self.user_token),
        ):
            path.write_text(json.dumps(config(user, token), indent=2) + "\n")
            os.chmod(path, 0o600)

    # -- using it

    def env(self) -> dict:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        # Per-instance discovery cache: ports are reused by later instances with other CRDs.
        env["KUBECACHEDIR"] = str(self.workdir / "kubectl-cache")
        return env

    @functools.cached_property
    def _read_context(self) -> ssl.SSLContext:
        return self._ssl_context()  # once: the CA exists from start() on

    def get_json(self, path: str, query: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
        """GET an API path as the admin: (HTTP status, JSON body). Waits poll reads this way
        rather than forking kubectl, which costs far more CPU per call."""
        url = self.server + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.admin_token}",
                                                       "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, context=self._read_context, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return e.code, json.loads(body)
            except ValueError:
                return e.code, {"message": body.decode(errors="replace")}

    def kubectl(self, *args, input: str | None = None, kubeconfig: Path | None = None,
                check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        env = self.env()
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        cmd = [str(self.kubectl_path), *map(str, args)]
        proc = subprocess.run(cmd, input=input, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def install_crds(self, paths: list[Path], timeout: float = 60) -> None:
        """Apply CRD manifests (server-side: big CRDs overflow the client-side annotation)
        and wait until each is Established."""
        if not paths:
            return
        files = [a for p in paths for a in ("-f", str(p))]
        applied = self.kubectl("apply", "--server-side", "--force-conflicts",
                               "--field-manager=tpufinetune-tests", "-o", "name", *files,
                               timeout=timeout).stdout.split()
        prefix = "customresourcedefinition.apiextensions.k8s.io/"
        names = [n[len(prefix):] for n in applied if n.startswith(prefix)]
        self._wait_established(names, timeout)

    def _wait_established(self, names: list[str], timeout: float) -> None:
        # A watch, not `kubectl wait` (which errors out on a CRD whose status has no
        # conditions yet) nor polling (each GET of KubeRay's ~1 MB CRD costs the server
        # real CPU). A watch without resourceVersion starts with the current state.
        pending = set(names)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ControlPlaneError(
                    f"CRDs not Established within {timeout:.0f}s: {', '.join(sorted(pending))}")
            req = urllib.request.Request(
                f"{self.server}/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
                f"?watch=1&timeoutSeconds={max(1, int(left))}",
                headers={"Authorization": f"Bearer {self.admin_token}"},
            )
            with urllib.request.urlopen(req, context=self._ssl_context(), timeout=left + 5) as r:
                for line in r:
                    event = json.loads(line)
                    crd = event.get("object") or {}
                    name = (crd.get("metadata") or {}).get("name")
                    conditions = (crd.get("status") or {}).get("conditions") or []
                    if any(c.get("type") == "Established" and c.get("status") == "True"
                           for c in conditions):
                        pending.discard(name)
                    if not pending:
                        return

    def install_crd(self, path) -> None:
        self.install_crds([Path(path)])

    def stop(self) -> None:
        self._stop_processes()
        with _live_lock:
            _live.discard(self)
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _stop_processes(self) -> None:
        # API server first, so it does not log etcd errors while going down.
        for proc in (self.apiserver, self.etcd):
            if proc is not None:
                stop_process(proc)

    def alive(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self.etcd, self.apiserver))

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _PortTaken(Exception):
    pass


def start_with_crds(bin_dir: Path | None = None, workdir: Path | None = None,
                    out=sys.stderr) -> tuple[ControlPlane, Path | None]:
    """Start a control plane with crds/*.yaml and KubeRay's RayCluster CRD installed.
    Returns the control plane and the KubeRay CRD path (None when that file is absent)."""
    cp = ControlPlane(bin_dir, workdir).start()
    try:
        crds = project_crd_files()
        kuberay = KUBERAY_CRD if KUBERAY_CRD.is_file() else None
        if kuberay is None:
            print(f"controlplane: KubeRay RayCluster CRD not found at {KUBERAY_CRD_DISPLAY}; "
                  "RayCluster objects cannot be created", file=out)
        cp.install_crds(crds + ([kuberay] if kuberay else []))
    except BaseException:
        cp.stop()
        raise
    return cp, kuberay
