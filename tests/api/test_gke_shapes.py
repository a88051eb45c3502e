"""The product's TPU table against GKE's published shapes (the harness's `gke_shapes.py`,
written once there). The ground builds its nodes and the TPU env from the harness's facts, so
a wrong product figure fails here by name and, on the ground, as it would on GKE. Pure."""

from __future__ import annotations

import importlib

import pytest
from kubernetes.utils import parse_quantity

from harness import gke_shapes as gke
from harness.nodepools import cpu_pool, node_status, tpu_pool
from tpufinetune.core import generations as product
from tpufinetune.core import sizing
from tpufinetune.core.api import parse_spec

TPU_GENERATIONS = [g for g in product.GENERATIONS if g.is_tpu]
RAY_TPU_MODULE = "ray._private.accelerators.tpu"


def _spec(generation: str, topology: str, chips_per_host: int | None = None):
    tpu = {"generation": generation, "topology": topology}
    if chips_per_host is not None:
        tpu["chipsPerHost"] = chips_per_host
    return parse_spec({"tpu": tpu, "image": "x", "checkpoint": {"storagePath": "gs://b"}})


def test_the_products_labels_are_gkes():
    assert (product.ACCELERATOR_LABEL, product.TOPOLOGY_LABEL, product.TPU_RESOURCE, product.SPOT_LABEL) == (
        gke.ACCELERATOR_LABEL, gke.TOPOLOGY_LABEL, gke.TPU_RESOURCE, gke.SPOT_LABEL)


@pytest.mark.parametrize("gen", TPU_GENERATIONS, ids=lambda g: g.name)
def test_every_generation_is_the_gke_family_of_its_node_label(gen):
    tpu = gke.family_by_label(gen.accelerator_label)
    for alias in gen.aliases:
        assert gke.family(alias) is tpu, alias
    assert gen.dimensions == tpu.topology_dims
    assert gen.devices_per_chip == tpu.devices_per_chip
    assert gen.tensorcores_per_chip == tpu.tensorcores_per_chip
    assert gen.ray_accelerator_type == tpu.ray_accelerator_type


@pytest.mark.parametrize("gen", TPU_GENERATIONS, ids=lambda g: g.name)
def test_every_machine_has_gkes_chips_vcpus_and_memory(gen):
    tpu = gke.family_by_label(gen.accelerator_label)
    for machine in gen.machines:
        published = tpu.machine(machine.chips_per_host)
        assert (machine.machine_type, machine.chips_per_host, machine.vcpus, machine.memory_gib) == (
            published.machine_type, published.tpu_chips, published.vcpus, published.memory_gib), machine.source
        assert machine.source == tpu.source


@pytest.mark.parametrize("gen", TPU_GENERATIONS, ids=lambda g: g.name)
def test_every_topology_is_a_gke_label_value_its_machine_can_form(gen):
    tpu = gke.family_by_label(gen.accelerator_label)
    for machine in gen.machines:
        for topology in machine.topologies:
            gke.check_topology(tpu, topology)
            assert gke.chips_in(topology) % machine.chips_per_host == 0, (machine.machine_type, topology)


@pytest.mark.parametrize("gen", TPU_GENERATIONS, ids=lambda g: g.name)
def test_the_worker_group_is_named_as_gke_names_the_slice_and_its_pods_fit_gkes_nodes(gen):
    # The tutorial's groups are v6e-16 and tpu7x-16: GKE's TPU_ACCELERATOR_TYPE of the slice.
    for machine in gen.machines:
        for topology in sorted(machine.topologies, key=product.topology_sort_key)[:3]:
            spec = _spec(gen.name, topology, machine.chips_per_host)
            shape = sizing.slice_shape(spec)
            tpu = gke.family_by_label(gen.accelerator_label)
            assert shape.group_name == tpu.accelerator_type(topology)
            pool = tpu_pool("p", gen.name, topology, chips_per_host=machine.chips_per_host)
            assert (shape.hosts, shape.chips_per_host) == (pool.nodes, pool.tpu_chips), topology
            requests = sizing.plan_resources(spec)["workers"][0]
            allocatable = node_status(pool, "t")["allocatable"]
            for name in ("cpu", "memory", gke.TPU_RESOURCE):
                assert parse_quantity(requests[name]) <= parse_quantity(allocatable[name]), (
                    machine.machine_type, topology, name, requests[name], allocatable[name])


def test_the_default_machine_for_a_topology_is_gkes():
    for gen in TPU_GENERATIONS:
        for topology in gen.valid_topologies():
            chosen = product.select_machine(gen, topology, None)
            assert chosen.chips_per_host == gke.default_chips_per_host(topology), (gen.name, topology)


@pytest.mark.parametrize(("generation", "topology", "pods"), [("cpu", "2", ("head", "workers")),
                                                              ("v6e", "4x4", ("head",))])
def test_heads_and_cpu_workers_fit_gkes_cpu_node(generation, topology, pods):
    allocatable = node_status(cpu_pool(), "t")["allocatable"]
    plan = sizing.plan_resources(_spec(generation, topology))
    for pod in pods:
        requests = plan[pod][0]
        for name in ("cpu", "memory"):
            assert parse_quantity(requests[name]) <= parse_quantity(allocatable[name]), (pod, name)


def test_the_tpu_env_is_the_tutorials():
    # The tutorial's v6e 4x4 and Ironwood 2x2x2 workers (host 3 of 4; host 1 of 2).
    v6e_hosts = [f"v6e-16-0-{i}.ray-torchtpu-cluster-headless" for i in range(4)]
    env = gke.tpu_pod_environment(gke.family("v6e"), "4x4", 3, "v6e-16-0", v6e_hosts)
    assert env["TPU_WORKER_ID"] == "3" and env["TPU_NAME"] == "v6e-16-0"
    assert env["TPU_WORKER_HOSTNAMES"] == ",".join(v6e_hosts)
    assert env["TORCH_TPU_TOPOLOGY"] == "4,4,1"
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[:5] == [
        "v6e-16-0-0.ray-torchtpu-cluster-headless:8471", "v6e-16-0-0.ray-torchtpu-cluster-headless:8472",
        "v6e-16-0-0.ray-torchtpu-cluster-headless:8473", "v6e-16-0-0.ray-torchtpu-cluster-headless:8474",
        "v6e-16-0-1.ray-torchtpu-cluster-headless:8471"]
    assert env["TPU_ACCELERATOR_TYPE"] == "v6e-16" and env["TPU_TOPOLOGY"] == "4x4"
    v7x_hosts = [f"tpu7x-16-0-{i}.ray-torchtpu-cluster-headless" for i in range(2)]
    env = gke.tpu_pod_environment(gke.family("tpu7x"), "2x2x2", 1, "tpu7x-16-0", v7x_hosts)
    assert env["TORCH_TPU_TOPOLOGY"] == "2,2,2,2"
    assert len(env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 16  # 8 devices on each host
    assert env["TPU_ACCELERATOR_TYPE"] == "tpu7x-16"
    with pytest.raises(ValueError, match="3 dimensions"):
        gke.tpu_pod_environment(gke.family("v7x"), "4x4", 0, "s", [])


def test_ray_reads_gkes_accelerator_type_as_the_products_generation():
    # Ray's own TPU code, private: if Ray moves it, this fails naming the module (a skip
    # would leave CI green with the check gone).
    try:
        ray_tpu = importlib.import_module(RAY_TPU_MODULE)
    except ImportError as error:
        pytest.fail(f"{RAY_TPU_MODULE} no longer imports ({error}): Ray moved its TPU accelerator "
                    "manager; point RAY_TPU_MODULE at its new home", pytrace=False)
    import ray.util.accelerators.accelerators as ray_types

    known = {v for k, v in vars(ray_types).items() if k.startswith("GOOGLE_TPU_")}
    for gen in TPU_GENERATIONS:
        tpu = gke.family_by_label(gen.accelerator_label)
        assert tpu.ray_accelerator_type in known
        pod_type = tpu.accelerator_type("2x2x2" if tpu.topology_dims == 3 else "4x4")
        assert ray_tpu.TPUAcceleratorManager.is_valid_tpu_accelerator_type(pod_type), pod_type
