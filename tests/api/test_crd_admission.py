"""The generated CRD in a real kube-apiserver: schema + CEL refuse what parse_spec refuses
(CEL twins with the very same words), defaults match pydantic's, `kubectl explain` and
`kubectl get` show what users need, and rendered RayClusters pass KubeRay's real CRD."""
from __future__ import annotations

import json

import pytest
import yaml
from api_spec_cases import GENERATION_ACCEPTED, INVALID, PVC, TOWERS_ACCEPTED, base_spec, shared_volume, spec_with

from harness.waiting import wait_for
from tpufinetune.core.api import parse_spec
from tpufinetune.core.podtemplate import raycluster_with_pod_settings

pytestmark = pytest.mark.cluster

UID = "6f1c2a7e-0b1d-4c55-9a57-3c1e0d2b8f10"

VALID = [
    spec_with(tpu={"generation": "v4", "topology": "2x2x1"}),
    spec_with(tpu={"generation": "v5litepod", "topology": "2x4", "chipsPerHost": 8}),
    spec_with(tpu={"generation": "v5p", "topology": "4x4x8", "spot": True}),
    spec_with(tpu={"generation": "trillium", "topology": "1x1", "reservation": "resv-1"}),
    spec_with(tpu={"generation": "ironwood", "topology": "2x2x2"},
              model={"tokenSecret": {"name": "hf-secret", "key": "hf_api_token"}}),
    spec_with(mode="collectives", checkpoint=None,
              tpu={"generation": "tpu7x", "topology": "4x4x4", "slices": 4}),
    spec_with(tpu={"generation": "v6e", "topology": "4x4", "slices": 2},
              training={"globalBatchBlocks": 256}),
    spec_with(tpu={"generation": "v5p", "topology": "16x16x24", "slices": 3}),
    spec_with(tpu={"generation": "cpu", "topology": "2", "slices": 32}),
    spec_with(activeDeadlineSeconds=86400, ttlSecondsAfterFinished=600, noProgressTimeoutSeconds=0),
    spec_with(noProgressTimeoutSeconds=60),
    spec_with(training={"method": "lora"}),
    spec_with(training={"method": "lora", "lora": {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj"],
                                                   "exportMerged": False}}),
    spec_with(training={"method": "dpo"}),
    spec_with(training={"method": "dpo", "datasetFormat": "preference", "lossOn": "responses", "lora": {},
                        "dpo": {"beta": 0.5, "loss": "sigmoid", "labelSmoothing": 0.2, "referenceFree": True}}),
    spec_with(training={"method": "dpo", "dpo": {"loss": "ipo", "labelSmoothing": 0}}),
    spec_with(tpu={"generation": "cpu", "topology": "3"}, serviceAccountName="trainer",
              workers={"resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": 1}}}),
    spec_with(head={"serviceAccountName": "head-sa", "priorityClassName": "high",
                    "labels": {"team": "ml"}, "env": [{"name": "A", "value": "1"}]},
              workers={"annotations": {"gke-gcsfuse/volumes": "true"},
                       "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                       "volumes": [{"name": "gcs", "csi": {
                           "driver": "gcsfuse.csi.storage.gke.io",
                           "volumeAttributes": {"bucketName": "b"}}},
                           {"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}],
                       "volumeMounts": [{"name": "gcs", "mountPath": "/mnt/gcs"},
                                        {"name": "ckpt", "mountPath": "/mnt/ckpt"}],
                       "env": [{"name": "K", "valueFrom": {
                           "secretKeyRef": {"name": "s", "key": "k"}}}]}),
    # A local checkpoint path under one shared volume on head and workers.
    spec_with(checkpoint={"storagePath": "/mnt/ckpt/run"}, head=shared_volume(PVC),
              workers=shared_volume(PVC)),
    spec_with(checkpoint={"storagePath": "file:///mnt/ckpt"}, head=shared_volume(PVC, subPath="a"),
              workers=shared_volume(PVC, subPath="a")),
    spec_with(checkpoint={"storagePath": "/mnt/gcs/ray"},
              head=shared_volume({"csi": {"driver": "gcsfuse.csi.storage.gke.io",
                                          "volumeAttributes": {"bucketName": "b"}}}, "/mnt/gcs/"),
              workers=shared_volume({"csi": {"driver": "gcsfuse.csi.storage.gke.io",
                                             "volumeAttributes": {"bucketName": "b"}}}, "/mnt/gcs/")),
    spec_with(checkpoint={"storagePath": "/nfs/ckpt"},
              head=shared_volume({"nfs": {"server": "10.0.0.2", "path": "/export"}}, "/nfs"),
              workers=shared_volume({"nfs": {"server": "10.0.0.2", "path": "/export"}}, "/nfs")),
    spec_with(checkpoint={"storagePath": "s3://bucket/ckpt"}),
] + GENERATION_ACCEPTED + TOWERS_ACCEPTED  # training.evaluation, training.towers: what parse_spec accepts, the CEL rules admit


def manifest(name: str, spec: dict) -> str:
    return yaml.safe_dump({"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune",
                           "metadata": {"name": name}, "spec": spec})


def apply(cp, namespace: str, text: str, *extra: str):
    return cp.kubectl("apply", "-n", namespace, *extra, "-f", "-", input=text, check=False)


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_invalid_spec_is_refused_by_the_apiserver(control_plane, namespace, case):
    result = apply(control_plane, namespace, manifest("bad", case.spec))
    assert result.returncode != 0, f"admitted: {case.id}"
    error = " ".join(result.stderr.split())
    assert case.field in error, error
    # CEL twins print parse_spec's exact words; schema checks print the apiserver's.
    assert (case.admission or case.message) in error, error
    stored = control_plane.kubectl("get", "tft", "-n", namespace, "-o", "name")
    assert stored.stdout.strip() == ""


def test_valid_specs_are_admitted_and_parse(control_plane, namespace):
    for index, spec in enumerate(VALID):
        parse_spec(spec)  # the operator accepts exactly what admission accepts
        result = apply(control_plane, namespace, manifest(f"ok-{index}", spec))
        assert result.returncode == 0, result.stderr


def test_admission_defaults_equal_pydantic_defaults(control_plane, namespace):
    assert apply(control_plane, namespace, manifest("defaults", base_spec())).returncode == 0
    stored = json.loads(control_plane.kubectl("get", "tft", "defaults", "-n", namespace,
                                              "-o", "json").stdout)["spec"]
    assert stored["model"]["id"] == "google/gemma-4-E2B-it"
    assert stored["training"]["epochs"] == 3 and stored["tpu"]["slices"] == 1
    expected = parse_spec(base_spec()).model_dump(by_alias=True, exclude_none=True,
                                                  mode="json")
    assert stored == expected


def test_kubectl_explain_shows_field_descriptions(control_plane):
    def explain():
        result = control_plane.kubectl("explain", "tpufinetune.spec.tpu", check=False)
        return result if result.returncode == 0 and "topology" in result.stdout else None

    # The apiserver publishes a new CRD's OpenAPI a moment after it is Established.
    result = wait_for(explain, 10, "kubectl explain tpufinetune.spec.tpu to succeed", interval=0.25)
    text = " ".join(result.stdout.split())
    assert "Physical chip arrangement of one slice" in text
    assert "chipsPerHost" in text and "Accepted names: v4; v5e (v5litepod)" in text


def test_kubectl_get_shows_the_printer_columns(control_plane, namespace):
    assert apply(control_plane, namespace, manifest("cols", base_spec())).returncode == 0
    status = {"status": {
        "phase": "Running", "epoch": 2, "epochs": 3, "epochProgress": "2/3", "loss": 2.205,
        "tokensPerSecond": 20545.2, "checkpointURI": "gs://my-bucket/ckpt_2",
        "message": "epoch 2 done", "progress": {"summary": "62%"}, "attempt": 2,
        "usage": {"chipHours": 12.5, "hostHours": 3.125, "provisioningSeconds": 40},
        # The wide listing shows the latest attempt's time to first step.
        "attempts": [{"attempt": 1, "startTime": "2026-01-01T00:00:00Z", "startup": {"firstStepSeconds": 95.5}},
                     {"attempt": 2, "startTime": "2026-01-01T01:00:00Z", "startup": {"firstStepSeconds": 41.5}}],
        "conditions": [{"type": "Ready", "status": "True", "reason": "JobRunning",
                        "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
    }}
    control_plane.kubectl("patch", "tft", "cols", "-n", namespace, "--subresource=status",
                          "--type=merge", "-p", json.dumps(status))
    header, row = control_plane.kubectl("get", "tft", "-n", namespace).stdout.splitlines()[:2]
    assert header.split() == ["NAME", "GENERATION", "TOPOLOGY", "MODE", "PHASE", "EPOCH",
                              "PROGRESS", "LOSS", "TOKENS/S", "AGE"]
    assert row.split()[:9] == ["cols", "v6e", "4x4", "finetune", "Running", "2/3", "62%",
                               "2.205", "20545.2"]
    header, row = control_plane.kubectl("get", "tpufinetunes", "-n", namespace,
                                        "-o", "wide").stdout.splitlines()[:2]
    assert header.split()[-7:] == ["CHECKPOINT", "ATTEMPTS", "CHIP-HOURS", "FIRST", "STEP", "(S)", "MESSAGE"]
    assert row.split()[-7:] == ["gs://my-bucket/ckpt_2", "2", "12.5", "41.5", "epoch", "2", "done"]


def test_kubectl_get_all_and_the_category_list_the_runs(control_plane, namespace):
    assert apply(control_plane, namespace, manifest("listed", base_spec())).returncode == 0
    for category in ("all", "tpufinetune"):
        names = control_plane.kubectl("get", category, "-n", namespace, "-o", "name").stdout
        assert "tpufinetune.tpufinetune.dev/listed" in names.split(), (category, names)


def test_render_output_applies_with_kubectl(control_plane, kuberay_crd, namespace):
    """tpufinetune render FILE | kubectl apply -f -: stdout holds only Kubernetes objects."""
    from tpufinetune.core.render import render

    spec = spec_with(workers={"annotations": {"gke-gcsfuse/volumes": "true"}})
    resource = {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune",
                "metadata": {"name": "piped", "namespace": namespace}, "spec": spec}
    result = apply(control_plane, namespace, render([resource], "piped.yaml"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "raycluster.ray.io/tft-piped created"


def test_rendered_rayclusters_pass_the_real_kuberay_crd(control_plane, kuberay_crd, namespace):
    documents = [raycluster_with_pod_settings(f"run-{index}", namespace, UID, parse_spec(spec))
                 for index, spec in enumerate(VALID)]
    result = apply(control_plane, namespace, yaml.safe_dump_all(documents),
                   "--dry-run=server")
    assert result.returncode == 0, result.stderr


def test_a_run_that_starts_from_itself_is_refused_and_a_chained_one_is_stored_as_written(control_plane, namespace):
    """spec.model.initFrom.run naming the object itself: only the object's own CEL rule reads
    metadata.name (parse_spec never sees it; the operator refuses it again at the first step)."""
    from tpufinetune.core.api import INIT_FROM_SELF_MESSAGE

    result = apply(control_plane, namespace, manifest("dpo", spec_with(model={"initFrom": {"run": "dpo"}})))
    error = " ".join(result.stderr.split())
    assert result.returncode != 0 and "spec.model.initFrom.run" in error and INIT_FROM_SELF_MESSAGE in error, error
    assert apply(control_plane, namespace, manifest("dpo", spec_with(model={"initFrom": {"run": "sft"}}))).returncode == 0
    stored = json.loads(control_plane.kubectl("get", "tft", "dpo", "-n", namespace, "-o", "json").stdout)["spec"]
    assert stored["model"]["initFrom"] == {"run": "sft", "artifact": "export"}
