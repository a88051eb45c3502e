"""Leader election on a coordination.k8s.io/v1 Lease: the decisions only (the I/O is in
adapters/lease.py). The rules are client-go's:

- A candidate may take the Lease when nobody holds it (no Lease yet, or an empty
  holderIdentity after a release), when it holds it itself (a renewal), or when the holder
  has not renewed it for `leaseDurationSeconds` as measured by *this candidate's own
  clock*: the time since it last saw the Lease change (its resourceVersion). Clocks of
  different machines never need to agree; renewTime is written for people, not compared.
- A renewal keeps acquireTime and leaseTransitions; a take-over sets acquireTime and adds
  one to leaseTransitions.
- The leader stops acting once it has not renewed for the renew deadline, which is shorter
  than the lease duration, so it has stopped before any candidate may take over. Its
  renewal is counted from when that try began (a slow answer does not stretch the lease),
  and each try, read and write together, ends by the renew deadline.
- Fencing: every create, delete and submit asks `fenced` just before it is made, so a
  leader that has not renewed within the renew deadline (its renewer stuck, or the process
  not yet gone after losing the Lease) makes no side effect a new leader could meet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

# A retry period is stretched by up to this factor (jitter), so the renew deadline must
# leave room for more than one retry: renew_deadline > JITTER * retry_period (client-go's rule).
JITTER = 1.2


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec, as election reads and writes it."""

    holder: str = ""
    duration_s: int = 0
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    transitions: int = 0


def timing_problem(lease_duration: float, renew_deadline: float, retry_period: float) -> str:
    """Why these timings cannot work ("" when they can), naming the settings."""
    if not lease_duration > renew_deadline:
        return (f"TPUFT_LEASE_DURATION ({lease_duration:g}) must be greater than TPUFT_RENEW_DEADLINE "
                f"({renew_deadline:g}): a leader that cannot renew must stop before another may take over")
    if not renew_deadline > JITTER * retry_period:
        return (f"TPUFT_RENEW_DEADLINE ({renew_deadline:g}) must be greater than {JITTER} x "
                f"TPUFT_RETRY_PERIOD ({retry_period:g}): the leader must get more than one try to renew")
    return ""


def seen(previous: tuple[str, float] | None, version: str, now: float) -> tuple[str, float]:
    """(resourceVersion, when this candidate first saw it): the clock the expiry counts on."""
    if previous is not None and previous[0] == version:
        return previous
    return version, now


def expired(record: LeaseRecord, unchanged_for: float) -> bool:
    """The holder has not renewed for its lease duration, as this candidate has watched."""
    return unchanged_for >= record.duration_s


def claim(record: LeaseRecord | None, me: str, duration_s: int, now: datetime,
          unchanged_for: float) -> LeaseRecord | None:
    """The record to write to take or keep the Lease; None while another holder's lease runs.

    `record` is the Lease as read (None: there is none yet); `unchanged_for` is how long
    this candidate has seen it unchanged (see `seen`)."""
    if record is None:
        return LeaseRecord(me, duration_s, now, now, 0)
    if record.holder == me:
        return replace(record, duration_s=duration_s, renew_time=now)
    if record.holder and not expired(record, unchanged_for):
        return None
    return LeaseRecord(me, duration_s, now, now, record.transitions + 1)


def released(record: LeaseRecord, now: datetime) -> LeaseRecord:
    """What a leader that stops cleanly writes: no holder, so a standby takes over on its
    next try instead of waiting out the lease (client-go's ReleaseOnCancel)."""
    return LeaseRecord("", 1, record.acquire_time, now, record.transitions)


def must_stop(last_renewed: float, now: float, renew_deadline: float) -> bool:
    """The leader has not renewed within the renew deadline: it stops acting at once."""
    return now - last_renewed >= renew_deadline


def fenced(last_renewed: float, now: float, renew_deadline: float, lost: str) -> str:
    """Why this leader may not act now ('' when it may): it lost or gave up the Lease
    (`lost`, said by the renewer), or its last renewal began a renew deadline ago or more."""
    if lost:
        return lost
    if must_stop(last_renewed, now, renew_deadline):
        return f"the Lease was last renewed {now - last_renewed:.1f} s ago (renew deadline {renew_deadline:g} s)"
    return ""
