"""The API's shared model base and the Ray pods' own settings (spec.head, spec.workers:
PodGroup and what it holds), part of the TPUFineTune API in api.py, which re-exports them.

The models layer: pydantic types only, no rules and no sizing (validation.py checks them,
celrules.py holds the schema's CEL rules, api.py composes the two). With specmodels.py,
these models are the source of the CRD schema (crdgen).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from .quantity import QUANTITY_PATTERN, normalize_quantity

# DNS-1123 subdomain (object, Secret and ServiceAccount names).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Ids, URIs, names and paths hold no control character (C0, DEL, C1, the Unicode line and
# paragraph separators): they reach logs, comments and command lines, where a line break
# would start a line of its own. One class, in the syntax both pydantic's regex engine and
# the apiserver's (RE2) read.
CONTROL_CHARACTERS = r"\x00-\x1F\x7F-\x9F\x{2028}\x{2029}"
PRINTABLE = rf"^[^{CONTROL_CHARACTERS}]*$"

Quantity = Annotated[
    str,
    BeforeValidator(normalize_quantity),
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}],
                    "pattern": QUANTITY_PATTERN, "x-kubernetes-int-or-string": True}),
]
ResourceMap = Annotated[dict[str, Quantity], Field(max_length=16)]


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True,
                              extra="forbid", protected_namespaces=())


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                      description="Secret name, in the TPUFineTune's namespace.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="Key within the Secret.")


class ResourceRequirements(_Model):
    requests: ResourceMap | None = Field(
        None, description="Overrides the default requests key by key (e.g. cpu, memory).")
    limits: ResourceMap | None = Field(
        None, description="Overrides the default limits key by key (e.g. cpu, memory).")


# Label and annotation keys: an optional DNS-subdomain prefix and a name, as Kubernetes has.
METADATA_KEY = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
LabelKey = Annotated[str, Field(min_length=1, max_length=317, pattern=METADATA_KEY)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]


def _list_map(key: str = "name") -> dict:
    # The apiserver refuses two items with the same key (and merges by it on apply).
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]}


class EnvSecretSource(_Model):
    secret_key_ref: SecretKeyRef = Field(description="Key of a Secret in the namespace.")


class EnvVar(_Model):
    name: str = Field(min_length=1, max_length=256, pattern=ENV_NAME,
                      description="Variable name.")
    value: str | None = Field(None, max_length=4096, description="A plain value.")
    value_from: EnvSecretSource | None = Field(
        None, description="Read the value from a Secret (secretKeyRef only).")


class Toleration(_Model):
    key: str | None = Field(None, max_length=317, pattern=METADATA_KEY,
                            description="Taint key; empty with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: str | None = Field(None, max_length=63, description="Taint value (Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty matches all.")
    toleration_seconds: int | None = Field(
        None, ge=0, description="NoExecute only: how long the pod stays after the taint.")


class PersistentVolumeClaimSource(_Model):
    claim_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                            description="PersistentVolumeClaim in the namespace, e.g. a "
                                        "ReadWriteMany Filestore claim for checkpoints.")
    read_only: bool = Field(False, description="Mount read-only.")


class CSISource(_Model):
    driver: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                        description="CSI driver, e.g. gcsfuse.csi.storage.gke.io.")
    read_only: bool = Field(False, description="Mount read-only.")
    volume_attributes: Annotated[dict[str, Annotated[str, Field(max_length=4096)]],
                                 Field(max_length=32)] | None = Field(
        None, description="Driver options, e.g. bucketName and mountOptions for GCS FUSE.")


class EmptyDirSource(_Model):
    medium: Literal["", "Memory"] = Field("", description='"" (node disk) or Memory.')
    size_limit: Quantity | None = Field(None, description="Size limit, e.g. 10Gi.")


class ConfigMapSource(_Model):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                      description="ConfigMap in the namespace.")


class SecretSource(_Model):
    secret_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                             description="Secret in the namespace.")


class NFSSource(_Model):
    server: str = Field(min_length=1, max_length=253, pattern=PRINTABLE, description="NFS server address.")
    path: str = Field(min_length=1, max_length=1024, pattern=rf"^/[^{CONTROL_CHARACTERS}]*$",
                      description="Exported path.")
    read_only: bool = Field(False, description="Mount read-only.")


class Volume(_Model):
    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL,
                      description="Volume name, referenced by volumeMounts.")
    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(
        None, description="A PersistentVolumeClaim (e.g. ReadWriteMany Filestore).")
    csi: CSISource | None = Field(
        None, description="An inline CSI volume (e.g. the GCS FUSE CSI driver).")
    empty_dir: EmptyDirSource | None = Field(None, description="Scratch space of the pod.")
    config_map: ConfigMapSource | None = Field(None, description="A ConfigMap's keys as files.")
    secret: SecretSource | None = Field(None, description="A Secret's keys as files.")
    nfs: NFSSource | None = Field(None, description="An NFS export.")


class VolumeMount(_Model):
    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL,
                      description="One of this group's volumes.")
    mount_path: str = Field(min_length=2, max_length=1024, pattern=rf"^/[^{CONTROL_CHARACTERS}]*$",
                            description="Absolute path in the Ray container.")
    read_only: bool = Field(False, description="Mount read-only.")
    sub_path: str | None = Field(None, max_length=1024, pattern=rf"^[^/{CONTROL_CHARACTERS}][^{CONTROL_CHARACTERS}]*$",
                                 description="Path within the volume (relative).")


class PodGroup(_Model):
    """One Ray pod group. Everything here is merged into the rendered RayCluster's pod
    template; what the slice decides (TPU resources, node selectors, /dev/shm) cannot be
    set here."""

    resources: ResourceRequirements | None = Field(
        None, description="Resource overrides merged over the sized defaults. "
                          "google.com/tpu is always derived from the topology.")
    service_account_name: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="ServiceAccount of these pods; overrides spec.serviceAccountName.")
    annotations: Annotated[dict[LabelKey, Annotated[str, Field(max_length=4096)]],
                           Field(max_length=32)] | None = Field(
        None, description="Pod annotations, e.g. gke-gcsfuse/volumes: \"true\" for the GCS "
                          "FUSE CSI driver.")
    labels: Annotated[dict[LabelKey, LabelValue], Field(max_length=32)] | None = Field(
        None, description="Pod labels (ray.io/ keys are KubeRay's).")
    tolerations: Annotated[list[Toleration], Field(max_length=16)] | None = Field(
        None, description="Tolerations added to the sized ones.")
    priority_class_name: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN, description="PriorityClass of the pods.")
    volumes: Annotated[list[Volume], Field(max_length=16)] | None = Field(
        None, json_schema_extra=_list_map(),
        description="Volumes added to the pods (/dev/shm stays the sized one).")
    volume_mounts: Annotated[list[VolumeMount], Field(max_length=16)] | None = Field(
        None, json_schema_extra=_list_map("mountPath"),
        description="Mounts of these volumes in the Ray container.")
    env: Annotated[list[EnvVar], Field(max_length=64)] | None = Field(
        None, json_schema_extra=_list_map(),
        description="Extra environment of the Ray container: plain values or "
                    "secretKeyRef.")


class MemorySettings(_Model):
    """Memory at length: the fields of spec.training that trade compute for device memory
    (Training takes them from here). Unset: the trainer's own default, and the operator
    passes no flag, so an older trainer image still runs the spec (docs/trainer.md,
    "Memory at length")."""

    # No schema defaults (an older operator would report a filled-in default as unknown).
    activation_checkpointing: Literal["auto", "none", "block", "selective"] | None = Field(
        None, description="Recompute activations in the backward instead of keeping them. auto "
                          "(unset): the memory plan chooses, none when the run fits, else the cheapest "
                          "that does, selective then block (status.plan.activationCheckpointing; on the "
                          "cpu stand-in and for a model the plan does not know: none). none: keep every "
                          "activation. block: recompute every decoder block (one more forward per step; "
                          "only each block's input is kept). selective: recompute each block's "
                          "self-attention only (queries, keys, values and, with eager attention, the "
                          "heads x length^2 scores), keeping the MLP's activations. A set value is kept, "
                          "and refused (DoesNotFit) when the run does not fit with it.")
    sharding: Literal["auto", "full", "hybrid", "replicate"] | None = Field(
        None, description="How the model state (fp32 weights, gradients, optimizer state) is spread over "
                          "the slice's devices. auto (unset): the memory plan chooses the least sharding "
                          "that fits: replicate, else hybrid, else full (status.plan.sharding; on the cpu "
                          "stand-in and for a model the plan does not know: full). full: sharded over every "
                          "device of the slice (FSDP). hybrid: sharded within groups of devices, the "
                          "smallest power of two that fits, replicated across the groups (HSDP). "
                          "replicate: every device holds the whole state (one gradient all-reduce a "
                          "step). With several slices the state is also replicated across slices. A set "
                          "value is kept, and refused (DoesNotFit) when the run does not fit with it.")
    attention: Literal["eager", "sdpa"] | None = Field(
        None, description="The attention kernel: eager (the tutorial's; every head's length x length "
                          "scores in memory) or sdpa (torch's scaled_dot_product_attention, which need "
                          "not keep them). Unset: eager on TPU, sdpa on GPU and the cpu stand-in.")
    freeze_embeddings: bool | None = Field(
        None, description="Do not train the input embedding: no gradient and no optimizer state for "
                          "it. A head tied to it (Gemma's) is the same weight and is frozen too. "
                          "Unset: false.")
