"""deploy/samples/: the tutorial's two jobs, the interconnect check on both slices, the
CPU rehearsal (pod-local and on a ReadWriteMany claim), the v6e job on GCS FUSE, queued in
Kueue and across two slices; each validates as the operator validates, and the real API server (schema
and CEL rules of the generated CRD) accepts it in a server-side dry run."""

from __future__ import annotations

import pytest
from manifests import DEPLOY, documents, load

from tpufinetune.core.api import parse_spec

SAMPLES = {
    "finetune-v6e-4x4.yaml": ("v6e", "4x4", "finetune"),
    "finetune-v7x-2x2x2.yaml": ("v7x", "2x2x2", "finetune"),
    "collectives-v6e-4x4.yaml": ("v6e", "4x4", "collectives"),
    "collectives-v7x-2x2x2.yaml": ("v7x", "2x2x2", "collectives"),
    "cpu-rehearsal.yaml": ("cpu", "2", "finetune"),
    "cpu-rehearsal-pvc.yaml": ("cpu", "2", "finetune"),
    "finetune-v6e-4x4-gcsfuse.yaml": ("v6e", "4x4", "finetune"),
    "finetune-v6e-4x4-queued.yaml": ("v6e", "4x4", "finetune"),
    "finetune-v6e-4x4-lora.yaml": ("v6e", "4x4", "finetune"),
    "finetune-v6e-16-two-slices.yaml": ("v6e", "4x4", "finetune"),
    "dpo-lora-e4b-v6e.yaml": ("v6e", "2x4", "finetune"),
    "dpo-after-sft-e4b-v6e.yaml": ("v6e", "2x4", "finetune"),  # two runs, the second chained to the first
    "finetune-vision-e2b-v6e.yaml": ("v6e", "4x4", "finetune"),
}


def test_the_samples_folder_holds_exactly_these():
    assert sorted(p.name for p in (DEPLOY / "samples").glob("*.yaml")) == sorted(SAMPLES)
    names = [d["metadata"]["name"] for f in SAMPLES for d in documents((DEPLOY / "samples" / f).read_text())]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_sample_validates_as_the_operator_does(sample):
    for document in documents((DEPLOY / "samples" / sample).read_text()):
        spec = parse_spec(document["spec"])
        assert (spec.tpu.generation, spec.tpu.topology, spec.mode) == SAMPLES[sample]


@pytest.mark.parametrize("sample", ["finetune-v6e-4x4.yaml", "finetune-v7x-2x2x2.yaml"])
def test_finetune_samples_are_the_tutorials_job(sample):
    spec = load((DEPLOY / "samples" / sample).read_text())["spec"]
    assert spec["model"] == {"id": "google/gemma-4-E2B-it", "tokenSecret": {"name": "hf-secret", "key": "hf_api_token"}}
    assert spec["dataset"] == {"id": "databricks/databricks-dolly-15k", "split": "train[:1024]"}
    assert spec["training"] == {"epochs": 3, "batchSizePerDevice": 4, "maxSeqLen": 512,
                                "learningRate": 2e-5, "weightDecay": 0.01}
    assert spec["checkpoint"] == {"storagePath": "gs://BUCKET/ray_train_torchtpu", "keep": 1,
                                  "scoreAttribute": "loss", "scoreOrder": "min"}


def test_the_v6e_sample_checks_its_slice_before_the_fine_tune_and_retries_from_its_checkpoints():
    spec = parse_spec(load((DEPLOY / "samples" / "finetune-v6e-4x4.yaml").read_text())["spec"])
    assert spec.preflight is not None and spec.preflight.enabled
    assert spec.max_retries == 2  # the grace period is the rendered default (test_sizing_table.py)


def test_the_two_slice_sample_renders_one_raycluster_of_two_replicas_on_two_pools():
    from tpufinetune.core.render import load_documents, render

    sample = DEPLOY / "samples" / "finetune-v6e-16-two-slices.yaml"
    out = render(load_documents(sample.read_text(), sample.name), sample.name)
    clusters = [d for d in load_documents(out, "render") if d.get("kind") == "RayCluster"]
    assert len(clusters) == 1
    (group,) = clusters[0]["spec"]["workerGroupSpecs"]
    assert (group["groupName"], group["replicas"], group["numOfHosts"]) == ("v6e-16", 2, 4)
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4"}
    # Each replica's hosts share one node pool, and no other replica's pods are in it.
    affinity = pod["affinity"]
    (together,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (apart,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together["topologyKey"] == apart["topologyKey"] == "cloud.google.com/gke-nodepool"
    assert together["matchLabelKeys"] == apart["mismatchLabelKeys"] == ["ray.io/worker-group-replica-index"]
    assert "--num-slices=2" in out and "--num-workers=32" in out


@pytest.mark.cluster
@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_sample_passes_a_server_side_dry_run(control_plane, namespace, sample):
    result = control_plane.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", DEPLOY / "samples" / sample)
    names = [d["metadata"]["name"] for d in documents((DEPLOY / "samples" / sample).read_text())]
    assert result.stdout.strip().splitlines() == [f"tpufinetune.tpufinetune.dev/{n} created (server dry run)"
                                                  for n in names]


def test_the_dpo_sample_trains_adapters_with_preference_pairs():
    from tpufinetune.core.jobspec import trainer_argv

    spec = parse_spec(load((DEPLOY / "samples" / "dpo-lora-e4b-v6e.yaml").read_text())["spec"])
    assert (spec.model.id, spec.training.method, spec.training.lora_settings().rank) == (
        "google/gemma-4-E4B-it", "dpo", 16)
    argv = trainer_argv(spec, run_name="r")
    assert "--method=dpo" in argv and "--dpo-lora=true" in argv and "--dpo-beta=0.1" in argv


def test_the_chained_sample_starts_its_dpo_run_from_the_sft_runs_merged_export():
    from tpufinetune.core.render import load_documents, render

    sample = DEPLOY / "samples" / "dpo-after-sft-e4b-v6e.yaml"
    sft, dpo = (parse_spec(d["spec"]) for d in documents(sample.read_text()))
    sft_name = documents(sample.read_text())[0]["metadata"]["name"]
    assert (dpo.model.init_from.run, dpo.model.init_from.artifact, dpo.training.method) == (sft_name, "export", "dpo")
    assert sft.training.lora_settings().export_merged and dpo.training.lora_settings() is not None
    out = render(load_documents(sample.read_text(), sample.name), sample.name)
    assert out.count("memory plan: lora fine-tune of google/gemma-4-E4B-it") == 1
    assert out.count("memory plan: dpo fine-tune of google/gemma-4-E4B-it") == 1  # the SFT's base, not the default


def test_the_vision_sample_is_planned_with_its_frozen_tower_and_passes_it_to_the_trainer():
    from tpufinetune.core.render import load_documents, render

    sample = DEPLOY / "samples" / "finetune-vision-e2b-v6e.yaml"
    spec = parse_spec(load(sample.read_text())["spec"])
    assert (spec.model.id, spec.training.towers.vision, spec.training.dataset_format) == (
        "google/gemma-4-E2B-it", "frozen", "messages")
    out = render(load_documents(sample.read_text(), sample.name), sample.name)
    (plan,) = [line for line in out.splitlines() if "memory plan:" in line]
    assert "full fine-tune of google/gemma-4-E2B-it" in plan and "vision tower frozen (167M parameters" in plan
    assert "--vision-tower=frozen" in out and "--max-images-per-example=2" in out
