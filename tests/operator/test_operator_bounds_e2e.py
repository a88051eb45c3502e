"""The operator never holds a slice it cannot explain, on the test ground:

- a preflight that never ends (its driver process stopped with SIGSTOP on the head pod, so
  the Ray job stays RUNNING and the head keeps answering: the hang the preflight exists to
  catch) ends the attempt after TPUFT_SUBMIT_TIMEOUT, reason SubmitTimeout, and the
  RayCluster is released;
- the Ray token signing key made unreadable (its Secret's data.key removed) while a run is
  Running: the operator says why in the run's status (Ray unreachable, with the Secret's
  problem) and in an Event, and deleting the run removes its finalizer and its RayCluster
  at once, with no token and no answer from Ray.

Nothing here is mocked: the hang is a real stopped process, the key a real Secret."""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tpufinetune.core import conditions as cond
from tpufinetune.core.raytoken import SIGNING_KEY_FIELD, SIGNING_KEY_SECRET
from ground_runs import operator_with, released, resource, running, start_run
from harness.timing import within

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

SUBMIT_TIMEOUT = 45  # TPUFT_SUBMIT_TIMEOUT for the hung preflight: seconds in Submitting
OPERATOR_NAMESPACE = "tpufinetune-system"


def head_uid(kube, cluster: str) -> str | None:
    heads = [p for p in kube.pods_of(cluster) if p["metadata"]["labels"].get("ray.io/node-type") == "head"]
    return heads[0]["metadata"]["uid"] if heads else None


def preflight_drivers(ground, pod_uid: str) -> list[int]:
    """The head pod's processes running the preflight's entrypoint (`tpufinetune-train
    collectives ...`: Ray starts it through a shell, both are taken)."""
    found = []
    for pid in ground.ray_processes(pod_uid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # it ended
            continue
        if b"collectives" in argv and any(b"tpufinetune-train" in arg for arg in argv):
            found.append(pid)
    return found


@contextmanager
def signing_key_without_its_key(ground):
    """The operator's signing key Secret with data.key removed (a bad edit, a broken
    restore), put back afterwards."""
    secret = ["-n", OPERATOR_NAMESPACE, "secret", SIGNING_KEY_SECRET]
    saved = json.loads(ground.kubectl("get", *secret, "-o", "json").stdout)["data"]
    ground.kubectl("patch", *secret, "--type=merge", "-p", json.dumps({"data": {SIGNING_KEY_FIELD: None}}))
    try:
        yield
    finally:
        ground.kubectl("patch", *secret, "--type=merge", "-p", json.dumps({"data": saved}))


def test_a_hung_preflight_and_an_unreadable_signing_key_never_hold_a_slice(
        operator, ground, kube, ground_assets, storage):
    alive = resource("bounds-alive", ground_assets, f"{storage}/alive", epochs=50)
    hung = resource("preflight-hung", ground_assets, f"{storage}/hung", preflight={"enabled": True})
    with operator_with(operator, TPUFT_SUBMIT_TIMEOUT=str(SUBMIT_TIMEOUT)):
        _, alive_cluster = start_run(kube, alive)
        uid, cluster = start_run(kube, hung)
        head = kube.wait_for(lambda: head_uid(kube, cluster), "the head pod of preflight-hung", timeout=300)
        # The preflight's driver stopped as soon as it starts: its job never ends.
        drivers = kube.wait_for(lambda: preflight_drivers(ground, head), "the preflight's driver process",
                                timeout=300, interval=0.1)
        for pid in drivers:
            os.kill(pid, signal.SIGSTOP)
        assert kube.status("preflight-hung").get("phase") == "Submitting"
        pods = [p["metadata"]["uid"] for p in kube.pods_of(cluster)]
        status = kube.wait_for(lambda: (s := kube.status("preflight-hung")).get("phase") == "Failed" and s,
                               "preflight-hung Failed by the submit timeout", timeout=within(SUBMIT_TIMEOUT + 60))
        failed = cond.find(status, cond.FAILED)
        assert failed["reason"] == "SubmitTimeout", failed
        assert f"preflight tft-{uid}-1-preflight to end after {SUBMIT_TIMEOUT} s in Submitting" in failed["message"]
        assert status["preflight"]["phase"] == "Failed"
        assert [a["reason"] for a in status["attempts"]] == ["NotStarted"]
        assert not cond.is_true(status, cond.JOB_SUBMITTED)  # no fine-tune job was submitted
        released(kube, ground, cluster, pods)
        running(kube, "bounds-alive")

    # The signing key unreadable, seen by an operator that starts now (the key is read
    # once per process): the live run is not observed, and the status says why.
    with operator_with(operator, signing_key_without_its_key(ground)):
        def says_why():
            message = kube.status("bounds-alive").get("message") or ""
            return "could not be derived" in message and message
        message = kube.wait_for(says_why, "bounds-alive's status saying why Ray is unreachable", timeout=within(60))
        assert message.startswith("Ray unreachable: the Ray token for ") and \
            f"{SIGNING_KEY_SECRET} has no data.{SIGNING_KEY_FIELD}" in message, message
        assert kube.status("bounds-alive")["phase"] == "Running"
        # The Event is posted after the status write: wait for it, within the operator's
        # own bound for saying why.

        def warned():
            events = kube.items("events", "--field-selector", "involvedObject.name=bounds-alive")
            return any(e["reason"] == "RayUnreachable" and e["type"] == "Warning"
                       and "could not be derived" in e["message"] for e in events)

        kube.wait_for(warned, "a RayUnreachable Warning Event saying why", timeout=within(30))
        # Deleting needs neither Ray nor the key: the finalizer goes with the RayCluster.
        started = time.monotonic()
        kube.kubectl("delete", "tpufinetune", "bounds-alive", "--wait=false")
        kube.wait_for(lambda: kube.get("tpufinetune", "bounds-alive") is None, "bounds-alive's finalizer removed",
                      timeout=within(30))
        assert time.monotonic() - started < within(30)
        kube.wait_for(lambda: kube.get("raycluster", alive_cluster) is None, "bounds-alive's RayCluster gone",
                      timeout=within(30))
