"""The MEGASCALE variables each worker of a multi-slice run gets from the live worker group
(backends.megascale_env): its own slice from its pod, the coordinator at slice 0's first
host whatever the ranks' order, one port per process of a host. The ground run that reads
them from every worker, before and after a slice is rebuilt, is
tests/operator/test_multislice_e2e.py."""

from __future__ import annotations

import pytest

from tpufinetune_trainer.backends import (DEFAULT_MEGASCALE_PORT, WorkerHost, megascale_env,
                                          torch_config, BACKENDS)
from tpufinetune_trainer.errors import ConfigError
from tpufinetune_trainer.slices import Place


def host(rank: int, slice_: int | None, tpu_host: int, address: str, base: int = DEFAULT_MEGASCALE_PORT):
    return WorkerHost(Place(slice_, tpu_host, rank), address, base)


def test_each_rank_gets_its_pods_slice_and_the_coordinator_is_slice_0s_first_host_not_rank_0():
    # Ray Train orders ranks by node: here rank 0 runs on slice 1's second host, and slice
    # 0's first host (TPU_WORKER_ID 0) holds ranks 5 and 6.
    workers = [host(0, 1, 1, "10.0.1.2"), host(1, 1, 1, "10.0.1.2"), host(2, 1, 0, "10.0.1.1"),
               host(3, 1, 0, "10.0.1.1"), host(4, 0, 1, "10.0.0.2"), host(5, 0, 0, "10.0.0.1"),
               host(6, 0, 0, "10.0.0.1"), host(7, 0, 1, "10.0.0.2")]
    env = megascale_env(workers, 2)
    assert [e["MEGASCALE_SLICE_ID"] for e in env] == ["1", "1", "1", "1", "0", "0", "0", "0"]
    assert {e["MEGASCALE_COORDINATOR_ADDRESS"] for e in env} == {"10.0.0.1:8081"}
    assert {e["MEGASCALE_NUM_SLICES"] for e in env} == {"2"}
    # Two processes a host: the base port and the next, by rank on the host.
    assert [e["MEGASCALE_PORT"] for e in env] == ["8081", "8082", "8081", "8082", "8081", "8081", "8082", "8082"]


def test_the_coordinators_port_is_its_own_process_port_and_the_pods_base_port_is_kept():
    workers = [host(0, 0, 0, "10.0.0.1", 9000), host(1, 0, 0, "10.0.0.1", 9000),
               host(2, 1, 0, "10.0.0.9", 9000), host(3, 1, 0, "10.0.0.9", 9000)]
    workers.reverse()  # the order reports arrive in does not matter
    env = megascale_env(workers, 2)
    assert env[0] == {"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.1:9000", "MEGASCALE_NUM_SLICES": "2",
                      "MEGASCALE_SLICE_ID": "0", "MEGASCALE_PORT": "9000"}
    assert [e["MEGASCALE_PORT"] for e in env] == ["9000", "9001", "9000", "9001"]


def test_an_ipv6_coordinator_is_bracketed():
    env = megascale_env([host(0, 0, 0, "fd00::1"), host(1, 1, 0, "fd00::2")], 2)
    assert env[1]["MEGASCALE_COORDINATOR_ADDRESS"] == "[fd00::1]:8081"


def test_a_rebuilt_slice_0_names_its_new_host():
    before = megascale_env([host(0, 0, 0, "10.0.0.1"), host(1, 1, 0, "10.0.0.2")], 2)
    after = megascale_env([host(0, 1, 0, "10.0.0.2"), host(1, 0, 0, "10.0.0.7")], 2)
    assert before[1]["MEGASCALE_COORDINATOR_ADDRESS"] == "10.0.0.1:8081"
    assert {e["MEGASCALE_COORDINATOR_ADDRESS"] for e in after} == {"10.0.0.7:8081"}
    assert [e["MEGASCALE_SLICE_ID"] for e in after] == ["1", "0"]


def test_ranks_that_are_not_whole_slices_are_refused_naming_the_counts():
    with pytest.raises(ConfigError, match=r"slice 0: 2, slice 1: 1"):
        megascale_env([host(0, 0, 0, "a"), host(1, 0, 1, "b"), host(2, 1, 0, "c")], 2)
    with pytest.raises(ConfigError, match="cannot tell which slice"):
        megascale_env([host(0, None, 0, "a"), host(1, 1, 0, "b")], 2)


def test_rays_own_multislice_setup_is_replaced_by_the_pods_slices():
    """Ray's torch backend sets the MEGASCALE variables itself for tpu_dist with several
    slices (`_TorchBackend._setup_tpu_multislice`: each rank's slice from its rank, rank 0
    the coordinator) after ours; the trainer's backend replaces that method. If Ray renames
    it, this fails rather than letting Ray's values win silently."""
    from ray.train.torch.config import _TorchBackend

    assert callable(getattr(_TorchBackend, "_setup_tpu_multislice", None))
    backend_cls = torch_config(BACKENDS["tpu"], num_slices=2).backend_cls
    assert backend_cls._setup_tpu_multislice is not _TorchBackend._setup_tpu_multislice
    assert backend_cls()._setup_tpu_multislice(None, "10.0.0.1", 2) is None  # touches no worker
