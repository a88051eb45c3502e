"""Operator benchmark (a script, not a test): prints a table.

On the real control plane with KubeRay's RayCluster CRD and the operator as users run it:
  1. apply -> RayCluster created, one resource at a time, p50 and p95 over 20;
  2. 100 resources applied at once -> time until all 100 RayClusters exist;
  3. operator RSS after that (peak of the samples taken while it worked).
Targets: p50 < 1 s, 100 in < 30 s, RSS < 200 MB.

    .venv/bin/python benchmarks/bench_operator.py [--single 20] [--burst 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from kubernetes import client, config, watch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from harness.controlplane import start_with_crds  # noqa: E402
from harness.operator_process import OperatorProcess  # noqa: E402


def manifest(name: str) -> dict:
    return {
        "apiVersion": "tpufinetune.dev/v1alpha1",
        "kind": "TPUFineTune",
        "metadata": {"name": name},
        "spec": {
            "tpu": {"generation": "v6e", "topology": "4x4"},
            "image": "registry.example/trainer:bench",
            "checkpoint": {"storagePath": "gs://bench/ckpt"},
        },
    }


class ClusterWatch:
    """Records when each RayCluster first appears, from a watch (no polling)."""

    def __init__(self, api: client.ApiClient, namespace: str):
        self.seen: dict[str, float] = {}
        self.cond = threading.Condition()
        self._objects = client.CustomObjectsApi(api)
        self._ns = namespace
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()
        time.sleep(0.5)

    def _run(self) -> None:
        while not self._stop:
            try:
                stream = watch.Watch().stream(self._objects.list_namespaced_custom_object, "ray.io", "v1",
                                              self._ns, "rayclusters", timeout_seconds=30)
                for event in stream:
                    if event["type"] == "ADDED":
                        with self.cond:
                            self.seen.setdefault(event["object"]["metadata"]["name"], time.monotonic())
                            self.cond.notify_all()
            except Exception:  # the apiserver going away at the end, or a dropped stream
                time.sleep(0.2)

    def close(self) -> None:
        self._stop = True

    def wait(self, names: set[str], timeout: float) -> float:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not names <= set(self.seen):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(names - set(self.seen))} RayClusters missing after {timeout}s")
                self.cond.wait(left)
            return max(self.seen[n] for n in names)


def rss_mb(pid: int) -> float:
    """RSS of the operator process (kopf runs in one process)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0



def print_table(rows: list[tuple[str, str, str]], value_width: int) -> None:
    """The benchmark's result: measure | value | target, one row each."""
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure'.ljust(width)} | {'value'.ljust(value_width)} | target")
    print(f"{'-' * width}-|-{'-' * value_width}-|---------")
    for measure, value, target in rows:
        print(f"{measure.ljust(width)} | {value.ljust(value_width)} | {target}")

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single", type=int, default=20)
    parser.add_argument("--burst", type=int, default=100)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="tft-bench-"))
    cp, _ = start_with_crds(workdir=workdir / "cp")
    operator = None
    try:
        env = cp.env()
        # The bench stops at RayCluster creation; no Ray head is needed for that.
        env.update(TPUFT_DASHBOARD_URL="http://127.0.0.1:9", TPUFT_POLL_INTERVAL="5",
                   TPUFT_OPERATOR_NAMESPACE="bench",  # the Ray token signing key goes there
                   TPUFT_LEADER_ELECTION="false")  # one operator, admin credentials
        operator = OperatorProcess(env, workdir / "operator.log")
        operator.start()
        api = config.new_client_from_config(str(cp.kubeconfig))
        namespace = "bench"
        cp.kubectl("create", "namespace", namespace)
        clusters = ClusterWatch(api, namespace)
        peak = [rss_mb(operator.proc.pid)]
        sampling = True

        def sample() -> None:
            while sampling:
                peak.append(rss_mb(operator.proc.pid))
                time.sleep(0.2)

        threading.Thread(target=sample, daemon=True).start()

        latencies = []
        for i in range(args.single):
            name = f"single-{i}"
            text = yaml.safe_dump(manifest(name))
            start = time.monotonic()
            cp.kubectl("-n", namespace, "apply", "-f", "-", input=text)
            created = clusters.wait({f"tft-{name}"}, timeout=30)
            latencies.append(created - start)

        # One `kubectl apply --server-side` of 100 documents: client-side apply spends
        # most of its time in kubectl itself (a GET and a three-way diff per object).
        burst = [manifest(f"burst-{i}") for i in range(args.burst)]
        text = yaml.safe_dump_all(burst)
        start = time.monotonic()
        cp.kubectl("-n", namespace, "apply", "--server-side", "-f", "-", input=text, timeout=120)
        applied = time.monotonic() - start
        done = clusters.wait({f"tft-burst-{i}" for i in range(args.burst)}, timeout=300) - start
        time.sleep(2)
        sampling = False
        clusters.close()
        quantiles = statistics.quantiles(latencies, n=20)
        rows = [
            ("apply -> RayCluster, p50", f"{statistics.median(latencies):.3f} s", "< 1 s"),
            ("apply -> RayCluster, p95", f"{quantiles[18]:.3f} s", ""),
            (f"{args.burst} applied at once: kubectl apply --server-side", f"{applied:.1f} s", ""),
            (f"{args.burst} applied at once -> all RayClusters", f"{done:.1f} s", "< 30 s"),
            ("operator RSS, peak", f"{max(peak):.0f} MB", "< 200 MB"),
            ("operator RSS, end", f"{rss_mb(operator.proc.pid):.0f} MB", ""),
        ]
        print_table(rows, value_width=10)
        return 0
    finally:
        if operator is not None:
            operator.stop()
        cp.stop()


if __name__ == "__main__":
    sys.exit(main())
