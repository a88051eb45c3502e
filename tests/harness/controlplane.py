"""A real Kubernetes control plane (etcd + kube-apiserver) on loopback, for tests and by hand.

The binaries come from `make controlplane` (tests/controlplane/build.sh), which builds them
from Go modules into .cache/controlplane/<kubernetes version>/bin/. This module starts them
the way envtest does: a fresh temporary data directory, free loopback ports, self-signed
serving certificates, a service-account signing key, RBAC with a token file holding an admin
identity (group system:masters) and a non-admin one, no controller-manager and no scheduler.

Nothing it starts may outlive its owner: each binary runs in its own process group, with
the kernel told to kill it if the Python process that started it dies (PR_SET_PDEATHSIG),
and stop() / atexit / SIGTERM stop the whole group.

Command line (what `make cluster` / `make cluster-down` run):

    python tests/harness/controlplane.py up      # detached; prints `export KUBECONFIG=...` and `export PATH=...`
    python tests/harness/controlplane.py status
    python tests/harness/controlplane.py down
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

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
# Where `up` keeps its state; TPUFT_CLUSTER_DIR moves it (the harness's own tests do, so
# they never touch a cluster started by hand).
CLUSTER_STATE_DIR = Path(os.environ.get("TPUFT_CLUSTER_DIR") or ROOT / ".cache" / "cluster")

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


def pinned_version() -> str:
    """The Kubernetes release pinned in tests/controlplane/go.mod (e.g. 'v1.37.2')."""
    for line in (GO_MODULE / "go.mod").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "k8s.io/kubernetes" and parts[1].startswith("v"):
            return parts[1]
    raise ControlPlaneError(f"no k8s.io/kubernetes requirement in {GO_MODULE / 'go.mod'}")


def default_bin_dir() -> Path:
    return ROOT / ".cache" / "controlplane" / pinned_version() / "bin"


def missing_binaries(bin_dir: Path) -> list[str]:
    return [b for b in ("etcd", "kube-apiserver", "kubectl") if not os.access(bin_dir / b, os.X_OK)]


def project_crd_files() -> list[Path]:
    return sorted(p for p in CRDS_DIR.glob("*.yaml") if p.is_file()) if CRDS_DIR.is_dir() else []


def _free_ports(n: int) -> list[int]:
    # All sockets stay bound until every port is picked, so the n ports differ.
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# ---------------------------------------------------------------- certificates and keys


def _write_pki(d: Path) -> None:
    """ca.crt, apiserver.crt/.key (for 127.0.0.1 and localhost), sa.key/sa.pub."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        _write_pki_openssl(d)
    else:
        _write_pki_cryptography(d)
    for key in ("ca.key", "apiserver.key", "sa.key"):
        os.chmod(d / key, 0o600)


def _write_pki_cryptography(d: Path) -> None:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    now = datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=7)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tpufinetune-test-ca")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(
            x509.SubjectAlternativeName([
                x509.DNSName("localhost"),
                x509.DNSName("kubernetes.default.svc"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
            ]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    (d / "ca.key").write_bytes(pem_key(ca_key))
    (d / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (d / "apiserver.key").write_bytes(pem_key(srv_key))
    (d / "apiserver.crt").write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    (d / "sa.key").write_bytes(pem_key(sa_key))
    (d / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def _write_pki_openssl(d: Path) -> None:
    if shutil.which("openssl") is None:
        raise ControlPlaneError(
            "neither the Python 'cryptography' package nor the openssl CLI is available "
            "to make the test certificates; install one of them"
        )

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "7",
        "-subj", "/CN=tpufinetune-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
        "-addext", "keyUsage=critical,digitalSignature,keyCertSign,cRLSign")
    run("req", "-new", *ec, "-keyout", "apiserver.key", "-out", "apiserver.csr",
        "-subj", "/CN=kube-apiserver")
    (d / "apiserver.ext").write_text(
        "subjectAltName=DNS:localhost,DNS:kubernetes.default.svc,IP:127.0.0.1,IP:10.0.0.1\n"
        "extendedKeyUsage=serverAuth\n"
    )
    run("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "apiserver.crt", "-days", "7", "-extfile", "apiserver.ext")
    run("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key")
    run("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")


# ---------------------------------------------------------------- child processes

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: rely on stop()/atexit only
    _prctl = None


def _child_setup() -> None:
    # Runs in the child between fork and exec: die with the parent, whatever kills it.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _spawn(argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    # The death signal fires when the *thread* that forked exits, so only ask for it
    # from the main thread (where pytest fixtures and the CLI run).
    in_main = threading.current_thread() is threading.main_thread()
    with open(log, "wb") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_child_setup if in_main else None,
        )


def _stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    # Anything left in its group (it had a session of its own) goes too.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


_WORKDIR_PREFIX = "tpuft-controlplane-"


def _remove_orphaned_workdirs() -> None:
    """Temporary data dirs left by an owner that was SIGKILLed (its children died with it)."""
    for d in Path(tempfile.gettempdir()).glob(_WORKDIR_PREFIX + "*"):
        try:
            owner = int((d / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not _alive(owner):
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
        _write_pki(pki)
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
        etcd_port, peer_port, api_port = _free_ports(3)
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        data = self.workdir / "etcd-data"
        shutil.rmtree(data, ignore_errors=True)
        self.etcd = _spawn(
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
        self.apiserver = _spawn(
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
                "--disable-admission-plugins=ServiceAccount",
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
                    text = _tail(log)
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
            + _tail(self.workdir / "kube-apiserver.log")
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
                _stop_process(proc)

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


# ---------------------------------------------------------------- command line

STATE_FILE = CLUSTER_STATE_DIR / "state.json"  # written by the supervisor
PID_FILE = CLUSTER_STATE_DIR / "supervisor.pid"  # written by `up`, before the supervisor is ready


def _read_state() -> dict | None:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _export_lines(state: dict) -> str:
    return f"export KUBECONFIG={state['kubeconfig']}\nexport PATH={state['bin_dir']}:$PATH"


def _start_stack(workdir: Path):
    """What `up` runs: the whole test ground with the operator (harness/ground.py), or,
    with TPUFT_CLUSTER_KIND=controlplane, only etcd + kube-apiserver with the CRDs."""
    if os.environ.get("TPUFT_CLUSTER_KIND", "ground") == "controlplane":
        cp, _ = start_with_crds(workdir=workdir, out=sys.stdout)
        return cp, cp
    from ground import Ground

    ground = Ground(workdir=workdir, with_operator=True).start()
    print(f"ground: up in {sum(ground.timings.values()):.1f}s {ground.timings}", flush=True)
    return ground, ground.cp


def _serve() -> int:
    """The detached supervisor behind `up`: runs the stack until SIGTERM/SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    workdir = CLUSTER_STATE_DIR / "run"
    shutil.rmtree(workdir, ignore_errors=True)
    try:
        stack, cp = _start_stack(workdir)
    except Exception as e:  # reported to `up` through the state file
        shutil.rmtree(workdir, ignore_errors=True)
        _write_state({"pid": os.getpid(), "error": str(e)})
        return 1
    try:
        _write_state({
            "pid": os.getpid(),
            "ready": True,
            "server": cp.server,
            "kubeconfig": str(cp.kubeconfig),
            "user_kubeconfig": str(cp.user_kubeconfig),
            "bin_dir": str(cp.bin_dir),
            "version": cp.version,
            "pids": stack.pids,
            "kuberay_crd": str(KUBERAY_CRD) if KUBERAY_CRD.is_file() else None,
        })
        while not stop.wait(1.0):
            if not stack.alive():
                print("controlplane: a component exited; stopping", flush=True)
                break
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        try:
            if (_read_state() or {}).get("pid") == os.getpid():
                STATE_FILE.unlink()
        except OSError:
            pass
    return 0


def _write_state(state: dict) -> None:
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(STATE_FILE)  # readers never see half a file


def cmd_up(timeout: float = 240.0) -> int:
    state = _read_state()
    if state and state.get("ready") and _supervisor_pid() == state["pid"]:
        print(_export_lines(state))
        return 0
    if _supervisor_pid() is not None:
        print("controlplane: one is still starting; try again in a moment", file=sys.stderr)
        return 1
    STATE_FILE.unlink(missing_ok=True)
    missing = missing_binaries(default_bin_dir())
    if missing:
        print("controlplane: binaries missing; run `make controlplane` first", file=sys.stderr)
        return 1
    CLUSTER_STATE_DIR.mkdir(parents=True, exist_ok=True)
    log = CLUSTER_STATE_DIR / "supervisor.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "_serve"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=ROOT,
        )
    # Recorded at once, so `down` can stop a supervisor that is still starting.
    PID_FILE.write_text(str(proc.pid))
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = _read_state() or {}
            if state.get("pid") == proc.pid and state.get("ready"):
                if not state.get("kuberay_crd"):
                    print(f"controlplane: KubeRay RayCluster CRD not found at "
                          f"{KUBERAY_CRD_DISPLAY}; not installed", file=sys.stderr)
                print(_export_lines(state))
                return 0
            if state.get("pid") == proc.pid and state.get("error"):
                print(f"controlplane: failed to start: {state['error']}", file=sys.stderr)
                proc.wait(30)
                cmd_down(quiet=True)
                return 1
            if proc.poll() is not None:
                print(f"controlplane: supervisor exited {proc.returncode}:\n{_tail(log)}",
                      file=sys.stderr)
                cmd_down(quiet=True)
                return 1
            time.sleep(0.2)
        print(f"controlplane: not ready within {timeout:.0f}s; see {log}", file=sys.stderr)
    except BaseException:  # Ctrl-C while starting: take the supervisor down too
        cmd_down(quiet=True)
        raise
    cmd_down(quiet=True)
    return 1


def _supervisor_pid() -> int | None:
    """The live supervisor's pid, from its state or, while it starts, from `up`'s pid file."""
    candidates = [(_read_state() or {}).get("pid")]
    try:
        candidates.append(int(PID_FILE.read_text()))
    except (OSError, ValueError):
        pass
    for pid in candidates:
        if isinstance(pid, int) and _alive(pid) and _is_supervisor(pid):
            return pid
    return None


def _is_supervisor(pid: int) -> bool:
    # Guards against a stale pid file naming a pid that the system has since reused.
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"_serve" in argv and any(a.endswith(b"controlplane.py") for a in argv)


def cmd_down(timeout: float = 30.0, quiet: bool = False) -> int:
    say = (lambda *a: None) if quiet else print
    pid = _supervisor_pid()
    if pid is None:
        say("controlplane: not running")
    else:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)  # its children die with it (PDEATHSIG)
        say("controlplane: stopped")
    STATE_FILE.unlink(missing_ok=True)
    PID_FILE.unlink(missing_ok=True)
    return 0


def cmd_status() -> int:
    state = _read_state()
    if state and state.get("ready") and _supervisor_pid() == state["pid"]:
        pids = " ".join(f"{k}={v}" for k, v in state["pids"].items())
        print(f"controlplane: running {state['version']} at {state['server']} "
              f"(supervisor {state['pid']}, {pids})\n{_export_lines(state)}")
        return 0
    print("controlplane: not running")
    return 1


def main(argv: list[str]) -> int:
    commands = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "_serve": _serve}
    if len(argv) != 1 or argv[0] not in commands:
        print(f"usage: {Path(__file__).name} up|down|status", file=sys.stderr)
        return 2
    try:
        return commands[argv[0]]()
    except KeyboardInterrupt:  # whatever was started is already stopped
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
