"""spec.model.initFrom, pure: a chained run waits holding nothing while its source has not
Succeeded (saying what it waits for), records the source's result once, trains every attempt
from that record, and fails naming the source when it has nothing to start from."""

import shlex
from dataclasses import replace
from datetime import timedelta

import pytest

from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.core.api import SpecError, parse_spec
from tpufinetune.core.initsource import source_view
from tpufinetune.core.jobspec import job_submission
from tpufinetune.core.phases import Identity, Observations, plan_for

from phase_helpers import T0, kinds

IDENT = Identity("dpo", "team-a", "uid-dpo", generation=1)
SFT_EXPORT = "gs://bucket/runs/tft-sft-abc/export"
SFT_BEST = "gs://bucket/runs/tft-sft-abc/checkpoint_000002"
E4B = "google/gemma-4-E4B-it"
DPO_SPEC = {"tpu": {"generation": "v6e", "topology": "4x4"}, "image": "example.com/trainer:1",
            "checkpoint": {"storagePath": "gs://bucket/runs"},
            "model": {"initFrom": {"run": "sft"}},
            "dataset": {"id": "gs://bucket/pairs.jsonl", "split": "train"},
            "training": {"method": "dpo", "lora": {}, "epochs": 1, "batchSizePerDevice": 1,
                         "activationCheckpointing": "block"}}


def dpo_spec(**model):
    return parse_spec({**DPO_SPEC, "model": {**DPO_SPEC["model"], **model}})


def plan(spec=None, recorded=None):
    return plan_for(IDENT, spec or dpo_spec(), timedelta(minutes=30), init_from=recorded)


def sft(phase="", **status):
    """The source as the API server holds it (an E4B LoRA SFT run)."""
    return {"metadata": {"name": "sft", "namespace": "team-a", "uid": "uid-sft"},
            "spec": {"model": {"id": E4B}, "training": {"method": "lora", "epochs": 3}},
            "status": {"phase": phase, **status} if phase else status}


def step(status, plan_=None, body=None, read=True, now=T0):
    source = source_view(body) if read else None
    return phases.transition(IDENT, plan_ or plan(), status, Observations(now=now, init_source=source))


def test_it_waits_holding_nothing_and_says_exactly_what_for():
    d = step({}, body=None)
    assert d.phase == phases.PENDING
    assert d.status["message"] == "no TPUFineTune sft in namespace team-a yet; waiting for it to be applied and to succeed"
    # No RayCluster asked for, no names reserved, no attempt open (no usage, no deadline clock).
    assert kinds(d) == ["RecordEvent"]
    assert not {"rayClusterName", "jobId", "attempt", "attempts", "startTime", "plan"} & d.status.keys()
    ready = cond.find(d.status, cond.INIT_FROM_READY)
    assert (ready["status"], ready["reason"]) == ("False", "SourceMissing")

    running = sft("Running", epoch=1, epochs=3, progress={"summary": "40% 12/30 ETA 2m"})
    d = step(d.status, body=running)
    assert d.phase == phases.PENDING
    assert d.status["message"] == "waiting for TPUFineTune sft to succeed: it is Running, epoch 2 of 3 (40% 12/30 ETA 2m)"
    assert [(a.reason, a.message) for a in d.actions] == [("WaitingForSource", d.status["message"])]
    assert cond.find(d.status, cond.INIT_FROM_READY)["reason"] == "SourceRunning"
    # Its next epoch changes the words, not the Events.
    later = step(d.status, body=sft("Running", epoch=2, epochs=3))
    assert later.status["message"].endswith("it is Running, epoch 3 of 3") and later.actions == []
    assert "rayClusterName" not in later.status


def test_a_source_that_provisions_is_shown_with_its_own_words():
    d = step({}, body=sft("Provisioning", message="hosts ready 0/4"))
    assert d.status["message"] == "waiting for TPUFineTune sft to succeed: it is Provisioning (hosts ready 0/4)"


def test_once_the_source_succeeds_its_export_is_recorded_then_the_run_plans_its_base_and_starts():
    waiting = step({}, body=sft("Running", epoch=2, epochs=3)).status
    done = sft("Succeeded", exportedModelURI=SFT_EXPORT, checkpointURI=SFT_BEST)
    d = step(waiting, body=done)
    recorded = {"run": "sft", "uid": "uid-sft", "artifact": "export", "uri": SFT_EXPORT, "modelId": E4B}
    assert d.status["initFrom"] == recorded
    assert d.phase == phases.PENDING and d.wake_at == T0  # the next step at once, with the plan made again
    assert cond.is_true(d.status, cond.INIT_FROM_READY)
    assert [a.reason for a in d.actions] == ["InitFromResolved"] and SFT_EXPORT in d.actions[0].message

    replanned = plan(recorded=d.status["initFrom"])
    assert replanned.memory_request.model_id == E4B and replanned.memory_request.dpo_lora
    reserved = step(d.status, replanned, read=False)
    assert reserved.status["rayClusterName"] and reserved.status["attempt"] == 1
    assert "E4B" in reserved.status["plan"]["message"]
    created = step(reserved.status, replanned, read=False)
    assert phases.CreateCluster(reserved.status["rayClusterName"]) in created.actions
    assert created.status["initFrom"] == recorded


def test_before_it_is_resolved_nothing_is_planned_and_no_model_is_guessed():
    assert plan().memory is None and plan().memory_request is None


def test_every_attempt_trains_from_the_record_whatever_became_of_the_source():
    recorded = {"run": "sft", "uid": "uid-sft", "artifact": "export", "uri": SFT_EXPORT, "modelId": E4B}
    status = {"phase": phases.PENDING, "initFrom": recorded, "observedGeneration": 1}
    replanned = plan(recorded=recorded)
    for body in (None, sft("Failed"), sft("Succeeded", exportedModelURI="gs://elsewhere/export")):
        d = step(status, replanned, body=body)
        assert d.status["initFrom"] == recorded and d.phase == phases.PENDING
    for attempt in (1, 2):
        argv = job_submission("dpo", "team-a", "uid-dpo", dpo_spec(), attempt, init_from=recorded).entrypoint_argv
        assert f"--model-id={SFT_EXPORT}" in argv and not any(a.startswith("--init-checkpoint") for a in argv)
        assert "--method=dpo" in argv and "--dpo-lora=true" in argv


def test_a_checkpoint_is_loaded_into_the_sources_base_model():
    spec = dpo_spec(initFrom={"run": "sft", "artifact": "checkpoint"})
    d = step({}, plan(spec), body=sft("Succeeded", exportedModelURI=SFT_EXPORT, checkpointURI=SFT_BEST))
    assert d.status["initFrom"] == {"run": "sft", "uid": "uid-sft", "artifact": "checkpoint", "uri": SFT_BEST,
                                    "modelId": E4B}
    submission = job_submission("dpo", "team-a", "uid-dpo", spec, 1, init_from=d.status["initFrom"])
    assert submission.entrypoint_argv[2:4] == [f"--model-id={E4B}", f"--init-checkpoint={SFT_BEST}"]
    assert shlex.split(submission.entrypoint) == submission.entrypoint_argv


def test_a_failed_source_ends_the_run_naming_it_and_what_to_do():
    waiting = step({}, body=sft("Running", epoch=0, epochs=3)).status
    failed = sft("Failed", message="job failed", conditions=[{"type": "Failed", "status": "True", "reason": "AppFailed"}])
    d = step(waiting, body=failed)
    assert d.phase == phases.FAILED and "rayClusterName" not in d.status
    assert cond.find(d.status, cond.FAILED)["reason"] == "InitFromFailed"
    assert d.status["message"].startswith("TPUFineTune sft failed (AppFailed: job failed)")
    assert "run it again" in d.status["message"]
    assert [(a.type, a.reason) for a in d.actions] == [("Warning", "InitFromFailed")]


@pytest.mark.parametrize("spec_model, body, words", [
    ({}, {**sft("Succeeded", checkpointURI=SFT_BEST),
          "spec": {"model": {"id": E4B}, "training": {"method": "lora", "lora": {"exportMerged": False}}}},
     "no exported model (status.exportedModelURI), only its LoRA adapter (its spec.training.lora.exportMerged is false)"),
    ({"initFrom": {"run": "sft", "artifact": "checkpoint"}}, sft("Succeeded", exportedModelURI=SFT_EXPORT),
     "no checkpoint (status.checkpointURI)"),
])
def test_a_source_that_succeeded_without_the_artifact_ends_the_run_unavailable(spec_model, body, words):
    d = step({}, plan(dpo_spec(**spec_model)), body=body)
    assert d.phase == phases.FAILED and cond.find(d.status, cond.FAILED)["reason"] == "InitFromUnavailable"
    assert words in d.status["message"] and "TPUFineTune sft succeeded with" in d.status["message"]


def test_a_model_id_that_is_not_the_sources_base_is_refused_naming_both():
    spec = dpo_spec(id="google/gemma-4-31B-it")
    d = step({}, plan(spec), body=sft("Succeeded", exportedModelURI=SFT_EXPORT))
    assert cond.find(d.status, cond.FAILED)["reason"] == "InitFromMismatch"
    assert "google/gemma-4-31B-it" in d.status["message"] and E4B in d.status["message"]
    same = step({}, plan(dpo_spec(id=E4B)), body=sft("Succeeded", exportedModelURI=SFT_EXPORT))
    assert same.status["initFrom"]["modelId"] == E4B


def test_a_chained_source_passes_its_own_base_on_and_its_checkpoint_is_not_offered():
    chained = sft("Succeeded", exportedModelURI=SFT_EXPORT, checkpointURI=SFT_BEST,
                  initFrom={"run": "sft0", "uid": "u0", "artifact": "export", "uri": "gs://b/sft0/export",
                            "modelId": E4B})
    chained["spec"]["model"] = {"id": "google/gemma-4-E2B-it", "initFrom": {"run": "sft0"}}
    assert step({}, body=chained).status["initFrom"]["modelId"] == E4B
    d = step({}, plan(dpo_spec(initFrom={"run": "sft", "artifact": "checkpoint"})), body=chained)
    assert cond.find(d.status, cond.FAILED)["reason"] == "InitFromUnavailable"


def test_naming_itself_is_refused_even_past_an_older_crd():
    spec = dpo_spec(initFrom={"run": "dpo"})
    d = step({}, plan(spec), body=None)
    assert d.phase == phases.FAILED and cond.find(d.status, cond.FAILED)["reason"] == "InitFromInvalid"


def test_a_deleting_source_and_one_not_read_are_waited_for():
    gone = sft("Running")
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    assert "it is being deleted" in step({}, body=gone).status["message"]
    assert step({}, read=False).phase == phases.PENDING


def test_a_suspended_waiting_run_stays_suspended_and_holds_nothing():
    waiting = step({}, body=None).status
    d = phases.transition(IDENT, replace(plan(), suspended=True), waiting,
                          Observations(now=T0, init_source=source_view(sft("Succeeded", exportedModelURI=SFT_EXPORT))))
    assert d.phase == phases.PENDING and "initFrom" not in d.status and "CreateCluster" not in kinds(d)


def test_the_unresolved_job_only_render_builds_names_what_it_waits_for():
    argv = job_submission("dpo", "team-a", "uid-dpo", dpo_spec(), 1).entrypoint_argv
    assert argv[2] == "--model-id=(the export of TPUFineTune sft, once it has Succeeded)"


def test_init_from_is_refused_with_mode_collectives():
    with pytest.raises(SpecError, match=r"^spec.model.initFrom: applies to mode finetune only"):
        parse_spec({**DPO_SPEC, "mode": "collectives", "training": {}, "dataset": {}})
