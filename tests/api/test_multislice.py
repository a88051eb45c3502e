"""Several slices (spec.tpu.slices > 1): one worker group whose replicas are the slices, each
on a node pool of its own, the slice index handed to every worker from KubeRay's replica
label; the MEGASCALE variables the TPU runtime joins the slices by; the trainer told the slice
count; Kueue and the memory planner counting every slice."""
from __future__ import annotations

import pytest
from api_spec_cases import spec_with

from tpufinetune.core import megascale
from tpufinetune.core.api import parse_spec
from tpufinetune.core.jobspec import preflight_submission, trainer_argv
from tpufinetune.core.memplan_spec import plan_spec
from tpufinetune.core.podtemplate import raycluster_with_pod_settings
from tpufinetune.core.sizing import NODEPOOL_LABEL, REPLICA_INDEX_LABEL, SLICE_INDEX_ENV, raycluster_name
from tpufinetune_trainer import backends as trainer_backends
from tpufinetune_trainer import cli as trainer_cli

UID = "6f1c2a7e-0b1d-4c55-9a57-3c1e0d2b8f10"


def render(**tpu) -> dict:
    spec = parse_spec(spec_with(tpu={"generation": "v6e", "topology": "4x4", **tpu}))
    return raycluster_with_pod_settings("two", "ml", UID, spec)


def worker_group(cluster: dict) -> dict:
    (group,) = cluster["spec"]["workerGroupSpecs"]
    return group


def test_two_slices_are_two_replicas_of_four_hosts_each_on_its_own_pool(kuberay_schema, webhook_refusal):
    cluster = render(slices=2)
    group = worker_group(cluster)
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"], group["numOfHosts"]) == (2, 2, 2, 4)
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4"}
    selector = {"matchLabels": {"ray.io/cluster": raycluster_name("two"), "ray.io/group": "v6e-16"}}
    (together,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together == {"labelSelector": selector, "matchLabelKeys": [REPLICA_INDEX_LABEL],
                        "topologyKey": NODEPOOL_LABEL}
    (apart,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert apart == {"labelSelector": selector, "mismatchLabelKeys": [REPLICA_INDEX_LABEL],
                     "topologyKey": NODEPOOL_LABEL}
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env[SLICE_INDEX_ENV]["valueFrom"] == {
        "fieldRef": {"fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}}
    assert kuberay_schema.problems(cluster) == [] and webhook_refusal(cluster) is None


def worker_env(cluster: dict) -> dict[str, dict]:
    return {e["name"]: e for e in worker_group(cluster)["template"]["spec"]["containers"][0]["env"]}


def test_every_worker_of_two_multi_host_slices_gets_the_four_megascale_values_of_its_slice(kuberay_schema):
    """The slice id from the replica label (as TPUFT_SLICE_INDEX); the coordinator by the name
    GKE's TPU webhook gives slice 0's first host under KubeRay's headless worker Service."""
    cluster = render(slices=2)
    env = worker_env(cluster)
    assert env["MEGASCALE_NUM_SLICES"] == {"name": "MEGASCALE_NUM_SLICES", "value": "2"}
    assert env["MEGASCALE_SLICE_ID"]["valueFrom"] == env[SLICE_INDEX_ENV]["valueFrom"] == {
        "fieldRef": {"fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}}
    assert env["MEGASCALE_PORT"]["value"] == "8081"
    assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == f"v6e-16-0-0.{raycluster_name('two')}-headless"
    assert kuberay_schema.problems(cluster) == []


def test_single_host_and_cpu_slices_get_no_coordinator_name_for_the_trainer_sets_it_from_the_live_group():
    """No DNS name exists for a single-host slice's pod (no headless Service, no webhook
    hostname), nor on the cpu stand-in: the trainer's backends.megascale_env gives it."""
    single = worker_env(render(topology="2x2", slices=3))
    assert single["MEGASCALE_NUM_SLICES"]["value"] == "3" and "MEGASCALE_SLICE_ID" in single
    assert "MEGASCALE_COORDINATOR_ADDRESS" not in single
    cpu = worker_env(raycluster_with_pod_settings("two", "ml", UID, parse_spec(
        spec_with(tpu={"generation": "cpu", "topology": "2", "slices": 2}))))
    assert {"MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_PORT"} <= set(cpu)
    assert "MEGASCALE_COORDINATOR_ADDRESS" not in cpu


def test_the_operator_and_the_trainer_agree_on_the_megascale_names_and_port():
    operator_names = (megascale.COORDINATOR_ENV, megascale.NUM_SLICES_ENV, megascale.SLICE_ID_ENV, megascale.PORT_ENV)
    assert operator_names == trainer_backends.MEGASCALE_ENV
    assert megascale.DEFAULT_PORT == trainer_backends.DEFAULT_MEGASCALE_PORT


def test_one_slice_renders_no_pool_rules_and_no_slice_index():
    pod = worker_group(render())["template"]["spec"]
    assert "affinity" not in pod
    names = {e["name"] for e in pod["containers"][0]["env"]}
    assert SLICE_INDEX_ENV not in names and not any(n.startswith("MEGASCALE_") for n in names)


def test_cpu_slices_get_the_slice_index_but_no_node_pool_rules():
    spec = parse_spec(spec_with(tpu={"generation": "cpu", "topology": "2", "slices": 2}))
    group = worker_group(raycluster_with_pod_settings("two", "ml", UID, spec))
    assert (group["replicas"], group["numOfHosts"]) == (2, 2)
    pod = group["template"]["spec"]
    assert "affinity" not in pod
    assert SLICE_INDEX_ENV in {e["name"] for e in pod["containers"][0]["env"]}


def test_kueue_counts_every_host_of_every_slice():
    """Kueue's RayCluster integration admits a worker group as replicas x numOfHosts pods of
    the template's requests: 2 slices x 4 hosts x 4 chips."""
    cluster = raycluster_with_pod_settings("two", "ml", UID, parse_spec(spec_with(
        tpu={"generation": "v6e", "topology": "4x4", "slices": 2}, queueName="tpu-queue")))
    group = worker_group(cluster)
    pods = group["replicas"] * group["numOfHosts"]
    chips = int(group["template"]["spec"]["containers"][0]["resources"]["requests"]["google.com/tpu"])
    assert cluster["spec"]["suspend"] is True and (pods, pods * chips) == (8, 32)


def test_the_trainer_is_told_the_slices_and_every_slices_devices():
    argv = trainer_argv(parse_spec(spec_with(tpu__slices=2)))
    assert "--num-workers=32" in argv and "--num-slices=2" in argv
    assert not any(a.startswith("--num-slices") for a in trainer_argv(parse_spec(spec_with())))
    collectives = trainer_argv(parse_spec(spec_with(mode="collectives", checkpoint=None, tpu__slices=2)))
    assert not any(a.startswith("--num-slices") for a in collectives)
    args = trainer_cli.build_parser().parse_args(argv[1:])
    assert trainer_cli._config(args).validate().num_slices == 2


def test_a_two_slice_runs_preflight_is_parsed_by_the_trainer_with_its_slices():
    spec = parse_spec(spec_with(tpu__slices=2, preflight={"enabled": True}))
    argv = preflight_submission("two", "ml", UID, spec, 1).entrypoint_argv
    assert argv[1] == "collectives" and "--num-slices=2" in argv
    args = trainer_cli.build_parser().parse_args(argv[1:])
    assert trainer_cli._config(args).validate().num_slices == 2


@pytest.mark.parametrize("slices", [1, 2, 4])
def test_the_memory_plan_is_one_slices_sharding_whatever_the_slices(slices):
    spec = parse_spec(spec_with(tpu__slices=slices))
    plan, one = plan_spec(spec), plan_spec(parse_spec(spec_with()))
    assert plan.per_chip_bytes == one.per_chip_bytes > 0 and plan.host_bytes == one.host_bytes
    assert (f"v6e 4x4 x {slices} slices" in plan.summary()) == (slices > 1)
