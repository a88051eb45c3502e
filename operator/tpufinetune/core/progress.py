"""Whether the operator still makes progress on its runs, for its liveness probe, and
which runs have trouble of their own. Pure: the caller passes the time (monotonic seconds).

A run makes progress when its status can be read and written: a step's decision lands
in the object's status only through the driver's one status write, and after a failed
write the next step first reads the status back. A run whose status reads or writes
have failed since some moment, with no successful write after it, is failing.

Two kinds of failure, told apart by the caller from the API server's answer:
- the run's own: the API server answered and refused this object's write (an admission
  policy or webhook, a value it rejects, a 403 on this namespace). A restart would change
  nothing and would reset every other run's clocks, so it never fails /healthz; the run
  shows it by a `StatusWriteFailing` Event and the `tpufinetune_status_write_failing_seconds`
  gauge (cause `run`).
- the operator's: no answer, a timeout, a 5xx, its own credentials refused (401), or
  throttling. Failing longer than the bound (TPUFT_STALL_TIMEOUT), with no status read or
  written by any run within the bound, the operator as a whole makes no progress: the
  probe makes /healthz fail so that Kubernetes restarts it (a fresh process, a fresh
  connection, every object read again).

A condition cannot be written while the status write itself fails. So the run's trouble is
shown as it happens by the Event and the gauge, and in the status once a write lands again:
that write carries condition StatusWritable (True, reason WritesFailed) saying for how long
writes failed and the last error (`recovered`).

Other failed steps (Ray unreachable, a retry waiting for workers) do not count here: they
have their own bounds in the run's state machine, which a restart would only reset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from tpufinetune.core import conditions as cond

RunKey = tuple[str, str, str]  # (namespace, name, uid)


@dataclass
class Failing:
    since: float
    error: str
    own: bool = False
    """The run's own trouble (the API server refused this object), not the operator's."""


@dataclass
class ProgressTracker:
    failing: dict[RunKey, Failing] = field(default_factory=dict)
    last_reached: float | None = None
    """When a status read or write of any run last got the API server's acceptance."""

    def reached(self, now: float) -> None:
        """A status read or write of some run succeeded: the API server serves the operator."""
        self.last_reached = now if self.last_reached is None else max(self.last_reached, now)

    def written(self, run: RunKey) -> None:
        """The run's status was written (or had nothing to change): it makes progress."""
        self.failing.pop(run, None)

    def failed(self, run: RunKey, now: float, error: str, own: bool = False) -> bool:
        """A status read or write of the run failed; the clock starts at the first one.
        True when this failure starts the run's trouble (the caller says so once)."""
        current = self.failing.get(run)
        self.failing[run] = Failing(since=current.since if current else now, error=error, own=own)
        return current is None

    def forget(self, run: RunKey) -> None:
        """The run is no longer driven (finished and released, or its object is gone)."""
        self.failing.pop(run, None)

    def stalled(self, now: float, bound: float) -> list[str]:
        """One line per run whose status reads or writes have failed for the operator's
        reasons for longer than `bound` seconds with no successful write since, while no
        run's status was read or written within `bound`; empty when the operator as a whole
        makes progress (a run refused for its own reasons is that run's trouble)."""
        if self.last_reached is not None and now - self.last_reached <= bound:
            return []
        return [f"{namespace}/{name}: no status write for {now - f.since:.0f} s (bound {bound:g} s); "
                f"last error: {f.error}"
                for (namespace, name, _), f in sorted(self.failing.items())
                if not f.own and now - f.since > bound]


def recovered(status: dict, failing: Failing, now: datetime, now_monotonic: float) -> None:
    """The status about to be written after its writes failed: it says so in condition
    StatusWritable, with when the failures began (on the wall clock) and the last error."""
    seconds = max(0.0, now_monotonic - failing.since)
    since = cond.timestamp(now - timedelta(seconds=seconds))
    whose = "refused this object" if failing.own else "did not serve the operator"
    cond.set_condition(status, cond.STATUS_WRITABLE, True, "WritesFailed",
                       f"status writes failed for {seconds:.0f} s from {since} until {cond.timestamp(now)} "
                       f"(the API server {whose}); last error: {failing.error}",
                       now, status.get("observedGeneration"))
