"""`make demo`: the whole stack on this machine's test ground, then everything stopped again.

The ground (tests/harness/ground.py) is a small GKE-shaped cluster: a real kube-apiserver,
etcd, kube-scheduler and kube-controller-manager, the real KubeRay operator, GKE-shaped TPU
and CPU node pools, and a node agent that runs each scheduled pod as a real Ray process.
The operator runs as deploy/'s ServiceAccount and reaches the Ray head by its Service name.
The sample CPU rehearsal (deploy/samples/cpu-rehearsal.yaml) is pointed at a tiny random
Gemma 4 and a generated dolly-style dataset (nothing can be downloaded here), uploaded to the
ground's Cloud Storage emulator; its checkpoints and export go there too (gs://).
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

from harness.ground import Ground  # noqa: E402
from harness.ray_fixtures import build_assets  # noqa: E402

SAMPLE = REPO / "deploy" / "samples" / "cpu-rehearsal.yaml"
TIMEOUT_S = 900


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def demo_manifest(assets: str, storage: str) -> dict:
    """The sample, on the assets under the gs:// prefix `assets`, checkpointing to `storage`."""
    manifest = yaml.safe_load(SAMPLE.read_text())
    spec = manifest["spec"]
    spec["model"] = {"id": f"{assets}/model"}  # no Hugging Face token needed offline
    spec["dataset"] = {"id": f"{assets}/data/train.jsonl", "split": "train[:512]"}
    spec["training"].update(epochs=3, maxSeqLen=128, learningRate=0.001, evalFraction=0.1)
    spec["checkpoint"]["storagePath"] = storage
    return manifest


def changed_lines(previous: list[str], table: str) -> list[str]:
    lines = table.strip().splitlines()
    return [line for line in lines if line not in previous] if previous else lines


def follow(ground: Ground, name: str) -> dict:
    """Print `kubectl get tpufinetunes` and `kubectl get pods -o wide` whenever they change,
    until the run ends."""
    seen_runs: list[str] = []
    seen_pods: list[str] = []
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        runs = ground.kubectl("get", "tpufinetunes").stdout
        without_age = "\n".join(line.rsplit(None, 1)[0] for line in runs.strip().splitlines())
        for line in changed_lines(seen_runs, without_age):
            print(f"  {line}", flush=True)
        seen_runs = without_age.splitlines()
        pods = ground.kubectl("get", "pods", "-o", "wide").stdout
        stable = "\n".join(" ".join(line.split()[:3] + line.split()[5:7]) for line in pods.strip().splitlines())
        for line in changed_lines(seen_pods, stable):
            print(f"    pods: {line}", flush=True)
        seen_pods = stable.splitlines()
        status = json.loads(ground.kubectl("get", "tpufinetune", name, "-o", "json").stdout).get("status", {})
        if status.get("phase") in ("Succeeded", "Failed"):
            return status
        time.sleep(1)
    raise TimeoutError(f"{name} did not finish within {TIMEOUT_S}s")


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = Path(tempfile.mkdtemp(prefix="tft-demo-"))
    ground = None
    started = time.monotonic()
    try:
        say("starting the test ground: kube-apiserver, etcd, kube-scheduler, kube-controller-manager, "
            "KubeRay, GKE-shaped node pools, the node agent, and the operator")
        ground = Ground(workdir=workdir / "ground", with_operator=True).start()
        print(f"  up in {sum(ground.timings.values()):.1f}s: {ground.timings}")
        print(ground.kubectl("get", "nodes", "-L", "cloud.google.com/gke-nodepool",
                             "-L", "node.kubernetes.io/instance-type", "-L", "cloud.google.com/gke-tpu-topology").stdout)
        say("building the offline assets: a tiny random Gemma 4 and a dolly-style dataset, "
            f"uploaded to gs://{ground.gcs.bucket}/demo/assets")
        assets = ground.gcs.upload(build_assets(workdir / "assets").root, ground.gcs.uri("demo", "assets"))

        manifest = demo_manifest(assets, ground.gcs.uri("demo", "checkpoints"))
        name = manifest["metadata"]["name"]
        say(f"kubectl apply -f {SAMPLE.relative_to(REPO)} (model and data pointed at the offline assets)")
        print(ground.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest)).stdout.strip())

        say("kubectl get tpufinetunes / kubectl get pods -o wide (each change)")
        status = follow(ground, name)

        say("loss per epoch")
        for entry in status.get("history", []):
            print(f"  epoch {entry['epoch']}: loss={entry.get('loss')} eval_loss={entry.get('evalLoss')} "
                  f"tokens/s={entry.get('tokensPerSecond')}")
        say("result")
        print(f"  phase:      {status.get('phase')}  ({status.get('message')})")
        print(f"  checkpoint: {status.get('checkpointURI')}")
        print(f"  exported:   {status.get('exportedModelURI')}")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (
                ground.kubectl("get", "rayclusters", "-o", "name").stdout.strip()
                or ground.kubectl("get", "pods", "-o", "name").stdout.strip()):
            time.sleep(1)
        left = ground.kubectl("get", "rayclusters,pods", "-o", "name").stdout.strip()
        print(f"  RayClusters and pods left running: {left or 'none'}")
        print(f"  Ray processes left: {len(ground.ray_processes())}")
        print(f"  (everything lives under {workdir}, the bucket's objects as files under "
              f"{ground.gcs_root / ground.gcs.bucket}; it is kept for you to look at)")
        print(f"  demo took {time.monotonic() - started:.0f}s")
        return 0 if status.get("phase") == "Succeeded" else 1
    finally:
        say("stopping the operator, every Ray process and the ground")
        if ground is not None:
            ground.stop()


if __name__ == "__main__":
    sys.exit(main())
