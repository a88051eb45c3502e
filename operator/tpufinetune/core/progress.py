"""Whether the operator still makes progress on its runs, for its liveness probe. Pure:
the caller passes the time (monotonic seconds).

A run makes progress when its status can be read and written: a step's decision lands
in the object's status only through the driver's one status write, and after a failed
write the next step first reads the status back. A run whose status reads or writes
have failed since some moment, with no successful write after it, is failing; failing
longer than the bound (TPUFT_STALL_TIMEOUT) it is stalled, and the probe makes /healthz
fail so that Kubernetes restarts the operator (a fresh process re-reads every object).

Other failed steps (Ray unreachable, a retry waiting for workers) do not count here: they
have their own bounds in the run's state machine, which a restart would only reset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RunKey = tuple[str, str, str]  # (namespace, name, uid)


@dataclass
class Failing:
    since: float
    error: str


@dataclass
class ProgressTracker:
    failing: dict[RunKey, Failing] = field(default_factory=dict)

    def written(self, run: RunKey) -> None:
        """The run's status was written (or had nothing to change): it makes progress."""
        self.failing.pop(run, None)

    def failed(self, run: RunKey, now: float, error: str) -> None:
        """A status read or write of the run failed; the clock starts at the first one."""
        current = self.failing.get(run)
        self.failing[run] = Failing(since=current.since if current else now, error=error)

    def forget(self, run: RunKey) -> None:
        """The run is no longer driven (finished and released, or its object is gone)."""
        self.failing.pop(run, None)

    def stalled(self, now: float, bound: float) -> list[str]:
        """One line per run whose status reads or writes have failed for longer than
        `bound` seconds with no successful write since; empty when all make progress."""
        return [f"{namespace}/{name}: no status write for {now - f.since:.0f} s (bound {bound:g} s); "
                f"last error: {f.error}"
                for (namespace, name, _), f in sorted(self.failing.items()) if now - f.since > bound]
