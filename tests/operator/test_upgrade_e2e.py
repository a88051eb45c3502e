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
version skew"). v0.2.0 predates skew tolerance: a status key it does not declare (this
version writes status.attempts, status.usage and more on every run) makes each of its steps
fail before it writes or does anything. ROLLBACK_OUTCOME is the decision that follows: a run
this version made is left alone while v0.2.0 leads (its status unchanged, its RayCluster
kept, its job never stopped, past the unreachable timeout that would fail it were v0.2.0
able to read it) and the upgrade finishes it (Succeeded, every epoch once, one job). A spec
field v0.2.0 does not know makes a rollback to it unsupported: the test says so.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from ground_runs import jobs_of, resource, running, start_run
from harness.previous_release import PREVIOUS_RELEASE, ROOT, missing_sentence, resolved
from tpufinetune.core import sizing

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

# What a rollback to the previous release does with a run this version made (docs/
# architecture.md, "Upgrades and version skew"): this version writes status keys v0.2.0
# does not declare on every run (status.attempts, status.usage, ...), and v0.2.0 refuses a
# status with keys it does not know at each step, before it writes or does anything. So the
# run is left alone while v0.2.0 leads (its status as this version left it, its RayCluster
# and its job running on Ray) and the upgrade finishes it. (Were the status readable to
# v0.2.0, it would drive the run and, without the per-cluster Ray token, fail it
# RayUnreachable: the outcome this decision rules out.)
ROLLBACK_OUTCOME = "left alone until the upgrade"
# Short, so that a v0.2.0 that could read B would fail it within the test's wait.
UNREACHABLE_TIMEOUT_S = 30
# Two short epochs (64 rows): "every epoch once" still tells a repeated or lost epoch apart.
EPOCHS = 2
ROWS = 64


def git_archive(commit: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "operator", "trainer"],
                          capture_output=True, check=True).stdout


def previous_release_commit() -> str:
    commit = resolved()
    if not commit:
        pytest.fail(missing_sentence() + " (`make prepare` fetches it)", pytrace=False)
    return commit


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory) -> Path:
    """The previous release's operator and trainer packages, from git, in a temp dir."""
    commit = previous_release_commit()
    tree = tmp_path_factory.mktemp(f"tpufinetune-{PREVIOUS_RELEASE}")
    archive = git_archive(commit)
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

    def __init__(self, ground, previous: Path, namespace: str):
        self.ground = ground
        self.previous = previous
        self.namespace = namespace
        self.process = None
        self.running = ""
        self.log_from = 0

    def start(self, which: str) -> None:
        env = {"TPUFT_PROVISION_TIMEOUT": "600", "TPUFT_RAY_UNREACHABLE_TIMEOUT": str(UNREACHABLE_TIMEOUT_S)}
        if which == PREVIOUS_RELEASE:
            # v0.2.0 watches one namespace by its name (no lists, no globs): the test's.
            env.update(PYTHONPATH=_pythonpath(self.previous), TPUFT_NAMESPACE=self.namespace)
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
def operators(ground, kube, previous_release):
    # The session's operator (tests/harness/ground_fixtures.py), if an earlier module
    # started it, must not drive these runs too: paused, and resumed afterwards.
    session = ground.operator if ground.operator is not None and ground.operator.proc is not None \
        and ground.operator.proc.poll() is None else None
    if session is not None:
        session.stop()
    ops = Operators(ground, previous_release, kube.ns)
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
    operators.replace(PREVIOUS_RELEASE)  # this version is killed: B's status is as it left it
    rolled_back = time.monotonic()
    b_left = {k: v for k, v in kube.status("made-by-current").items() if k != "kopf"}
    b_job = f"tft-{uid_b}-1"

    def b_untouched(what: str) -> None:
        now = {k: v for k, v in kube.status("made-by-current").items() if k != "kopf"}
        assert now == b_left, (f"{ROLLBACK_OUTCOME}: {PREVIOUS_RELEASE} changed B's status {what} (its own check "
                               f"of B said {refused or 'nothing'}: {refusal}): phase {now.get('phase')}, "
                               f"{now.get('message')}; changed keys "
                               f"{sorted(k for k in now.keys() | b_left.keys() if now.get(k) != b_left.get(k))}")
        assert kube.get("raycluster", cluster_b)["metadata"]["uid"] == cluster_b_uid
        # Its job runs on (or has ended on its own): never stopped.
        job = {j.submission_id: str(j.status) for j in jobs_of(kube, cluster_b, uid_b)}.get(b_job, "missing")
        assert job.rsplit(".", 1)[-1] in ("RUNNING", "SUCCEEDED"), (b_job, job)

    # Its first steps read B (and each one refuses it) or, were B readable to it, find B's
    # head refusing its token and fail B within UNREACHABLE_TIMEOUT_S: wait for either.
    kube.wait_for(lambda: "undeclared status keys" in operators.log()
                  or kube.status("made-by-current").get("phase") != "Running",
                  f"{PREVIOUS_RELEASE} refusing B's status, or changing it", timeout=UNREACHABLE_TIMEOUT_S + 60)
    b_untouched("on its first steps")

    # The rolled-back operator drives a run of its own on this release's CRD: A, into Running.
    uid_a, cluster_a = start_run(kube, run_manifest("made-by-previous"))
    a_running = running(kube, "made-by-previous")
    cluster_a_uid = kube.get("raycluster", cluster_a)["metadata"]["uid"]
    # Only the previous release ran since A was applied, and A's status says so: nothing of
    # what this version writes on every run (status.attempts, status.usage, ...).
    assert set(a_running) <= previous_keys, sorted(set(a_running) - previous_keys)
    assert operators.running == PREVIOUS_RELEASE and operators.process.proc.poll() is None
    # B still left alone once v0.2.0 has stepped B past the unreachable timeout (its refusal
    # logged after it, the step that would have failed B): status, cluster, job.
    refusals = operators.log().count("undeclared status keys")
    kube.wait_for(lambda: time.monotonic() - rolled_back > UNREACHABLE_TIMEOUT_S
                  and operators.log().count("undeclared status keys") > refusals,
                  f"{PREVIOUS_RELEASE} refusing B again past its unreachable timeout", timeout=UNREACHABLE_TIMEOUT_S + 60)
    b_untouched("while it led")
    assert set(b_left) - previous_keys, b_left  # the keys it refuses are there

    # 3. The upgrade, mid-run of A.
    assert kube.status("made-by-previous")["phase"] == "Running"
    operators.replace("current")

    a = finished(kube, "made-by-previous")
    assert a["phase"] == "Succeeded", a.get("message")
    assert [entry["epoch"] for entry in a["history"]] == list(range(1, EPOCHS + 1))
    one_cluster_one_job(kube, "made-by-previous", uid_a, cluster_a, cluster_a_uid)
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
