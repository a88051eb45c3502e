"""Two operator replicas on the test ground, as deploy/ runs them: one leads, the other
stands by; the leader is SIGKILLed mid-run and the standby takes over once the Lease ran
out. The run ends Succeeded with one Ray job for its one attempt and every epoch once.

The rules and the elector alone are in test_leader_election.py (milliseconds, and on the
bare API server).
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from harness.ground import OPERATOR_NAMESPACE, OPERATOR_PODS
from tpufinetune.settings import Settings

from ground_runs import jobs_of, resource, start_run
from harness.timing import within

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

DEFAULTS = Settings()  # the ground runs the deployed defaults: 15 s lease, 2 s retry
LEASE = DEFAULTS.lease_name
# The ground shares two cores with a training run (three Ray pods, the control plane,
# KubeRay): a standby's tries and kopf's start can each lag by seconds. Takeover must
# still come within the lease duration plus one jittered retry period, times the
# suite's one load factor (harness/timing.py).


def lease(kube) -> dict:
    return json.loads(kube.cp.kubectl("-n", OPERATOR_NAMESPACE, "get", "lease", LEASE, "-o", "json").stdout)["spec"]


def answers(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as answer:
        assert answer.status == 200, url
        return answer.read().decode()


def test_the_standby_takes_over_a_killed_leader_within_the_lease_and_the_run_succeeds(
        operator, ground, kube, ground_assets, storage):
    kube.wait_for(lambda: lease(kube).get("holderIdentity") == OPERATOR_PODS[0], "the session's operator leads")
    standby = ground.start_replica()
    try:
        # A standby is healthy (Kubernetes must not restart it) and serves its metrics.
        assert json.loads(answers(f"http://127.0.0.1:{standby.port}/healthz")) == {"leader": False}
        assert "tpufinetune" in answers(standby.metrics_url)
        kube.wait_for(lambda: "standing by" in standby.log_tail(), "the replica stands by", timeout=30)
        assert lease(kube)["holderIdentity"] == OPERATOR_PODS[0]

        # The RayCluster is kept a while after the end, so its head can list the jobs.
        manifest = resource("two-replicas", ground_assets, storage, epochs=3,
                            dataset={"id": ground_assets.data, "split": "train[:64]"},
                            ttlSecondsAfterFinished=300)
        uid, cluster = start_run(kube, manifest)
        kube.wait_for(lambda: kube.status("two-replicas").get("phase") == "Running", "phase Running", timeout=300)
        transitions = lease(kube).get("leaseTransitions", 0)

        operator.kill()  # SIGKILL: no release, the Lease is left to run out
        killed = time.monotonic()
        kube.wait_for(lambda: lease(kube).get("holderIdentity") == OPERATOR_PODS[1],
                      "the standby holds the Lease", timeout=3 * DEFAULTS.lease_duration, interval=0.2)
        took = time.monotonic() - killed
        spec = lease(kube)
        assert spec["leaseTransitions"] == transitions + 1
        # Not before the lease ran out (as the standby watched it: the leader's last renewal
        # was up to one retry period before the kill), and not long after.
        assert took >= DEFAULTS.lease_duration - DEFAULTS.retry_period * 1.2, took
        assert took <= within(DEFAULTS.lease_duration + DEFAULTS.retry_period * 1.2), took
        print(f"takeover {took:.1f} s after SIGKILL (lease {DEFAULTS.lease_duration:g} s, "
              f"retry {DEFAULTS.retry_period:g} s)")

        status = kube.wait_for(lambda: (s := kube.status("two-replicas")).get("phase") in ("Succeeded", "Failed")
                               and s, "the run to end", timeout=600)
        assert status["phase"] == "Succeeded", (status.get("message"), status.get("attempts"))
        assert status["attempt"] == 1 and status["jobId"] == f"tft-{uid}-1"
        assert [entry["epoch"] for entry in status["history"]] == [1, 2, 3]
        # One Ray job for the one attempt: the new leader re-attached to the running job.
        assert [job.submission_id for job in jobs_of(kube, cluster, uid)] == [f"tft-{uid}-1"]
        assert "leading as" in standby.log_tail(200)
    finally:
        # A clean stop releases the Lease: the session's operator leads again at its
        # first try instead of after a lease duration.
        standby.stop()
        released = time.monotonic()
        if operator.proc.poll() is not None:  # killed above (not when the test failed earlier)
            operator.start()
        kube.wait_for(lambda: lease(kube).get("holderIdentity") == OPERATOR_PODS[0],
                      "the session's operator leads again", timeout=3 * DEFAULTS.lease_duration, interval=0.2)
        back = time.monotonic() - released
    assert standby.proc.returncode == 0
    assert back < DEFAULTS.lease_duration, back  # the release, not the expiry
