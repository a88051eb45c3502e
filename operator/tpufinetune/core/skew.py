"""Version skew: what this operator does with what a newer version put into an object.

Spec fields it does not know (the installed CRD is newer) are ignored by
`api.parse_stored_spec`; `report_ignored_fields` says which, on the SpecFieldsIgnored
condition and in one Warning Event per change. Status keys a newer operator wrote are
carried untouched (`status.checked_status`, `status_patch`).
"""

from __future__ import annotations

from datetime import datetime

from . import conditions as cond
from .phases import Decision, RecordEvent
from .status import STATUS_KEYS

IGNORED = "UnknownFields"
ALL_KNOWN = "AllFieldsKnown"


def ignored_fields_message(ignored: tuple[str, ...]) -> str:
    return (f"this operator version does not know {', '.join(ignored)} and runs without "
            f"{'it' if len(ignored) == 1 else 'them'}: the installed TPUFineTune CRD is newer "
            "than the operator; upgrade the operator to the CRD's release, or remove the fields")


def report_ignored_fields(decision: Decision, ignored: tuple[str, ...], now: datetime,
                          generation: int | None) -> None:
    """Set SpecFieldsIgnored on the decision's status: True naming the fields while there
    are any, False once a later generation has none (absent if there never were any). A
    Warning Event goes with each new set of ignored fields, not with every step."""
    status = decision.status
    existing = cond.find(status, cond.SPEC_FIELDS_IGNORED)
    if not ignored:
        if existing is not None and existing.get("status") == "True":
            cond.set_condition(status, cond.SPEC_FIELDS_IGNORED, False, ALL_KNOWN,
                               "every spec field is known to this operator version", now, generation)
        return
    message = ignored_fields_message(ignored)[: cond.MESSAGE_LIMIT]
    reported = existing is not None and existing.get("status") == "True" and existing.get("message") == message
    cond.set_condition(status, cond.SPEC_FIELDS_IGNORED, True, IGNORED, message, now, generation)
    if not reported:
        decision.actions.append(RecordEvent("Warning", "SpecFieldsIgnored", message))


def status_patch(old: dict, new: dict) -> dict:
    """JSON merge patch from old to new status: changed keys, and None for removed ones.
    Only keys this version declares are ever removed: one a newer operator wrote (read
    back after a rollback) is not ours to delete, and stays for when it returns."""
    patch = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new and k in STATUS_KEYS})
    return patch
