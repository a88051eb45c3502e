"""Tests of the control-plane harness itself, against the real etcd + kube-apiserver."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from kubernetes import client, watch

from harness import controlplane as cpmod
from harness.kubewatch import KubeWatch
from harness.waiting import wait_for

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "harness.test.tpufinetune.dev", "v1", "widgets"

WIDGET_CRD = textwrap.dedent(
    f"""\
    apiVersion: apiextensions.k8s.io/v1
    kind: CustomResourceDefinition
    metadata:
      name: {PLURAL}.{GROUP}
    spec:
      group: {GROUP}
      scope: Namespaced
      names: {{kind: Widget, listKind: WidgetList, plural: {PLURAL}, singular: widget}}
      versions:
      - name: {VERSION}
        served: true
        storage: true
        subresources: {{status: {{}}}}
        additionalPrinterColumns:
        - {{name: Size, type: integer, jsonPath: .spec.size}}
        - {{name: Phase, type: string, jsonPath: .status.phase}}
        schema:
          openAPIV3Schema:
            type: object
            properties:
              spec:
                type: object
                required: [size, maxSize]
                x-kubernetes-validations:
                - rule: "self.size <= self.maxSize"
                  message: "size must not exceed maxSize"
                properties:
                  size: {{type: integer, minimum: 0}}
                  maxSize: {{type: integer}}
              status:
                type: object
                properties:
                  phase: {{type: string}}
    """
)


def widget(name: str, size: int = 1, max_size: int = 10) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"size": size, "maxSize": max_size},
    }


@pytest.fixture(scope="module")
def widget_crd(control_plane, tmp_path_factory):
    path = tmp_path_factory.mktemp("crd") / "widgets.yaml"
    path.write_text(WIDGET_CRD)
    control_plane.install_crd(path)
    return path


@pytest.fixture
def objects(k8s_api):
    return client.CustomObjectsApi(k8s_api)


def _gone(pid: int) -> bool:
    """True when no process (a zombie counts as gone) and no process group has this id."""
    for probe in (os.kill, os.killpg):
        try:
            probe(pid, 0)
        except ProcessLookupError:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        return False
    return True


def _wait_gone(pids, timeout: float = 15.0) -> None:
    pids = list(pids)
    wait_for(lambda: all(_gone(p) for p in pids), timeout, f"processes {pids} to be gone", interval=0.1,
             details=lambda: f"still there: {[p for p in pids if not _gone(p)]}")


# ---------------------------------------------------------------- basics


def test_kubectl_and_server_report_pinned_release(control_plane):
    out = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    pinned = cpmod.pinned_version()
    assert out["clientVersion"]["gitVersion"] == pinned
    assert out["serverVersion"]["gitVersion"] == pinned
    client_only = control_plane.kubectl("version", "--client").stdout
    assert f"Client Version: {pinned}" in client_only


def test_namespace_fixture_gives_an_active_namespace(control_plane, k8s_api, namespace):
    ns = client.CoreV1Api(k8s_api).read_namespace(namespace)
    assert ns.status.phase == "Active"
    got = control_plane.kubectl("get", "namespace", namespace, "-o", "jsonpath={.metadata.name}")
    assert got.stdout == namespace


def test_kubectl_error_shows_stderr(control_plane):
    with pytest.raises(subprocess.CalledProcessError) as info:
        control_plane.kubectl("get", "namespace", "no-such-namespace-here")
    assert "NotFound" in str(info.value) or "not found" in str(info.value)


# ---------------------------------------------------------------- custom resources


def test_custom_resource_create_get_list_watch(widget_crd, objects, namespace):
    args = (GROUP, VERSION, namespace, PLURAL)
    created = objects.create_namespaced_custom_object(*args, widget("a", size=2))
    assert created["metadata"]["uid"]

    got = objects.get_namespaced_custom_object(*args, "a")
    assert got["spec"] == {"size": 2, "maxSize": 10}

    listed = objects.list_namespaced_custom_object(*args)
    assert [i["metadata"]["name"] for i in listed["items"]] == ["a"]
    since = listed["metadata"]["resourceVersion"]

    objects.create_namespaced_custom_object(*args, widget("b"))
    objects.patch_namespaced_custom_object(*args, "a", {"spec": {"size": 3}})

    events = []
    w = watch.Watch()
    for ev in w.stream(objects.list_namespaced_custom_object, *args,
                       resource_version=since, timeout_seconds=10):
        events.append((ev["type"], ev["object"]["metadata"]["name"], ev["object"]["spec"]["size"]))
        if len(events) == 2:
            w.stop()
    assert events == [("ADDED", "b", 1), ("MODIFIED", "a", 3)]


def test_status_subresource_writes_status_only(widget_crd, objects, namespace):
    args = (GROUP, VERSION, namespace, PLURAL)
    objects.create_namespaced_custom_object(*args, widget("s", size=4))

    # Through /status: the status is written, the spec change in the same body is dropped.
    objects.patch_namespaced_custom_object_status(
        *args, "s", {"spec": {"size": 9}, "status": {"phase": "Running"}}
    )
    got = objects.get_namespaced_custom_object(*args, "s")
    assert got["status"] == {"phase": "Running"}
    assert got["spec"]["size"] == 4

    # And the other way round: the main resource ignores status.
    objects.patch_namespaced_custom_object(
        *args, "s", {"spec": {"size": 5}, "status": {"phase": "Hacked"}}
    )
    got = objects.get_namespaced_custom_object(*args, "s")
    assert got["spec"]["size"] == 5
    assert got["status"] == {"phase": "Running"}


def test_cel_rule_rejects_bad_object_with_its_message(control_plane, widget_crd, namespace):
    bad = yaml.safe_dump(widget("too-big", size=11, max_size=10))
    res = control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=bad, check=False)
    assert res.returncode != 0
    assert "size must not exceed maxSize" in res.stderr
    assert "Invalid" in res.stderr

    good = yaml.safe_dump(widget("fits", size=10, max_size=10))
    res = control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=good)
    assert "widget.harness.test.tpufinetune.dev/fits created" in res.stdout


def test_kubectl_get_prints_printer_columns(control_plane, widget_crd, objects, namespace):
    args = (GROUP, VERSION, namespace, PLURAL)
    objects.create_namespaced_custom_object(*args, widget("shown", size=7))
    objects.patch_namespaced_custom_object_status(*args, "shown", {"status": {"phase": "Done"}})

    out = control_plane.kubectl("get", "widgets", "-n", namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "SIZE", "PHASE"]
    assert out[1].split()[:3] == ["shown", "7", "Done"]


def test_the_watch_sees_an_overlap_shorter_than_any_poll(control_plane, k8s_api, namespace):
    """Two pods that exist together for a few milliseconds: kubewatch's measure sees both
    (a poll every half second would almost never)."""
    api = client.CoreV1Api(k8s_api)

    def pod(name: str) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                "spec": {"containers": [{"name": "c", "image": "registry.example/none:1"}]}}

    with KubeWatch(control_plane.kubeconfig, namespace, at_once=len) as seen:
        for name in ("first", "second"):
            api.create_namespaced_pod(namespace, pod(name))
        for name in ("first", "second"):  # no node, no kubelet: a delete removes the pod at once
            api.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        wait_for(lambda: seen.events >= 4, 30, "the two creations and the two deletions")
    assert seen.most["at_once"] == 2


# ---------------------------------------------------------------- RBAC


def test_non_admin_is_forbidden_until_a_role_grants_access(control_plane, widget_crd, namespace):
    user_kc = control_plane.user_kubeconfig
    who = control_plane.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}",
                                kubeconfig=user_kc)
    assert who.stdout == control_plane.user_name

    denied = control_plane.kubectl("get", "widgets", "-n", namespace, kubeconfig=user_kc,
                                   check=False)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr
    assert f'User "{control_plane.user_name}" cannot list resource "widgets"' in denied.stderr

    grant = textwrap.dedent(
        f"""\
        apiVersion: rbac.authorization.k8s.io/v1
        kind: Role
        metadata: {{name: widget-reader, namespace: {namespace}}}
        rules:
        - apiGroups: ["{GROUP}"]
          resources: ["widgets"]
          verbs: ["get", "list", "watch"]
        ---
        apiVersion: rbac.authorization.k8s.io/v1
        kind: RoleBinding
        metadata: {{name: widget-reader, namespace: {namespace}}}
        roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: widget-reader}}
        subjects:
        - {{apiGroup: rbac.authorization.k8s.io, kind: User, name: {control_plane.user_name}}}
        """
    )
    control_plane.kubectl("apply", "-f", "-", input=grant)

    # The authorizer learns of new bindings through its informers: allow it a moment.
    wait_for(lambda: control_plane.kubectl("get", "widgets", "-n", namespace, kubeconfig=user_kc,
                                           check=False).returncode == 0,
             15, "the non-admin user allowed to get widgets", interval=0.2)

    # Only what the Role says: no writes here, nothing in another namespace.
    can = control_plane.kubectl("auth", "can-i", "create", f"widgets.{GROUP}", "-n", namespace,
                                kubeconfig=user_kc, check=False)
    assert can.stdout.strip() == "no"
    elsewhere = control_plane.kubectl("get", "widgets", "-n", "default", kubeconfig=user_kc,
                                      check=False)
    assert "Forbidden" in elsewhere.stderr


# ---------------------------------------------------------------- KubeRay CRD


def test_kuberay_crd_is_installed_and_validates(control_plane, kuberay_crd, namespace):
    crd = json.loads(control_plane.kubectl("get", "crd", "rayclusters.ray.io", "-o", "json").stdout)
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established["Established"] == "True"
    # The real schema is enforced: a head group spec without a pod template is refused.
    bad = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "bad"},
           "spec": {"headGroupSpec": {"rayStartParams": {}}}}
    res = control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad),
                                check=False)
    assert res.returncode != 0
    assert "template" in res.stderr


# ---------------------------------------------------------------- nothing outlives its owner


def test_stopped_instance_leaves_no_process(tmp_path):
    cp = cpmod.ControlPlane()
    try:
        cp.start()
        pids = cp.pids
        assert set(pids) == {"etcd", "kube-apiserver"}
        assert all(not _gone(p) for p in pids.values())
        ns = cp.kubectl("get", "namespace", "default", "-o", "jsonpath={.status.phase}")
        assert ns.stdout == "Active"
        workdir = cp.workdir
    finally:
        cp.stop()
    _wait_gone(pids.values(), timeout=1)
    assert not workdir.exists()


def _run_owner(tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    """A separate Python process that starts a control plane and then idles."""
    script = textwrap.dedent(
        """\
        import json, sys, time
        sys.path.insert(0, sys.argv[1])
        from harness.controlplane import ControlPlane
        cp = ControlPlane(workdir=sys.argv[2]).start()
        print(json.dumps(cp.pids), flush=True)
        time.sleep(300)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "cp")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        pytest.fail(f"owner process did not start a control plane: {proc.stderr.read()}")
    return proc, json.loads(line)


def test_killing_the_owner_stops_its_control_plane(tmp_path):
    """SIGKILL: the owner runs no handler, so only the kernel's parent-death signal stops its
    processes. A SIGTERM to an owner without a handler ends the same way; one that handles
    it is the supervisor, stopped by `down` in test_cli_up_status_down."""
    proc, pids = _run_owner(tmp_path)
    try:
        assert all(not _gone(p) for p in pids.values())
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        _wait_gone(pids.values())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_up_status_down(tmp_path):
    env = dict(os.environ, TPUFT_CLUSTER_DIR=str(tmp_path / "cluster"), TPUFT_CLUSTER_KIND="controlplane")
    script = str(Path(cpmod.__file__).with_name("supervisor.py"))

    def cli(cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, script, cmd], env=env, capture_output=True,
                              text=True, timeout=180)

    up = cli("up")
    try:
        assert up.returncode == 0, up.stderr
        lines = up.stdout.splitlines()
        assert len(lines) == 2, up.stdout
        assert lines[0].startswith("export KUBECONFIG=")
        assert lines[1].startswith("export PATH=") and lines[1].endswith(":$PATH")
        kubeconfig = lines[0].split("=", 1)[1]
        bin_dir = lines[1].split("=", 1)[1].rsplit(":", 1)[0]
        assert Path(bin_dir, "kubectl").is_file()

        state = json.loads((tmp_path / "cluster" / "state.json").read_text())
        pids = [state["pid"], *state["pids"].values()]

        kenv = dict(os.environ, KUBECONFIG=kubeconfig, KUBECACHEDIR=str(tmp_path / "kc"))
        crds = subprocess.run([str(Path(bin_dir, "kubectl")), "get", "crd", "-o", "name"],
                              env=kenv, capture_output=True, text=True, check=True).stdout
        assert cpmod.KUBERAY_CRD.is_file(), f"KubeRay CRD not found at {cpmod.KUBERAY_CRD_DISPLAY}"
        assert "customresourcedefinition.apiextensions.k8s.io/rayclusters.ray.io" in crds
        for f in cpmod.project_crd_files():
            for doc in yaml.safe_load_all(f.read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    name = doc["metadata"]["name"]
                    assert f"customresourcedefinition.apiextensions.k8s.io/{name}" in crds

        status = cli("status")
        assert status.returncode == 0 and "running" in status.stdout
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    _wait_gone(pids)
    assert cli("status").returncode == 1
