"""Version skew of status.attempts[].startup: an operator older than the trainer's `startup`
event (a rollback, or a newer trainer image) folds it as nothing and writes its status
beside the startup this version wrote, refusing nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import older_operator as older_operator_package

# The last operator without the startup event.
PRE_STARTUP_COMMIT = "1de2b228647236a2c685fa512224ca1d1cc37562"

EVENT = {"event": "startup", "v": 1, "step": 1, "started_at": 1796565605.0, "data_ready_s": 12.5,
         "workers_ready_s": 20.0, "model_loaded_s": 31.25, "first_step_s": 40.0}


@pytest.fixture(scope="module")
def older_operator(tmp_path_factory) -> Path:
    return older_operator_package.extract(PRE_STARTUP_COMMIT, tmp_path_factory.mktemp("pre-startup"), "pre-startup")


def test_an_older_operator_ignores_the_event_and_carries_this_versions_startup(older_operator):
    from tpufinetune.core import attempts
    from tpufinetune.core.status import checked_status

    written = {"phase": "Running", "attempt": 1, "phaseTransitionTime": "2026-12-07T03:00:00Z",
               "lastEventTime": "2026-12-07T03:01:00Z",
               "attempts": [{"attempt": 1, "startTime": "2026-12-07T02:59:00Z",
                             "sliceReadyTime": "2026-12-07T02:59:50Z"}]}
    attempts.note_steps(written, [EVENT], running=True)
    assert written["attempts"][0]["startup"]["trainer"]["firstStepSeconds"] == 40.0
    checked_status(written)
    probe = ("import copy, json, sys\nfrom tpufinetune.core.runevents import apply_event\n"
             "from tpufinetune.core import attempts\nfrom tpufinetune.core.status import checked_status\n"
             "previous = json.loads(sys.argv[1]); status = copy.deepcopy(previous)\n"
             "event = json.loads(sys.argv[2]); apply_event(status, event)\n"
             "attempts.note_steps(status, [event, {'event': 'progress', 'step': 3, 'total_steps': 9}], running=True)\n"
             "checked_status(status, previous)\nprint(json.dumps(status['attempts']))\n")
    (entry,) = older_operator_package.run(older_operator, probe, json.dumps(written), json.dumps(EVENT))
    assert entry["startup"] == written["attempts"][0]["startup"] and entry["lastStep"] == 3
