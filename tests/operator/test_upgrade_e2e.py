"""Roll back to the previous release, and upgrade again, with runs in flight (the ground).

In the style of KubeRay's "upgrade from the previous release" e2e: the previous release's
operator code (the tag below, materialised with `git archive` from this clone's history)
runs in the same venv with PYTHONPATH pointing at it. One module, two short CPU runs, both
directions, each operator really driving:

1. this checkout's operator makes run B and drives it into Running;
2. it is killed and the previous release takes over mid-run (a rollback; the CRD stays this
   release's, as the upgrade procedure says). It makes run A and drives it into Running:
   A's status then holds only keys the previous release declares, proof that it, and not
   this version, wrote it;
3. it is killed and this checkout's operator takes over mid-run again (the upgrade).

Both runs end Succeeded with nothing duplicated or lost: one RayCluster each, never
recreated; one Ray job per attempt, attempt 1 only; every epoch once in status.history.
Then both are deleted and their finalizers go.

The supported skew is one release either way (docs/architecture.md, "Upgrades and
version skew"). v0.2.0 predates skew tolerance: before the rollback the test asks v0.2.0's
own code whether it can read run B. A status key it does not declare (this version's
status.attempts and status.usage are such keys, written on every run) makes each of its
steps fail (logged; nothing is stopped, written or deleted; B's head also refuses its
operator-wide token, so until its Ray unreachable timeout the steps fail on that call first):
B's job keeps running on Ray, B's status stays as this version left it, and the upgrade
finishes it (Succeeded, every epoch once, one job). A spec field it does not know is not supported. ROLLBACK_OUTCOME says
what happens to a run this version made when a previous release that can read its status
takes it over; it is asserted then, so a change to it is a decision.
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

from ground_runs import jobs_of, resource, running, start_run
from tpufinetune.core import conditions as cond
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
# Short, so that the previous release's first status write for B (below) comes soon.
UNREACHABLE_TIMEOUT_S = 30
# Two short epochs (64 rows): "every epoch once" still tells a repeated or lost epoch apart.
EPOCHS = 2
ROWS = 64


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


DECLARED_KEYS = """
from tpufinetune.core.status import TPUFineTuneStatus
print(" ".join(f.alias or name for name, f in TPUFineTuneStatus.model_fields.items()))
"""


def previous_release_status_keys(tree: Path) -> set[str]:
    """The status keys the previous release's own model declares."""
    out = subprocess.run([sys.executable, "-c", DECLARED_KEYS], text=True, capture_output=True, check=True,
                         env=dict(os.environ, PYTHONPATH=_pythonpath(tree))).stdout
    return set(out.split())


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
        self.log_from = 0

    def start(self, which: str) -> None:
        env = {"TPUFT_PROVISION_TIMEOUT": "600", "TPUFT_RAY_UNREACHABLE_TIMEOUT": str(UNREACHABLE_TIMEOUT_S)}
        if which == PREVIOUS_RELEASE:
            env["PYTHONPATH"] = _pythonpath(self.previous)
        log = self.ground.workdir / "operator.log"  # appended to by each start
        self.log_from = log.stat().st_size if log.exists() else 0
        self.process = self.ground.start_operator(extra_env=env)
        self.running = which

    def log(self) -> str:
        """What the running operator has logged since it started."""
        with open(self.process.log_path, "rb") as log:
            log.seek(self.log_from)
            return log.read().decode(errors="replace")

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


def finished(kube, name: str) -> dict:
    return kube.wait_for(lambda: (s := kube.status(name)).get("phase") in ("Succeeded", "Failed") and s,
                         f"{name} finished", timeout=600, interval=1)


def one_cluster_one_job(kube, name: str, uid: str, cluster: str, cluster_uid: str) -> None:
    status = kube.status(name)
    assert status["rayClusterName"] == cluster
    assert kube.get("raycluster", cluster)["metadata"]["uid"] == cluster_uid  # never recreated
    assert status["attempt"] == 1 and status["jobId"] == f"tft-{uid}-1" and not status.get("retries")
    assert [job.submission_id for job in jobs_of(kube, cluster, uid)] == [f"tft-{uid}-1"]


def test_runs_in_flight_survive_a_rollback_and_an_upgrade(ground, kube, operators, ground_assets, storage):
    def run_manifest(name: str) -> dict:
        # ttlSecondsAfterFinished keeps each head up after the end, to count its jobs.
        # The head's memory as this version sizes it: v0.2.0's 2Gi cpu head is OOM-killed
        # (Ray's head and the job's driver need more) wherever limits are enforced, as on
        # GKE and on the ground; a v0.2.0 user sets spec.head.resources, as here.
        head_memory = {"memory": sizing.CPU_HEAD_MEMORY}
        return resource(name, ground_assets, f"{storage}/{name}", epochs=EPOCHS, rows=ROWS,
                        ttlSecondsAfterFinished=600,
                        head={"resources": {"requests": head_memory, "limits": head_memory}})

    previous_keys = previous_release_status_keys(operators.previous) | {"kopf"}
    assert {"phase", "rayClusterName", "jobId", "history"} <= previous_keys  # it read its own model

    # 1. This version makes B and drives it into Running.
    operators.start("current")
    uid_b, cluster_b = start_run(kube, run_manifest("made-by-current"))
    running(kube, "made-by-current")
    cluster_b_uid = kube.get("raycluster", cluster_b)["metadata"]["uid"]

    # 2. The rollback, mid-run of B.
    assert kube.status("made-by-current")["phase"] == "Running"
    refused, refusal = previous_release_refusal(operators.previous, kube.get("tpufinetune", "made-by-current"))
    assert refused != "spec", (f"{PREVIOUS_RELEASE} cannot read this release's spec ({refusal}): a rollback "
                               "to it is not supported; see docs/architecture.md, 'Upgrades and version skew'")
    operators.replace(PREVIOUS_RELEASE)
    b_left = {k: v for k, v in kube.status("made-by-current").items() if k != "kopf"}
    if refused != "status":
        # It can read B but cannot reach B's head: the documented outcome, never a hang.
        b = finished(kube, "made-by-current")
        assert (b["phase"], cond.find(b, cond.FAILED)["reason"]) == ROLLBACK_OUTCOME, b.get("message")

    # The rolled-back operator drives a run of its own on this release's CRD: A, into Running.
    uid_a, cluster_a = start_run(kube, run_manifest("made-by-previous"))
    a_running = running(kube, "made-by-previous")
    cluster_a_uid = kube.get("raycluster", cluster_a)["metadata"]["uid"]
    # Only the previous release ran since A was applied, and A's status says so: nothing of
    # what this version writes on every run (status.attempts, status.usage, ...).
    assert set(a_running) <= previous_keys, sorted(set(a_running) - previous_keys)
    assert operators.running == PREVIOUS_RELEASE and operators.process.proc.poll() is None
    if refused == "status":
        # It leaves B alone. B's head refuses its operator-wide token, so each step fails
        # (nothing written) until the head has not answered for its unreachable timeout;
        # then the step that would fail B is refused at its status write, before any action.
        assert set(b_left) - previous_keys, b_left  # the keys it refuses are there
        kube.wait_for(lambda: "undeclared status keys" in operators.log(),
                      f"{PREVIOUS_RELEASE} refusing B's status ({refusal})", timeout=UNREACHABLE_TIMEOUT_S + 60)
        # B untouched all along: the same status as this version left it, still Running.
        assert {k: v for k, v in kube.status("made-by-current").items() if k != "kopf"} == b_left
        assert b_left["phase"] == "Running"

    # 3. The upgrade, mid-run of A.
    assert kube.status("made-by-previous")["phase"] == "Running"
    operators.replace("current")

    a = finished(kube, "made-by-previous")
    assert a["phase"] == "Succeeded", a.get("message")
    assert [entry["epoch"] for entry in a["history"]] == list(range(1, EPOCHS + 1))
    one_cluster_one_job(kube, "made-by-previous", uid_a, cluster_a, cluster_a_uid)
    if refused == "status":
        # Left alone by the previous release, finished by the upgrade: its job ran on.
        b = finished(kube, "made-by-current")
        assert b["phase"] == "Succeeded", b.get("message")
        assert [entry["epoch"] for entry in b["history"]] == list(range(1, EPOCHS + 1))
        one_cluster_one_job(kube, "made-by-current", uid_b, cluster_b, cluster_b_uid)

    # The upgraded operator releases what either version made.
    for name in ("made-by-previous", "made-by-current"):
        kube.kubectl("delete", "tpufinetune", name, "--wait=false")
    for name, cluster in (("made-by-previous", cluster_a), ("made-by-current", cluster_b)):
        kube.wait_for(lambda name=name: kube.get("tpufinetune", name) is None, f"{name}'s finalizer removed", timeout=60)
        kube.wait_for(lambda cluster=cluster: kube.get("raycluster", cluster) is None, f"{cluster} deleted", timeout=60)
    assert operators.running == "current"
    assert operators.process.proc.poll() is None
