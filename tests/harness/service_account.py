"""Run the operator as deploy/'s ServiceAccount instead of the admin: apply the RBAC objects
of a kustomize folder to a test control plane, get a token from the TokenRequest API
(`kubectl create token`) and write a kubeconfig that uses it. And find the refusals in an
operator log."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DEPLOY_BASE = Path(__file__).resolve().parents[2] / "deploy" / "base"
RBAC_KINDS = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
# An RBAC refusal names the identity: `... is forbidden: User "system:serviceaccount:..."
# cannot list resource ...`; kopf may also say "Not enough permissions". Other 403s are
# not about RBAC and must not count: the apiserver also answers "forbidden: unable to
# create new content in namespace X because it is being terminated" when another test's
# namespace is going away while the operator (watching all namespaces) acts in it.
FORBIDDEN = re.compile(r'forbidden: User "|cannot \w+ resource|not enough permissions', re.IGNORECASE)


def rbac_objects(control_plane, folder: Path = DEPLOY_BASE) -> list[dict]:
    objects = yaml.safe_load_all(control_plane.kubectl("kustomize", folder).stdout)
    return [o for o in objects if o and o["kind"] in RBAC_KINDS]


def service_account_kubeconfig(control_plane, path: Path, rbac: list[dict] | None = None) -> Path:
    rbac = rbac_objects(control_plane) if rbac is None else rbac
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
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


def refusals(log_path: Path) -> list[str]:
    return [line for line in log_path.read_text(errors="replace").splitlines() if FORBIDDEN.search(line)]
