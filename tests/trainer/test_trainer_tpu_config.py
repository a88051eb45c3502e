"""The TPU configuration, built and checked on a machine without a TPU.

Covers the two slices of the tutorial: v6e 4x4 (4 hosts x 4 chips, 16 workers) and
v7x 2x2x2 (2 hosts x 4 chips x 2 chiplets, 16 workers with RAY_TPU_RESOURCE_PER_CHIP=2).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tpufinetune_trainer import backends
from tpufinetune_trainer.collectives import assign_ranks
from tpufinetune_trainer.errors import ConfigError, UsageError


@pytest.fixture(autouse=True)
def _no_tpu_here():
    assert importlib.util.find_spec("torch_tpu") is None, "these tests assume a host without torch_tpu"
    yield
    assert "torch_tpu" not in sys.modules  # nothing here may initialise a TPU


def test_v6e_4x4_slice(monkeypatch):
    monkeypatch.delenv("RAY_TPU_RESOURCE_PER_CHIP", raising=False)
    tpu = backends.resolve("tpu")
    scaling = backends.scaling_config(tpu, 16, "4x4", "TPU-V6E")
    assert scaling.use_tpu and not scaling.use_gpu
    assert (scaling.num_workers, scaling.topology, scaling.accelerator_type) == (16, "4x4", "TPU-V6E")
    assert scaling.resources_per_worker == {"TPU": 1}
    assert backends.torch_config(tpu).backend == "tpu_dist"
    assert (tpu.device_type, tpu.compute_dtype, tpu.attn_implementation) == ("tpu", "bfloat16", "eager")
    assert tpu.capturable_optimizer and not tpu.compile_by_default  # off until measured on a slice
    assert backends.tpu_workers_per_slice("4x4", "TPU-V6E") == 16


@pytest.mark.parametrize("device,requested,compiled", [
    ("tpu", "auto", False), ("tpu", "on", True), ("tpu", "off", False),
    ("cuda", "auto", True), ("cuda", "off", False), ("cpu", "auto", False), ("cpu", "on", True)])
def test_compile_auto_is_off_on_tpu_until_measured(device, requested, compiled):
    """--compile auto (and the API's training.compile default) compiles no block on TPU:
    per-block compile has never run on a slice; `on` still compiles anywhere."""
    assert backends.compile_enabled(backends.resolve(device), requested) is compiled


def test_unknown_compile_mode_names_the_flag():
    with pytest.raises(UsageError, match="--compile"):
        backends.compile_enabled(backends.resolve("tpu"), "maybe")


def test_v7x_2x2x2_slice_schedules_per_chiplet(monkeypatch):
    monkeypatch.setenv("RAY_TPU_RESOURCE_PER_CHIP", "2")  # as on the tutorial's Ironwood cluster
    tpu = backends.resolve("tpu")
    scaling = backends.scaling_config(tpu, 16, "2x2x2", "TPU-V7X")
    assert (scaling.num_workers, scaling.topology, scaling.accelerator_type) == (16, "2x2x2", "TPU-V7X")
    assert scaling.resources_per_worker == {"TPU": 1}
    assert backends.tpu_workers_per_slice("2x2x2", "TPU-V7X") == 16


def test_v7x_without_the_chiplet_setting_names_it(monkeypatch):
    monkeypatch.delenv("RAY_TPU_RESOURCE_PER_CHIP", raising=False)
    with pytest.raises(ConfigError, match="RAY_TPU_RESOURCE_PER_CHIP=2"):
        backends.scaling_config(backends.resolve("tpu"), 16, "2x2x2", "TPU-V7X")


@pytest.mark.parametrize("workers,topology,accelerator", [(12, "4x4", "TPU-V6E"), (32, "4x4", "TPU-V6E"),
                                                          (16, "3x3", "TPU-V6E")])
def test_worker_count_must_fill_exactly_one_slice(workers, topology, accelerator, monkeypatch):
    monkeypatch.delenv("RAY_TPU_RESOURCE_PER_CHIP", raising=False)
    with pytest.raises(ConfigError, match="--num-workers|--topology"):
        backends.scaling_config(backends.resolve("tpu"), workers, topology, accelerator)


def test_two_slices_take_every_slices_devices_and_a_count_of_one_slice_is_refused(monkeypatch):
    monkeypatch.delenv("RAY_TPU_RESOURCE_PER_CHIP", raising=False)
    scaling = backends.scaling_config(backends.resolve("tpu"), 32, "4x4", "TPU-V6E", num_slices=2)
    assert scaling.num_workers == 32 and scaling.topology == "4x4"
    with pytest.raises(ConfigError, match="Set --num-workers 32"):
        backends.scaling_config(backends.resolve("tpu"), 16, "4x4", "TPU-V6E", num_slices=2)


def test_auto_follows_what_the_cluster_advertises():
    assert backends.resolve("auto", {"CPU": 4.0, "TPU": 16.0}).name == "tpu"
    assert backends.resolve("auto", {"CPU": 4.0, "GPU": 2.0}).name == "cuda"
    assert backends.resolve("auto", {"CPU": 4.0}).name == "cpu"
    assert backends.resolve("auto", {"CPU": 4.0}).dist_backend == "gloo"
    with pytest.raises(UsageError, match="unknown --device 'quantum'"):
        backends.resolve("quantum")


def test_cpu_and_gpu_scaling():
    cpu = backends.scaling_config(backends.resolve("cpu"), 2, "4x4", "TPU-V6E")
    assert cpu.num_workers == 2 and not cpu.use_tpu and not cpu.use_gpu and cpu.resources_per_worker == {"CPU": 1}
    gpu = backends.scaling_config(backends.resolve("cuda"), 8, "4x4", "TPU-V6E")
    assert gpu.use_gpu and backends.torch_config(backends.resolve("cuda")).backend == "nccl"


def _tpu_places(hosts: int, per_host: int) -> list[dict]:
    # What each actor reports: the webhook's TPU_WORKER_ID and Ray's device id on its host.
    return [{"node_ip": f"10.0.0.{h}", "tpu_worker_id": h, "accelerator_id": d, "tpu_hosts": ""}
            for h in range(hosts) for d in range(per_host)]


@pytest.mark.parametrize("hosts,per_host", [(4, 4), (2, 8)])  # v6e 4x4, v7x 2x2x2
def test_collectives_rank_arithmetic_matches_the_tutorial(hosts, per_host):
    ranks = assign_ranks(_tpu_places(hosts, per_host), devices_per_host=per_host)
    assert [r["rank"] for r in ranks] == list(range(16))
    assert ranks[5] == {"worker_id": 5 // per_host, "local_rank": 5 % per_host, "rank": 5}


def test_cpu_rank_arithmetic_numbers_hosts_in_order():
    places = [{"node_ip": ip, "tpu_worker_id": 0, "accelerator_id": 0, "tpu_hosts": ""}
              for ip in ["b", "b", "a", "a"]]
    assert [(r["worker_id"], r["local_rank"], r["rank"]) for r in assign_ranks(places)] == [
        (0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]


def test_torch_tpu_is_imported_only_after_the_compile_cache_is_placed(monkeypatch, tmp_path):
    """Jobs run without torch's device-backend autoload, so the worker imports torch_tpu
    itself (before tpu_dist starts), and only once the cache root it reads at import is set.
    The import is recorded, not done: this host has no torch_tpu."""
    root = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
    monkeypatch.setenv(root, "unset")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset")
    imported = []
    monkeypatch.setattr(backends.importlib, "import_module", lambda name: imported.append((name, backends.os.environ[root])))
    backends.load_tpu_runtime(str(tmp_path))
    assert imported == [("torch_tpu", f"{tmp_path}/torch_tpu")]
