"""Status writes refused around the end of a real job lose nothing, and one object the API
server refuses is that run's trouble (an Event, a gauge), never a failing /healthz that would
restart the operator and every run's clocks with it.

On the ground (harness/ground.py), with the operator as deployed: deploy/'s ServiceAccount
and ClusterRole (the `operator` fixture's TokenRequest token) and deploy/base's settings
ConfigMap as shipped (poll interval, timeouts), except TPUFT_STALL_TIMEOUT, shortened so
that the refusal outlasts it within the test. The refusal comes from the real
kube-apiserver: a ValidatingAdmissionPolicy that refuses every write of
tpufinetunes/status in the test's namespace, as a misbehaving policy or webhook would.
With the policy in force again after the run ended (its RayCluster kept by
spec.ttlSecondsAfterFinished), a delete releases the RayCluster and the object is gone
within DELETE_S: releasing a slice and removing the finalizer never wait on a status write.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from ground_runs import jobs_of, operator_with, resource, running, scrape, start_run
from harness.admission import refusing_policy
from harness.kubewatch import KubeWatch
from harness.waiting import wait_for
from tpufinetune.core.api import GROUP, PLURAL, VERSION
from tpufinetune.settings import Settings

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]
REFUSAL = "status writes are refused by the test's admission policy"
SETTINGS = Path(__file__).resolve().parents[2] / "deploy" / "base" / "configmap.yaml"
STALL_S = 10  # TPUFT_STALL_TIMEOUT for this test (shipped: minutes)
DELETE_S = 30  # a delete while status writes are refused: the RayCluster and the object gone


def refuse_status_writes(namespace: str) -> list[dict]:
    return refusing_policy(f"refuse-status-{namespace}", namespace, "tpufinetune.dev", "tpufinetunes/status", ["UPDATE"], REFUSAL)


# Keys that say where an install lives, not how it behaves: the ground operator keeps its own
# (it watches the tests' t-* namespaces; the sinks file is mounted only in a pod).
WHERE_INSTALLED = ("TPUFT_NAMESPACE", "TPUFT_NOTIFY_SINKS_FILE")


def shipped_settings() -> dict[str, str]:
    """The operator's environment from deploy/base's settings ConfigMap, less WHERE_INSTALLED."""
    data = next(d for d in yaml.safe_load_all(SETTINGS.read_text())
                if d["metadata"]["name"] == "tpufinetune-operator-settings")["data"]
    return {key: value for key, value in data.items() if key not in WHERE_INSTALLED}


def status_writes_refused(kube, name: str) -> bool:
    """The policy is in force: a server-side dry run of a status write is refused by it."""
    probe = kube.kubectl("patch", "tpufinetune", name, "--subresource=status", "--type=merge", "--dry-run=server",
                         "-p", '{"status": {"message": "probe"}}', check=False)
    return REFUSAL in probe.stderr


def healthz(url: str) -> int | None:
    """The HTTP status /healthz answers (None: no answer at all)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


class Deployed:
    """What `scrape` needs of the operator restarted with the shipped settings: it serves
    /metrics on the session operator's port (operator_with keeps its environment)."""

    def __init__(self, env: dict):
        self.metrics_url = f"http://127.0.0.1:{env['TPUFT_METRICS_PORT']}/metrics"


def failed_steps(operator, phase: str) -> float:
    """Steps from `phase` that raised (tpufinetune_reconcile_errors_total): a status write
    refused fails its step."""
    return scrape(operator).get(("tpufinetune_reconcile_errors_total", (("phase", phase),)), 0.0)


def ended(objects: list[dict]) -> int:
    """1 once any TPUFineTune the watch saw has a terminal phase written."""
    return int(any((o.get("status") or {}).get("phase") in ("Succeeded", "Failed") for o in objects))


def job_ended(kube, cluster: str, uid: str) -> bool:
    try:
        jobs = jobs_of(kube, cluster, uid)
    except Exception:  # the head is not answering this moment; ask again
        return False
    return bool(jobs) and all(str(job.status.value) not in ("PENDING", "RUNNING") for job in jobs)


def test_refused_status_writes_around_the_job_end_lose_nothing_and_are_the_runs_trouble_not_a_restart(
        operator, ground, kube, ground_assets, storage):
    manifest = resource("refused", ground_assets, storage, epochs=2, dataset={"split": "train[:64]"},
                        ttlSecondsAfterFinished=600)  # the cluster kept, for the delete at the end
    policy = yaml.safe_dump_all(refuse_status_writes(kube.ns))
    env = {**shipped_settings(), "TPUFT_STALL_TIMEOUT": str(STALL_S)}
    deployed_settings = Settings.from_env(env)
    # A step that fails sleeps a poll interval, then looks again (Ray, with its timeout)
    # and writes (the Kubernetes timeout): two such steps fit in this, whatever the load.
    two_steps_s = 2 * (deployed_settings.poll_interval + deployed_settings.ray_timeout
                       + deployed_settings.kube_timeout)
    with operator_with(operator, **env) as deployed:
        health = f"http://127.0.0.1:{deployed.port}/healthz"
        metrics = Deployed(deployed.env)
        uid, cluster = start_run(kube, manifest)
        running(kube, "refused")
        assert healthz(health) == 200
        # Every version of the run the API server stores from here on: an end written while
        # the policy refuses would be one of them, however briefly it stood.
        with KubeWatch(ground.cp.kubeconfig, kube.ns, resource=(GROUP, VERSION, PLURAL), ended=ended) as watch:
            kube.cp.kubectl("apply", "-f", "-", input=policy)
            try:
                # The API server refuses this object for its own reasons: that is the run's
                # trouble, said by an Event and a gauge, and never a restart of the operator
                # (every other run's clocks): /healthz stays healthy past the bound and
                # kopf's 10 s cache of a healthy answer.
                kube.wait_for(lambda: any(e["reason"] == "StatusWriteFailing" for e in kube.items(
                    "events", "--field-selector", "involvedObject.name=refused")), "the StatusWriteFailing Event",
                    timeout=two_steps_s)
                failing = ("tpufinetune_status_write_failing_seconds",
                           (("cause", "run"), ("name", "refused"), ("namespace", kube.ns)))
                kube.wait_for(lambda: scrape(metrics).get(failing), "the failing-writes gauge", timeout=30)
                watched_until = time.monotonic() + STALL_S + 15
                while time.monotonic() < watched_until:
                    assert healthz(health) == 200, "one refused object failed the operator's /healthz"
                    time.sleep(1)
                assert scrape(metrics)[failing] > STALL_S
                kube.wait_for(lambda: job_ended(kube, cluster, uid), "the job's end", timeout=300)
                # The operator has tried to write the end: two more failed steps from
                # Running, the second begun after the first ended, after the job's end was
                # seen here, so it saw the job ended and its write of the end was refused.
                failed = failed_steps(metrics, "Running")
                wait_for(lambda: failed_steps(metrics, "Running") >= failed + 2, two_steps_s,
                         "two refused steps after the job's end", details=deployed.log_tail)
                assert watch.most["ended"] == 0, kube.status("refused")  # its end is not written yet
                assert kube.status("refused")["phase"] == "Running"
            finally:
                kube.cp.kubectl("delete", "-f", "-", input=policy, check=False)
        kube.wait_for(lambda: kube.status("refused").get("phase") in ("Succeeded", "Failed"), "the run's end",
                      timeout=180)
        assert healthz(health) == 200
        kube.wait_for(lambda: failing not in scrape(metrics), "the gauge gone once writes land", timeout=30)
    status = kube.status("refused")
    assert status["phase"] == "Succeeded", status.get("message")
    assert [entry["epoch"] for entry in status["history"]] == [1, 2]
    assert status["epochProgress"] == "2/2"
    assert status["checkpointURI"] and storage in status["checkpointURI"]
    assert status["exportedModelURI"]
    log = operator.log_path.read_text(errors="replace")
    assert REFUSAL in log  # the writes were refused, not merely absent
    # Status writes refused again, then the run deleted: its RayCluster (kept by the TTL)
    # is released and the finalizer removed without one status write landing.
    assert kube.get("raycluster", cluster) is not None
    kube.cp.kubectl("apply", "-f", "-", input=policy)
    try:
        kube.wait_for(lambda: status_writes_refused(kube, "refused"), "the policy in force again", timeout=30)
        began = time.monotonic()
        kube.kubectl("delete", "tpufinetune", "refused", "--wait=false")
        kube.wait_for(lambda: kube.get("tpufinetune", "refused") is None and kube.get("raycluster", cluster) is None,
                      "the RayCluster released and the object gone", timeout=DELETE_S)
        assert time.monotonic() - began < DELETE_S
    finally:
        kube.cp.kubectl("delete", "-f", "-", input=policy, check=False)
