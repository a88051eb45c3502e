"""A burst of new runs on the operator as users run it (`python -m tpufinetune.cli operator`,
default settings) against the real kube-apiserver with KubeRay's RayCluster CRD (no KubeRay:
the RayClusters never get ready, as when a slice waits for capacity). One burst shows:

- the operator's connections to the API server stay bounded while every run takes its
  first steps at once: kopf's session has a limit (handlers.login), the Kubernetes client's
  pool one per thread, and the watches one each. Checked to fail with kopf's own
  unlimited session: 214 connections for this burst (55 with the limit);
- once every run waits for its RayCluster, the runs take no steps at rest (they sleep until
  a watched change or a timer), where each would step every poll interval before;
- an edit (spec.suspend) still wakes its sleeping run at once, through kopf's watch of the
  TPUFineTunes (handlers.resource_seen).

About 40 s on a running control plane.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request

import pytest
import yaml
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from harness.operator_process import OperatorProcess
from harness.ports import free_port
from harness.timing import within
from harness.waiting import wait_for
from tpufinetune import driver
from tpufinetune.adapters.handlers import kopf_connection_limit
from tpufinetune.core.api import GROUP, PLURAL, VERSION
from tpufinetune.settings import Settings

from run_helpers import tpufinetune

RUNS = 120
# The informer's watches (RayClusters, pods, Workloads) and its lists hold one each, and the
# Ray token Secret's reads go through the client's pool; kopf's session is bounded by its own
# limit; a few more for connections being closed while their successors open.
WATCH_STREAMS = 3
SLACK = 5
# Poll intervals the runs are watched at rest: each would be RUNS steps for runs that polled.
REST_POLLS = 10

pytestmark = pytest.mark.cluster


def connections_to(pid: int, port: int) -> int:
    """The process's established TCP connections to `port` on loopback: its sockets
    (/proc/PID/fd) matched against the kernel's table (/proc/PID/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    with open(f"/proc/{pid}/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if state == "01" and inode in inodes and int(remote.split(":")[1], 16) == port:
                count += 1
    return count


def steps(metrics_url: str) -> float:
    """Steps the operator has completed, all phases (tpufinetune_reconciles_total)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "tpufinetune_reconciles_total")


def test_a_burst_keeps_connections_bounded_then_waiting_runs_rest_and_an_edit_wakes_its_run(
        control_plane, kuberay_crd, k8s_api, namespace, tmp_path):
    objects = client.CustomObjectsApi(k8s_api)
    metrics_port = free_port()
    env = control_plane.env()
    env.update(TPUFT_NAMESPACE=namespace, TPUFT_OPERATOR_NAMESPACE=namespace, TPUFT_LEADER_ELECTION="false",
               TPUFT_POLL_INTERVAL="1", TPUFT_METRICS_PORT=str(metrics_port))
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    operator = OperatorProcess(env, tmp_path / "operator.log")
    operator.start()
    api_port = int(control_plane.server.rsplit(":", 1)[1])
    most = [0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            most[0] = max(most[0], connections_to(operator.proc.pid, api_port))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        control_plane.kubectl("-n", namespace, "apply", "--server-side", "-f", "-", timeout=300,
                              input=yaml.safe_dump_all([tpufinetune(f"burst-{i}") for i in range(RUNS)]))

        def all_waiting() -> bool:
            items = objects.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
            return len(items) == RUNS and all(
                (i.get("status") or {}).get("message", "").startswith("waiting for RayCluster") for i in items)

        wait_for(all_waiting, within(120), f"all {RUNS} runs waiting for their RayClusters", interval=0.5,
                 details=operator.log_tail)
        sampling.set()
        sampler.join()
        # A new run's first status write waits for kopf's own first writes (driver.Run.settle):
        # not refused as stale, re-read and made again (before: at least once a run).
        conflicts = operator.log_path.read_text().count("re-reading the status")
        assert conflicts <= RUNS * 0.05, f"{conflicts} status writes of {RUNS} new runs refused as stale"
        bound = kopf_connection_limit(1) + Settings().kube_threads + WATCH_STREAMS + SLACK
        assert 0 < most[0] <= bound, (most[0], bound)

        # At rest: a poll interval of 1 s would be RUNS steps a second. First the steps in
        # flight end (the last spaced writes land, a watch event of a run's own RayCluster
        # is looked at): a poll interval passes without a step, which a run that polled
        # would never leave.
        poll = Settings.from_env(env).poll_interval
        counted: list[float | None] = [None]

        def still() -> bool:  # called a poll interval apart
            counted.append(steps(metrics_url))
            return counted[-1] == counted[-2]

        wait_for(still, within(REST_POLLS * poll), "a poll interval without a step", interval=poll,
                 details=operator.log_tail)
        # Then, for REST_POLLS poll intervals (within the idle resync, which steps every run
        # once), next to no step: a run that polled would take one in each.
        assert REST_POLLS * poll < driver.IDLE_RESYNC_S
        before = counted[-1]
        allowed = RUNS * 0.05
        try:
            taken = wait_for(lambda: (n := steps(metrics_url) - before) > allowed and n, REST_POLLS * poll,
                             f"more than {allowed:g} steps by {RUNS} runs that only wait", interval=poll / 4)
        except AssertionError:  # the wait ran out: they rested
            taken = steps(metrics_url) - before
        else:
            raise AssertionError(f"{taken} steps within {REST_POLLS * poll:g} s by {RUNS} runs that only wait")

        # An edit wakes its sleeping run at once (a waiting run sleeps up to a minute).
        objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "burst-7", {"spec": {"suspend": True}})

        def suspended() -> bool:
            status = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "burst-7")["status"]
            return status.get("phase") == "Pending" and "suspended" in status.get("message", "")

        wait_for(suspended, within(10), "the suspended run to be Pending", interval=0.2, details=operator.log_tail)
        print(f"{RUNS} runs at once: at most {most[0]} connections to the API server (bound {bound}); "
              f"{taken:.0f} steps in {REST_POLLS * poll:g} s at rest")
    finally:
        sampling.set()
        operator.stop()
