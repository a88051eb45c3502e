"""Pods on the test ground get what GKE gives them and nothing else: their own /tmp, HOME
and /dev/shm, the env their spec gives (with a kubelet's additions), the volumes they
declare, init containers that really run, and their memory limit (an OOM kill ends the
container with OOMKilled). Plain pods with small commands, and a TPUFineTune run whose
worker is OOM-killed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.nodeagent import health_check_to_gcs
from harness.processes import tail
from harness.podsandbox import mount_order
from harness.podspec import ConfigError, MountError, container_env, mount_targets, service_env, volume_plan
from tpufinetune_trainer.checkpoint import WRITE_THREADS

# ---- pure: the kubelet's derivations -------------------------------------------------------

POD = {"metadata": {"name": "p", "namespace": "ns", "labels": {"app": "x"}}}
OBJECTS = {
    ("ConfigMap", "settings"): {"data": {"mode": "fast", "bad key": "skipped"}},
    ("Secret", "creds"): {"data": {"token": "czNjcjN0"}},  # s3cr3t
}


def lookup(kind, name):
    return OBJECTS.get((kind, name))


def test_env_from_the_spec_alone_with_the_kubelets_rules():
    container = {"name": "c", "resources": {"limits": {"memory": "1Gi"}},
                 "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CM_"},
                             {"secretRef": {"name": "absent", "optional": True}}],
                 "env": [{"name": "A", "value": "$(CM_mode)-$(B)"}, {"name": "B", "value": "b"},
                         {"name": "T", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                         {"name": "M", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
                         {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                         {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
                         {"name": "NONE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "x", "optional": True}}}]}
    env = container_env(POD, container, base={"PATH": "/bin"}, fields={}, services={"WEB_SERVICE_HOST": "10.0.0.9", "B": "svc"},
                        lookup=lookup)
    assert env == {"PATH": "/bin", "CM_mode": "fast", "A": "fast-svc", "B": "b", "T": "s3cr3t", "M": "fast",
                   "APP": "x", "MEM": "1024", "WEB_SERVICE_HOST": "10.0.0.9"}


@pytest.mark.parametrize("ref, message", [
    ({"secretKeyRef": {"name": "missing", "key": "k"}}, 'secret "missing" not found'),
    ({"secretKeyRef": {"name": "creds", "key": "k"}}, "couldn't find key k in Secret ns/creds"),
    ({"configMapKeyRef": {"name": "settings", "key": "k"}}, "couldn't find key k in ConfigMap ns/settings"),
])
def test_a_missing_reference_is_a_config_error_in_the_kubelets_words(ref, message):
    with pytest.raises(ConfigError, match=message):
        container_env(POD, {"env": [{"name": "X", "valueFrom": ref}]}, base={}, fields={}, services={}, lookup=lookup)


def test_service_variables_as_a_kubelet_injects_them():
    env = service_env([{"metadata": {"name": "my-svc"}, "spec": {"clusterIP": "10.0.0.7", "ports": [
        {"name": "gcs", "port": 6379, "protocol": "TCP"}]}},
        {"metadata": {"name": "headless"}, "spec": {"clusterIP": "None", "ports": [{"port": 80}]}}])
    assert env["MY_SVC_SERVICE_HOST"] == "10.0.0.7" and env["MY_SVC_SERVICE_PORT"] == "6379"
    assert env["MY_SVC_SERVICE_PORT_GCS"] == "6379" and env["MY_SVC_PORT_6379_TCP_ADDR"] == "10.0.0.7"
    assert not any(name.startswith("HEADLESS") for name in env)


def test_volumes_resolve_to_their_sources():
    assert volume_plan({"name": "shm", "emptyDir": {"medium": "Memory"}}, "ns", lookup, None).kind == "memory"
    files = volume_plan({"name": "s", "secret": {"secretName": "creds", "items": [{"key": "token", "path": "t/tok"}]}},
                        "ns", lookup, None).files
    assert files == {"t/tok": (b"s3cr3t", 0o644)}
    gcs = {"name": "g", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {"bucketName": "b1"}}}
    assert volume_plan(gcs, "ns", lookup, "/srv/gcs").path == "/srv/gcs/b1"
    with pytest.raises(MountError, match="driver name gcsfuse.csi.storage.gke.io not found"):
        volume_plan(gcs, "ns", lookup, None)
    with pytest.raises(MountError, match='persistentvolumeclaim "c" not found'):
        volume_plan({"name": "v", "persistentVolumeClaim": {"claimName": "c"}}, "ns", lookup, None)


def test_mounts_with_sub_paths_and_parents_first():
    mounts = mount_targets({"volumeMounts": [{"name": "v", "mountPath": "/tmp/a/b", "subPath": "x", "readOnly": True},
                                             {"name": "v", "mountPath": "/tmp"}]}, {"v": "/src"}, {})
    assert [m["target"] for m in mount_order(mounts)] == ["/tmp", "/tmp/a/b"]
    assert mounts[0] == {"source": "/src/x", "target": "/tmp/a/b", "readOnly": True, "subPath": True}
    with pytest.raises(MountError, match="relative path inside the volume"):
        mount_targets({"volumeMounts": [{"name": "v", "mountPath": "/m", "subPath": "../etc"}]}, {"v": "/src"}, {})


def test_kuberays_gcs_wait_asks_the_heads_real_gcs_address():
    script = ("if ray health-check --address rc-head-svc.ns.svc.cluster.local:6379 > /dev/null 2>&1; then\n"
              "if ray health-check --address rc-head-svc.ns.svc.cluster.local:6379; then")
    assert health_check_to_gcs(script, "127.40.0.2:40123") == (
        "if ray health-check --address 127.40.0.2:40123 > /dev/null 2>&1; then\n"
        "if ray health-check --address 127.40.0.2:40123; then")


# ---- on the ground: plain pods -------------------------------------------------------------

PROBE = """
import json, os, sys
print(json.dumps({"env": dict(os.environ), "tmp": sorted(os.listdir("/tmp")), "cwd": os.getcwd(),
                  "host_file": os.path.exists(sys.argv[1])}))
"""


def plain_pod(name: str, command: list[str], restart: str = "Never", **spec) -> dict:
    container = {"name": "main", "image": "python:3.11", "command": command}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 2, "containers": [container], **spec}}


def phase(kube, name: str) -> str:
    return ((kube.get("pod", name) or {}).get("status") or {}).get("phase", "")


def pod_log(ground, kube, name: str) -> str:
    path = ground.workdir / "pods" / f"{kube.ns}_{name}.log"
    return path.read_text() if path.exists() else ""


def last_json(ground, kube, name: str) -> dict:
    return json.loads([line for line in pod_log(ground, kube, name).splitlines() if line.startswith("{")][-1])


def wait_phase(kube, name: str, wanted: str, timeout: float = 90) -> None:
    try:
        kube.wait_for(lambda: phase(kube, name) == wanted, f"pod {name} {wanted}", timeout=timeout)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{kube.get('pod', name)}\n---- node agent log tail ----\n"
                             + tail(kube.ground.workdir / "node-agent.log", 30)) from None


@pytest.mark.ground
def test_a_pod_sees_its_own_tmp_and_only_the_env_its_spec_gives(ground, kube, tmp_path):
    host_file = tmp_path / "host-only"
    host_file.write_text("x")
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"mode": "fast"}})
    kube.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
                "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}})
    kube.apply(plain_pod("writer", ["sh", "-c", "touch /tmp/writers-file && echo written && sleep 600"]))
    kube.wait_for(lambda: "written" in pod_log(ground, kube, "writer"), "the other pod's /tmp file written")
    kube.apply(plain_pod("reader", [sys.executable, "-c", PROBE, str(host_file)], container={
        "env": [{"name": "GIVEN", "value": "yes"},
                {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}}],
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CM_"}]}))
    wait_phase(kube, "reader", "Succeeded")
    seen = last_json(ground, kube, "reader")
    # Nothing of the machine's /tmp, nor the other pod's file; only the image's filesystem
    # (this checkout) is bound back where it lies, should it lie under /tmp.
    checkout = Path(__file__).resolve().parents[2]
    bound = [checkout.relative_to("/tmp").parts[0]] if checkout.is_relative_to("/tmp") else []
    assert seen["tmp"] == bound and not seen["host_file"] and seen["cwd"] == "/home/ray", seen["tmp"]
    env = seen["env"]
    assert env["GIVEN"] == "yes" and env["MODE"] == "fast" and env["CM_mode"] == "fast"
    assert env["HOSTNAME"] == "reader" and env["WEB_SERVICE_PORT"] == "80" and env["KUBERNETES_SERVICE_HOST"]
    node_env = set(json.loads((ground.workdir / "nodeagent.ready").read_text())["node_env"])
    image = {"PATH", "HOME", "LANG", "HOSTNAME"}
    services = {n for n in env if n.startswith(("KUBERNETES_", "WEB_"))}
    assert set(env) - image - node_env - services == {"GIVEN", "MODE", "CM_mode"}
    kube.kubectl("delete", "pod", "writer", "--wait=false")


@pytest.mark.ground
def test_a_pod_waits_for_its_secret_and_starts_once_it_exists(ground, kube):
    kube.apply(plain_pod("needs-secret", ["sh", "-c", "echo token=$TOKEN"], container={
        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "later", "key": "token"}}}]}))

    def waiting_reason():
        statuses = (kube.get("pod", "needs-secret").get("status") or {}).get("containerStatuses") or [{}]
        return (statuses[0].get("state") or {}).get("waiting", {})

    kube.wait_for(lambda: waiting_reason().get("reason") == "CreateContainerConfigError", "CreateContainerConfigError")
    assert waiting_reason()["message"] == 'secret "later" not found'
    kube.kubectl("create", "secret", "generic", "later", "--from-literal=token=abc")
    wait_phase(kube, "needs-secret", "Succeeded")
    assert "token=abc" in pod_log(ground, kube, "needs-secret")


@pytest.mark.ground
def test_volumes_as_a_kubelet_mounts_them(ground, kube):
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "conf"}, "data": {"a.txt": "A", "b.txt": "B"}})
    kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"}, "stringData": {"key": "K"}})
    kube.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "shared"},
                "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    volumes = [{"name": "conf", "configMap": {"name": "conf", "items": [{"key": "a.txt", "path": "sub/a"}]}},
               {"name": "sec", "secret": {"secretName": "sec"}},
               {"name": "scratch", "emptyDir": {}},
               {"name": "shm", "emptyDir": {"medium": "Memory"}},
               {"name": "shared", "persistentVolumeClaim": {"claimName": "shared"}}]
    mounts = [{"name": "conf", "mountPath": "/etc/conf", "readOnly": True},
              {"name": "conf", "mountPath": "/tmp/a-file", "subPath": "sub/a"},
              {"name": "sec", "mountPath": "/var/run/sec", "readOnly": True},
              {"name": "scratch", "mountPath": "/scratch"},
              {"name": "shm", "mountPath": "/dev/shm"},
              {"name": "shared", "mountPath": "/data"}]
    script = ("set -e; test \"$(cat /etc/conf/sub/a)\" = A; test ! -e /etc/conf/b.txt; test \"$(cat /tmp/a-file)\" = A;"
              " test \"$(cat /var/run/sec/key)\" = K; ! touch /etc/conf/x 2>/dev/null;"
              " echo s > /scratch/s; echo m > /dev/shm/m; echo \"$1\" >> /data/log; echo mounted-ok")
    for name in ("first", "second"):
        kube.apply(plain_pod(name, ["sh", "-c", script, "sh", name], volumes=volumes,
                             container={"volumeMounts": mounts}))
    for name in ("first", "second"):
        wait_phase(kube, name, "Succeeded")
        assert "mounted-ok" in pod_log(ground, kube, name)
    claim = kube.get("pvc", "shared")
    host_dir = Path(kube.cp.kubectl("get", "pv", claim["spec"]["volumeName"], "-o",
                                    "jsonpath={.spec.hostPath.path}").stdout)
    assert sorted(host_dir.joinpath("log").read_text().split()) == ["first", "second"]
    assert str(host_dir).startswith(str(ground.workdir))


@pytest.mark.ground
def test_init_containers_run_in_order_and_a_failing_one_blocks_the_pod(ground, kube):
    scratch = {"volumes": [{"name": "s", "emptyDir": {}}]}
    mount = [{"name": "s", "mountPath": "/s"}]
    kube.apply(plain_pod("inits", ["sh", "-c", "cat /s/one /s/two"], **scratch, initContainers=[
        {"name": "one", "image": "x", "command": ["sh", "-c", "echo 1 > /s/one"], "volumeMounts": mount},
        {"name": "two", "image": "x", "command": ["sh", "-c", "test -e /s/one && echo 2 > /s/two"], "volumeMounts": mount}],
        container={"volumeMounts": mount}))
    kube.apply(plain_pod("blocked", ["sh", "-c", "echo main ran"], restart="Always", initContainers=[
        {"name": "fails", "image": "x", "command": ["sh", "-c", "exit 3"]}]))
    wait_phase(kube, "inits", "Succeeded")
    assert pod_log(ground, kube, "inits").split()[-2:] == ["1", "2"]

    def init_status():
        statuses = (kube.get("pod", "blocked").get("status") or {}).get("initContainerStatuses") or [{}]
        return statuses[0]

    kube.wait_for(lambda: (init_status().get("state") or {}).get("waiting", {}).get("reason") == "CrashLoopBackOff",
                  "Init:CrashLoopBackOff")
    status = init_status()
    assert status["lastState"]["terminated"]["exitCode"] == 3 and status["restartCount"] >= 1
    pod = kube.get("pod", "blocked")
    assert pod["status"]["phase"] == "Pending"
    assert pod["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    assert "main ran" not in pod_log(ground, kube, "blocked")


@pytest.mark.ground
def test_a_container_over_its_memory_limit_is_oom_killed(ground, kube):
    kube.apply(plain_pod("hungry", [sys.executable, "-c", "x = bytearray(300 * 2**20); print('surv' + 'ived')"],
                         container={"resources": {"limits": {"memory": "64Mi"}}}))
    wait_phase(kube, "hungry", "Failed")
    terminated = kube.get("pod", "hungry")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["reason"], terminated["exitCode"]) == ("OOMKilled", 137)
    assert "survived" not in pod_log(ground, kube, "hungry")


@pytest.mark.ground
def test_a_volume_that_cannot_be_mounted_keeps_the_pod_creating_with_the_kubelets_event(ground, kube):
    kube.apply(plain_pod("bucket", ["true"], volumes=[{"name": "b", "csi": {
        "driver": "no-such-driver.example.dev", "volumeAttributes": {"bucketName": "models"}}}],
        container={"volumeMounts": [{"name": "b", "mountPath": "/models"}]}))

    def failed_mount():
        return [e["message"] for e in kube.items("events") if e.get("reason") == "FailedMount"]

    messages = kube.wait_for(failed_mount, "a FailedMount event")
    assert messages[0] == ('MountVolume.SetUp failed for volume "b" : kubernetes.io/csi: driver name '
                           "no-such-driver.example.dev not found in the list of registered CSI drivers")
    assert phase(kube, "bucket") == "Pending"


@pytest.mark.ground
def test_an_oom_killed_worker_is_the_runs_reason(ground, operator, kube):
    """A worker whose limit is below what `ray start` needs is OOM-killed (the whole
    container, exit 137) and restarted; the run, still provisioning, says OOMKilled."""
    name = "oom"
    small = {"requests": {"memory": "100Mi"}, "limits": {"memory": "100Mi"}}
    kube.apply({"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name}, "spec": {
        "tpu": {"generation": "cpu", "topology": "2"}, "image": "registry.example/tpufinetune-trainer:test",
        "model": {"id": "/never-read/model"}, "dataset": {"id": "/never-read/data", "split": "train"},
        "checkpoint": {"storagePath": "gs://tpufinetune-ground/never-written"}, "workers": {"resources": small}}})
    cluster = kube.wait_for(lambda: kube.status(name).get("rayClusterName"), "rayClusterName in status")

    def oom_killed_worker():
        for pod in kube.pods_of(cluster):
            for status in (pod.get("status") or {}).get("containerStatuses") or []:
                terminated = (status.get("lastState") or status.get("state") or {}).get("terminated") or {}
                if terminated.get("reason") == "OOMKilled":
                    return terminated
        return None

    terminated = kube.wait_for(oom_killed_worker, "a worker container OOMKilled", timeout=180)
    assert terminated["exitCode"] == 137
    message = kube.wait_for(lambda: "OOMKilled" in kube.status(name).get("message", "") and kube.status(name)["message"],
                            "OOMKilled in the run's status message", timeout=120)
    assert "exceeded its memory limit" in message


@pytest.mark.ground
def test_a_run_on_a_shared_claim_succeeds_with_its_checkpoint_on_the_volume(ground, operator, kube, ground_assets):
    """A local checkpoint path is refused at apply unless it is shared (test_crd_admission);
    shared, it works: a ReadWriteMany claim of the ground's default class, mounted at the same
    path on the head and both workers, holds both ranks' shards of each checkpoint."""
    kube.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "checkpoints"},
                "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    group = {"volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints"}}],
             "volumeMounts": [{"name": "checkpoints", "mountPath": "/mnt/checkpoints"}]}
    kube.apply({"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "on-a-claim"},
                "spec": {"tpu": {"generation": "cpu", "topology": "2"},
                         "image": "registry.example/tpufinetune-trainer:test",
                         "model": {"id": ground_assets.model},
                         "dataset": {"id": ground_assets.data, "split": "train[:320]"},  # a short epoch
                         "training": {"epochs": 1, "batchSizePerDevice": 8, "maxSeqLen": 128},
                         "checkpoint": {"storagePath": "/mnt/checkpoints/run"}, "head": group, "workers": group}})
    kube.kubectl("wait", "tpufinetune/on-a-claim", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
    checkpoint = kube.status("on-a-claim")["checkpointURI"]
    assert checkpoint.startswith("/mnt/checkpoints/run/"), checkpoint
    claim = kube.get("pvc", "checkpoints")
    volume_dir = Path(kube.cp.kubectl("get", "pv", claim["spec"]["volumeName"], "-o",
                                      "jsonpath={.spec.hostPath.path}").stdout)
    on_volume = volume_dir / checkpoint.removeprefix("/mnt/checkpoints/")
    both_ranks = {f"__{rank}_{i}.distcp" for rank in (0, 1) for i in range(WRITE_THREADS)}  # the writer's files per rank
    assert {p.name for p in on_volume.glob("*.distcp")} == both_ranks, list(on_volume.iterdir())
    assert (on_volume / ".metadata").is_file()
