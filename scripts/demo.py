"""`make demo`: the whole stack on this machine, then everything stopped again.

A real kube-apiserver + etcd (built from Go modules), KubeRay's real RayCluster CRD, a
real local Ray head, the operator as users run it, and the sample CPU rehearsal
(deploy/samples/cpu-rehearsal.yaml) pointed at a tiny random Gemma 4 and a generated
dolly-style dataset (nothing can be downloaded here). No pods run without a kubelet, so
the demo plays KubeRay's one part: it reports the RayCluster ready, and the operator's
TPUFT_DASHBOARD_URL setting points it at the local Ray head.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from harness.controlplane import start_with_crds  # noqa: E402
from harness.operator_process import OperatorProcess  # noqa: E402
from harness.ray_fixtures import build_assets  # noqa: E402
from harness.rayhead import RayHead  # noqa: E402

SAMPLE = REPO / "deploy" / "samples" / "cpu-rehearsal.yaml"
TIMEOUT_S = 900


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def demo_manifest(workdir: Path, assets) -> dict:
    manifest = yaml.safe_load(SAMPLE.read_text())
    spec = manifest["spec"]
    spec["model"] = {"id": str(assets.model)}  # no Hugging Face token needed offline
    spec["dataset"] = {"id": str(assets.data), "split": "train[:512]"}
    spec["training"].update(epochs=3, maxSeqLen=128, learningRate=0.001, evalFraction=0.1)
    spec["checkpoint"]["storagePath"] = str(workdir / "checkpoints")
    return manifest


def follow(cp, name: str, cluster_ready) -> dict:
    """Print `kubectl get tpufinetunes` whenever it changes, until the run ends."""
    last, deadline = "", time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        cluster_ready()
        table = cp.kubectl("get", "tpufinetunes").stdout.strip()
        without_age = [line.rsplit(None, 1)[0] for line in table.splitlines()]
        if without_age != last:
            print(table.splitlines()[-1] if last else table, flush=True)
            last = without_age
        status = json.loads(cp.kubectl("get", "tpufinetune", name, "-o", "json").stdout).get("status", {})
        if status.get("phase") in ("Succeeded", "Failed"):
            return status
        time.sleep(1)
    raise TimeoutError(f"{name} did not finish within {TIMEOUT_S}s")


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = Path(tempfile.mkdtemp(prefix="tft-demo-"))
    cp = head = operator = None
    try:
        say("starting a real control plane (kube-apiserver + etcd) with the CRDs")
        cp, kuberay = start_with_crds(workdir=workdir / "cp")
        if kuberay is None:
            print("KubeRay's RayCluster CRD is missing: see tests/README.md", file=sys.stderr)
            return 1
        say("starting a local Ray head (token authentication on)")
        head = RayHead.start(num_cpus=4)
        say("building the offline assets: a tiny random Gemma 4 and a dolly-style dataset")
        assets = build_assets(workdir / "assets")
        say("starting the operator: tpufinetune operator")
        env = cp.env()
        env.update(TPUFT_DASHBOARD_URL=head.dashboard_url, TPUFT_RAY_TOKEN=head.token or "",
                   TPUFT_POLL_INTERVAL="1", HF_HUB_OFFLINE="1")
        operator = OperatorProcess(env, workdir / "operator.log")
        operator.start()

        manifest = demo_manifest(workdir, assets)
        name = manifest["metadata"]["name"]
        say(f"kubectl apply -f {SAMPLE.relative_to(REPO)} (model and data pointed at the offline assets)")
        print(cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest)).stdout.strip())

        marked = []

        def cluster_ready() -> None:
            # Playing KubeRay: no kubelet runs pods here, so report the cluster ready.
            if marked:
                return
            got = cp.kubectl("get", "rayclusters", "-o", "name", check=False).stdout.split()
            if got:
                cluster = got[0].split("/")[-1]
                cp.kubectl("patch", "raycluster", cluster, "--subresource=status", "--type=merge",
                           "-p", json.dumps({"status": {"state": "ready"}}))
                print(f"(KubeRay's part: RayCluster {cluster} accepted by the real CRD, reported ready)", flush=True)
                marked.append(cluster)

        say("kubectl get tpufinetunes (each change)")
        status = follow(cp, name, cluster_ready)

        say("loss per epoch")
        for entry in status.get("history", []):
            print(f"  epoch {entry['epoch']}: loss={entry.get('loss')} eval_loss={entry.get('evalLoss')} "
                  f"tokens/s={entry.get('tokensPerSecond')}")
        say("result")
        print(f"  phase:      {status.get('phase')}  ({status.get('message')})")
        print(f"  checkpoint: {status.get('checkpointURI')}")
        print(f"  exported:   {status.get('exportedModelURI')}")
        left = cp.kubectl("get", "rayclusters", "-o", "name").stdout.strip()
        print(f"  RayClusters left running: {left or 'none'}")
        print(f"  (everything lives under {workdir}; it is kept for you to look at)")
        return 0 if status.get("phase") == "Succeeded" else 1
    finally:
        say("stopping the operator, the Ray head and the control plane")
        for part in (operator, head, cp):
            if part is not None:
                part.stop()


if __name__ == "__main__":
    sys.exit(main())
