"""Standard Kubernetes conditions (metav1.Condition) on a status dict. Pure functions.

Each condition keeps its lastTransitionTime while its status stays the same, so
`kubectl wait --for=condition=X` and Argo CD see real transitions, not every poll.
"""

from __future__ import annotations

from datetime import datetime, timezone

from .status import Condition

# Condition types the operator maintains.
ADMITTED = "Admitted"  # only with spec.queueName: Kueue admitted the RayCluster
CLUSTER_READY = "ClusterReady"
JOB_SUBMITTED = "JobSubmitted"
RUNNING = "Running"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
# Only with spec.evaluation.lmEval: True once lm-eval ran on the export; False with why it did not
# (the run still Succeeded: an evaluation never fails it).
EVALUATED = "Evaluated"
# Only once the spec had a field this operator version does not know (a newer CRD).
SPEC_FIELDS_IGNORED = "SpecFieldsIgnored"
# Only once the head did not answer in Submitting or Running: False since when it stopped
# answering (its lastTransitionTime is the unreachable clock, so a restarted operator goes
# on counting from there), True again once it answers.
RAY_REACHABLE = "RayReachable"
# Only once the run's status could not be written for a while: written True with the first
# write that lands again, saying for how long and why writes failed (while they fail the
# condition cannot be written; the StatusWriteFailing Event and gauge say it meanwhile).
STATUS_WRITABLE = "StatusWritable"
# Only once an edit failed the operator's checks: False while the edited spec is refused
# and the applied generation's plan stays in force; True once a valid spec is back.
SPEC_VALID = "SpecValid"

# Only with spec.model.initFrom: False while the run waits for its source run to succeed (the
# message says what it waits for), True once status.initFrom is recorded.
INIT_FROM_READY = "InitFromReady"

ALL_TYPES = (ADMITTED, CLUSTER_READY, JOB_SUBMITTED, RUNNING, SUCCEEDED, FAILED, EVALUATED, SPEC_FIELDS_IGNORED,
             RAY_REACHABLE, STATUS_WRITABLE, SPEC_VALID, INIT_FROM_READY)
MESSAGE_LIMIT = 1024


def timestamp(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def find(status: dict, type_: str) -> dict | None:
    for condition in status.get("conditions") or []:
        if condition.get("type") == type_:
            return condition
    return None


def remove(status: dict, type_: str) -> None:
    """Drop one condition (one that no longer describes anything)."""
    if find(status, type_) is not None:
        status["conditions"] = [c for c in status["conditions"] if c.get("type") != type_]


def is_true(status: dict, type_: str) -> bool:
    condition = find(status, type_)
    return bool(condition and condition.get("status") == "True")


def set_condition(
    status: dict,
    type_: str,
    value: bool,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> None:
    """Insert or update one condition in place, in the fixed order of ALL_TYPES."""
    new_status = "True" if value else "False"
    existing = find(status, type_)
    since = timestamp(now)
    if existing and existing.get("status") == new_status:
        since = existing.get("lastTransitionTime", since)
    # Built through the status model, so a misspelt or ill-typed key fails here instead of
    # being pruned by the apiserver.
    condition = Condition(
        type=type_, status=new_status, reason=reason, message=message[:MESSAGE_LIMIT],
        last_transition_time=since, observed_generation=generation,
    ).model_dump(by_alias=True, exclude_none=True)
    others = [c for c in status.get("conditions") or [] if c.get("type") != type_]
    order = {name: index for index, name in enumerate(ALL_TYPES)}
    status["conditions"] = sorted(
        others + [condition], key=lambda c: order.get(c.get("type"), len(order))
    )


def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 time back to an aware UTC datetime; None for None. Takes timestamp()'s
    form and the Kubernetes client's (a datetime serialised as `+00:00`, with fractions)."""
    if not text:
        return None
    parsed = datetime.fromisoformat(text)
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)


