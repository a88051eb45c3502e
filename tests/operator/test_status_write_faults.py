"""Status writes refused around the end of a real job lose nothing, and an operator that
cannot write a run's status says so on /healthz.

On the ground (harness/ground.py), with the operator as deployed: deploy/'s ServiceAccount
and ClusterRole (the `operator` fixture's TokenRequest token) and deploy/base's settings
ConfigMap as shipped (poll interval, timeouts), except TPUFT_STALL_TIMEOUT, shortened so
that the refusal outlasts it within the test. The refusal comes from the real
kube-apiserver: a ValidatingAdmissionPolicy that refuses every write of
tpufinetunes/status in the test's namespace, as a misbehaving policy or webhook would.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from ground_runs import jobs_of, operator_with, resource, running, start_run
from harness.admission import refusing_policy

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]
REFUSAL = "status writes are refused by the test's admission policy"
SETTINGS = Path(__file__).resolve().parents[2] / "deploy" / "base" / "configmap.yaml"
STALL_S = 10  # TPUFT_STALL_TIMEOUT for this test (shipped: minutes)
REFUSED_S = 20  # the least time the policy stays


def refuse_status_writes(namespace: str) -> list[dict]:
    return refusing_policy(f"refuse-status-{namespace}", namespace, "tpufinetune.dev", "tpufinetunes/status", ["UPDATE"], REFUSAL)


def shipped_settings() -> dict[str, str]:
    """The operator's environment from deploy/base's settings ConfigMap."""
    return dict(yaml.safe_load(SETTINGS.read_text())["data"])


def healthz(url: str) -> int | None:
    """The HTTP status /healthz answers (None: no answer at all)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def job_ended(kube, cluster: str, uid: str) -> bool:
    try:
        jobs = jobs_of(kube, cluster, uid)
    except Exception:  # the head is not answering this moment; ask again
        return False
    return bool(jobs) and all(str(job.status.value) not in ("PENDING", "RUNNING") for job in jobs)


def test_refused_status_writes_around_the_job_end_lose_nothing_and_fail_healthz_past_the_bound(
        operator, ground, kube, ground_assets, storage):
    manifest = resource("refused", ground_assets, storage, epochs=2, dataset={"split": "train[:64]"})
    policy = yaml.safe_dump_all(refuse_status_writes(kube.ns))
    env = {**shipped_settings(), "TPUFT_STALL_TIMEOUT": str(STALL_S)}
    with operator_with(operator, **env) as deployed:
        health = f"http://127.0.0.1:{deployed.port}/healthz"
        uid, cluster = start_run(kube, manifest)
        running(kube, "refused")
        assert healthz(health) == 200
        kube.cp.kubectl("apply", "-f", "-", input=policy)
        refused_at = time.monotonic()
        try:
            # Past the bound with every write refused, kopf's probe fails (500).
            kube.wait_for(lambda: healthz(health) == 500, "/healthz failing", timeout=STALL_S + 60)
            kube.wait_for(lambda: job_ended(kube, cluster, uid), "the job's end", timeout=300)
            time.sleep(max(0.0, REFUSED_S - (time.monotonic() - refused_at)))
            assert kube.status("refused")["phase"] == "Running"  # its end is not written yet
        finally:
            kube.cp.kubectl("delete", "-f", "-", input=policy, check=False)
        kube.wait_for(lambda: kube.status("refused").get("phase") in ("Succeeded", "Failed"), "the run's end",
                      timeout=180)
        kube.wait_for(lambda: healthz(health) == 200, "/healthz healthy again", timeout=60)
    status = kube.status("refused")
    assert status["phase"] == "Succeeded", status.get("message")
    assert [entry["epoch"] for entry in status["history"]] == [1, 2]
    assert status["epochProgress"] == "2/2"
    assert status["checkpointURI"] and storage in status["checkpointURI"]
    assert status["exportedModelURI"]
    log = operator.log_path.read_text(errors="replace")
    assert REFUSAL in log  # the writes were refused, not merely absent
    assert f"{kube.ns}/refused: no status write for" in log  # what the failing probe said
