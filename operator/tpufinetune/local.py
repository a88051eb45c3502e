"""`tpufinetune run --local FILE`: the operator's state machine against a local Ray head,
without Kubernetes. Same validation, sizing, entrypoint and event parsing; the RayCluster
is rendered but not created (the local head stands in for it), and status changes are
printed instead of written.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from datetime import datetime

import yaml

from tpufinetune.core import phases, startup
from tpufinetune.driver import Run
from tpufinetune.core.phases import ClusterView, Identity
from tpufinetune.core.podstatus import HEALTHY, SliceHealth
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.settings import Settings, SettingsError

SHOWN = ("phase", "epochProgress", "loss", "evalLoss", "tokensPerSecond", "checkpointURI", "message")


class LocalBackend:
    one_machine = True  # every Ray process shares this machine's filesystem (api.ONE_MACHINE)

    def __init__(self, address: str, out=sys.stdout):
        self.address = address
        self.out = out
        self.cluster_up = False  # the local head "is" the cluster between create and delete
        self.started: set = set()  # attempts whose startup was printed (once each)

    def _say(self, text: str) -> None:
        print(f"[{datetime.now():%H:%M:%S}] {text}", file=self.out, flush=True)

    async def observe(self, ident: Identity, name: str) -> ClusterView:
        return ClusterView(exists=self.cluster_up, owned=True, ready=True, dashboard_url=self.address)

    async def create(self, ident: Identity, manifest: dict) -> None:
        self.cluster_up = True
        workers = manifest["spec"]["workerGroupSpecs"][0]
        self._say(
            f"RayCluster {manifest['metadata']['name']} rendered ({workers.get('numOfHosts', 1)} hosts x "
            f"{workers['replicas']} replicas); using the local Ray head at {self.address} instead"
        )

    async def delete(self, ident: Identity, name: str) -> None:
        self.cluster_up = False

    async def slice_health(self, ident: Identity, name: str, since, hosts: int) -> SliceHealth:
        return HEALTHY  # no pods to judge: the local head is taken as it is

    async def ray_token(self, ident: Identity) -> str | None:
        return None  # the local head's token: TPUFT_RAY_TOKEN (or RAY_AUTH_TOKEN), for every run

    async def write_status(self, ident: Identity, patch: dict, new: dict, resource_version: str) -> str:
        changed = [k for k in SHOWN if k in patch and patch[k] is not None]
        if changed:
            self._say("  ".join(f"{k}={new[k]}" for k in changed))
        for entry in new.get("attempts") or []:  # each attempt's time to first step, and a warm retry
            line = startup.summary(entry)
            if line and entry.get("attempt") not in self.started:
                self.started.add(entry.get("attempt"))
                self._say(line)
        return ""  # one writer, nothing to fence

    async def maintenance(self, ident: Identity, cluster: str) -> tuple[tuple[str, str], ...]:
        return ()  # a local head has no Kubernetes nodes

    async def read_status(self, ident: Identity) -> tuple[dict, str] | None:
        return None  # printing never fails half-way: the run's own copy is the status

    def record(self, ident: Identity, type_: str, reason: str, message: str) -> None:
        self._say(f"event {type_} {reason}: {message}")


def load_resource(path: str) -> dict:
    text = sys.stdin.read() if path == "-" else open(path).read()
    docs = [d for d in yaml.safe_load_all(text) if d]
    if len(docs) != 1:
        raise SystemExit(f"{path}: expected one TPUFineTune document, found {len(docs)}")
    body = docs[0]
    meta = body.setdefault("metadata", {})
    meta.setdefault("namespace", "default")
    meta.setdefault("generation", 1)
    return body


async def run_local(body: dict, address: str, settings: Settings, out=sys.stdout) -> dict:
    jobs = RayJobs(headers=settings.ray_headers(), timeout=settings.ray_timeout, threads=settings.ray_threads)
    run = Run(body, LocalBackend(address, out), jobs, settings)
    try:
        await run.run(asyncio.Event())
    except asyncio.CancelledError:
        await run.step(deleting=True)  # Ctrl-C: stop the job, leave nothing running
        raise
    finally:
        await run.close()
    return run.status


# A chained run waits for its source's result, which only the operator of the cluster that
# holds the source can read: here it would wait forever.
CHAINED_REFUSAL = ("spec.model.initFrom: a chained run starts from another TPUFineTune's result, which only "
                   "the operator in the cluster that holds that run can read, so --local would wait for it "
                   "forever; apply this TPUFineTune with kubectl where its source run is, or start from the "
                   "source's export here: remove initFrom and set spec.model.id to its status.exportedModelURI")


def chained(body: dict) -> bool:
    return bool(((body.get("spec") or {}).get("model") or {}).get("initFrom"))


def main(args) -> int:
    body = load_resource(args.file)
    if chained(body):
        print(f"tpufinetune run: {CHAINED_REFUSAL}", file=sys.stderr)
        return 2
    body["metadata"].setdefault("uid", args.uid or str(uuid.uuid4()))
    env = dict(os.environ)
    if not env.get("TPUFT_RAY_TOKEN") and env.get("RAY_AUTH_TOKEN"):
        env["TPUFT_RAY_TOKEN"] = env["RAY_AUTH_TOKEN"]
    env.setdefault("TPUFT_POLL_INTERVAL", "1")
    try:
        settings = Settings.from_env(env)
    except SettingsError as exc:
        print(f"tpufinetune run: {exc}", file=sys.stderr)
        return 2
    address = args.address or env.get("RAY_DASHBOARD_ADDRESS") or "http://127.0.0.1:8265"
    print(f"uid {body['metadata']['uid']} (pass --uid to re-attach to this run)", flush=True)
    try:
        status = asyncio.run(run_local(body, address, settings))
    except KeyboardInterrupt:
        print("interrupted: job stopped", file=sys.stderr)
        return 130
    print(yaml.safe_dump({"status": status}, sort_keys=False), end="")
    return 0 if status.get("phase") == phases.SUCCEEDED else 1
