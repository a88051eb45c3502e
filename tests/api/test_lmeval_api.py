"""spec.evaluation.lmEval in the API: what parse_spec refuses, naming the field, and what a
real kube-apiserver refuses with the generated CRD (the same words for the CEL twins); what both
accept; the Python-only refusal of an export too big for the one TPU chip lm-eval runs on,
naming the figure; and an operator older than the field (a rollback) ignoring it by name."""
from __future__ import annotations

import json

import pytest
import older_operator as older_operator_package
import yaml
from api_spec_cases import Invalid, spec_with

from tpufinetune import crdgen
from tpufinetune.core import lmevalrules
from tpufinetune.core.api import parse_spec
from tpufinetune.core.errors import SpecError

FIELD = "spec.evaluation.lmEval"


def lm_eval(**fields) -> dict:
    return {"lmEval": {"tasks": ["hellaswag"], **fields}}


LM_EVAL_INVALID = [
    Invalid("lmeval-no-task", spec_with(evaluation={"lmEval": {"tasks": []}}), f"{FIELD}.tasks",
            "at least 1 item", admission="should have at least 1 items", python_exact=False),
    Invalid("lmeval-no-tasks-field", spec_with(evaluation={"lmEval": {}}), f"{FIELD}.tasks", "is required",
            admission="Required value", python_exact=False),
    Invalid("lmeval-task-twice", spec_with(evaluation=lm_eval(tasks=["arc_easy", "arc_easy"])), f"{FIELD}.tasks",
            lmevalrules.TASKS_TWICE_MESSAGE, admission='Duplicate value: "arc_easy"'),
    Invalid("lmeval-task-not-a-name", spec_with(evaluation=lm_eval(tasks=["--output_path=/tmp"])), f"{FIELD}.tasks[0]",
            "must match pattern", admission="should match", python_exact=False),
    Invalid("lmeval-limit-zero", spec_with(evaluation=lm_eval(limit=0)), f"{FIELD}.limit",
            "must be greater than 0", admission="should be greater than 0", python_exact=False),
    Invalid("lmeval-limit-fractional-count", spec_with(evaluation=lm_eval(limit=2.5)), f"{FIELD}.limit",
            lmevalrules.LIMIT_MESSAGE),
    Invalid("lmeval-negative-fewshot", spec_with(evaluation=lm_eval(numFewshot=-1)), f"{FIELD}.numFewshot",
            "must be greater than or equal to 0", admission="should be greater than or equal to 0",
            python_exact=False),
    Invalid("lmeval-collectives", spec_with(mode="collectives", checkpoint=None, evaluation=lm_eval()), FIELD,
            lmevalrules.COLLECTIVES_MESSAGE),
    Invalid("lmeval-unmerged-lora", spec_with(training={"method": "lora", "lora": {"exportMerged": False}},
                                              evaluation=lm_eval()), FIELD, lmevalrules.UNMERGED_MESSAGE),
    # The fit's twin: the apiserver names the figures too (the model id as the planner matches it, lower case).
    Invalid("lmeval-export-too-big", spec_with(model={"id": "google/gemma-4-31B-it"}, training={"method": "lora"},
                                               evaluation=lm_eval()), FIELD,
            "in bfloat16 needs 58.2 GiB (its weights and 1 GiB for lm-eval's forward) on the one v6e chip",
            admission="google/gemma-4-31b-it in bfloat16 needs 58.2 GiB (its weights and 1 GiB for lm-eval's "
                      "forward) on the one v6e chip lm-eval runs on, more than the 28.8 GiB usable",
            python_exact=False),
    Invalid("lmeval-include-path-line-break", spec_with(evaluation=lm_eval(includePath="gs://b/t\nx")),
            f"{FIELD}.includePath", "must hold no control character", admission="should match", python_exact=False),
]
LM_EVAL_ACCEPTED = [
    spec_with(evaluation=lm_eval()),
    spec_with(evaluation=lm_eval(tasks=["hellaswag", "arc_easy", "mmlu_abstract_algebra", "my-task.v2"],
                                 numFewshot=0, limit=0.05, includePath="gs://bucket/tasks")),
    spec_with(evaluation=lm_eval(limit=1)),
    spec_with(evaluation=lm_eval(limit=200)),
    spec_with(training={"method": "lora"}, evaluation=lm_eval()),
    spec_with(training={"method": "dpo"}, evaluation=lm_eval()),
    spec_with(evaluation={}),
    # A chip that holds 31B's export (v5p): admitted by the fit's twin as by parse_spec.
    spec_with(tpu={"generation": "v5p", "topology": "2x2x1"}, model={"id": "google/gemma-4-31B-it"},
              training={"method": "lora"}, evaluation=lm_eval()),
]


@pytest.mark.parametrize("case", LM_EVAL_INVALID, ids=lambda c: c.id)
def test_parse_spec_refuses_each_case_naming_its_field(case):
    with pytest.raises(SpecError) as caught:
        parse_spec(case.spec)
    assert caught.value.field == case.field
    assert case.message in str(caught.value)


@pytest.mark.parametrize("spec", LM_EVAL_ACCEPTED, ids=str)
def test_parse_spec_accepts_each_spec(spec):
    parse_spec(spec)


def test_every_cel_twin_is_in_the_crd_with_its_message():
    spec = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    messages = {rule.get("message") for rule in spec["x-kubernetes-validations"]}
    assert {lmevalrules.LIMIT_MESSAGE, lmevalrules.COLLECTIVES_MESSAGE, lmevalrules.UNMERGED_MESSAGE} <= messages
    tasks = spec["properties"]["evaluation"]["properties"]["lmEval"]["properties"]["tasks"]
    assert tasks["x-kubernetes-list-type"] == "set" and tasks["minItems"] == 1


def refusal(spec: dict) -> str:
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    assert caught.value.field == FIELD
    return str(caught.value)


def test_an_export_too_big_for_the_one_chip_lm_eval_runs_on_is_refused_naming_the_figure():
    """The trainer loads the whole export on one worker's TPU device: its bf16 weights and lm-eval's
    allowance must fit that device's HBM (the planner's headroom kept)."""
    on_v6e = refusal(spec_with(model={"id": "google/gemma-4-31B-it"}, training={"method": "lora"},
                               evaluation=lm_eval()))
    assert ("google/gemma-4-31B-it in bfloat16 needs 58.2 GiB (its weights and 1 GiB for lm-eval's forward) on the "
            "one v6e chip lm-eval runs on, more than the 28.8 GiB usable of its 32 GiB of HBM") in on_v6e
    assert "14.4 GiB usable of its 16 GiB" in refusal(spec_with(
        tpu={"generation": "v5e", "topology": "2x2"}, model={"id": "google/gemma-4-E4B-it"}, evaluation=lm_eval()))
    # A chip that holds it (v5p; a v7x chiplet), a model the table does not know, the cpu stand-in: not refused.
    parse_spec(spec_with(tpu={"generation": "v5p", "topology": "2x2x1"}, model={"id": "google/gemma-4-31B-it"},
                         training={"method": "lora"}, evaluation=lm_eval()))
    parse_spec(spec_with(tpu={"generation": "v7x", "topology": "2x2x1"}, model={"id": "google/gemma-4-31B-it"},
                         training={"method": "lora"}, evaluation=lm_eval()))
    parse_spec(spec_with(model={"id": "gs://bucket/my-70b"}, evaluation=lm_eval()))
    parse_spec(spec_with(tpu={"generation": "cpu", "topology": "1"}, evaluation=lm_eval()))


# The last operator without spec.evaluation.
PRE_LM_EVAL_COMMIT = "3681d761b006cb1fb520fbee70a4c188af6e5141"


def test_an_operator_older_than_lm_eval_runs_the_spec_without_it_and_names_it_ignored(tmp_path):
    """A rollback: the older operator drops spec.evaluation as an unknown field and says so (the
    SpecFieldsIgnored condition), and runs the fine-tune as before; it never evaluates."""
    older = older_operator_package.extract(PRE_LM_EVAL_COMMIT, tmp_path, "pre-lmEval")
    spec = spec_with(evaluation=lm_eval(limit=8))
    parse_spec(spec)  # this operator runs it
    answer = older_operator_package.reads(older, spec)
    assert answer["ignored"] == ["spec.evaluation"]
    assert answer["says"].startswith("this operator version does not know spec.evaluation and runs without it")
    assert not [a for a in answer["argv"] if "lmeval" in a]


# ---- the real apiserver -----------------------------------------------------------------------


def manifest(name: str, spec: dict) -> str:
    return yaml.safe_dump({"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune",
                           "metadata": {"name": name}, "spec": spec})


@pytest.mark.cluster
@pytest.mark.parametrize("case", LM_EVAL_INVALID, ids=lambda c: c.id)
def test_the_apiserver_refuses_each_case(control_plane, namespace, case):
    result = control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=manifest("bad", case.spec), check=False)
    assert result.returncode != 0, f"admitted: {case.id}"
    error = " ".join(result.stderr.split())
    assert case.field.removeprefix("spec.").split("[")[0] in error, error
    assert (case.admission or case.message) in error, error


@pytest.mark.cluster
def test_the_apiserver_admits_each_accepted_spec(control_plane, namespace):
    for index, spec in enumerate(LM_EVAL_ACCEPTED):
        result = control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=manifest(f"lmeval-{index}", spec),
                                       check=False)
        assert result.returncode == 0, result.stderr


def test_an_older_operator_meeting_a_run_mid_evaluation_ends_it_succeeded_and_releases_the_slice(tmp_path):
    """Why the phase stays Running while the export is evaluated: after a rollback the older
    operator reads the attempt's own job (the fine-tune's, succeeded), ends the run Succeeded and
    releases the slice, carrying status.evaluation as it found it."""
    from datetime import datetime, timezone

    from tpufinetune.core import phaselmeval, phases
    from tpufinetune.core.phases import ClusterView, Identity, JobView, Observations, Plan

    now = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
    ident, plan = Identity("demo", "ns", "uid-1"), Plan(cluster_name="demo-rc", epochs=1, lm_eval_tasks=("hellaswag",))
    ready = ClusterView(exists=True, owned=True, ready=True, dashboard_url="http://head:8265", uid="rc-1")
    status: dict = {}
    for cluster, job in ((None, None), (None, None), (ready, None), (ready, JobView("RUNNING"))):
        status = phases.transition(ident, plan, status, Observations(now=now, cluster=cluster, job=job)).status
    result = {"event": "result", "exported_model_uri": "gs://b/ckpt/run/export", "best_checkpoint_uri": "gs://b/c"}
    status = phases.transition(ident, plan, status, Observations(now=now, cluster=ready, job=JobView("SUCCEEDED"),
                                                                 events=(result,))).status
    assert phaselmeval.evaluating(status)
    older = older_operator_package.extract(PRE_LM_EVAL_COMMIT, tmp_path, "pre-lmEval")
    probe = ("import json, sys\nfrom datetime import datetime, timezone\nfrom tpufinetune.core import phases\n"
             "from tpufinetune.core.phases import ClusterView, Identity, JobView, Observations, Plan\n"
             "status = json.loads(sys.argv[1])\n"
             "d = phases.transition(Identity('demo', 'ns', 'uid-1'), Plan(cluster_name='demo-rc', epochs=1), status,"
             " Observations(now=datetime(2026, 1, 1, 12, 5, tzinfo=timezone.utc), job=JobView('SUCCEEDED'),"
             " cluster=ClusterView(exists=True, owned=True, ready=True, dashboard_url='http://head:8265')))\n"
             "print(json.dumps({'phase': d.phase, 'actions': [type(a).__name__ for a in d.actions],"
             " 'evaluation': d.status.get('evaluation')}))\n")
    answer = older_operator_package.run(older, probe, json.dumps(status))
    assert answer["phase"] == "Succeeded" and "DeleteCluster" in answer["actions"]
    assert answer["evaluation"] == status["evaluation"]
