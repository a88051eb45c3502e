"""Conditions are built through the status model: the written keys are the CRD's, and a
value the CRD would refuse fails here, not at the apiserver."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from tpufinetune.core import conditions
from tpufinetune.core.status import Condition

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T1 = datetime(2026, 1, 1, 0, 5, tzinfo=timezone.utc)


def test_a_condition_has_exactly_the_crd_keys():
    status: dict = {}
    conditions.set_condition(status, conditions.RUNNING, True, "JobRunning", "epoch 1", T0, 3)
    (written,) = status["conditions"]
    assert written == {"type": "Running", "status": "True", "reason": "JobRunning",
                       "message": "epoch 1", "lastTransitionTime": "2026-01-01T00:00:00Z",
                       "observedGeneration": 3}
    assert set(written) == {Condition.model_fields[f].alias for f in Condition.model_fields}


def test_the_transition_time_moves_only_when_the_status_flips():
    status: dict = {}
    conditions.set_condition(status, conditions.RUNNING, True, "JobRunning", "", T0, None)
    conditions.set_condition(status, conditions.RUNNING, True, "JobRunning", "later", T1, None)
    assert conditions.parse_time(conditions.find(status, conditions.RUNNING)["lastTransitionTime"]) == T0
    assert "observedGeneration" not in status["conditions"][0]
    conditions.set_condition(status, conditions.RUNNING, False, "JobEnded", "", T1, None)
    assert conditions.parse_time(conditions.find(status, conditions.RUNNING)["lastTransitionTime"]) == T1


def test_times_read_back_in_both_forms_the_operator_meets():
    # timestamp()'s own form, and a Kubernetes client datetime serialised (a pod's
    # condition read through the adapter): the same instant, aware and in UTC.
    assert conditions.parse_time(conditions.timestamp(T0)) == T0
    client_form = T0.astimezone(timezone(timedelta(hours=2))).isoformat()
    assert conditions.parse_time(client_form) == T0 and conditions.parse_time(client_form).tzinfo == timezone.utc
    assert conditions.parse_time("2026-01-01T00:00:00.250000+00:00").microsecond == 250000
    assert conditions.parse_time("") is None and conditions.parse_time(None) is None


def test_a_value_the_crd_refuses_fails_when_the_condition_is_built():
    with pytest.raises(ValidationError, match=r"reason\n  String should have at most 1024 characters"):
        conditions.set_condition({}, conditions.FAILED, True, "R" * 1025, "", T0, None)
