"""A real local Ray head for tests and manual work, isolated from any other Ray here.

    python tests/harness/rayhead.py up     # start in the background, print the lines to paste
    python tests/harness/rayhead.py down   # stop exactly what `up` started

The head runs `ray start --head --block` from this project's virtualenv, on loopback,
with its own free ports, its own temp dir and its own session, so job drivers run the
venv's Python (and `tpufinetune-train`), and stopping it never touches another Ray on
the machine (no `ray stop`).

Token authentication: the head is started with RAY_AUTH_MODE=token and a fresh
RAY_AUTH_TOKEN in its environment (the variable wins over RAY_AUTH_TOKEN_PATH and
~/.ray/auth_token, so nothing is written to or read from the home directory). Every Ray
process the head spawns, job drivers included, inherits both. Clients need the same
two variables (`RayHead.env()`), or, over HTTP, `Authorization: Bearer <token>`
(`RayHead.headers()`), which is what JobSubmissionClient sends when given `headers=`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from ports import free_port  # noqa: E402
from processes import alive  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
STATE_FILE = REPO / ".cache" / "rayhead" / "state.json"


@dataclass
class RayHead:
    gcs_address: str = ""
    dashboard_url: str = ""
    token: str | None = None
    temp_dir: str = ""
    pid: int = 0
    started_at: float = 0.0  # the head process's start time: its pid alone may be reused
    log_path: str = ""
    owns_temp_dir: bool = True
    ports: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ client side
    def env(self, base: dict | None = None) -> dict:
        """Environment for a client process (or a `tpufinetune-train` run) against this head."""
        env = dict(os.environ if base is None else base)
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        env["RAY_ADDRESS"] = self.gcs_address
        env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        if self.token:
            env["RAY_AUTH_MODE"] = "token"
            env["RAY_AUTH_TOKEN"] = self.token
        else:
            env["RAY_AUTH_MODE"] = "disabled"
            env.pop("RAY_AUTH_TOKEN", None)
        return env

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def job_client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard_url, headers=self.headers())

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, num_cpus: int = 4, auth: bool = True, temp_dir: str | None = None,
              object_store_bytes: int = 400 * 1024 * 1024, timeout_s: float = 180.0,
              attempts: int = 3) -> "RayHead":
        """Start a head; retried with fresh ports when Ray gives up during startup (it
        allows its raylet only 30 s to register, which a loaded machine can miss)."""
        for attempt in range(1, attempts + 1):
            try:
                return cls._start_once(num_cpus, auth, temp_dir, object_store_bytes, timeout_s)
            except (RuntimeError, TimeoutError):
                if attempt == attempts:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(cls, num_cpus: int, auth: bool, temp_dir: str | None, object_store_bytes: int,
                    timeout_s: float) -> "RayHead":
        owns = temp_dir is None
        # Ray's socket paths must stay under 107 bytes: keep the temp dir short.
        temp_dir = temp_dir or tempfile.mkdtemp(prefix="rh-", dir="/tmp")
        names = ["gcs", "dashboard", "agent_http", "agent_grpc", "runtime_env", "metrics", "node_manager",
                 "object_manager", "client"]
        ports = {name: free_port() for name in names}
        head = cls(gcs_address=f"127.0.0.1:{ports['gcs']}", dashboard_url=f"http://127.0.0.1:{ports['dashboard']}",
                   token=secrets.token_hex(32) if auth else None, temp_dir=temp_dir,
                   log_path=os.path.join(temp_dir, "ray-start.log"), owns_temp_dir=owns, ports=ports)
        cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
               "--node-ip-address=127.0.0.1", f"--port={ports['gcs']}",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
               f"--dashboard-agent-listen-port={ports['agent_http']}",
               f"--dashboard-agent-grpc-port={ports['agent_grpc']}",
               f"--runtime-env-agent-port={ports['runtime_env']}", f"--metrics-export-port={ports['metrics']}",
               f"--node-manager-port={ports['node_manager']}", f"--object-manager-port={ports['object_manager']}",
               f"--ray-client-server-port={ports['client']}",
               f"--num-cpus={num_cpus}", "--num-gpus=0", f"--object-store-memory={object_store_bytes}",
               f"--temp-dir={temp_dir}"]
        # RAY_ADDRESS in the head's own environment is inherited by every Ray process it
        # spawns: Ray-internal "auto" lookups (Ray Train's placement-group cleaner, for
        # one) then find this head instead of failing on "multiple active Ray instances"
        # when others run Ray on the same machine. `ray start --head` itself ignores it.
        env = head.env()
        with open(head.log_path, "ab") as log:
            # Own session: the whole tree is one process group we can signal, and a
            # Ctrl-C in the terminal that ran `up` does not reach it.
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO))
        head.pid = proc.pid
        head.started_at = _start_time(proc.pid)
        try:
            head._wait_ready(proc, timeout_s)
        except BaseException:
            head.stop()
            raise
        return head

    def _wait_ready(self, proc: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {proc.returncode}; log:\n{self.log_tail()}")
            # `ray start` prints this once the node has registered; before that the
            # dashboard may answer while the start still fails.
            started = "Ray runtime started." in self.log_tail(1 << 20)
            if started and self._dashboard_answers("/api/version") and self._dashboard_answers("/api/jobs/"):
                return
            time.sleep(0.5)
        raise TimeoutError(f"Ray head not ready after {timeout_s:.0f}s; log:\n{self.log_tail()}")

    def _dashboard_answers(self, path: str) -> bool:
        request = urllib.request.Request(self.dashboard_url + path, headers=self.headers())
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 8.0) -> None:
        """Stop the head's process group, then any process still tied to this head
        (job drivers run in sessions of their own). Nothing else is touched."""
        if self.pid and not _reused(self.pid, self.started_at):
            _signal_group(self.pid, signal.SIGTERM)
            if not _wait_gone(lambda: _group_alive(self.pid), grace_s):
                _signal_group(self.pid, signal.SIGKILL)
                _wait_gone(lambda: _group_alive(self.pid), 5)
            self.pid = 0  # stopped: a second stop (the session's, after an early one) signals nothing
        strays = self._stray_pids()
        for pid in strays:
            _kill(pid, signal.SIGTERM)
        if strays and not _wait_gone(lambda: any(alive(p) for p in strays), 5):
            for pid in strays:
                _kill(pid, signal.SIGKILL)
        if self.owns_temp_dir and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _stray_pids(self) -> list[int]:
        """Processes whose command line names our temp dir, or whose RAY_ADDRESS points
        at our GCS port."""
        marks = [str(self.temp_dir)] if self.temp_dir else []
        # Ray hands drivers the node's own IP, not 127.0.0.1: match on the GCS port.
        port = ":" + self.gcs_address.rsplit(":", 1)[-1]
        found = []
        for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
            if proc.pid == os.getpid():
                continue
            environ = proc.info["environ"] or {}
            cmdline = " ".join(proc.info["cmdline"] or ())
            ours = environ.get("RAY_ADDRESS", "").endswith(port)
            if ours or any(m in cmdline for m in marks):
                found.append(proc.pid)
        return found

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _start_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def _reused(pid: int, started_at: float) -> bool:
    """Is `pid` now another process? With pid_max at 32768 a busy machine wraps its pids in
    minutes, and a pod's processes on the ground share this pid namespace: a head that died
    early (reaped by the subprocess module) leaves its number to the next process group
    leader, which a blind killpg would take down. While any process of the head's group is
    left, the kernel does not hand its number out again."""
    now = _start_time(pid)
    return bool(now and started_at and now != started_at)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the group? Zombies answer killpg(0) too."""
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(still_there, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not still_there():
            return True
        time.sleep(0.2)
    return not still_there()


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else ""
    if command == "up":
        if STATE_FILE.exists():
            print(f"already up (state in {STATE_FILE.relative_to(REPO)}); run `down` first", file=sys.stderr)
            return 1
        num_cpus = int(os.environ.get("RAYHEAD_NUM_CPUS", "4"))
        head = RayHead.start(num_cpus=num_cpus)
        STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
        STATE_FILE.write_text(head.to_json())
        os.chmod(STATE_FILE, 0o600)  # it holds the token
        print(f"export RAY_ADDRESS={head.gcs_address}")
        print(f"export RAY_DASHBOARD_URL={head.dashboard_url}")
        print("export RAY_AUTH_MODE=token")
        print(f"export RAY_AUTH_TOKEN={head.token}")
        return 0
    if command == "down":
        if not STATE_FILE.exists():
            print("not up", file=sys.stderr)
            return 0
        head = RayHead(**json.loads(STATE_FILE.read_text()))
        head.stop()
        STATE_FILE.unlink()
        print("Ray head stopped")
        return 0
    print("usage: rayhead.py up|down", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
