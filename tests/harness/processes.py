"""Child processes of the harness: spawning a binary in a process group
of its own that dies with its parent, stopping it with its whole group, and asking whether a
pid is alive (psutil: a zombie is not alive)."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil


_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: rely on stop()/atexit only
    _prctl = None


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: die with the parent, whatever kills it.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
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
            preexec_fn=_die_with_parent if in_main else None,
        )


def wait_answering(proc: subprocess.Popen, answers, what: str, log: Path, timeout: float,
                   interval: float = 0.1, error: type[Exception] = RuntimeError) -> None:
    """Return once `answers()` is true for a server just spawned; `error` with the tail of
    its log if it exits first, or (after stopping it) if `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not answers():
        if proc.poll() is not None:
            raise error(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        if time.monotonic() > deadline:
            stop_process(proc)
            raise error(f"{what} did not answer within {timeout:.0f}s:\n{tail(log)}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
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


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def command_line(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def in_private_mount_namespace(mount: str, path: Path, argv: list[str]) -> list[str]:
    """argv run in a mount namespace of its own, after the shell command `mount` (which
    reads `path` as $1) has changed what this one process sees; nothing else on the
    machine sees it. As root, a plain mount namespace; otherwise a user namespace maps us
    to root in it. `path` and argv travel as positional parameters, never inside the script."""
    namespace = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        namespace.insert(1, "--map-root-user")
    return [*namespace, "--", "sh", "-c", f"{mount} && shift && exec \"$@\"", "sh", str(path), *argv]
