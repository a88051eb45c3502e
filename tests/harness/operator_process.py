"""The operator as a subprocess (`python -m tpufinetune.cli operator`), for the
end-to-end tests and `make demo`: started with a liveness endpoint it waits on, killed
like a crash, or stopped cleanly. An exit nobody asked for (the operator gives up a Lease
it could not renew, or dies) is followed by a restart, as the kubelet restarts the
Deployment's container (restartPolicy Always): without it, a leader that stepped down
under load would leave every later test of the session without an operator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from ports import free_port  # noqa: E402
from processes import in_private_mount_namespace  # noqa: E402


# The kubelet's first restart of a crashed container comes after a 10 s back-off; the
# ground's is shorter, the suite's waits being what they are.
RESTART_BACKOFF_S = 2


def private_hosts_argv(hosts_file: Path, argv: list[str]) -> list[str]:
    """argv where `hosts_file` is /etc/hosts: the ground's cluster DNS for this one process."""
    return in_private_mount_namespace('mount --bind "$1" /etc/hosts', hosts_file, argv)


class OperatorProcess:
    def __init__(self, env: dict, log_path: Path, hosts_file: Path | None = None):
        self.env = env
        self.log_path = log_path
        self.hosts_file = hosts_file
        self.proc: subprocess.Popen | None = None
        self.port = free_port()
        self.restarts = 0  # exits nobody asked for, each followed by a restart
        self._lock = threading.RLock()
        self._deliberate = False  # kill() or stop() asked for the exit
        self._watcher: threading.Thread | None = None

    def start(self, timeout: float = 60) -> None:
        with self._lock:
            self._deliberate = False
            self._start(timeout)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._restart_on_exit, name="operator-restarter", daemon=True)
            self._watcher.start()

    def _restart_on_exit(self, backoff: float = RESTART_BACKOFF_S) -> None:
        while True:
            time.sleep(1)
            with self._lock:
                if self._deliberate or self.proc is None or self.proc.poll() is None:
                    continue
                code = self.proc.returncode
                with open(self.log_path, "a") as log:
                    log.write(f"[harness] the operator exited with {code}, unasked: restarted in {backoff:g} s, "
                              "as the kubelet restarts its container\n")
                time.sleep(backoff)
                self.restarts += 1
                try:
                    self._start()
                except RuntimeError as error:  # shown in its log; tried again on the next round
                    with open(self.log_path, "a") as log:
                        log.write(f"[harness] restart failed: {error}\n")

    def _start(self, timeout: float = 60) -> None:
        argv = [sys.executable, "-m", "tpufinetune.cli", "operator",
                "--liveness", f"http://127.0.0.1:{self.port}/healthz"]
        if self.hosts_file is not None:
            argv = private_hosts_argv(self.hosts_file, argv)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"operator not live after {timeout}s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to clean up (and no restart: the test asked)."""
        with self._lock:
            self._deliberate = True
            if self.proc and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def stop(self) -> None:
        with self._lock:
            self._deliberate = True
            if self.proc and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    self.kill()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
