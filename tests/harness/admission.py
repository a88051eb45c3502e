"""A ValidatingAdmissionPolicy (and its binding) that refuses one kind of request in one
namespace: the real API server's admission chain produces the refusal a webhook, a policy
engine or a quota would, so the operator meets it exactly as in production."""

from __future__ import annotations


def refusing_policy(name: str, namespace: str, api_group: str, resource: str, operations: list[str],
                    message: str) -> list[dict]:
    """Objects to apply: every `operations` request on `resource` in `namespace` is denied
    with `message`."""
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{
                      "apiGroups": [api_group], "apiVersions": ["*"], "operations": list(operations),
                      "resources": [resource]}]},
                  "validations": [{"expression": "false", "message": message}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": name},
         "spec": {"policyName": name, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {
                      "matchLabels": {"kubernetes.io/metadata.name": namespace}}}}},
    ]
