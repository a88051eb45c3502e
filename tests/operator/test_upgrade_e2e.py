"""Upgrade from the previous release, and roll back, with runs in flight (the ground).

In the style of KubeRay's "upgrade from the previous release" e2e: the previous release's
operator code (the tag below, materialised with `git archive` from this clone's history)
runs in the same venv with PYTHONPATH pointing at it. One module, two short CPU runs, both
directions:

1. the previous release drives run A (made by it) into Running;
2. it is killed and this checkout's operator takes over mid-run (the upgrade); it makes
   run B and drives it into Running;
3. it is killed and the previous release takes over again mid-run (a rollback).

Both runs end Succeeded with nothing duplicated or lost: one RayCluster each, never
recreated; one Ray job per attempt, attempt 1 only; every epoch once in status.history.
Then both are deleted under the rolled-back operator and their finalizers go (an older
operator refusing a newer one's status keys could never release them).

The supported skew is one release either way (docs/architecture.md, "Upgrades and
version skew"). ROLLBACK_OUTCOME says what happens to a run the newer operator made when
the previous release takes it over; it is asserted, so a change to it is a decision.
v0.2.0 predates skew tolerance: before the rollback the test asks v0.2.0's own code
whether it can read run B. A status key it does not declare (this version's
status.attempts and status.usage are such keys) makes each of its steps fail (logged;
nothing is stopped or deleted): the job keeps running on Ray, and the test redoes the
upgrade, which must finish the run (Succeeded, every epoch once, one job). A spec field it
does not know is not supported.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ground_runs import jobs_of, resource, start_run
from tpufinetune.core import sizing

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS_RELEASE = "v0.2.0"
# The tag's commit: a clone without tags (a shallow CI checkout fetches none) still has it
# in its history.
PREVIOUS_RELEASE_COMMIT = "8eb4e17b080d7f8cb0ad93cc5b04d12ac103e089"
# A run made by this version, taken over by the previous release, runs to this phase.
# Today both reach Ray heads with the one operator-wide token, so it ends Succeeded. If a
# newer version changes how heads are reached (e.g. per-cluster tokens), the previous
# release cannot drive that version's runs: set this to "Failed" with reason RayUnreachable,
# reached within TPUFT_RAY_UNREACHABLE_TIMEOUT below, never a hang.
# v0.2.0 reaches every head with one operator-wide token; this version gives each
# RayCluster its own (derived from a signing key v0.2.0 does not know), so v0.2.0 cannot
# drive a run this version made: it fails it as RayUnreachable and releases its slice.
ROLLBACK_OUTCOME = ("Failed", "RayUnreachable")
UNREACHABLE_TIMEOUT_S = 60
EPOCHS = 3


def _git(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=check)


def previous_release_commit() -> str:
    for ref in (f"refs/tags/{PREVIOUS_RELEASE}", PREVIOUS_RELEASE_COMMIT):
        found = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
        if found.returncode == 0:
            return found.stdout.decode().strip()
    pytest.fail(f"the previous release is not in this clone: neither the tag {PREVIOUS_RELEASE} nor "
                f"its commit {PREVIOUS_RELEASE_COMMIT} resolves; fetch it with "
                f"`git fetch origin tag {PREVIOUS_RELEASE}` (or `git fetch --unshallow`)", pytrace=False)


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory) -> Path:
    """The previous release's operator and trainer packages, from git, in a temp dir."""
    commit = previous_release_commit()
    tree = tmp_path_factory.mktemp(f"tpufinetune-{PREVIOUS_RELEASE}")
    archive = _git("archive", "--format=tar", commit, "operator", "trainer").stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    # The same interpreter must import the previous release's code, not this checkout's
    # (the venv's editable install points here).
    env = dict(os.environ, PYTHONPATH=_pythonpath(tree))
    imported = subprocess.run([sys.executable, "-c", "import tpufinetune; print(tpufinetune.__file__)"],
                              env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(imported).is_relative_to(tree), imported
    return tree


def _pythonpath(tree: Path) -> str:
    return f"{tree}/operator:{tree}/trainer"


REFUSAL_CHECK = """
import json, sys
from tpufinetune.core.api import parse_spec
from tpufinetune.core.status import checked_status
body = json.load(sys.stdin)
try:
    parse_spec(body["spec"])
except ValueError as error:
    print("spec", error)
    sys.exit()
try:
    checked_status(body.get("status") or {})
except ValueError as error:
    print("status", error)
"""


def previous_release_refusal(tree: Path, body: dict) -> tuple[str, str]:
    """What the previous release's own checks (the ones each of its steps makes) say about
    `body`: ("", "") when it can drive it, else ("spec" | "status", its message)."""
    out = subprocess.run([sys.executable, "-c", REFUSAL_CHECK], input=json.dumps(body), text=True,
                         env=dict(os.environ, PYTHONPATH=_pythonpath(tree)), capture_output=True, check=True).stdout
    kind, _, message = out.strip().partition(" ")
    return kind, message


class Operators:
    """One operator on the ground at a time: the previous release or this checkout's."""

    def __init__(self, ground, previous: Path):
        self.ground = ground
        self.previous = previous
        self.process = None
        self.running = ""

    def start(self, which: str) -> None:
        env = {"TPUFT_PROVISION_TIMEOUT": "600", "TPUFT_RAY_UNREACHABLE_TIMEOUT": str(UNREACHABLE_TIMEOUT_S)}
        if which == PREVIOUS_RELEASE:
            env["PYTHONPATH"] = _pythonpath(self.previous)
        self.process = self.ground.start_operator(extra_env=env)
        self.running = which

    def replace(self, which: str) -> None:
        """As a crash or a forced rollout: the running operator is killed, not drained."""
        self.process.kill()
        self.start(which)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@pytest.fixture
def operators(ground, previous_release):
    # The session's operator (tests/harness/ground_fixtures.py), if an earlier module
    # started it, must not drive these runs too: paused, and resumed afterwards.
    session = ground.operator if ground.operator is not None and ground.operator.proc is not None \
        and ground.operator.proc.poll() is None else None
    if session is not None:
        session.stop()
    ops = Operators(ground, previous_release)
    try:
        yield ops
    finally:
        ops.stop()
        if session is not None:
            session.start()
            ground.operator = session


def running(kube, name: str) -> dict:
    status = kube.wait_for(lambda: (s := kube.status(name)).get("phase") == "Running" and s,
                           f"{name} Running", timeout=300)
    return status


def finished(kube, name: str) -> dict:
    return kube.wait_for(lambda: (s := kube.status(name)).get("phase") in ("Succeeded", "Failed") and s,
                         f"{name} finished", timeout=600, interval=1)


def one_cluster_one_job(kube, name: str, uid: str, cluster: str, cluster_uid: str) -> None:
    status = kube.status(name)
    assert status["rayClusterName"] == cluster
    assert kube.get("raycluster", cluster)["metadata"]["uid"] == cluster_uid  # never recreated
    assert status["attempt"] == 1 and status["jobId"] == f"tft-{uid}-1" and not status.get("retries")
    assert [job.submission_id for job in jobs_of(kube, cluster, uid)] == [f"tft-{uid}-1"]


def test_runs_in_flight_survive_an_upgrade_and_a_rollback(ground, kube, operators, ground_assets, storage):
    def run_manifest(name: str) -> dict:
        # ttlSecondsAfterFinished keeps each head up after the end, to count its jobs.
        # The head's memory as this version sizes it: v0.2.0's 2Gi cpu head is OOM-killed
        # (Ray's head and the job's driver need more) wherever limits are enforced, as on
        # GKE and on the ground; a v0.2.0 user sets spec.head.resources, as here.
        head_memory = {"memory": sizing.CPU_HEAD_MEMORY}
        return resource(name, ground_assets, f"{storage}/{name}", epochs=EPOCHS,
                        dataset={"split": "train[:64]"}, ttlSecondsAfterFinished=600,
                        head={"resources": {"requests": head_memory, "limits": head_memory}})

    operators.start(PREVIOUS_RELEASE)
    uid_a, cluster_a = start_run(kube, run_manifest("made-by-previous"))
    running(kube, "made-by-previous")
    cluster_a_uid = kube.get("raycluster", cluster_a)["metadata"]["uid"]

    # The upgrade, mid-run.
    assert kube.status("made-by-previous")["phase"] == "Running"
    operators.replace("current")
    uid_b, cluster_b = start_run(kube, run_manifest("made-by-current"))
    running(kube, "made-by-current")
    cluster_b_uid = kube.get("raycluster", cluster_b)["metadata"]["uid"]

    # The rollback, mid-run (of B at least; A may have finished under this version).
    assert kube.status("made-by-current")["phase"] == "Running"
    refused, refusal = previous_release_refusal(operators.previous, kube.get("tpufinetune", "made-by-current"))
    assert refused != "spec", (f"{PREVIOUS_RELEASE} cannot read this release's spec ({refusal}): a rollback "
                               "to it is not supported; see docs/architecture.md, 'Upgrades and version skew'")
    operators.replace(PREVIOUS_RELEASE)
    if refused == "status":
        # It leaves B alone: every step is refused before anything is written or done.
        kube.wait_for(lambda: "undeclared status keys" in operators.process.log_tail(400),
                      f"{PREVIOUS_RELEASE} refusing B's status ({refusal})", timeout=60)
        assert kube.status("made-by-current")["phase"] == "Running"
        operators.replace("current")  # the upgrade, redone, finishes it

    a = finished(kube, "made-by-previous")
    assert a["phase"] == "Succeeded", a.get("message")
    assert [entry["epoch"] for entry in a["history"]] == list(range(1, EPOCHS + 1))
    one_cluster_one_job(kube, "made-by-previous", uid_a, cluster_a, cluster_a_uid)

    b = finished(kube, "made-by-current")
    # A status the previous release refuses keeps it off the run: the redone upgrade finished it.
    phase, reason = ("Succeeded", "") if refused == "status" else ROLLBACK_OUTCOME
    assert b["phase"] == phase, b.get("message")
    if phase == "Succeeded":
        assert [entry["epoch"] for entry in b["history"]] == list(range(1, EPOCHS + 1))
        one_cluster_one_job(kube, "made-by-current", uid_b, cluster_b, cluster_b_uid)
    else:
        assert next(c for c in b["conditions"] if c["type"] == "Failed")["reason"] == reason

    # The operator now running (the rolled-back one, unless it had to be upgraded again)
    # releases what either version made.
    for name, cluster in (("made-by-previous", cluster_a), ("made-by-current", cluster_b)):
        kube.kubectl("delete", "tpufinetune", name, "--wait=false")
    for name, cluster in (("made-by-previous", cluster_a), ("made-by-current", cluster_b)):
        kube.wait_for(lambda name=name: kube.get("tpufinetune", name) is None, f"{name}'s finalizer removed", timeout=60)
        kube.wait_for(lambda cluster=cluster: kube.get("raycluster", cluster) is None, f"{cluster} deleted", timeout=60)
    assert operators.running == ("current" if refused else PREVIOUS_RELEASE)
    assert operators.process.proc.poll() is None
