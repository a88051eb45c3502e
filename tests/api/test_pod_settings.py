"""spec.head / spec.workers pod settings: merged into the RayCluster's pod templates, never
over what the slice decides (resources, node selectors, /dev/shm, the operator's env)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from api_spec_cases import base_spec, spec_with

from tpufinetune.core.api import parse_spec
from tpufinetune.core.podtemplate import apply_pod_settings, raycluster_with_pod_settings
from tpufinetune.core.sizing import pod_labels, render_raycluster

SAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "samples"
UID = "6f1c2a7e-0b1d-4c55-9a57-3c1e0d2b8f10"

EVERY_SETTING = {
    "serviceAccountName": "trainer-gcs",
    "priorityClassName": "tpu-high",
    "annotations": {"gke-gcsfuse/volumes": "true", "gke-gcsfuse/cpu-limit": "0"},
    "labels": {"team": "ml", "example.com/cost-center": "42"},
    "tolerations": [{"key": "example.com/dedicated", "operator": "Equal", "value": "ml",
                     "effect": "NoSchedule"}],
    "volumes": [
        {"name": "gcs", "csi": {"driver": "gcsfuse.csi.storage.gke.io",
                                "volumeAttributes": {"bucketName": "my-bucket",
                                                     "mountOptions": "implicit-dirs"}}},
        {"name": "shared", "persistentVolumeClaim": {"claimName": "checkpoints"}},
    ],
    "volumeMounts": [{"name": "gcs", "mountPath": "/gcs"},
                     {"name": "shared", "mountPath": "/mnt/checkpoints", "subPath": "runs"}],
    "env": [{"name": "EXTRA", "value": "1"},
            {"name": "WANDB_API_KEY",
             "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}],
}

SPECS = {
    "v6e-4x4": base_spec(),
    "v7x-2x2x2": spec_with(tpu={"generation": "v7x", "topology": "2x2x2", "spot": True},
                           model={"tokenSecret": {"name": "hf", "key": "token"}}),
    "cpu-3": spec_with(tpu={"generation": "cpu", "topology": "3"}),
}


def _pods(cluster: dict) -> list[dict]:
    return [cluster["spec"]["headGroupSpec"]["template"],
            *(group["template"] for group in cluster["spec"]["workerGroupSpecs"])]


def _sized_parts(cluster: dict) -> list:
    """Everything the slice and the operator decide."""
    parts = [cluster["metadata"], cluster["spec"]["rayVersion"],
             cluster["spec"]["headGroupSpec"]["rayStartParams"]]
    for group in cluster["spec"]["workerGroupSpecs"]:
        parts.append({k: v for k, v in group.items() if k != "template"})
    for pod in _pods(cluster):
        spec, container = pod["spec"], pod["spec"]["containers"][0]
        sized_volumes = [v for v in spec.get("volumes", []) if v["name"] == "dshm"]
        parts += [spec.get("nodeSelector"), container["resources"], container["image"],
                  container.get("ports"), sized_volumes,
                  [m for m in container.get("volumeMounts", []) if m["name"] == "dshm"]]
    return parts


@pytest.mark.parametrize("name", SPECS)
def test_pod_settings_never_change_what_the_slice_decides(name):
    plain_spec = parse_spec(SPECS[name])
    plain = render_raycluster("run", "ml", UID, plain_spec)
    merged = raycluster_with_pod_settings(
        "run", "ml", UID, parse_spec({**SPECS[name], "head": EVERY_SETTING,
                                      "workers": EVERY_SETTING}))
    assert _sized_parts(merged) == _sized_parts(plain)
    for plain_pod, pod in zip(_pods(plain), _pods(merged)):
        plain_env = plain_pod["spec"]["containers"][0].get("env", [])
        # The operator's env (HF_TOKEN, RAY_TPU_RESOURCE_PER_CHIP) comes first, unchanged.
        assert pod["spec"]["containers"][0]["env"][:len(plain_env)] == plain_env


def test_every_setting_lands_in_both_pod_templates():
    spec = parse_spec(spec_with(head=EVERY_SETTING, workers=EVERY_SETTING))
    for template in _pods(raycluster_with_pod_settings("run", "ml", UID, spec)):
        # The users' labels, and the operator's own (its pod watch selects on them).
        assert template["metadata"] == {"annotations": EVERY_SETTING["annotations"],
                                        "labels": {**EVERY_SETTING["labels"], **pod_labels("run")}}
        pod = template["spec"]
        container = pod["containers"][0]
        assert pod["serviceAccountName"] == "trainer-gcs"
        assert pod["priorityClassName"] == "tpu-high"
        assert pod["tolerations"] == EVERY_SETTING["tolerations"]
        # Schema defaults (readOnly: false) are written out, as the apiserver stores them.
        gcs = EVERY_SETTING["volumes"][0]
        assert [v for v in pod["volumes"] if v["name"] != "dshm"] == [
            {"name": "gcs", "csi": {**gcs["csi"], "readOnly": False}},
            {"name": "shared", "persistentVolumeClaim": {"claimName": "checkpoints",
                                                         "readOnly": False}}]
        assert [m for m in container["volumeMounts"] if m["name"] != "dshm"] == [
            {"name": "gcs", "mountPath": "/gcs", "readOnly": False},
            {"name": "shared", "mountPath": "/mnt/checkpoints", "readOnly": False,
             "subPath": "runs"}]
        assert container["env"][-2:] == EVERY_SETTING["env"]


def test_group_service_account_overrides_the_spec_wide_one():
    spec = parse_spec(spec_with(serviceAccountName="everyone",
                                workers={"serviceAccountName": "workers-only"}))
    head, worker = _pods(raycluster_with_pod_settings("run", "ml", UID, spec))
    assert head["spec"]["serviceAccountName"] == "everyone"
    assert worker["spec"]["serviceAccountName"] == "workers-only"


def test_no_settings_render_exactly_the_sized_raycluster():
    spec = parse_spec(base_spec())
    plain = render_raycluster("run", "ml", UID, spec)
    assert apply_pod_settings(plain, spec) == plain


def test_merging_leaves_its_input_alone():
    spec = parse_spec(spec_with(workers=EVERY_SETTING))
    plain = render_raycluster("run", "ml", UID, spec)
    before = yaml.safe_dump(plain)
    apply_pod_settings(plain, spec)
    assert yaml.safe_dump(plain) == before


@pytest.mark.parametrize("name", SPECS)
def test_merged_rayclusters_pass_kuberays_schema_and_tpu_webhook(name, kuberay_schema,
                                                                 webhook_refusal):
    spec = parse_spec({**SPECS[name], "head": EVERY_SETTING, "workers": EVERY_SETTING})
    cluster = raycluster_with_pod_settings("run", "ml", UID, spec)
    assert kuberay_schema.problems(cluster) == []
    assert webhook_refusal(cluster) is None


@pytest.mark.parametrize("sample,claim_or_driver", [
    ("cpu-rehearsal-pvc.yaml", "checkpoints"),
    ("finetune-v6e-4x4-gcsfuse.yaml", "gcsfuse.csi.storage.gke.io"),
])
def test_shared_storage_samples_mount_the_checkpoint_path_on_every_pod(sample,
                                                                      claim_or_driver):
    resource = yaml.safe_load((SAMPLES / sample).read_text())
    spec = parse_spec(resource["spec"])
    storage = spec.checkpoint.storage_path
    cluster = raycluster_with_pod_settings(resource["metadata"]["name"], "ml", UID, spec)
    for template in _pods(cluster):
        pod = template["spec"]
        mounts = pod["containers"][0]["volumeMounts"]
        mounted = [m for m in mounts if storage.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounted, f"{storage} is not on a shared volume in {template}"
        (volume,) = [v for v in pod["volumes"] if v["name"] == mounted[0]["name"]]
        source = volume.get("persistentVolumeClaim", {}).get("claimName") or \
            volume.get("csi", {}).get("driver")
        assert source == claim_or_driver
