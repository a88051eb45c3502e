"""Version skew, pure: what this operator does with what a newer version put into an object
(docs/architecture.md, "Upgrades and version skew").

- A spec field it does not know (the installed CRD is newer) is ignored and reported; the
  run proceeds. `parse_spec`, admission's twin for what users write, still refuses it.
- A status key it does not know (a newer operator wrote it, then was rolled back) is
  carried untouched: neither refused nor removed. What this version writes is checked.
"""
from __future__ import annotations

import copy
import json
from datetime import datetime, timezone

import pytest

from api_spec_cases import base_spec, spec_with
from tpufinetune.core import conditions as cond
from tpufinetune.core.api import SpecError, parse_spec, parse_stored_spec
from tpufinetune.core.phases import Decision, RecordEvent
from tpufinetune.core.skew import report_ignored_fields
from tpufinetune.core.status import STATUS_KEYS, UndeclaredStatusKey, checked_status
from tpufinetune.core.skew import status_patch

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
NEWER_SPEC = spec_with(
    futureKnob=3,                                   # a top-level field
    tpu__multislicePolicy="strict",                 # inside a nested object
    workers={"env": [{"name": "A", "value": "1", "fromConfigMap": {"name": "cm"}}]},  # inside a list item
)
IGNORED = ("spec.futureKnob", "spec.tpu.multislicePolicy", "spec.workers.env[0].fromConfigMap")


def test_unknown_spec_fields_at_any_depth_are_ignored_and_named():
    given = copy.deepcopy(NEWER_SPEC)
    spec, ignored = parse_stored_spec(given)
    assert ignored == IGNORED
    known = spec_with(workers={"env": [{"name": "A", "value": "1"}]})
    assert spec == parse_spec(known)  # exactly what the fields this version knows say
    assert given == NEWER_SPEC  # the object's spec is never rewritten


def test_a_spec_without_unknown_fields_reports_none():
    spec, ignored = parse_stored_spec(base_spec())
    assert ignored == () and spec == parse_spec(base_spec())


def test_users_are_still_refused_unknown_fields_as_admission_refuses_them():
    with pytest.raises(SpecError, match=r"^spec.futureKnob: unknown field$"):
        parse_spec(spec_with(futureKnob=3))


def test_a_known_field_that_is_invalid_is_still_refused_beside_unknown_ones():
    with pytest.raises(SpecError, match=r"^spec.tpu.topology: \"3x3\" is not a valid v6e topology"):
        parse_stored_spec(spec_with(futureKnob=3, tpu__topology="3x3"))
    with pytest.raises(SpecError, match=r"^spec.tpu: is required$"):
        parse_stored_spec(spec_with(futureKnob=3, tpu=None))


def test_ignored_fields_set_the_condition_and_one_event_per_change():
    first = Decision({"phase": "Pending"})
    report_ignored_fields(first, IGNORED, T0, 1)
    condition = cond.find(first.status, cond.SPEC_FIELDS_IGNORED)
    assert condition["status"] == "True" and condition["reason"] == "UnknownFields"
    assert all(path in condition["message"] for path in IGNORED)
    assert condition["observedGeneration"] == 1
    (event,) = first.actions
    assert event == RecordEvent("Warning", "SpecFieldsIgnored", condition["message"])

    again = Decision(copy.deepcopy(first.status))  # the next step (or a restarted operator)
    report_ignored_fields(again, IGNORED, T0, 1)
    assert again.actions == [] and again.status == first.status

    fewer = Decision(copy.deepcopy(first.status))  # an edit that drops one of them
    report_ignored_fields(fewer, IGNORED[:1], T0, 2)
    assert [a.reason for a in fewer.actions] == ["SpecFieldsIgnored"]
    assert IGNORED[1] not in cond.find(fewer.status, cond.SPEC_FIELDS_IGNORED)["message"]

    none_left = Decision(copy.deepcopy(fewer.status))
    report_ignored_fields(none_left, (), T0, 3)
    condition = cond.find(none_left.status, cond.SPEC_FIELDS_IGNORED)
    assert condition["status"] == "False" and condition["reason"] == "AllFieldsKnown"
    assert none_left.actions == []


def test_a_run_that_never_had_unknown_fields_has_no_such_condition():
    decision = Decision({"phase": "Running"})
    report_ignored_fields(decision, (), T0, 1)
    assert decision.status == {"phase": "Running"} and decision.actions == []


# ---- status keys a newer operator wrote ----------------------------------------------

READ_BACK = {  # as the API server holds it: a newer operator wrote the *Newer keys
    "phase": "Running", "attempt": 1, "jobId": "tft-u-1", "loss": 3.0,
    "rayTokenNewer": {"secretName": "tft-demo-ray-token"},
    "progress": {"step": 3, "totalSteps": 30, "stallsNewer": 0},
    "conditions": [{"type": "Running", "status": "True", "reason": "JobRunning", "message": "",
                    "lastTransitionTime": "2026-11-30T10:00:00Z", "severityNewer": "Info"},
                   {"type": "LeaderNewer", "status": "True", "reason": "Elected", "message": "",
                    "lastTransitionTime": "2026-11-30T10:00:00Z"}],
    "kopf": {"progress": {}},
}


def test_status_keys_a_newer_operator_wrote_are_carried_not_refused():
    new = copy.deepcopy(READ_BACK)
    new["loss"] = 2.5  # what this version writes
    new["progress"]["step"] = 4  # a changed object carrying a newer key inside it
    cond.set_condition(new, cond.SUCCEEDED, False, "Running", "", T0, 1)  # a changed list
    assert checked_status(new, READ_BACK) is new


def test_what_this_version_writes_is_still_checked_beside_carried_keys():
    for misspelt, path in [({"checkpointUri": "gs://b/x"}, "status.checkpointUri"),
                           ({"progress": {**READ_BACK["progress"], "etaSecs": 3}}, r"status.progress.etaSecs"),
                           ({"rayTokenNewer": {"secretName": "changed"}}, "status.rayTokenNewer")]:
        with pytest.raises(UndeclaredStatusKey, match=path):
            checked_status({**copy.deepcopy(READ_BACK), **misspelt}, READ_BACK)


def test_without_a_read_back_status_every_key_is_checked():
    with pytest.raises(UndeclaredStatusKey, match="status.rayTokenNewer"):
        checked_status(copy.deepcopy(READ_BACK))


def test_the_status_patch_never_removes_a_key_this_version_does_not_own():
    new = {k: v for k, v in READ_BACK.items() if k not in ("rayTokenNewer", "jobId", "kopf")}
    assert status_patch(READ_BACK, new) == {"jobId": None}
    assert "rayTokenNewer" not in STATUS_KEYS and "jobId" in STATUS_KEYS and "kopf" not in STATUS_KEYS


# ---- schema defaults against the previous release ------------------------------------------

PREVIOUS_RELEASE_COMMIT = "8eb4e17b080d7f8cb0ad93cc5b04d12ac103e089"  # v0.2.0 (test_upgrade_e2e.py)
CRD_PATH = "crds/tpufinetunes.tpufinetune.dev.yaml"


def _stored_defaults(node: dict, path: str = "spec") -> set[str]:
    """Paths the API server fills into an object that does not give them: a default where
    its parent object is itself always there (the root, or a parent with a default)."""
    found: set[str] = set()
    for name, prop in (node.get("properties") or {}).items():
        if "default" in prop:
            found.add(f"{path}.{name}")
            found |= _stored_defaults(prop, f"{path}.{name}")
    return found


def _spec_schema(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_no_new_spec_field_is_stored_in_every_object_by_a_schema_default():
    """A schema default is written into every object; the previous release refuses a spec
    field it does not know, so a new field with one would make every run unreadable to it
    after a rollback. Unset has to mean the default in code instead (as `training.method`)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shown = subprocess.run(["git", "-C", str(root), "show", f"{PREVIOUS_RELEASE_COMMIT}:{CRD_PATH}"],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        pytest.fail(f"the previous release's CRD is not in this clone ({shown.stderr.strip()}); "
                    "fetch its history (`git fetch --unshallow`)", pytrace=False)
    previous = _stored_defaults(_spec_schema(shown.stdout))
    current = _stored_defaults(_spec_schema((root / CRD_PATH).read_text()))
    assert previous and {"spec.training.epochs"} <= current
    assert not current - previous, f"new stored defaults: {sorted(current - previous)}"


# ---- a method an older operator does not know -----------------------------------------------

# The last operator without method dpo (training.method full or lora only).
PRE_DPO_COMMIT = "58d546e6734fc1ef89d90339b5b9b64fb392cdd1"


def test_an_operator_older_than_dpo_refuses_a_dpo_run_by_its_method_rather_than_run_it_as_sft(tmp_path):
    """training.dpo alone an older operator would ignore (an unknown field), but the CRD
    admits it only beside method: dpo, which that operator's closed set refuses, naming the
    field: the run is refused, never trained as a full fine-tune on preference data."""
    import older_operator

    operator = older_operator.extract(PRE_DPO_COMMIT, tmp_path, "pre-DPO")
    dpo = spec_with(training={"method": "dpo", "lora": {"rank": 8}, "dpo": {"beta": 0.2}})
    parse_spec(dpo)  # this operator runs it
    probe = ("import json, sys\nfrom tpufinetune.core.api import SpecError, parse_stored_spec\n"
             "try:\n    print(json.dumps({'ran': list(parse_stored_spec(json.loads(sys.argv[1]))[1])}))\n"
             "except SpecError as e:\n    print(json.dumps({'refused': e.field, 'why': str(e)}))\n")
    answer = older_operator.run(operator, probe, json.dumps(dpo))
    assert answer.get("refused") == "spec.training.method" and '"dpo" is not valid' in answer["why"], answer
