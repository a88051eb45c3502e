"""status.tensorboardURI: the folder of the run's TensorBoard event files, from the trainer's
`plan` event (docs/protocol.md), declared in the status model (checked_status refuses an
undeclared key) and kept by a plan that carries none (an older trainer image). Pure."""

from __future__ import annotations

from tpufinetune.core.runevents import apply_event
from tpufinetune.core.status import checked_status

URI = "gs://bucket/runs/r1/tensorboard"


def plan(**fields) -> dict:
    return {"event": "plan", "total_steps": 18, "steps_per_epoch": 9, **fields}


def test_the_plan_names_the_runs_tensorboard_folder():
    status: dict = {}
    apply_event(status, plan(tensorboard_uri=URI))
    assert status["tensorboardURI"] == URI
    assert checked_status(status) is status  # declared: the API server keeps it


def test_a_resumed_attempts_plan_and_an_older_trainers_keep_it():
    status: dict = {}
    apply_event(status, plan(tensorboard_uri=URI))
    apply_event(status, plan(tensorboard_uri=URI, resumed_step=12))
    apply_event(status, plan())  # an older trainer image says nothing of it
    apply_event(status, plan(tensorboard_uri=""))
    assert status["tensorboardURI"] == URI
