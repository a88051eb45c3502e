"""Memory cgroups (v1) for the ground's pods, as a kubelet makes them: one per pod, one per
container below it with the container's `limits.memory`.

They live below the cgroup of the process that starts the ground (the agent inherits it), in
`tpuft-<ground id>/`, so the ground's processes are found exactly (`cgroup.procs`), killed
exactly, and counted against whatever limits the machine already puts on that process.

An OOM kill in a container's cgroup shows in its `memory.oom_control` counter `oom_kill`.
Cgroup v1 kills one process; Kubernetes on cgroup v2 (memory.oom.group) kills the whole
container, so the agent kills the rest of the group when the counter moves (`oom_killed`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")


class CgroupError(RuntimeError):
    pass


def own_memory_cgroup() -> Path:
    """This process's memory cgroup directory."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return MEMORY_ROOT / path.lstrip("/")
    raise CgroupError("no cgroup v1 memory controller (/sys/fs/cgroup/memory): the ground's "
                      "pods need it for their memory limits")


def ground_cgroup(ground_id: str) -> Path:
    return own_memory_cgroup() / f"tpuft-{ground_id}"


def procs(cgroup: Path) -> list[int]:
    """Every pid in the cgroup and the cgroups below it ([] when it does not exist)."""
    found: list[int] = []
    for directory, _, _ in os.walk(cgroup):
        try:
            found += [int(p) for p in Path(directory, "cgroup.procs").read_text().split()]
        except OSError:
            continue
    return found


def create(cgroup: Path, limit_bytes: int | None = None) -> Path:
    cgroup.mkdir(parents=True, exist_ok=True)
    if limit_bytes is not None:
        (cgroup / "memory.limit_in_bytes").write_text(str(limit_bytes))
    return cgroup


def read_number(path: Path) -> int:
    """An integer cgroup file (memory.usage_in_bytes ...); 0 when it is gone."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def oom_kills(cgroup: Path) -> int:
    try:
        for line in (cgroup / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except OSError:
        pass
    return 0


def signal_all(cgroup: Path, sig: int) -> int:
    pids = procs(cgroup)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return len(pids)


def kill_all(cgroup: Path) -> None:
    """SIGKILL until the cgroup (and those below) hold no process: one that forks while
    being killed is caught on the next pass."""
    deadline = time.monotonic() + 10
    while signal_all(cgroup, signal.SIGKILL) and time.monotonic() < deadline:
        time.sleep(0.05)


def remove(cgroup: Path) -> None:
    """Kill what is left, then remove the cgroup and those below it, deepest first."""
    if not cgroup.exists():
        return
    kill_all(cgroup)
    for directory, _, _ in sorted(os.walk(cgroup), key=lambda entry: -len(entry[0])):
        for _ in range(50):  # a killed process leaves its cgroup a moment after it dies
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
