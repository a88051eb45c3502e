"""Read one TPUFineTune with the user's kubeconfig, for commands run from a workstation
(`tpufinetune plot`)."""
from __future__ import annotations

from kubernetes import client, config
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from tpufinetune.core.names import GROUP, PLURAL, VERSION


def read_tpufinetune(name: str, namespace: str | None, kubeconfig: str | None) -> tuple[str, dict]:
    """(namespace, the object): the namespace given, else the kubeconfig context's, else
    default. LookupError names what could not be read and why."""
    try:
        api = config.new_client_from_config(config_file=kubeconfig)
        if namespace is None:
            _, context = config.list_kube_config_contexts(config_file=kubeconfig)
            namespace = (context or {}).get("context", {}).get("namespace") or "default"
    except (config.ConfigException, OSError) as exc:
        raise LookupError(f"no usable kubeconfig ({kubeconfig or '$KUBECONFIG or ~/.kube/config'}): "
                          f"{exc}; pass --kubeconfig") from None
    with api:
        try:
            obj = client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                raise LookupError(f"tpufinetune {namespace}/{name} not found "
                                  f"(kubectl get tpufinetunes -n {namespace})") from None
            raise LookupError(f"reading tpufinetune {namespace}/{name}: {exc.status} {exc.reason}") from None
        except HTTPError as exc:
            raise LookupError(f"cannot reach the API server: {exc}") from None
    return namespace, obj
