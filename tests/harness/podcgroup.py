"""Cgroups for the ground's pods, as a kubelet makes them: one per pod, one per container
below it, in the memory hierarchy (v1, the container's `limits.memory`) and its twin in the
CPU hierarchy (`cpu.shares` from the CPU requests: podspec.pod_cpu_shares and
container_cpu_shares). A cgroup is named by its memory path; `cpu_cgroup` gives its twin,
created and removed with it.

They live below the cgroup of the process that starts the ground (the agent inherits it), in
`tpuft-<ground id>/`, so the ground's processes are found exactly (`cgroup.procs`), killed
exactly, and counted against whatever limits the machine already puts on that process.

The ground's own cgroup is the kubelet's `kubepods`: its twin weighs what a node of this
machine's CPUs allots its pods (`node_cpu_shares`), so the pods together neither starve nor
are starved by the ground's other processes (the control plane, the operator) that run
beside it. The memory cgroup is joined by the container's runtime (podsandbox.py); the CPU
one before it, by `CpuJoin` in the child between fork and exec.
Cgroup v1's `cpu` controller (mounted alone or as `cpu,cpuacct`) is used where it exists;
else cgroup v2's `cpu.weight` where the unified hierarchy offers `cpu` (the kubelet's
CpuSharesToCPUWeight); with neither, pods run without CPU weights (a warning).

An OOM kill in a container's cgroup shows in its `memory.oom_control` counter `oom_kill`.
Cgroup v1 kills one process; Kubernetes on cgroup v2 (memory.oom.group) kills the whole
container, so the agent kills the rest of the group when the counter moves (`oom_killed`).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")

log = logging.getLogger("podcgroup")


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


# ---- CPU -----------------------------------------------------------------------------------


def shares_to_weight(shares: int) -> int:
    """The kubelet's CpuSharesToCPUWeight (cgroup v2's cpu.weight, 1..10000)."""
    return 1 + ((shares - 2) * 9999) // 262142


def node_cpu_shares() -> int:
    """The kubelet's `kubepods` cpu.shares for a node of this machine's CPUs
    (MilliCPUToShares of its capacity)."""
    return min(262144, (os.cpu_count() or 1) * 1024)


@dataclass(frozen=True)
class CpuHierarchy:
    own: Path  # this process's cgroup in it: the ground's cgroups go below
    weight_file: str  # cpu.shares (v1) or cpu.weight (v2)


def _mounts() -> list[tuple[Path, str, set[str]]]:
    """(mount point, fstype, super options) of every cgroup mount."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fstype, _, options = (after.split() + ["", "", ""])[:3]
        if fstype in ("cgroup", "cgroup2"):
            found.append((Path(before.split()[4]), fstype, set(options.split(","))))
    return found


@functools.cache
def cpu_hierarchy() -> CpuHierarchy | None:
    """Where this process's CPU cgroup is (v1 `cpu`, else v2 with `cpu` enabled), or None."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        own["v2" if hierarchy == "0" else controllers] = path.lstrip("/")
    for mount, fstype, options in _mounts():
        if fstype == "cgroup" and "cpu" in options:
            path = next((p for c, p in own.items() if "cpu" in c.split(",")), None)
            if path is not None and (mount / path / "cpu.shares").exists():
                return CpuHierarchy(mount / path, "cpu.shares")
    for mount, fstype, _ in _mounts():
        if fstype == "cgroup2" and "v2" in own:
            parent = mount / own["v2"]
            try:
                if "cpu" in (parent / "cgroup.subtree_control").read_text().split():
                    return CpuHierarchy(parent, "cpu.weight")
            except OSError:
                pass
    log.warning("no CPU cgroup controller (cgroup v1 cpu, or cgroup v2 with cpu in this process's "
                "cgroup.subtree_control): pods run without CPU shares")
    return None


def cpu_cgroup(cgroup: Path) -> Path | None:
    """The CPU twin of a memory cgroup below this process's (None without a CPU controller)."""
    cpu = cpu_hierarchy()
    return None if cpu is None else cpu.own / cgroup.relative_to(own_memory_cgroup())


def cpu_shares(cgroup: Path) -> int | None:
    """The cpu.shares of a cgroup's twin as written (cpu.weight read back as it was set:
    None there, since the conversion is not invertible)."""
    cpu, twin = cpu_hierarchy(), cpu_cgroup(cgroup)
    if cpu is None or cpu.weight_file != "cpu.shares":
        return None
    return read_number(twin / "cpu.shares")


class CpuJoin:
    """A subprocess preexec_fn that moves the child into a cgroup's CPU twin between fork
    and exec, so everything it starts stays there (a no-op without a CPU controller). The
    file is opened here, in the parent: the child only writes. A context manager: closed
    once the child has started."""

    def __init__(self, cgroup: Path):
        twin = cpu_cgroup(cgroup)
        self.fd = None if twin is None else os.open(twin / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    def __call__(self) -> None:
        if self.fd is not None:
            os.write(self.fd, b"0")  # 0: the writing process (the child)

    def __enter__(self) -> CpuJoin:
        return self

    def __exit__(self, *_) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def procs(cgroup: Path) -> list[int]:
    """Every pid in the cgroup and the cgroups below it ([] when it does not exist)."""
    found: list[int] = []
    for directory, _, _ in os.walk(cgroup):
        try:
            found += [int(p) for p in Path(directory, "cgroup.procs").read_text().split()]
        except OSError:
            continue
    return found


def create(cgroup: Path, limit_bytes: int | None = None, shares: int | None = None) -> Path:
    """The memory cgroup (with its limit) and its CPU twin (with its shares)."""
    cgroup.mkdir(parents=True, exist_ok=True)
    if limit_bytes is not None:
        (cgroup / "memory.limit_in_bytes").write_text(str(limit_bytes))
    cpu, twin = cpu_hierarchy(), cpu_cgroup(cgroup)
    if twin is not None:
        twin.mkdir(parents=True, exist_ok=True)
        if cpu.weight_file == "cpu.weight" and twin.parent != cpu.own:
            try:  # v2: a child has cpu.weight only where its parent hands the controller down
                (twin.parent / "cgroup.subtree_control").write_text("+cpu")
            except OSError as error:
                log.warning("enabling cpu in %s: %s", twin.parent, error)
        if shares is not None:
            value = shares if cpu.weight_file == "cpu.shares" else shares_to_weight(shares)
            (twin / cpu.weight_file).write_text(str(value))
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
    """Kill what is left, then remove the cgroup and those below it, deepest first, and
    its CPU twin."""
    if cgroup.exists():
        kill_all(cgroup)
        _rmdirs(cgroup)
    twin = cpu_cgroup(cgroup)
    if twin is not None and twin.exists():
        _rmdirs(twin)


def _rmdirs(cgroup: Path) -> None:
    for directory, _, _ in sorted(os.walk(cgroup), key=lambda entry: -len(entry[0])):
        for _ in range(50):  # a killed process leaves its cgroup a moment after it dies
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
