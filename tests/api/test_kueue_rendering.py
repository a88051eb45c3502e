"""spec.queueName: the RayCluster is created suspended, with Kueue's queue label (and its
WorkloadPriorityClass label), so Kueue admits it without its webhook. Without a queue
nothing of Kueue appears."""
from __future__ import annotations

from api_spec_cases import spec_with

from tpufinetune.core.api import parse_spec
from tpufinetune.core.podtemplate import raycluster_with_pod_settings
from tpufinetune.core.sizing import PRIORITY_CLASS_LABEL, QUEUE_NAME_LABEL

UID = "6f1c2a7e-0b1d-4c55-9a57-3c1e0d2b8f10"


def render(**changes) -> dict:
    return raycluster_with_pod_settings("demo", "team-a", UID, parse_spec(spec_with(**changes)))


def test_a_queued_run_renders_a_suspended_raycluster_labelled_for_its_queue():
    cluster = render(queueName="tpu-queue", workloadPriorityClassName="high")
    assert cluster["spec"]["suspend"] is True
    assert cluster["metadata"]["labels"][QUEUE_NAME_LABEL] == "tpu-queue"
    assert cluster["metadata"]["labels"][PRIORITY_CLASS_LABEL] == "high"
    # The operator's own labels stay.
    assert cluster["metadata"]["labels"]["tpufinetune.dev/name"] == "demo"


def test_a_queue_without_priority_class_adds_only_the_queue_label():
    labels = render(queueName="tpu-queue")["metadata"]["labels"]
    assert QUEUE_NAME_LABEL in labels and PRIORITY_CLASS_LABEL not in labels


def test_without_a_queue_nothing_of_kueue_is_rendered():
    cluster = render()
    assert "suspend" not in cluster["spec"]
    assert not any(key.startswith("kueue.x-k8s.io/") for key in cluster["metadata"]["labels"])
