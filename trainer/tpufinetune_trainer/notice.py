"""Checkpoint on notice: a SIGTERM (the pod is going away) or a request (the node has
maintenance scheduled) makes every rank save a step checkpoint together.

How a notice reaches the training loop:
- SIGTERM. Ray Train runs the training function in a thread of the worker actor, and
  Python runs signal handlers on a process's main thread only, so the handler is installed
  there before training starts (the backend's `on_start` runs `install_sigterm_handler` on
  every worker, as an actor call: the actor's main thread). It replaces Ray's own handler
  (which exits at once) and only records the notice; a second SIGTERM gets Ray's handler.
  On GKE the kubelet signals only the container's first process (`ray start`): the Ray
  pods' preStop hook (`tpufinetune.core.podtemplate`) sends SIGTERM to the Ray workers of
  its pod first and waits, within the grace period, until they have exited.
- A request. `tpufinetune-train checkpoint-now` (a short Ray job the operator submits
  through the head's Job API when a node of the run gets GKE's
  `cloud.google.com/scheduled-maintenance-time` label) puts a key in Ray's internal KV
  store; rank 0 reads it at most once per `POLL_S`.

Ranks agree on a notice with one all_reduce (MAX) on the CPU (gloo) group, so a notice seen
by any rank makes all ranks save after the same step. That all_reduce locks every host
together, so it is not made after every step: each agreement also fixes the step of the
next one (`Agreements`), about AGREE_EVERY_S of steps later as rank 0 measures them. A
notice then waits at most that long plus a step; a step of 50 ms (a slice dispatch-bound
at a few hundred tokens a chip) agrees once every 20 steps instead of every step. Steps are
timed as the device completes them, not as the host dispatches them: on an asynchronous
device the host runs ahead (about 10 ms a step), and timing its dispatch would put the next
agreement 100 steps of 100 ms away, past a Spot notice's 30 s. So each agreement leaves a
value its step produced on the device, and the next one reads it (waiting, if the device is
behind, which also keeps the host at most one interval ahead). The background
checkpoint's completion is agreed in the same all_reduce (train.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

NONE, REQUESTED, TERMINATING = 0, 1, 2
REASONS = {REQUESTED: "Requested", TERMINATING: "SIGTERM"}
KV_NAMESPACE = "tpufinetune"
POLL_S = 1.0
# Seconds of steps between two agreements at most (once at least one step has been timed).
AGREE_EVERY_S = 1.0
# Where a worker announces itself to its pod's preStop hook: the directory (per pod, from
# the pod's environment) holds one file per worker pid, removed once that worker has saved
# on notice (or has finished); the hook signals those pids and waits for the files. Each
# file holds its process's start time, so that the hook never signals a later process that
# was given the pid of a worker that died without removing its file.
NOTICE_DIR_ENV = "TPUFT_NOTICE_DIR"

_lock = threading.Lock()
_state = {"code": NONE, "at": 0.0}
_previous_handler = None


def request_key(run_name: str) -> str:
    return f"checkpoint-request/{run_name}"


def _on_sigterm(signum, frame) -> None:
    with _lock:
        again = _state["code"] == TERMINATING
        _state.update(code=TERMINATING, at=_state["at"] or time.time())
    if again and callable(_previous_handler):
        _previous_handler(signum, frame)


def install_sigterm_handler() -> bool:
    """Record SIGTERM instead of exiting; call on the process's main thread (a Ray actor
    call). Returns whether it was installed."""
    global _previous_handler
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    if previous is not _on_sigterm:
        _previous_handler = previous
    _announce(True)
    return True


def _pid_file() -> str | None:
    directory = os.environ.get(NOTICE_DIR_ENV)
    return os.path.join(directory, str(os.getpid())) if directory else None


def start_time(pid: int | str = "self") -> str:
    """A process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat, read
    after the command name, which may hold spaces); empty where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _announce(present: bool) -> None:
    path = _pid_file()
    if path is None:
        return
    try:
        if present:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as announced:
                announced.write(start_time())
        else:
            os.remove(path)
    except OSError:
        pass


def done() -> None:
    """This worker has saved on notice, or has nothing left to save: its pod's preStop hook
    may let the pod go."""
    _announce(False)


def received() -> int:
    """This process's own notice (NONE or TERMINATING)."""
    with _lock:
        return _state["code"]


def reset() -> None:
    """Forget a notice (tests; a restarted worker group is a new process anyway)."""
    with _lock:
        _state.update(code=NONE, at=0.0)


class NoticeWatch:
    """What all ranks agree on after each step. `read_request` (rank 0 only) returns a
    pending request's JSON text or None; `clear_request` removes it once served."""

    def __init__(self, rank: int, read_request=None, clear_request=None, poll_s: float = POLL_S):
        self.rank = rank
        self.read_request, self.clear_request = read_request, clear_request
        self.poll_s = poll_s
        self._next_poll = 0.0
        self.request: dict | None = None  # the request being served

    def _local(self) -> int:
        code = received()
        if self.rank == 0 and self.read_request is not None and code == NONE and self.request is None:
            now = time.monotonic()
            if now >= self._next_poll:
                self._next_poll = now + self.poll_s
                text = self.read_request()
                if text:
                    try:
                        self.request = json.loads(text)
                    except ValueError:
                        self.request = {"reason": "Requested"}
        if self.request is not None:
            code = max(code, REQUESTED)
        return code

    def agreed(self, group, *flags: int) -> tuple[int, ...]:
        """Collective: the strongest notice any rank holds, then each of `flags` (whole
        numbers, at least 0) at its largest over the ranks, in one all_reduce."""
        import torch
        import torch.distributed as dist

        values = torch.tensor([self._local(), *flags], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        return tuple(int(v) for v in values.tolist())

    def served(self) -> dict:
        """The request just served (rank 0), removed from the store so it is served once."""
        request, self.request = self.request or {}, None
        if self.rank == 0 and self.clear_request is not None:
            self.clear_request()
        return request


class Agreements:
    """When the ranks next agree (the notice, the background save): after a step every
    rank knows in advance, since every agreement carries the next one's distance, proposed
    by rank 0 (the others propose 0 and the all_reduce takes the largest). The first
    agreement comes after the first step; each later one about `every_s` of steps on, as
    rank 0 timed the steps the device completed, at least one step on.

    Completed steps: an agreement is handed a value its step produced on the device
    (`agreed(..., produced)`, the trainer's step counter), and the next agreement's proposal
    reads it (`item()`, which returns once the device has produced it): the time it returns
    is when that step was complete, or later. The rate is the steps between two such reads
    over the time between them. Without a value (a host that is its own device, the CPU),
    a step is complete when the proposal is made."""

    def __init__(self, rank: int, every_s: float = AGREE_EVERY_S, clock=time.monotonic):
        self.rank, self.every_s, self.clock = rank, every_s, clock
        self.next_step = 0  # the global step after which the next agreement comes
        self._produced = None  # (step, a device value that step produced) left by the last agreement
        self._done: tuple[int, float] | None = None  # (step, time) a step was last seen complete

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def _completed(self, step: int) -> tuple[int, float]:
        """(a step known complete, when it was seen so): the last agreement's step once its
        device value is read, else (synchronous) this one's."""
        if self._produced is None:
            return step, self.clock()
        done, value = self._produced
        self._produced = None
        value.item()  # waits until the device has produced it
        return done, self.clock()

    def proposal(self, step: int) -> int:
        """This rank's proposal of steps to the next agreement (rank 0's decides)."""
        if self.rank != 0:
            return 0
        done, now = self._completed(step)
        last, self._done = self._done, (done, now)
        if last is None or done <= last[0]:
            return 1
        per_step = (now - last[1]) / (done - last[0])
        return max(1, int(self.every_s / per_step)) if per_step > 0 else 1

    def soon(self, step: int) -> None:
        """Every rank: the next agreement after the step following `step` at the latest
        (after an epoch's end, whose evaluation and save the steps' rate does not count)."""
        self.next_step = min(self.next_step, step + 1)

    def agreed(self, step: int, steps_to_next: int, produced=None) -> None:
        """Every rank: the agreement after `step` fixed the next one's distance. `produced`:
        a device value step `step` produced (rank 0 keeps a copy for the next proposal)."""
        self.next_step = step + max(1, steps_to_next)
        if self.rank == 0 and produced is not None:
            self._produced = (step, produced.clone())


def ray_kv_watch(rank: int, run_name: str) -> NoticeWatch:
    """A watch that reads requests from the Ray cluster's internal KV store."""
    from ray.experimental import internal_kv

    key = request_key(run_name)

    def read() -> str | None:
        value = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        return value.decode() if value else None

    def clear() -> None:
        internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)

    return NoticeWatch(rank, read, clear)


def put_request(run_name: str, reason: str, detail: str = "") -> dict:
    """Ask the running trainer of `run_name` for a checkpoint now (a driver connected to
    the cluster: `tpufinetune-train checkpoint-now`)."""
    from ray.experimental import internal_kv

    request = {"reason": reason, "detail": detail, "at": time.time()}
    internal_kv._internal_kv_put(request_key(run_name), json.dumps(request), overwrite=True,
                                 namespace=KV_NAMESPACE)
    return request
