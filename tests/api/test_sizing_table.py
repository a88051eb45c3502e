"""Table tests: generation x topology -> RayCluster sizing, checked against the KubeRay
schema and the KubeRay TPU webhook's rule for every shape."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from api_spec_cases import spec_with

from tpufinetune.core import generations as g
from tpufinetune.core.api import parse_spec
from tpufinetune.core.errors import SpecError
from tpufinetune.core.sizing import (DEFAULT_TERMINATION_GRACE_SECONDS, NOTICE_ENV, MAX_CLUSTER_NAME, SHUTDOWN_ENV, raycluster_name, render_raycluster,
                                slice_shape, total_devices)

# generation, topology, chipsPerHost, expected: hosts, google.com/tpu, group, machine,
# Ray TPU resource per host (None when Ray's default of one per chip applies)
SHAPES = [
    ("v4", "2x2x1", None, 1, 4, "v4-8", "ct4p-hightpu-4t", None),
    ("v4", "2x2x2", None, 2, 4, "v4-16", "ct4p-hightpu-4t", None),
    ("v4", "2x2x4", None, 4, 4, "v4-32", "ct4p-hightpu-4t", None),
    ("v4", "4x4x4", None, 16, 4, "v4-128", "ct4p-hightpu-4t", None),
    ("v4", "8x8x12", None, 192, 4, "v4-1536", "ct4p-hightpu-4t", None),
    ("v4", "8x16x16", None, 512, 4, "v4-4096", "ct4p-hightpu-4t", None),
    ("v5e", "1x1", None, 1, 1, "v5litepod-1", "ct5lp-hightpu-1t", None),
    ("v5e", "2x2", None, 1, 4, "v5litepod-4", "ct5lp-hightpu-4t", None),
    ("v5litepod", "2x4", None, 2, 4, "v5litepod-8", "ct5lp-hightpu-4t", None),
    ("v5e", "2x4", 8, 1, 8, "v5litepod-8", "ct5lp-hightpu-8t", None),
    ("v5e", "4x4", None, 4, 4, "v5litepod-16", "ct5lp-hightpu-4t", None),
    ("v5e", "8x16", None, 32, 4, "v5litepod-128", "ct5lp-hightpu-4t", None),
    ("v5e", "16x16", None, 64, 4, "v5litepod-256", "ct5lp-hightpu-4t", None),
    ("v5p", "2x2x1", None, 1, 4, "v5p-8", "ct5p-hightpu-4t", None),
    ("v5p", "2x4x4", None, 8, 4, "v5p-64", "ct5p-hightpu-4t", None),
    ("v5p", "4x4x8", None, 32, 4, "v5p-256", "ct5p-hightpu-4t", None),
    ("v5p", "16x16x16", None, 1024, 4, "v5p-8192", "ct5p-hightpu-4t", None),
    ("v5p", "16x16x24", None, 1536, 4, "v5p-12288", "ct5p-hightpu-4t", None),
    ("v6e", "1x1", None, 1, 1, "v6e-1", "ct6e-standard-1t", None),
    ("v6e", "1x1", 1, 1, 1, "v6e-1", "ct6e-standard-1t", None),
    ("v6e", "2x2", None, 1, 4, "v6e-4", "ct6e-standard-4t", None),
    ("trillium", "2x4", None, 2, 4, "v6e-8", "ct6e-standard-4t", None),
    ("v6e", "2x4", 8, 1, 8, "v6e-8", "ct6e-standard-8t", None),
    ("v6e", "4x4", 4, 4, 4, "v6e-16", "ct6e-standard-4t", None),
    ("v6e", "4x8", None, 8, 4, "v6e-32", "ct6e-standard-4t", None),
    ("v6e", "8x8", None, 16, 4, "v6e-64", "ct6e-standard-4t", None),
    ("v6e", "16x16", None, 64, 4, "v6e-256", "ct6e-standard-4t", None),
    ("v7x", "2x2x1", None, 1, 4, "tpu7x-8", "tpu7x-standard-4t", "8"),
    ("tpu7x", "2x2x4", None, 4, 4, "tpu7x-32", "tpu7x-standard-4t", "8"),
    ("ironwood", "2x4x4", None, 8, 4, "tpu7x-64", "tpu7x-standard-4t", "8"),
    ("v7x", "4x4x4", None, 16, 4, "tpu7x-128", "tpu7x-standard-4t", "8"),
    ("v7x", "8x8x16", None, 256, 4, "tpu7x-2048", "tpu7x-standard-4t", "8"),
    ("v7x", "16x16x24", None, 1536, 4, "tpu7x-12288", "tpu7x-standard-4t", "8"),
]


def _render(generation: str, topology: str, chips_per_host: int | None = None, **extra):
    tpu = {"generation": generation, "topology": topology}
    if chips_per_host is not None:
        tpu["chipsPerHost"] = chips_per_host
    spec = parse_spec(spec_with(tpu=tpu, **extra))
    return spec, render_raycluster("run", "ns", "uid-1", spec)


def _worker(manifest: dict) -> tuple[dict, dict]:
    group = manifest["spec"]["workerGroupSpecs"][0]
    return group, group["template"]["spec"]


@pytest.mark.parametrize("generation,topology,per_host,hosts,tpus,group_name,machine,ray_tpu",
                         SHAPES, ids=lambda v: str(v))
def test_shape_sizing(generation, topology, per_host, hosts, tpus, group_name, machine,
                      ray_tpu, kuberay_schema, webhook_refusal):
    spec, manifest = _render(generation, topology, per_host)
    group, pod = _worker(manifest)
    gen = g.generation(generation)
    assert slice_shape(spec).machine.machine_type == machine
    assert (group["numOfHosts"], group["groupName"]) == (hosts, group_name)
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
    container = pod["containers"][0]
    for side in ("requests", "limits"):
        assert container["resources"][side]["google.com/tpu"] == str(tpus)
    assert pod["nodeSelector"] == {g.ACCELERATOR_LABEL: gen.accelerator_label,
                                   g.TOPOLOGY_LABEL: topology}
    assert group.get("resources", {}).get("TPU") == ray_tpu
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
    assert hosts * tpus == g.chips_in(topology)
    assert webhook_refusal(manifest) is None
    assert kuberay_schema.problems(manifest) == []


def test_table_covers_enough_shapes():
    assert len({(gen, topo) for gen, topo, *_ in SHAPES}) >= 30
    assert {"1x1", "2x2", "2x4"} <= {topo for _, topo, *_ in SHAPES}


@pytest.mark.parametrize("gen", [x for x in g.GENERATIONS if x.is_tpu], ids=lambda x: x.name)
def test_every_valid_topology_renders_and_passes_the_webhook(gen, webhook_refusal):
    for topology in gen.valid_topologies():
        for per_host in g.chips_per_host_options(gen, topology):
            _, manifest = _render(gen.name, topology, per_host)
            assert webhook_refusal(manifest) is None, (gen.name, topology, per_host)


@pytest.mark.parametrize("gen", [x for x in g.GENERATIONS if x.is_tpu], ids=lambda x: x.name)
def test_invalid_shape_message_lists_every_valid_shape(gen):
    wrong = "3x3" if gen.dimensions == 3 else "3x3x3"
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with(tpu__generation=gen.name, tpu__topology=wrong))
    listed = caught.value.message.split("valid: ")[1].split(", ")
    assert listed == gen.valid_topologies()


def test_generation_facts_match_the_design_table():
    facts = {x.name: (x.accelerator_label, x.machines[0].machine_type,
                      x.machines[0].chips_per_host, x.dimensions, x.devices_per_chip)
             for x in g.GENERATIONS if x.is_tpu}
    assert facts == {
        "v4": ("tpu-v4-podslice", "ct4p-hightpu-4t", 4, 3, 1),
        "v5e": ("tpu-v5-lite-podslice", "ct5lp-hightpu-4t", 4, 2, 1),
        "v5p": ("tpu-v5p-slice", "ct5p-hightpu-4t", 4, 3, 1),
        "v6e": ("tpu-v6e-slice", "ct6e-standard-4t", 4, 2, 1),
        "v7x": ("tpu7x", "tpu7x-standard-4t", 4, 3, 2),
    }
    for gen in g.GENERATIONS:
        for topology in gen.valid_topologies():
            assert topology.count("x") + 1 == gen.dimensions, (gen.name, topology)


def test_total_devices_counts_chiplets_and_slices():
    assert total_devices(parse_spec(spec_with(tpu={"generation": "v6e", "topology": "4x4"}))) == 16
    assert total_devices(parse_spec(spec_with(tpu={"generation": "v7x", "topology": "2x2x2"}))) == 16
    collectives = spec_with(mode="collectives", tpu={"generation": "v5p", "topology": "2x2x2",
                                                     "slices": 3})
    assert total_devices(parse_spec(collectives)) == 24


def test_slices_become_replicas_of_one_worker_group():
    _, manifest = _render("v6e", "4x4", mode="collectives")
    spec = parse_spec(spec_with(mode="collectives", tpu={"generation": "v6e", "topology": "4x4",
                                                         "slices": 2}))
    group, _ = _worker(render_raycluster("run", "ns", "uid", spec))
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
    assert group["numOfHosts"] == 4


def test_cpu_stand_in_has_cpu_workers_and_no_tpu_anything(kuberay_schema, webhook_refusal):
    _, manifest = _render("cpu", "3")
    group, pod = _worker(manifest)
    assert (group["groupName"], group["numOfHosts"], group["replicas"]) == ("cpu-3", 3, 1)
    assert "resources" not in group and "nodeSelector" not in pod and "volumes" not in pod
    container = pod["containers"][0]
    assert container["resources"] == {"limits": {"cpu": "1", "memory": "2Gi"},
                                      "requests": {"cpu": "1", "memory": "2Gi"}}
    head = manifest["spec"]["headGroupSpec"]
    assert head["rayStartParams"] == {"num-cpus": "0"}
    assert head["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "cpu": "1", "memory": "4Gi"}
    assert kuberay_schema.problems(manifest) == [] and webhook_refusal(manifest) is None


def test_spot_and_reservation_select_nodes():
    _, manifest = _render("v5p", "2x2x2", tpu__spot=True, tpu__reservation="my-resv")
    _, pod = _worker(manifest)
    assert pod["nodeSelector"] == {
        g.ACCELERATOR_LABEL: "tpu-v5p-slice", g.TOPOLOGY_LABEL: "2x2x2",
        "cloud.google.com/gke-spot": "true",
        "cloud.google.com/reservation-name": "my-resv",
        "cloud.google.com/reservation-affinity": "specific",
    }
    head_pod = manifest["spec"]["headGroupSpec"]["template"]["spec"]
    assert "nodeSelector" not in head_pod  # the head is a CPU pod: no TPU node needed


def test_overrides_service_account_and_no_token_without_secret(kuberay_schema):
    spec = parse_spec(spec_with(serviceAccountName="trainer-sa",
                                head={"resources": {"requests": {"cpu": 2, "memory": "8Gi"},
                                                    "limits": {"cpu": 2}}},
                                workers={"resources": {"requests": {"memory": "300Gi"},
                                                       "limits": {"memory": "300Gi"}}}))
    manifest = render_raycluster("run", "ns", "uid", spec)
    head = manifest["spec"]["headGroupSpec"]["template"]["spec"]
    _, worker = _worker(manifest)
    assert head["serviceAccountName"] == worker["serviceAccountName"] == "trainer-sa"
    assert head["containers"][0]["resources"] == {
        "limits": {"cpu": "2", "memory": "16Gi"}, "requests": {"cpu": "2", "memory": "8Gi"}}
    assert worker["containers"][0]["resources"]["limits"] == {
        "cpu": "64", "memory": "300Gi", "google.com/tpu": "4"}
    # No token without a Secret: the only env is checkpoint on notice's and the shutdown's.
    assert all(pod["containers"][0]["env"] == NOTICE_ENV + SHUTDOWN_ENV for pod in (head, worker))
    assert kuberay_schema.problems(manifest) == []


def test_every_ray_pod_checkpoints_on_notice_within_its_grace_period(kuberay_schema):
    manifest = render_raycluster("run", "ns", "uid", parse_spec(spec_with(terminationGracePeriodSeconds=25)))
    head = manifest["spec"]["headGroupSpec"]["template"]["spec"]
    _, worker = _worker(manifest)
    for pod in (head, worker):
        assert pod["terminationGracePeriodSeconds"] == 25
        container = pod["containers"][0]
        assert container["lifecycle"]["preStop"]["exec"]["command"][:2] == ["/bin/sh", "-c"]
        assert {"name": "TPUFT_NOTICE_DIR", "value": "/tmp/tpufinetune-notice/$(TPUFT_POD_UID)"} in container["env"]
    default = render_raycluster("run", "ns", "uid", parse_spec(spec_with()))
    assert _worker(default)[1]["terminationGracePeriodSeconds"] == DEFAULT_TERMINATION_GRACE_SECONDS == 60
    assert kuberay_schema.problems(manifest) == []


def test_owner_reference_and_labels():
    _, manifest = _render("v6e", "2x2")
    metadata = manifest["metadata"]
    assert metadata["labels"] == {"app.kubernetes.io/managed-by": "tpufinetune",
                                  "tpufinetune.dev/name": "run"}
    assert metadata["ownerReferences"] == [{
        "apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "name": "run",
        "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert metadata["namespace"] == "ns"


@pytest.mark.parametrize("name", ["demo", "a.b", "a-b", "x" * 36, "y" * 253,
                                  "gemma.finetune.v6e-4x4.team-a.2026"])
def test_raycluster_name_is_a_short_dns_label(name):
    cluster = raycluster_name(name)
    assert cluster == raycluster_name(name)
    assert len(cluster) <= MAX_CLUSTER_NAME
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", cluster)


def test_raycluster_names_do_not_collide():
    assert raycluster_name("demo") == "tft-demo"
    names = ["a.b", "a-b", "x" * 60, "x" * 61, "x" * 59 + "y"]
    assert len({raycluster_name(n) for n in names}) == len(names)


def test_docs_sizing_table_matches_the_generation_table():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for gen in g.GENERATIONS:
        for m in gen.machines:
            topologies = ", ".join(sorted(m.topologies, key=g.topology_sort_key))
            row = (f"| {gen.name} ({', '.join(gen.aliases)}) | `{gen.accelerator_label}` | "
                   f"`{m.machine_type}` | {m.chips_per_host} | {topologies} | "
                   f"{m.worker_cpu} / {m.worker_memory} / {m.shm_size} | "
                   f"{m.chips_per_host * gen.devices_per_chip} |")
            assert row in docs, f"docs/api.md sizing table is out of date: {row}"
