"""The test ground's pure parts: GKE-shaped node pools from the TPU table, and the node
agent's reading of KubeRay's `ray start` line. Milliseconds; no processes."""

from __future__ import annotations

import pytest
from kubernetes.utils import parse_quantity

from harness.nodeagent import hosts_file_text, ray_start_args, rewrite_ray_start, service_names
from harness.nodepools import (
    TPU_TAINT,
    cpu_pool,
    default_pools,
    node_manifest,
    node_status,
    reserved_memory_mib,
    reserved_millicores,
    tpu_pool,
)
from tpufinetune.core.generations import GENERATIONS, generation
from tpufinetune.core.sizing import plan_resources


def test_the_default_ground_has_one_pool_per_slice_plus_cpu_nodes():
    pools = {p.name: p for p in default_pools()}
    assert (pools["v6e-4x4"].machine_type, pools["v6e-4x4"].nodes, pools["v6e-4x4"].tpu_chips) == ("ct6e-standard-4t", 4, 4)
    assert (pools["v7x-2x2x2"].machine_type, pools["v7x-2x2x2"].nodes, pools["v7x-2x2x2"].tpu_chips) == ("tpu7x-standard-4t", 2, 4)
    assert pools["cpu-pool"].tpu_chips == 0 and pools["cpu-pool"].nodes >= 1


def test_a_tpu_node_has_gkes_labels_taint_and_its_machines_capacity():
    pool = tpu_pool("v6e-4x4", "v6e", "4x4")
    node = node_manifest(pool, pool.node_names()[0])
    labels = node["metadata"]["labels"]
    assert labels["cloud.google.com/gke-nodepool"] == "v6e-4x4"
    assert labels["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
    assert labels["cloud.google.com/gke-tpu-topology"] == "4x4"
    assert labels["node.kubernetes.io/instance-type"] == "ct6e-standard-4t"
    assert labels["cloud.google.com/machine-family"] == "ct6e"
    assert node["spec"]["taints"] == [TPU_TAINT]
    status = node_status(pool, "2026-01-01T00:00:00Z")
    machine = generation("v6e").machines_for("4x4")[0]
    assert status["capacity"]["cpu"] == str(machine.vcpus) == "180"
    assert status["capacity"]["memory"] == f"{machine.memory_gib}Gi"
    assert status["capacity"]["google.com/tpu"] == status["allocatable"]["google.com/tpu"] == "4"
    assert parse_quantity(status["allocatable"]["cpu"]) < parse_quantity(status["capacity"]["cpu"])


def test_cpu_nodes_are_untainted_and_have_no_tpu():
    pool = cpu_pool()
    node = node_manifest(pool, pool.node_names()[0])
    assert "taints" not in node["spec"] and "cloud.google.com/gke-tpu-accelerator" not in node["metadata"]["labels"]
    assert "google.com/tpu" not in node_status(pool, "t")["capacity"]


def test_gke_reservations_follow_the_published_tiers():
    # https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes: a 4-vCPU
    # machine reserves 60 + 10 + 2 x 5 = 80m; 16 GiB reserves 1 + 0.8 + 0.8 GiB + 100 MiB.
    assert reserved_millicores(1) == 60
    assert reserved_millicores(4) == 80
    assert reserved_millicores(180) == 80 + 176 * 2.5
    assert reserved_memory_mib(16) == round((1 + 0.8 + 0.8) * 1024) + 100


@pytest.mark.parametrize("gen", [g for g in GENERATIONS if g.is_tpu], ids=lambda g: g.name)
def test_every_machine_in_the_table_has_a_sourced_size_that_fits_its_worker_pod(gen):
    from tpufinetune.core.api import parse_spec

    for machine in gen.machines:
        assert machine.vcpus > 0 and machine.memory_gib > 0
        assert machine.source.startswith("https://cloud.google.com/")
        topology = sorted(machine.topologies, key=len)[0]
        pool = tpu_pool("p", gen.name, topology, chips_per_host=machine.chips_per_host)
        allocatable = node_status(pool, "t")["allocatable"]
        spec = parse_spec({"tpu": {"generation": gen.name, "topology": topology,
                                   "chipsPerHost": machine.chips_per_host},
                           "image": "x", "checkpoint": {"storagePath": "gs://b"}})
        requests = plan_resources(spec)["workers"][0]
        for name in ("cpu", "memory"):
            assert parse_quantity(requests[name]) <= parse_quantity(allocatable[name]), (machine.machine_type, name)


KUBERAY_HEAD = {
    "name": "ray-head", "command": ["/bin/bash", "-lc", "--"],
    "args": ["ulimit -n 65536; ray start --head  --block  --dashboard-agent-listen-port=52365  "
             "--dashboard-host=0.0.0.0  --metrics-export-port=8080  --num-cpus=0  --memory=17179869184 "],
}
KUBERAY_WORKER = {
    "name": "ray-worker", "command": ["/bin/bash", "-lc", "--"],
    "args": ["ulimit -n 65536; $KUBERAY_GEN_RAY_START_CMD"],
    "env": [{"name": "KUBERAY_GEN_RAY_START_CMD",
             "value": "ray start  --address=rc-head-svc.ns.svc.cluster.local:6379  --block  "
                      "--num-cpus=64  --resources='{\"TPU\":4}'  --metrics-export-port 8080"}],
}
PORTS = dict(gcs=6001, metrics=6002, agent_http=6003, agent_grpc=6004, runtime_env=6005, client=6006)


def test_the_agent_keeps_the_pods_ray_params_and_owns_addresses_and_ports():
    head = rewrite_ray_start(ray_start_args(KUBERAY_HEAD), head=True, ip="127.9.0.1", temp_dir="/tmp/p1",
                             gcs_address=None, ports=PORTS)
    assert head[:5] == ["--head", "--port=6001", "--dashboard-host=127.9.0.1", "--dashboard-port=8265",
                        "--ray-client-server-port=6006"]
    assert "--num-cpus=0" in head and "--memory=17179869184" in head
    assert "--dashboard-host=0.0.0.0" not in head and "--metrics-export-port=8080" not in head
    assert head.count("--block") == 1

    worker = rewrite_ray_start(ray_start_args(KUBERAY_WORKER), head=False, ip="127.9.0.2", temp_dir="/tmp/p2",
                               gcs_address="127.9.0.1:6001", ports=PORTS)
    assert worker[0] == "--address=127.9.0.1:6001"
    assert '--resources={"TPU":4}' in worker and "--num-cpus=64" in worker
    assert "8080" not in worker and not any(a.startswith("--address=rc-head") for a in worker)


def test_a_container_without_ray_start_is_refused_by_name():
    with pytest.raises(ValueError, match="sidecar"):
        ray_start_args({"name": "sidecar", "command": ["sleep", "infinity"]})


def test_cluster_dns_names_every_form_of_a_service_name():
    text = hosts_file_text({name: "127.9.0.1" for name in service_names("rc-head-svc", "ml")})
    assert "127.9.0.1 rc-head-svc.ml rc-head-svc.ml.svc rc-head-svc.ml.svc.cluster.local" in text
    assert text.startswith("127.0.0.1 localhost\n")
