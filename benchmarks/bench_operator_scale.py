"""Operator steady-state cost at scale (a script, not a test): prints a table.

On the real control plane with KubeRay's RayCluster CRD, and the operator as users run it:
  - N TPUFineTunes (v6e 4x4) whose RayClusters wait for capacity: no KubeRay runs here,
    so each stays not ready, as KubeRay leaves a cluster whose pods are Unschedulable;
  - a few real runs on a local Ray head: their RayClusters are marked ready (what KubeRay
    would write) and the operator reaches the head through TPUFT_DASHBOARD_URL; they run
    the trainer's collectives check for real (jobs, log streams, status writes).
Measured over a steady window once every waiting run is Provisioning and the real runs
are in flight: the operator's requests to the API server per second, by resource and verb
(the kube-apiserver's own apiserver_request_total; nothing else talks to it in the
window), the operator's threads and RSS (peak), and how the real runs ended.
Targets: no per-run GET or LIST every tick, threads bounded, RSS < 300 MB.

    flock /tmp/tpuft-ground.lock .venv/bin/python benchmarks/bench_operator_scale.py [--waiting 300] [--real 2]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from harness.controlplane import start_with_crds  # noqa: E402
from harness.operator_process import OperatorProcess  # noqa: E402
from harness.rayhead import RayHead  # noqa: E402
from bench_operator import print_table  # noqa: E402

REQUEST = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<count>[0-9.e+]+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')


def waiting(name: str) -> dict:
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name},
            "spec": {"tpu": {"generation": "v6e", "topology": "4x4"}, "image": "registry.example/trainer:bench",
                     "checkpoint": {"storagePath": "gs://bench/ckpt"}}}


def real(name: str, storage: Path) -> dict:
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name},
            "spec": {"tpu": {"generation": "cpu", "topology": "2"}, "mode": "collectives",
                     "image": "registry.example/trainer:bench", "checkpoint": {"storagePath": str(storage)}}}


def requests(cp) -> Counter:
    counts: Counter = Counter()
    for line in cp.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        match = REQUEST.match(line)
        if match:
            labels = dict(LABEL.findall(match["labels"]))
            resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
            counts[(resource, labels.get("verb", ""))] += int(float(match["count"]))
    return counts


def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def phases(cp, namespace: str) -> Counter:
    out = cp.kubectl("-n", namespace, "get", "tpufinetunes", "-o",
                     "jsonpath={range .items[*]}{.status.phase}{\"\\n\"}{end}", timeout=120).stdout
    return Counter(line or "(none)" for line in out.splitlines())


def wait(what: str, predicate, timeout: float, interval: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} after {timeout}s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waiting", type=int, default=300)
    parser.add_argument("--real", type=int, default=2)
    parser.add_argument("--window", type=float, default=60.0, help="seconds of steady state measured")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="tft-bench-scale-"))
    cp, _ = start_with_crds(workdir=workdir / "cp")
    head = operator = None
    try:
        head = RayHead.start(num_cpus=4)
        env = cp.env()
        namespace = "bench"
        cp.kubectl("create", "namespace", namespace)
        # A fixed dashboard (the local head, its token); the runs' token Secrets are still
        # created, from a signing key kept in the bench namespace.
        env.update(TPUFT_DASHBOARD_URL=head.dashboard_url, TPUFT_RAY_TOKEN=head.token or "",
                   TPUFT_POLL_INTERVAL="5", TPUFT_OPERATOR_NAMESPACE=namespace,
                   TPUFT_LEADER_ELECTION="false")  # one operator, admin credentials
        operator = OperatorProcess(env, workdir / "operator.log")
        operator.start()
        pid = operator.proc.pid
        peak = {"rss": 0, "threads": 0}
        sampling = True

        def sample() -> None:
            while sampling:
                peak["rss"] = max(peak["rss"], proc_status(pid, "VmRSS"))
                peak["threads"] = max(peak["threads"], proc_status(pid, "Threads"))
                time.sleep(0.5)

        threading.Thread(target=sample, daemon=True).start()

        started = time.monotonic()
        text = yaml.safe_dump_all([waiting(f"wait-{i}") for i in range(args.waiting)])
        cp.kubectl("-n", namespace, "apply", "--server-side", "-f", "-", input=text, timeout=300)
        wait("every waiting run Provisioning",
             lambda: phases(cp, namespace).get("Provisioning", 0) >= args.waiting, timeout=600)
        settled = time.monotonic() - started

        storage = workdir / "ckpt"
        reals = [f"real-{i}" for i in range(args.real)]
        cp.kubectl("-n", namespace, "apply", "-f", "-",
                   input=yaml.safe_dump_all([real(name, storage) for name in reals]))
        for name in reals:  # what KubeRay would write once the pods are up
            wait(f"RayCluster of {name}", lambda: cp.kubectl("-n", namespace, "get", "raycluster", f"tft-{name}",
                                                             check=False).returncode == 0, timeout=120, interval=0.5)
            cp.kubectl("-n", namespace, "patch", "raycluster", f"tft-{name}", "--subresource=status",
                       "--type=merge", "-p", '{"status": {"state": "ready"}}')

        before, t0 = requests(cp), time.monotonic()
        time.sleep(args.window)
        after, elapsed = requests(cp), time.monotonic() - t0
        rates = {key: (after[key] - before[key]) / elapsed for key in after if after[key] - before[key] > 0}

        final = wait("the real runs to end", lambda: all(
            (cp.kubectl("-n", namespace, "get", "tpufinetune", name, "-o", "jsonpath={.status.phase}").stdout
             in ("Succeeded", "Failed")) for name in reals) and phases(cp, namespace), timeout=600)
        sampling = False

        rows = [
            (f"{args.waiting} applied -> all Provisioning", f"{settled:.0f} s", ""),
            (f"API requests/s, all, {args.window:.0f} s steady window", f"{sum(rates.values()):.1f}",
             f"<< {args.waiting}/poll"),
        ]
        for (resource, verb), rate in sorted(rates.items(), key=lambda kv: -kv[1])[:8]:
            rows.append((f"  {verb} {resource}", f"{rate:.2f}", ""))
        rows += [
            ("operator threads, peak", str(peak["threads"]), "bounded"),
            ("operator RSS, peak", f"{peak['rss'] / 1024:.0f} MB", "< 300 MB"),
            ("phases at the end", ", ".join(f"{k} {v}" for k, v in sorted(final.items())), ""),
        ]
        print_table(rows, value_width=24)
        return 0
    finally:
        if operator is not None:
            operator.stop()
        if head is not None:
            head.stop()
        cp.stop()


if __name__ == "__main__":
    sys.exit(main())
