"""The ground's container runtime init: what runc does between a kubelet's "start this
container" and the container's first instruction, for one process tree on this machine.

    python -I podsandbox.py SPEC.json      (the container's environment is this process's)

SPEC: {"cgroup": DIR or null, "mounts": [{"source", "target", "readOnly"}],
"cwd": DIR, "argv": [...]}. In order: join the pod's cgroup (every descendant stays in it),
enter a mount namespace of its own (nothing it mounts is seen outside), bind every mount,
change to the working directory and exec argv. Only the standard library: it runs before
anything of the pod's.

Every source is opened before the first mount, and bound from its descriptor: a mount on
/tmp or /dev/shm would otherwise hide the sources that live below them (the ground's pod
directories, a PV's host directory). A mount point that does not exist is created (a
directory, or an empty file for a file source) where the target path leads at that moment:
on this machine's filesystem, or inside a mount made earlier (a path under /tmp lands in the
pod's own /tmp).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 1 << 14, 1 << 18
START_ERROR = 128  # what a kubelet reports for a container its runtime could not start


def mount_order(mounts: list[dict]) -> list[dict]:
    """Parents before children (/tmp before /tmp/data), otherwise as given."""
    return sorted(mounts, key=lambda m: len(os.path.normpath(m["target"]).split("/")))


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(libc, source: str | None, target: str, flags: int) -> None:
    _check(libc.mount(source.encode() if source else None, target.encode(), None,
                      ctypes.c_ulong(flags), None), f"mount {target}")


def enter(spec: dict) -> None:
    if spec.get("cgroup"):
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(libc, None, "/", MS_REC | MS_PRIVATE)  # nothing propagates back to the host
    mounts = mount_order(spec.get("mounts") or [])
    sources = [os.open(m["source"], os.O_PATH) for m in mounts]
    for m, fd in zip(mounts, sources):
        target = m["target"]
        if not os.path.lexists(target):
            os.makedirs(os.path.dirname(target) or "/", exist_ok=True)
            if not os.path.isdir(f"/proc/self/fd/{fd}"):  # a file (a subPath of a key) on a file
                open(target, "a").close()
            else:
                os.makedirs(target, exist_ok=True)  # two pods may create one host path at once
        _mount(libc, f"/proc/self/fd/{fd}", target, MS_BIND | MS_REC)
        if m.get("readOnly"):
            _mount(libc, None, target, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_REC)
        os.close(fd)
    os.makedirs(spec["cwd"], exist_ok=True)
    os.chdir(spec["cwd"])


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        enter(spec)
    except OSError as error:
        print(f"container start failed: {error}", file=sys.stderr, flush=True)
        return START_ERROR
    command = spec["argv"]
    try:
        os.execvp(command[0], command)
    except OSError as error:
        print(f'exec: "{command[0]}": {error.strerror}', file=sys.stderr, flush=True)
        return START_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
