"""Status goes through the status model before it is written: a key the CRD does not
declare (the API server would prune it in silence) is refused with its path."""
from __future__ import annotations

import pytest

from tpufinetune.core.status import UndeclaredStatusKey, checked_status

FULL = {
    "phase": "Running", "attempt": 1, "rayClusterName": "tft-demo", "jobId": "tft-u-1",
    "dashboardURL": "http://tft-demo-head-svc.ns.svc:8265", "epoch": 1, "epochs": 3,
    "checkpointURI": "gs://b/run/checkpoint_000001", "logCursor": 120, "message": "epoch 1/3",
    "conditions": [{"type": "Running", "status": "True", "reason": "JobRunning", "message": "",
                    "lastTransitionTime": "2026-11-30T10:00:00Z"}],
    "history": [{"epoch": 1, "loss": 1.5}],
}


def test_a_status_the_operator_writes_passes():
    assert checked_status(FULL) is FULL


@pytest.mark.parametrize("misspelt, path", [
    ({"checkpointUri": "gs://b/x"}, "status.checkpointUri"),
    ({"conditions": [dict(FULL["conditions"][0], lastTransition="2026-11-30T10:00:00Z")]},
     "status.conditions[0].lastTransition"),
    ({"history": [{"epoch": 1, "evalLos": 1.2}]}, "status.history[0].evalLos"),
])
def test_an_undeclared_key_is_refused_with_its_path(misspelt, path):
    with pytest.raises(UndeclaredStatusKey, match=path.replace("[", r"\[").replace("]", r"\]")):
        checked_status(dict(FULL, **misspelt))


ATTEMPTS = {
    "attempts": [{"attempt": 1, "startTime": "2026-11-30T10:00:00Z", "endTime": "2026-11-30T11:00:00Z",
                  "reason": "Preempted", "message": "pod w-1 was deleted", "resumedFrom": "", "lastStep": 12,
                  "lostSteps": 2, "rayClusterUID": "6f1c", "sliceReadyTime": "2026-11-30T10:10:00Z",
                  "sliceReleaseTime": "2026-11-30T11:00:00Z", "logsURI": "gs://b/tft-demo-6f1c/logs/attempt-1",
                  "usage": {"chipHours": 13.333, "hostHours": 3.333, "provisioningSeconds": 600.0}}],
    "usage": {"chipHours": 13.333, "hostHours": 3.333, "provisioningSeconds": 600.0},
    "checkpointStep": 10,
}


def test_attempts_and_usage_pass_and_a_reason_outside_the_closed_set_is_refused():
    assert checked_status(dict(FULL, **ATTEMPTS))
    wrong = [dict(ATTEMPTS["attempts"][0], reason="Crashed")]
    with pytest.raises(ValueError, match="reason"):
        checked_status(dict(FULL, attempts=wrong))
    with pytest.raises(ValueError, match="chipHours"):
        checked_status(dict(FULL, usage={"chipHours": -1.0}))
    with pytest.raises(UndeclaredStatusKey, match=r"status.attempts\[0\].cost"):
        checked_status(dict(FULL, attempts=[dict(ATTEMPTS["attempts"][0], cost=3)]))
    with pytest.raises(ValueError, match="logsURI"):
        checked_status(dict(FULL, attempts=[dict(ATTEMPTS["attempts"][0], logsURI="gs://b/" + "x" * 2048)]))


STARTUP = {"clusterReadySeconds": 41.0, "jobSubmittedSeconds": 43.0, "driverStartedSeconds": 47.2,
           "firstStepSeconds": 95.1,
           "trainer": {"dataReadySeconds": 12.3, "workersReadySeconds": 20.1, "modelLoadedSeconds": 31.0,
                       "firstStepCompiledSeconds": 40.2, "firstStepSeconds": 47.9, "dataSource": "RunStorage",
                       "tokenizedExamples": 0, "compileCacheHits": 2, "compileCacheMisses": 0,
                       "resumedEpochEndSeconds": 18.4}}


def test_an_attempts_startup_passes_the_model_and_the_crd_declares_it():
    from tpufinetune import crdgen
    from tpufinetune.core.status import TPUFineTuneStatus

    attempt = dict(ATTEMPTS["attempts"][0], startup=STARTUP)
    status = dict(FULL, attempts=[attempt])
    assert checked_status(status) is status
    dumped = TPUFineTuneStatus.model_validate(status).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert dumped["attempts"][0]["startup"] == STARTUP  # the same keys back, nothing dropped
    with pytest.raises(ValueError, match="firstStepSeconds"):
        checked_status(dict(FULL, attempts=[dict(attempt, startup=dict(STARTUP, firstStepSeconds=-1.0))]))
    with pytest.raises(UndeclaredStatusKey, match=r"status.attempts\[0\].startup.trainer.compiledSeconds"):
        checked_status(dict(FULL, attempts=[dict(attempt, startup=dict(STARTUP, trainer={"compiledSeconds": 1.0}))]))
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    declared = schema["properties"]["attempts"]["items"]["properties"]["startup"]
    trainer = declared["properties"].pop("trainer")
    assert set(declared["properties"]) | {"trainer"} == set(STARTUP)
    assert set(trainer["properties"]) == set(STARTUP["trainer"])
    source = trainer["properties"].pop("dataSource")
    assert source["enum"] == ["Tokenized", "LocalCache", "RunStorage"] and source["description"]
    with pytest.raises(ValueError, match="dataSource"):
        checked_status(dict(FULL, attempts=[dict(attempt, startup=dict(STARTUP, trainer={"dataSource": "peer"}))]))
    counts = {"tokenizedExamples", "compileCacheHits", "compileCacheMisses"}
    for name, field in [*declared["properties"].items(), *trainer["properties"].items()]:
        assert (field["type"], field["minimum"]) == ("integer" if name in counts else "number", 0), name
        assert field["description"], name


def test_the_export_proof_event_folds_into_status_export_which_the_model_takes():
    from tpufinetune.core.runevents import apply_event, split_malformed
    from tpufinetune.core.status import EXPORT_SAMPLE_LIMIT, EXPORT_TEXT_LIMIT

    proof = {"event": "export_proof", "v": 1, "model_uri": "gs://b/run/export",
             "adapter_uri": "gs://b/run/export-adapter", "dtype": "bfloat16", "tokens": 8, "load_s": 12.34567,
             "sample": [{"prompt": "Name a colour.", "completion": " Blue", "completion_ids": [1, 2],
                         "adapter_completion": " Red", "adapter_completion_ids": [3, 4]},
                        {"prompt": "p" * 999, "completion": "c" * 999}] * EXPORT_SAMPLE_LIMIT}
    status = dict(FULL, exportedModelURI="gs://b/run/export")
    apply_event(status, proof)
    export = status["export"]
    assert (export["tokens"], export["loadSeconds"], export["dtype"]) == (8, 12.346, "bfloat16")
    assert export["sample"][0] == {"prompt": "Name a colour.", "completion": " Blue", "adapterCompletion": " Red"}
    assert len(export["sample"]) == EXPORT_SAMPLE_LIMIT  # bounded, and each text cut to fit the CRD
    assert len(export["sample"][1]["prompt"]) == len(export["sample"][1]["completion"]) == EXPORT_TEXT_LIMIT
    assert status["exportedModelURI"] == "gs://b/run/export"  # where it was, beside the proof
    assert checked_status(status) is status
    kept, dropped = split_malformed(dict(FULL), [proof, dict(proof, tokens=-1)])
    assert kept == [proof] and len(dropped) == 1  # a proof the model refuses is dropped, not written


def test_a_multimodal_export_proof_keeps_which_images_each_prompt_was_asked_with():
    from tpufinetune.core.runevents import apply_event
    from tpufinetune.core.evalstatus import IMAGE_PATH_LIMIT, PROMPT_IMAGE_LIMIT

    image = "gs://b/data/images/00007.png"
    proof = {"event": "export_proof", "v": 1, "model_uri": "gs://b/run/export", "dtype": "bfloat16", "tokens": 8,
             "load_s": 1.5, "mode": "generated",
             "sample": [{"prompt": "What colour is this picture?", "images": [image],
                         "completion": "The picture is red.", "completion_ids": [1, 2]},
                        {"prompt": "p", "completion": "c", "images": ["gs://b/" + "d/" * 400 + "x.png"] * 99}]}
    status = dict(FULL, exportedModelURI="gs://b/run/export")
    apply_event(status, proof)
    first, second = status["export"]["sample"]
    assert first == {"prompt": "What colour is this picture?", "completion": "The picture is red.", "images": [image]}
    assert len(second["images"]) == PROMPT_IMAGE_LIMIT and second["images"][0].endswith("/d/x.png")
    assert len(second["images"][0]) == IMAGE_PATH_LIMIT  # its end: the image's own name kept
    assert checked_status(status) is status


def test_a_failed_export_proof_is_the_trainers_failure_with_its_reason():
    from tpufinetune.core.runevents import apply_event

    status = dict(FULL)
    apply_event(status, {"event": "failure", "v": 1, "type": "ExportUnloadable",
                         "message": "the exported model at gs://b/run/export does not load: SafetensorError: x"})
    failure = status["trainerFailure"]
    assert failure["type"] == "ExportUnloadable" and "does not load" in failure["message"]
    assert "export" not in status
