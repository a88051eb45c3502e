"""Run the operator as deploy/'s ServiceAccount instead of the admin: apply the RBAC objects
of a kustomize folder to a test control plane, get a token from the TokenRequest API
(`kubectl create token`) and write a kubeconfig that uses it. And find the refusals in an
operator log.

The operator acts only in the namespaces it watches, each bound as deploy/base's
rolebinding-watched.yaml binds ml-team. The ground's operator watches WATCHED (`default`, and
every harness namespace: k8s_fixtures.namespace_name makes them t-…), so its RBAC is
deploy/overlays/several-namespaces' (a glob), and each namespace gets that RoleBinding when
it is made (`bind_namespace`), as an admin installing for those namespaces would do."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import yaml

from harness.waiting import wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DEPLOY_BASE = DEPLOY / "base"
SEVERAL_NAMESPACES = DEPLOY / "overlays" / "several-namespaces"
RUNS_ROLE = "tpufinetune-operator-runs"  # bound in each watched namespace
# TPUFT_NAMESPACE of the ground's operator.
WATCHED = "default t-*"
RBAC_KINDS = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
# An RBAC refusal names the identity: `... is forbidden: User "system:serviceaccount:..."
# cannot list resource ...`; kopf may also say "Not enough permissions". Other 403s are
# not about RBAC and must not count: the apiserver also answers "forbidden: unable to
# create new content in namespace X because it is being terminated" when another test's
# namespace is going away while the operator (watching all namespaces) acts in it.
FORBIDDEN = re.compile(r'forbidden: User "|cannot \w+ resource|not enough permissions|\(403 Forbidden\)', re.IGNORECASE)
# A namespace a glob of TPUFT_NAMESPACE matches is bound only once it exists (no RoleBinding
# can be made before its namespace), while kopf starts watching it the moment it appears: its
# first list there may be refused until the binding reaches the authorizer, and kopf retries
# it ("Request attempt N failed; will retry"). Those retries, in a namespace of the glob,
# are not a missing rule; kopf giving up ("escalating") still is.
GLOB_RETRY = re.compile(r"Request attempt #?\d+(?:/\d+)? failed; will retry: \w+ \S*/namespaces/(t-[a-z0-9-]+)/")


def is_watch_binding(obj: dict) -> bool:
    return obj["kind"] == "RoleBinding" and obj["roleRef"]["name"] == RUNS_ROLE


def rbac_objects(control_plane, folder: Path = SEVERAL_NAMESPACES) -> list[dict]:
    """The folder's RBAC objects less its RoleBindings of watched namespaces (deploy/base's
    ml-team): each test binds its own namespaces (`watch_binding`)."""
    objects = yaml.safe_load_all(control_plane.kubectl("kustomize", folder).stdout)
    return [o for o in objects if o and o["kind"] in RBAC_KINDS and not is_watch_binding(o)]


def watch_binding(control_plane, namespace: str) -> dict:
    """deploy/base's RoleBinding of a watched namespace, for `namespace`."""
    objects = yaml.safe_load_all(control_plane.kubectl("kustomize", DEPLOY_BASE).stdout)
    (binding,) = [o for o in objects if o and is_watch_binding(o)]
    binding["metadata"]["namespace"] = namespace
    return binding


def bind_namespace(control_plane, namespace: str, create: bool = False) -> None:
    """Let the operator act in `namespace` (one of those it watches); `create`: make the
    namespace in the same call, just before its binding."""
    made = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}] if create else []
    binding = watch_binding(control_plane, namespace)
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(made + [binding]))
    # The authorizer learns of a binding a moment after it is stored: a run applied before
    # would have its first creates refused, as an admin's would who applied both at once.
    # (Before any operator has started on this API server the role is not there to grant.)
    if control_plane.kubectl("get", "clusterrole", RUNS_ROLE, check=False).returncode != 0:
        return
    (subject,) = binding["subjects"]
    user = f"system:serviceaccount:{subject['namespace']}:{subject['name']}"
    wait_for(lambda: control_plane.kubectl("auth", "can-i", "create", "secrets", "-n", namespace, f"--as={user}",
                                           check=False).stdout.strip() == "yes",
             30, f"the operator's RoleBinding in {namespace} to take effect", interval=0.2)


def service_account_kubeconfig(control_plane, path: Path, rbac: list[dict] | None = None,
                               namespaces: tuple[str, ...] | list[str] = ("default",)) -> Path:
    """A kubeconfig of the operator's ServiceAccount, its RBAC applied and `namespaces` bound
    (`default`, which the ground watches; tests pass their own)."""
    rbac = rbac_objects(control_plane) if rbac is None else rbac
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(
        rbac + [watch_binding(control_plane, namespace) for namespace in namespaces]))
    account = next(o["metadata"] for o in rbac if o["kind"] == "ServiceAccount")
    token = control_plane.kubectl(
        "create", "token", account["name"], "-n", account["namespace"], "--duration=12h").stdout.strip()
    user = f"system:serviceaccount:{account['namespace']}:{account['name']}"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": control_plane.server,
                                                  "certificate-authority": str(control_plane.ca_path)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "test", "user": user}}],
        "current-context": "operator",
    }))
    path.chmod(0o600)
    return path


# A namespace being deleted loses the operator's RoleBinding in the namespace controller's
# first pass, while its runs may still be winding down: what the operator then sends there
# (a Deleting Event, kopf retrying it and giving up) is refused for that reason, not for a
# missing rule. A refusal names its namespace in the request's path.
NAMESPACE_OF = re.compile(r"/namespaces/([a-z0-9-]+)/|in the namespace \"([a-z0-9-]+)\"")
LOGGED_AT = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")


def logged_at(line: str) -> datetime | None:
    """The local time of an operator log line ([2026-12-07 02:18:44,700] ...), or None."""
    found = LOGGED_AT.match(line)
    if found is None:
        return None
    return datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S").replace(microsecond=int(found[2]) * 1000)


def refused_after_deletion(line: str, deleted: dict[str, datetime]) -> bool:
    """Whether a refusal was logged in a namespace after its deletion began (`deleted`: each
    namespace the harness deleted, and when, in local time as the log writes it)."""
    found, at = NAMESPACE_OF.search(line), logged_at(line)
    namespace = found and (found[1] or found[2])
    return bool(namespace) and at is not None and namespace in deleted and at >= deleted[namespace]


def refusals(log_path: Path, deleted: dict[str, datetime] | None = None) -> list[str]:
    """The operator log's RBAC refusals, less kopf's retries in a namespace just bound and
    whatever was refused in a namespace after its deletion began (`deleted`)."""
    return [line for line in log_path.read_text(errors="replace").splitlines()
            if FORBIDDEN.search(line) and not GLOB_RETRY.search(line)
            and not refused_after_deletion(line, deleted or {})]
