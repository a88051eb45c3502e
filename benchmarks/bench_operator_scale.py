"""Operator cost at rest, and after a restart, with many runs (a script, not a test): prints a table.

On the real control plane with KubeRay's RayCluster CRD, and the operator as users run it:
  - finished runs (--finished): TPUFineTunes whose status says Succeeded, written before the
    operator starts (as an operator restart finds them);
  - waiting runs (--waiting, cumulative sizes, e.g. 100,1000): v6e 4x4 runs whose RayClusters
    wait for capacity (no KubeRay runs here, so each stays not ready, as KubeRay leaves a
    cluster whose pods are Unschedulable); --queued-share of them name a Kueue queue, so
    their RayClusters are created suspended and wait for Kueue (which does not run here);
  - a few real runs (--real) on a local Ray head: their RayClusters are marked ready (what
    KubeRay would write) and the operator reaches the head through TPUFT_DASHBOARD_URL; they
    fine-tune the tiny model for real (jobs, log streams, status writes) for many epochs.
For each size, measured over a steady window once every waiting run is Provisioning or
Queued: the operator's requests to the API server per second, by resource and verb (the
kube-apiserver's own apiserver_request_total; nothing else talks to it in the window), the
operator's threads and RSS. With --restart, the operator is then killed (SIGKILL) and a new
one started: the seconds until every real run's status moves again (a new step written),
and the log bytes the new operator read (tpufinetune_log_bytes_total).
Targets: requests/s independent of the number of waiting and finished runs, threads
bounded, RSS < 250 MB at 1000 runs, restart -> steady state <= 30 s.

    .venv/bin/python benchmarks/bench_operator_scale.py \
        [--waiting 100,1000] [--finished 700] [--real 2] [--restart]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
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
from harness.ports import free_port  # noqa: E402
from harness.rayhead import RayHead  # noqa: E402
from bench_operator import print_table, proc_status  # noqa: E402

REQUEST = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<count>[0-9.e+]+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')


def waiting(name: str, queue: str = "") -> dict:
    spec = {"tpu": {"generation": "v6e", "topology": "4x4"}, "image": "registry.example/trainer:bench",
            "checkpoint": {"storagePath": "gs://bench/ckpt"}}
    if queue:
        spec["queueName"] = queue
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name}, "spec": spec}


def real(name: str, storage: Path, assets: Path) -> dict:
    """A fine-tune of the tiny model that runs for many epochs: its status moves at each
    epoch's end (a progress and an epoch event)."""
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name},
            "spec": {"tpu": {"generation": "cpu", "topology": "2"}, "image": "registry.example/trainer:bench",
                     "model": {"id": str(assets / "model")},
                     "dataset": {"id": str(assets / "data" / "train.jsonl"), "split": "train"},
                     "training": {"epochs": 500, "batchSizePerDevice": 4, "maxSeqLen": 128},
                     "checkpoint": {"storagePath": str(storage / name)},
                     # One shared volume holds the path (here: the local head's own disk).
                     **{group: {"volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}],
                                "volumeMounts": [{"name": "ckpt", "mountPath": str(storage)}]}
                        for group in ("head", "workers")}}}


def requests(cp) -> Counter:
    counts: Counter = Counter()
    for line in cp.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        match = REQUEST.match(line)
        if match:
            labels = dict(LABEL.findall(match["labels"]))
            resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
            counts[(resource, labels.get("verb", ""))] += int(float(match["count"]))
    return counts


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def confine(head_pid: int, cpus: str) -> None:
    """Pin the Ray head's processes to `cpus`; the raylet's workers, started later, inherit it."""
    import psutil

    allowed = set()
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        allowed.update(range(int(low), int(high or low) + 1))
    group = os.getpgid(head_pid)
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == group:
                os.sched_setaffinity(proc.pid, allowed)
        except (OSError, psutil.Error):
            pass


def is_queued(index: int, share: float) -> bool:
    return int((index + 1) * share) > int(index * share)


def write_finished(cp, namespace: str, count: int) -> None:
    """Runs that ended before this operator started: applied, then their status written
    (Succeeded, their RayCluster released) through the status subresource."""
    from kubernetes import client, config

    cp.kubectl("-n", namespace, "apply", "--server-side", "-f", "-", timeout=600,
               input=yaml.safe_dump_all([waiting(f"done-{i}") for i in range(count)]))
    api = config.new_client_from_config(config_file=str(cp.kubeconfig))
    objects = client.CustomObjectsApi(api)
    for i in range(count):
        objects.patch_namespaced_custom_object_status(
            "tpufinetune.dev", "v1alpha1", namespace, "tpufinetunes", f"done-{i}",
            {"status": {"phase": "Succeeded", "rayClusterName": f"tft-done-{i}", "message": "finished earlier",
                        "completionTime": "2026-01-01T00:00:00Z"}})
    api.close()


def steps(cp, namespace: str, names: list[str]) -> dict[str, int]:
    out = cp.kubectl("-n", namespace, "get", "tpufinetunes", "-o", "jsonpath={range .items[*]}{.metadata.name}"
                     "{\" \"}{.status.phase}{\" \"}{.status.progress.step}{\"\\n\"}{end}", timeout=120).stdout
    found = {}
    for line in out.splitlines():
        name, _, rest = line.partition(" ")
        phase, _, step = rest.partition(" ")
        if name in names:
            found[name] = int(step) if phase == "Running" and step.strip() else -1
    return found


def scraped(operator, metric: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(operator.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(metric) and not line.startswith("#"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waiting", default="100,1000", help="cumulative numbers of waiting runs, each measured")
    parser.add_argument("--queued-share", type=float, default=0.3, help="share of waiting runs queued in Kueue")
    parser.add_argument("--finished", type=int, default=700)
    parser.add_argument("--real", type=int, default=2)
    parser.add_argument("--window", type=float, default=60.0, help="seconds of steady state measured")
    parser.add_argument("--restart", action="store_true", help="then kill -9 the operator and time a new one")
    parser.add_argument("--ray-cpus", default="1", help="CPUs the Ray head and its trainers may use (taskset "
                        "list, e.g. 1 or 2-3; empty: all): the trainers would otherwise take every core the "
                        "operator and the API server are measured on")
    args = parser.parse_args()
    sizes = [int(n) for n in args.waiting.split(",")]

    workdir = Path(tempfile.mkdtemp(prefix="tft-bench-scale-"))
    cp, _ = start_with_crds(workdir=workdir / "cp")
    head = operator = None
    sampling = True
    try:
        assets = workdir / "assets"
        subprocess.run([sys.executable, "-m", "tpufinetune_trainer.assets", "--out", str(assets)], check=True,
                       stdout=subprocess.DEVNULL)
        head = RayHead.start(num_cpus=4)
        if args.ray_cpus:
            confine(head.pid, args.ray_cpus)
        env = cp.env()
        metrics_port = free_port()
        namespace = "bench"
        cp.kubectl("create", "namespace", namespace)
        write_finished(cp, namespace, args.finished)
        # A fixed dashboard (the local head, its token); the runs' token Secrets are still
        # created, from a signing key kept in the bench namespace.
        env.update(TPUFT_DASHBOARD_URL=head.dashboard_url, TPUFT_RAY_TOKEN=head.token or "",
                   TPUFT_POLL_INTERVAL="5", TPUFT_OPERATOR_NAMESPACE=namespace,
                   TPUFT_LEADER_ELECTION="false",  # one operator, admin credentials
                   TPUFT_METRICS_PORT=str(metrics_port))
        operator = OperatorProcess(env, workdir / "operator.log")
        operator.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        operator.start()
        peak = {"rss": 0, "threads": 0}

        def sample() -> None:
            while sampling:
                try:
                    peak["rss"] = max(peak["rss"], proc_status(operator.proc.pid, "VmRSS"))
                    peak["threads"] = max(peak["threads"], proc_status(operator.proc.pid, "Threads"))
                except (OSError, ValueError):
                    pass  # between the killed operator and the next
                time.sleep(0.5)

        threading.Thread(target=sample, daemon=True).start()

        storage = workdir / "ckpt"
        reals = [f"real-{i}" for i in range(args.real)]
        cp.kubectl("-n", namespace, "apply", "-f", "-",
                   input=yaml.safe_dump_all([real(name, storage, assets) for name in reals]))
        for name in reals:  # what KubeRay would write once the pods are up
            wait(f"RayCluster of {name}", lambda: cp.kubectl("-n", namespace, "get", "raycluster", f"tft-{name}",
                                                             check=False).returncode == 0, timeout=120, interval=0.5)
            cp.kubectl("-n", namespace, "patch", "raycluster", f"tft-{name}", "--subresource=status",
                       "--type=merge", "-p", '{"status": {"state": "ready"}}')
        wait("the real runs to train", lambda: all(v > 0 for v in steps(cp, namespace, reals).values())
             and len(steps(cp, namespace, reals)) == len(reals), timeout=600)

        columns, applied = [], 0
        for size in sizes:
            queued = sum(is_queued(i, args.queued_share) for i in range(size))
            started = time.monotonic()
            # Every run whose index crosses a multiple of 1/share is queued: the share holds at each size.
            text = yaml.safe_dump_all([waiting(f"wait-{i}", queue="team-a" if is_queued(i, args.queued_share) else "")
                                       for i in range(applied, size)])
            cp.kubectl("-n", namespace, "apply", "--server-side", "-f", "-", input=text, timeout=600)
            applied = size
            wait(f"{size} waiting runs Provisioning or Queued",
                 lambda: phases(cp, namespace).get("Provisioning", 0) + phases(cp, namespace).get("Queued", 0)
                 >= size, timeout=1200)
            settled = time.monotonic() - started
            time.sleep(10)  # the last wake-ups of the new runs
            peak.update(rss=0, threads=0)
            before, t0, cpu0 = requests(cp), time.monotonic(), cpu_seconds(operator.proc.pid)
            time.sleep(args.window)
            after, elapsed = requests(cp), time.monotonic() - t0
            cpu = (cpu_seconds(operator.proc.pid) - cpu0) / elapsed
            rates = {key: (after[key] - before[key]) / elapsed for key in after if after[key] - before[key] > 0}
            columns.append({"size": size, "queued": queued, "settled": settled, "rates": rates,
                            "rss": peak["rss"], "threads": peak["threads"], "cpu": cpu,
                            "phases": phases(cp, namespace)})

        restart = None
        if args.restart and reals:
            before_steps = steps(cp, namespace, reals)
            operator.kill()
            killed = time.monotonic()
            operator.start()
            moved = wait("every real run's status moving again", lambda: all(
                step > before_steps[name] for name, step in steps(cp, namespace, reals).items()), timeout=300,
                interval=0.5)
            restart = {"seconds": time.monotonic() - killed, "moved": bool(moved),
                       "log_bytes": scraped(operator, "tpufinetune_log_bytes_total"),
                       "rss": proc_status(operator.proc.pid, "VmRSS")}
        sampling = False

        total = args.finished + args.real
        rows = [("runs: finished + real + waiting (queued)",
                 " | ".join(f"{args.finished} + {args.real} + {c['size']} ({c['queued']})" for c in columns),
                 "")]
        rows.append(("waiting applied -> all Provisioning/Queued", " | ".join(f"{c['settled']:.0f} s" for c in columns), ""))
        rows.append((f"API requests/s, all, {args.window:.0f} s window",
                     " | ".join(f"{sum(c['rates'].values()):.2f}" for c in columns), "same at every size"))
        keys = sorted({k for c in columns for k in c["rates"]}, key=lambda k: -max(c["rates"].get(k, 0) for c in columns))
        for resource, verb in keys[:10]:
            rows.append((f"  {verb} {resource}", " | ".join(f"{c['rates'].get((resource, verb), 0):.2f}" for c in columns), ""))
        rows += [
            ("operator CPU, mean in window", " | ".join(f"{c['cpu'] * 100:.0f} %" for c in columns), ""),
            ("operator threads, peak in window", " | ".join(str(c["threads"]) for c in columns), "bounded"),
            ("operator RSS, peak in window", " | ".join(f"{c['rss'] / 1024:.0f} MB" for c in columns),
             f"< 250 MB at {total + sizes[-1]}"),
            ("phases at the end", ", ".join(f"{k} {v}" for k, v in sorted(columns[-1]["phases"].items())), ""),
        ]
        if restart is not None:
            rows += [
                ("kill -9 -> every real run's status moving", f"{restart['seconds']:.1f} s", "<= 30 s"),
                ("log bytes read by the new operator", f"{restart['log_bytes']:.0f}", "a bounded tail"),
                ("new operator RSS", f"{restart['rss'] / 1024:.0f} MB", "< 250 MB"),
            ]
        print_table(rows, value_width=40)
        return 0
    finally:
        sampling = False
        if operator is not None:
            operator.stop()
        if head is not None:
            head.stop()
        cp.stop()


if __name__ == "__main__":
    sys.exit(main())
