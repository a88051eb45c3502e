"""Fixtures for the real control plane (etcd + kube-apiserver built from Go modules).

Contract (other tests code against it):

- `control_plane` (session): a started `harness.controlplane.ControlPlane` with crds/*.yaml
  installed. Attributes `kubeconfig` (admin), `user_kubeconfig` (non-admin `user_name`),
  `kubectl_path`, `bin_dir`, `server`, `admin_token`, `user_name`, `ca_path`; methods
  `env()`, `kubectl(*args, input=None, kubeconfig=None, check=True, timeout=60)` and
  `install_crd(path)` (apply, then wait until Established).
- `kuberay_crd` (session): Path of KubeRay's RayCluster CRD (extracted from the pinned
  ray-operator module by `make kuberay`), installed; fails with the command to run when
  it has not been built.
- `k8s_api` (session): a `kubernetes.client.ApiClient` for the admin.
- `namespace` (function): name of a fresh namespace, deleted afterwards (without waiting:
  this bare control plane runs no controller-manager, so it stays Terminating; the test
  ground's `ground_namespace` really goes).

Tests that use any of these are marked `cluster` automatically.
"""
from __future__ import annotations

import re
import secrets

import pytest

from harness import controlplane as cpmod
from harness import session_order

_CLUSTER_FIXTURES = {"control_plane", "kuberay_crd", "k8s_api", "namespace"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _CLUSTER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def control_plane():
    bin_dir = cpmod.default_bin_dir()
    missing = cpmod.missing_binaries(bin_dir)
    if missing:
        pytest.fail(
            f"control plane binaries missing ({', '.join(missing)}): run `make controlplane` "
            "(builds etcd, kube-apiserver and kubectl from Go modules; needs Go 1.26+)",
            pytrace=False,
        )
    cp = cpmod.ControlPlane(bin_dir)
    try:
        cp.start()
        cp.install_crds(cpmod.project_crd_files())
    except BaseException:
        cp.stop()
        raise
    session_order.hold(session_order.CONTROL_PLANE, cp.stop)
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def kuberay_crd(control_plane):
    path = cpmod.KUBERAY_CRD
    if not path.is_file():
        pytest.fail(f"KubeRay RayCluster CRD not found at {cpmod.KUBERAY_CRD_DISPLAY}", pytrace=False)
    control_plane.install_crd(path)
    return path


@pytest.fixture(scope="session")
def k8s_api(control_plane):
    from kubernetes import config

    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    try:
        yield api
    finally:
        api.close()


def namespace_name(request) -> str:
    """A fresh, valid namespace name that says which test made it."""
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    return f"t-{stem}-{secrets.token_hex(3)}"


@pytest.fixture
def namespace(request, k8s_api):
    from kubernetes import client

    name = namespace_name(request)
    core = client.CoreV1Api(k8s_api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        try:
            core.delete_namespace(name)
        except client.ApiException as e:
            if e.status != 404:
                raise
