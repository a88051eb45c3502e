"""What a kubelet derives from a pod spec before it starts a container (pure, on the pod as
JSON): the container's environment and the source of each volume.

Objects the pod refers to (Secrets, ConfigMaps, PVCs, PVs) come through `lookup(kind, name)`
(None when absent). A missing one raises the kubelet's own words: `ConfigError` for env
(the container waits in CreateContainerConfigError), `MountError` for a volume (it waits in
ContainerCreating, with a FailedMount event); the agent retries both on its sync loop.
"""

from __future__ import annotations

import base64
import math
import re
from dataclasses import dataclass, field

from kubernetes.utils import parse_quantity

GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class ConfigError(Exception):
    """CreateContainerConfigError: a referenced Secret, ConfigMap or key does not exist."""


class MountError(Exception):
    """FailedMount: a volume could not be set up (yet)."""


def expand(value: str, env: dict) -> str:
    """$(VAR) references, as the kubelet expands them ($$ escapes; unknown ones stay)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def service_env(services: list[dict]) -> dict:
    """`<NAME>_SERVICE_HOST`/`_PORT` and the Docker-link variables a kubelet gives for each
    Service with a cluster IP (envvars.FromServices)."""
    env: dict[str, str] = {}
    for service in services:
        spec = service.get("spec") or {}
        ip = spec.get("clusterIP")
        if not ip or ip == "None" or not spec.get("ports"):
            continue
        name = service["metadata"]["name"].upper().replace("-", "_")
        first = spec["ports"][0]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(first["port"])
        for port in spec["ports"]:
            if port.get("name"):
                env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
        protocol = first.get("protocol", "TCP")
        url = f"{protocol.lower()}://{ip}:{first['port']}"
        env[f"{name}_PORT"] = url
        for port in spec["ports"]:
            proto = port.get("protocol", "TCP")
            prefix = f"{name}_PORT_{port['port']}_{proto.upper()}"
            env[prefix] = f"{proto.lower()}://{ip}:{port['port']}"
            env[f"{prefix}_PROTO"] = proto.lower()
            env[f"{prefix}_PORT"] = str(port["port"])
            env[f"{prefix}_ADDR"] = ip
    return env


def _data(kind: str, obj: dict) -> dict[str, bytes]:
    if kind == "Secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def _key(kind: str, ref: dict, namespace: str, lookup) -> str | None:
    obj = lookup(kind, ref["name"])
    if obj is None:
        if ref.get("optional"):
            return None
        raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
    data = _data(kind, obj)
    if ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ConfigError(f"couldn't find key {ref['key']} in {kind} {namespace}/{ref['name']}")
    return data[ref["key"]].decode()


def resource_value(container: dict, ref: dict) -> str:
    """resourceFieldRef: limits.memory, requests.cpu ... in units of the divisor, rounded up."""
    section, _, resource = ref["resource"].partition(".")
    resources = container.get("resources") or {}
    quantity = (resources.get(section) or {}).get(resource) or (resources.get("limits") or {}).get(resource)
    if quantity is None:
        return "0"
    divisor = parse_quantity(ref.get("divisor") or "1")
    value = parse_quantity(quantity) / divisor
    return str(int(-(-value // 1)))


def container_env(pod: dict, container: dict, *, base: dict, fields: dict, services: dict, lookup) -> dict:
    """The container's environment: `base` (the image's and the ground's), then envFrom,
    then env, then the service variables not already set, as makeEnvironmentVariables."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    for source in container.get("envFrom") or []:
        kind, ref = ("ConfigMap", source["configMapRef"]) if source.get("configMapRef") else ("Secret", source["secretRef"])
        obj = lookup(kind, ref["name"])
        if obj is None:
            if ref.get("optional"):
                continue
            raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
        for key, value in _data(kind, obj).items():
            name = (source.get("prefix") or "") + key
            if _ENV_NAME.match(name):  # a kubelet skips (and reports) invalid names
                env[name] = value.decode()
    for item in container.get("env") or []:
        name, source = item["name"], item.get("valueFrom")
        if source is None:
            env[name] = expand(item.get("value") or "", {**services, **env})
        elif "fieldRef" in source:
            env[name] = field_value(source["fieldRef"]["fieldPath"], pod, fields)
        elif "resourceFieldRef" in source:
            env[name] = resource_value(container, source["resourceFieldRef"])
        else:
            kind, ref = ("ConfigMap", source["configMapKeyRef"]) if "configMapKeyRef" in source else ("Secret", source["secretKeyRef"])
            value = _key(kind, ref, namespace, lookup)
            if value is not None:
                env[name] = value
    for name, value in services.items():
        env.setdefault(name, value)
    return env


# ---- volumes -------------------------------------------------------------------------------


@dataclass
class VolumePlan:
    """Where a volume's files come from: a directory of the pod ("dir"), one in memory
    ("memory": tmpfs, e.g. /dev/shm), a directory that exists on this machine ("host"), or
    projected files written into a directory of the pod ("files": path -> (bytes, mode))."""
    kind: str
    path: str = ""
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)


def _projection(kind: str, ref: dict, namespace: str, lookup, default_mode: int) -> dict:
    obj = lookup(kind, ref["name"])
    if obj is None:
        if ref.get("optional"):
            return {}
        raise MountError(f'{kind.lower()} "{ref["name"]}" not found')
    data = _data(kind, obj)
    items = ref.get("items")
    if not items:
        return {key: (value, default_mode) for key, value in data.items()}
    files = {}
    for item in items:
        if item["key"] not in data:
            if ref.get("optional"):
                continue
            raise MountError(f"configmap references non-existent config key: {item['key']}"
                             if kind == "ConfigMap" else f"references non-existent secret key: {item['key']}")
        files[item["path"]] = (data[item["key"]], item.get("mode", default_mode))
    return files


def field_value(path: str, pod: dict, fields: dict) -> str:
    """A fieldRef's value: a label or annotation of the pod (`metadata.labels['k']`), the
    whole map as a volume gets it (one key="value" a line), or one of `fields`."""
    match = re.fullmatch(r"metadata\.(labels|annotations)(?:\['(.+)'\])?", path)
    if match is None:
        return fields.get(path, "")
    values = (pod.get("metadata") or {}).get(match.group(1)) or {}
    if match.group(2) is None:
        return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
    return values.get(match.group(2), "")


def _downward(items: list[dict], fields: dict, pod: dict, default_mode: int) -> dict:
    """A downwardAPI volume's (or projection's) files: fieldRef paths as the env's."""
    files = {}
    for item in items or []:
        ref = item.get("fieldRef")
        if ref is None:  # resourceFieldRef: the container's limits; no pod here reads them
            raise MountError(f"downwardAPI item {item.get('path')!r}: only fieldRef runs on the ground")
        files[item["path"]] = (field_value(ref["fieldPath"], pod, fields).encode(), item.get("mode", default_mode))
    return files


def volume_plan(volume: dict, namespace: str, lookup, gcs_root: str | None, *, pod: dict | None = None,
                fields: dict | None = None, token=None) -> VolumePlan:
    """`fields` are the downward API's values (as the env's fieldRef); `token(audience,
    seconds)` asks the API server for a token of the pod's ServiceAccount bound to the pod
    (TokenRequest), as a kubelet does for a serviceAccountToken projection."""
    name = volume["name"]
    if "emptyDir" in volume:
        medium = (volume["emptyDir"] or {}).get("medium") or ""
        return VolumePlan("memory" if medium == "Memory" else "dir")
    for kind, key in (("Secret", "secret"), ("ConfigMap", "configMap")):
        if key in volume:
            source = volume[key]
            ref = {**source, "name": source.get("secretName") or source.get("name")}
            return VolumePlan("files", files=_projection(kind, ref, namespace, lookup, source.get("defaultMode", 0o644)))
    if "downwardAPI" in volume:
        source = volume["downwardAPI"]
        return VolumePlan("files", files=_downward(source.get("items"), fields or {}, pod or {},
                                                   source.get("defaultMode", 0o644)))
    if "projected" in volume:
        files = {}
        mode = volume["projected"].get("defaultMode", 0o644)
        for source in volume["projected"].get("sources") or []:
            if "serviceAccountToken" in source:
                if token is None:
                    raise MountError(f"volume {name!r}: no token for the pod's ServiceAccount")
                request = source["serviceAccountToken"]
                files[request["path"]] = (token(request.get("audience") or "", int(request.get("expirationSeconds") or 3600)).encode(), mode)
                continue
            if "downwardAPI" in source:
                files.update(_downward(source["downwardAPI"].get("items"), fields or {}, pod or {}, mode))
                continue
            kind = "Secret" if "secret" in source else "ConfigMap" if "configMap" in source else None
            if kind is None:
                raise MountError(f"volume {name!r}: only secret, configMap, downwardAPI and serviceAccountToken "
                                 "projections run on the ground")
            files.update(_projection(kind, source["secret" if kind == "Secret" else "configMap"], namespace, lookup, mode))
        return VolumePlan("files", files=files)
    if "hostPath" in volume:
        return VolumePlan("host", volume["hostPath"]["path"])
    if "csi" in volume:
        return _csi(volume["csi"]["driver"], (volume["csi"].get("volumeAttributes") or {}).get("bucketName", ""), gcs_root)
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"]["claimName"]
        pvc = lookup("PersistentVolumeClaim", claim)
        if pvc is None:
            raise MountError(f'persistentvolumeclaim "{claim}" not found')
        pv_name = (pvc.get("spec") or {}).get("volumeName")
        pv = lookup("PersistentVolume", pv_name) if pv_name and (pvc.get("status") or {}).get("phase") == "Bound" else None
        if pv is None:
            raise MountError(f'persistentvolumeclaim "{claim}" is not bound')
        spec = pv["spec"]
        if "hostPath" in spec or "local" in spec:
            return VolumePlan("host", (spec.get("hostPath") or spec.get("local"))["path"])
        if "csi" in spec:
            return _csi(spec["csi"]["driver"], spec["csi"].get("volumeHandle", ""), gcs_root)
        raise MountError(f"persistentvolume {pv_name!r}: only hostPath, local and the GCS FUSE CSI driver run on the ground")
    raise MountError(f"volume {name!r}: its type does not run on the ground "
                     "(emptyDir, secret, configMap, downwardAPI, projected, hostPath, persistentVolumeClaim, csi gcsfuse do)")


def _csi(driver: str, bucket: str, gcs_root: str | None) -> VolumePlan:
    if driver != GCSFUSE_DRIVER or gcs_root is None:
        raise MountError(f"kubernetes.io/csi: driver name {driver} not found in the list of registered CSI drivers")
    if not bucket:
        raise MountError("the GCS FUSE CSI driver needs a bucket (volumeAttributes.bucketName)")
    return VolumePlan("host", f"{gcs_root.rstrip('/')}/{bucket}")


def mount_targets(container: dict, volume_paths: dict[str, str], env: dict) -> list[dict]:
    """The container's volumeMounts as the runtime's mounts: source (the volume's path, or a
    subPath below it), target, readOnly."""
    mounts = []
    for m in container.get("volumeMounts") or []:
        if m["name"] not in volume_paths:
            raise MountError(f"volumeMount {m['name']!r} names no volume of the pod")
        sub = m.get("subPath") or (expand(m["subPathExpr"], env) if m.get("subPathExpr") else "")
        if sub.startswith("/") or ".." in sub.split("/"):
            raise MountError(f"subPath {sub!r} must be a relative path inside the volume")
        source = volume_paths[m["name"]] + (f"/{sub}" if sub else "")
        mounts.append({"source": source, "target": m["mountPath"], "readOnly": bool(m.get("readOnly")),
                       "subPath": bool(sub)})
    return mounts


# ---- CPU shares ----------------------------------------------------------------------------

# The kubelet's cgroup v1 CPU weights (pkg/kubelet/cm/helpers_linux.go): MinShares,
# MaxShares, SharesPerCPU.
MIN_SHARES, MAX_SHARES, SHARES_PER_CPU = 2, 262144, 1024


def milli_cpu_to_shares(milli: int) -> int:
    """The kubelet's MilliCPUToShares: 1024 per CPU requested, 2 for none, capped."""
    if milli == 0:
        return MIN_SHARES
    return max(MIN_SHARES, min(MAX_SHARES, milli * SHARES_PER_CPU // 1000))


def _milli(quantity: str) -> int:
    return math.ceil(parse_quantity(quantity) * 1000)  # Quantity.MilliValue rounds up


def cpu_request_milli(container: dict) -> int:
    """A container's CPU request in millicores, rounded up as Quantity.MilliValue; its limit
    when it has no request (the API server's defaulting), 0 with neither."""
    resources = container.get("resources") or {}
    value = (resources.get("requests") or {}).get("cpu") or (resources.get("limits") or {}).get("cpu")
    return 0 if value is None else _milli(value)


def pod_cpu_milli(spec: dict) -> int:
    """The pod's CPU request as the kubelet sizes its pod cgroup (resource.PodRequests): the
    app containers and sidecars (restartable init containers) summed, or the largest step
    of the init containers if more, plus the pod's overhead."""
    total = sum(cpu_request_milli(c) for c in spec.get("containers") or [])
    sidecars = init_peak = 0
    for init in spec.get("initContainers") or []:
        milli = cpu_request_milli(init)
        if init.get("restartPolicy") == "Always":  # a sidecar runs beside everything after it
            total += milli
            sidecars += milli
            step = sidecars
        else:
            step = milli + sidecars
        init_peak = max(init_peak, step)
    overhead = (spec.get("overhead") or {}).get("cpu")
    return max(total, init_peak) + (_milli(overhead) if overhead else 0)


def pod_cpu_shares(spec: dict) -> int:
    """cpu.shares of the pod's cgroup."""
    return milli_cpu_to_shares(pod_cpu_milli(spec))


def container_cpu_shares(container: dict) -> int:
    """cpu.shares of a container's cgroup (a container without a request gets 2)."""
    return milli_cpu_to_shares(cpu_request_milli(container))
