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


def serve_webhook(handler: type, pki, path: str):
    """Serve `handler` (a BaseHTTPRequestHandler) over TLS with the ground's serving
    certificate (valid for 127.0.0.1) on a free loopback port, in a daemon thread: an
    admission webhook the API server can call. Returns the server and the webhook's URL."""
    import ssl
    import threading
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"https://127.0.0.1:{server.server_address[1]}/{path}"
