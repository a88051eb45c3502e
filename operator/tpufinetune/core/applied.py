"""The applied generation's spec, kept in status.appliedSpec beside status.observedGeneration.

An edit to a running run applies to its next attempt, and an edit the operator's checks
refuse never applies: until then the plan of the generation applied stays in force
(watchdog, deadline, TTL, slice size; phases.plan_in_force). The operator keeps that
generation's spec in memory; status.appliedSpec keeps it across a restart, when the stored
object holds only the latest generation's spec. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from tpufinetune.core.api import SpecError
from tpufinetune.core.phases import Identity, Plan, plan_for
from tpufinetune.core.status import APPLIED_SPEC_LIMIT

APPLIED_SPEC = "appliedSpec"


def record(status: dict, generation: int, source: str, refused: bool,
           applied: tuple[int, str] | None) -> None:
    """Write into `status` (about to be written) the spec of the generation it names as
    applied: the latest generation's `source` when the step applied it, else the one
    applied before (`applied`: generation and spec source), when that is the one named."""
    named = status.get("observedGeneration")
    if named == generation and not refused:
        kept = source
    elif applied is not None and named == applied[0]:
        kept = applied[1]
    else:
        return
    if len(kept) > APPLIED_SPEC_LIMIT:
        status.pop(APPLIED_SPEC, None)  # never a record of another generation
    elif status.get(APPLIED_SPEC) != kept:
        status[APPLIED_SPEC] = kept


def recorded(status: dict, ident: Identity, parse, provision_timeout: timedelta,
             submit_timeout: timedelta) -> tuple[int, str, Plan] | None:
    """The applied generation, its spec source and its plan as a written status records
    them (`parse`: the spec source to (spec, ignored fields), SpecError if refused). None
    when it records none (a status an older version wrote) or the record no longer parses:
    then the latest generation goes, as before the record existed."""
    generation, source = status.get("observedGeneration"), status.get(APPLIED_SPEC)
    if not (isinstance(generation, int) and not isinstance(generation, bool) and isinstance(source, str) and source):
        return None
    try:
        spec, _ = parse(source)
    except (SpecError, ValueError):
        return None
    plan = plan_for(dataclasses.replace(ident, generation=generation), spec, provision_timeout, submit_timeout)
    return generation, source, plan
