"""Cross-field rules, written twice from one table: as CEL for admission, as Python for
the operator and `tpufinetune render`.

Each CEL rule below has a Python twin in `check_spec` with the same condition and the
same message text (the CEL `messageExpression` rebuilds the Python f-string), so a spec is
refused with the same words by `kubectl apply` and by `tpufinetune render`. Checks CEL
cannot express (quantity arithmetic across merged defaults) exist only in Python and run
in the operator before anything is created.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from . import generations as g
from .errors import SpecError
from .quantity import parse_quantity
from .sizing import SLICE_INDEX_ENV, plan_resources, slice_shape

if TYPE_CHECKING:
    from .api import PodGroup, ResourceRequirements, TPUFineTuneSpec

SLICES_MESSAGE = (f"is more slices than one run can span ({g.multislice_ceilings()}); use fewer "
                  "slices or a smaller topology")
STORAGE_MESSAGE = ("is required when mode is finetune: a gs:// bucket path or a shared "
                   "filesystem path where Ray Train writes checkpoints")
# A local checkpoint path is one filesystem for the head and every worker only when it lies
# under one shared volume mounted at the same place on both (Ray Train's workers write their
# shards, the driver on the head checks and reports them).
SHARED_SOURCES = ("persistentVolumeClaim", "nfs", "csi")
SHARED_STORAGE_MESSAGE = ("is a local path, which each Ray pod would write on its own disk: "
                          "use a gs:// bucket path, or mount one shared volume "
                          "(persistentVolumeClaim, nfs or csi), by the same name, writable at "
                          "the same mountPath in spec.head and spec.workers and put the path "
                          "under it")
EVAL_SCORE_MESSAGE = ("eval_loss needs training.evalFraction greater than 0: with no "
                      "evaluation no epoch reports eval_loss; set training.evalFraction "
                      "(e.g. 0.05) or rank checkpoints by loss")
EARLY_STOP_MESSAGE = ("needs training.evalFraction greater than 0: it acts on the evaluation "
                      "loss, and with no evaluation there is none; set training.evalFraction "
                      "(e.g. 0.05) or remove it")
EARLY_STOP_FIELDS = ("targetEvalLoss", "earlyStoppingPatience")
GLOBAL_BATCH_MESSAGE = ("must be 0 (no gradient accumulation) or a multiple of every slice's "
                        "devices (devices per slice x tpu.slices) x training.batchSizePerDevice, "
                        "the factor being the accumulation steps")
TOKENS_PER_STEP_MESSAGE = ("must be a multiple of every slice's devices (devices per slice x tpu.slices) x "
                           "training.batchSizePerDevice (blocks per device per micro-batch) x "
                           "training.maxSeqLen, the factor being the accumulation steps, and is not "
                           "given with training.globalBatchBlocks")
MIN_NO_PROGRESS_TIMEOUT = 60
NO_PROGRESS_MESSAGE = (f"must be 0 (off) or at least {MIN_NO_PROGRESS_TIMEOUT} seconds: "
                       "the trainer reports progress about every 30 s")
# Each run's head requires its own token (KubeRay authOptions, core/raytoken.py): Ray has
# token authentication since 2.52.0, and KubeRay refuses token mode below it.
MIN_RAY_VERSION = (2, 52, 0)
RAY_VERSION_MESSAGE = ("must be 2.52.0 or newer: every run's Ray head requires its own token "
                       "(Ray token authentication, since 2.52.0); use an image with a newer Ray")
# rayVersion (already X.Y.Z by the schema) at least MIN_RAY_VERSION, as a CEL regex.
RAY_VERSION_AT_LEAST = "^(([3-9]|[1-9][0-9]+)[.][0-9]+|2[.](5[2-9]|[6-9][0-9]|[1-9][0-9]{2,}))[.][0-9]+$"
PRIORITY_QUEUE_MESSAGE = ("is a Kueue WorkloadPriorityClass and needs queueName: set "
                          "spec.queueName to a LocalQueue, or remove it")
TPU_OVERRIDE_MESSAGE = ("google.com/tpu is set from the topology (chips per host); "
                        "remove it from the overrides")

# The pod settings users may add to the Ray pods (api.PodGroup) never replace what the
# operator sets from the slice and the spec.
# RAY_AUTH_*: KubeRay skips its own when the container already has one, and a user's
# would replace the run's token (core/raytoken.py).
RESERVED_ENV = ("HF_TOKEN", "RAY_TPU_RESOURCE_PER_CHIP", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                "RAY_AUTH_TOKEN_PATH", SLICE_INDEX_ENV)
RESERVED_ENV_PREFIX = "TPU_"  # the KubeRay TPU webhook's TPU_WORKER_ID, TPU_NAME, ...
SHM_VOLUME, SHM_PATH = "dshm", "/dev/shm"
RESERVED_LABEL_PREFIX = "ray.io/"
VOLUME_SOURCES = ("persistentVolumeClaim", "csi", "emptyDir", "configMap", "secret", "nfs")
ENV_VALUE_MESSAGE = "set exactly one of value and valueFrom.secretKeyRef"
ENV_RESERVED_MESSAGE = ("is set by the operator (HF_TOKEN from model.tokenSecret; "
                        f"RAY_TPU_RESOURCE_PER_CHIP, TPU_* and {SLICE_INDEX_ENV} from the slice; RAY_AUTH_* "
                        "from the run's own Ray token); use another name")
VOLUME_SOURCE_MESSAGE = f"set exactly one volume source: {', '.join(VOLUME_SOURCES)}"
SHM_VOLUME_MESSAGE = ("dshm is the workers' /dev/shm volume, sized from the machine; use "
                      "another name")
SHM_MOUNT_MESSAGE = ("/dev/shm is the workers' shared-memory volume, sized from the "
                     "machine; mount elsewhere")
MOUNT_VOLUME_MESSAGE = ("every volumeMounts[].name must be one of this group's volumes; "
                        "add the volume or fix the name")
LABEL_MESSAGE = "ray.io/ labels are KubeRay's; use another prefix"


def _cel_list(values: list[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def cel_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _is_generation(gen: g.Generation) -> str:
    return f"self.generation in {_cel_list(list(gen.aliases))}"


def _topology_rule(gen: g.Generation) -> dict:
    valid = gen.valid_topologies()
    reason = f" is not a valid {gen.name} topology; valid: {', '.join(valid)}"
    return {
        "rule": f"!({_is_generation(gen)}) || self.topology in {_cel_list(valid)}",
        "messageExpression": "'\"' + self.topology + '\"' + " + cel_string(reason),
        "message": reason.strip(),
        "fieldPath": ".topology",
        "reason": "FieldValueInvalid",
    }


def _cpu_topology_rule() -> dict:
    reason = (f" is not a valid cpu topology; use a worker count from 1 to "
              f"{g.MAX_CPU_WORKERS}")
    return {
        "rule": ("self.generation != 'cpu' || (self.topology.matches('^[0-9]{1,3}$') && "
                 f"int(self.topology) >= 1 && int(self.topology) <= {g.MAX_CPU_WORKERS})"),
        "messageExpression": "'\"' + self.topology + '\"' + " + cel_string(reason),
        "message": reason.strip(),
        "fieldPath": ".topology",
        "reason": "FieldValueInvalid",
    }


# string(self.chipsPerHost) has no size bound for the apiserver's cost estimator (the
# CRD is refused); indexing a list of literals does, and chipsPerHost is 1..8.
_CHIPS_PER_HOST_TEXT = (f"{_cel_list([str(n) for n in range(1, g.MAX_CHIPS_PER_HOST + 1)])}"
                        "[self.chipsPerHost - 1]")


def _chips_per_host_rule(gen: g.Generation) -> dict:
    fits = " || ".join(
        f"(self.chipsPerHost == {m.chips_per_host} && "
        f"self.topology in {_cel_list(sorted(m.topologies, key=g.topology_sort_key))})"
        for m in gen.machines)
    # The valid options depend on the topology: group topologies by their option list.
    by_options: dict[str, list[str]] = {}
    for topology in gen.valid_topologies():
        options = ", ".join(str(o) for o in g.chips_per_host_options(gen, topology))
        by_options.setdefault(options, []).append(topology)
    *branches, (last_options, _) = by_options.items()
    options_expr = cel_string(last_options)
    for options, topologies in reversed(branches):
        options_expr = (f"(self.topology in {_cel_list(topologies)} ? "
                        f"{cel_string(options)} : {options_expr})")
    return {
        "rule": f"!({_is_generation(gen)}) || !has(self.chipsPerHost) || {fits}",
        "messageExpression": (f"{_CHIPS_PER_HOST_TEXT} + ' does not fit a {gen.name} ' + "
                              f"self.topology + ' slice; valid: ' + {options_expr}"),
        "message": f"does not fit the {gen.name} slice shape; by machine: "
                   f"{g.machines_summary(gen)}",
        "fieldPath": ".chipsPerHost",
        "reason": "FieldValueInvalid",
    }


def _slices_rule() -> dict:
    """slices within what one run can span: a map of every alias/topology whose ceiling is
    below MAX_SLICES (the schema's own bound), and the cpu stand-in's worker total."""
    ceilings = "{" + ", ".join(
        f"'{alias}/{topology}': {g.max_slices(gen, topology)}" for gen in g.GENERATIONS if gen.is_tpu
        for alias in gen.aliases for topology in gen.valid_topologies()
        if g.max_slices(gen, topology) < g.MAX_SLICES) + "}"
    key = "self.generation + '/' + self.topology"
    cpu = f"(!self.topology.matches('^[0-9]{{1,3}}$') || self.slices * int(self.topology) <= {g.MAX_CPU_WORKERS})"
    return {"rule": (f"!has(self.slices) || self.slices == 1 || (self.generation == 'cpu' ? {cpu} : "
                     f"(!({key} in {ceilings}) || self.slices <= {ceilings}[{key}]))"),
            "message": SLICES_MESSAGE, "fieldPath": ".slices", "reason": "FieldValueInvalid"}


def tpu_rules() -> list[dict]:
    """CEL rules on `spec.tpu`."""
    rules = [_topology_rule(gen) for gen in g.GENERATIONS if gen.is_tpu]
    rules.append(_cpu_topology_rule())
    rules.append(_slices_rule())
    rules += [_chips_per_host_rule(gen) for gen in g.GENERATIONS if gen.is_tpu]
    rules.append({
        "rule": "self.generation != 'cpu' || !has(self.chipsPerHost)",
        "message": "applies to TPU generations only; remove it for cpu",
        "fieldPath": ".chipsPerHost",
        "reason": "FieldValueForbidden",
    })
    return rules


def _devices_per_slice_map() -> str:
    """CEL map 'generation/topology' -> devices of one slice, every alias and valid
    topology of every TPU generation (the trainer's world size, from the table)."""
    entries = [f"'{alias}/{topology}': {g.chips_in(topology) * gen.devices_per_chip}"
               for gen in g.GENERATIONS if gen.is_tpu
               for alias in gen.aliases for topology in gen.valid_topologies()]
    return "{" + ", ".join(entries) + "}"


def _micro_batch_cel() -> tuple[str, str]:
    """(whether the slice's devices are known, the examples or blocks of one micro-batch of
    every device) as CEL over the spec, with the schema's defaults where a field is unset."""
    from .api import Training  # api imports this module

    key = "self.tpu.generation + '/' + self.tpu.topology"
    devices_map = _devices_per_slice_map()
    is_cpu = "(self.tpu.generation == 'cpu' && self.tpu.topology.matches('^[0-9]{1,3}$'))"
    known = f"({is_cpu} || {key} in {devices_map})"
    devices = f"({is_cpu} ? int(self.tpu.topology) : {devices_map}[{key}])"
    default = Training.model_fields["batch_size_per_device"].default  # what defaulting fills in
    per_device = ("(has(self.training.batchSizePerDevice) ? "
                  f"self.training.batchSizePerDevice : {default})")
    slices = "(has(self.tpu.slices) ? self.tpu.slices : 1)"
    return known, f"({devices} * {slices} * {per_device})"


def _global_batch_rule(is_collectives: str) -> dict:
    known, micro = _micro_batch_cel()
    return {
        "rule": (f"{is_collectives} || !has(self.training) || "
                 "!has(self.training.globalBatchBlocks) || self.training.globalBatchBlocks == 0 || "
                 f"!{known} || self.training.globalBatchBlocks % {micro} == 0"),
        # No messageExpression: string(<int>) is unbounded for the CRD cost estimator.
        "message": GLOBAL_BATCH_MESSAGE,
        "fieldPath": ".training.globalBatchBlocks",
        "reason": "FieldValueInvalid",
    }


def _tokens_per_step_rule(is_collectives: str) -> dict:
    from .api import Training  # api imports this module

    known, micro = _micro_batch_cel()
    length = (f"(has(self.training.maxSeqLen) ? self.training.maxSeqLen : "
              f"{Training.model_fields['max_seq_len'].default})")
    return {
        "rule": (f"{is_collectives} || !has(self.training) || !has(self.training.tokensPerStep) || "
                 "((!has(self.training.globalBatchBlocks) || self.training.globalBatchBlocks == 0) && "
                 f"(!{known} || self.training.tokensPerStep % ({micro} * {length}) == 0))"),
        "message": TOKENS_PER_STEP_MESSAGE,
        "fieldPath": ".training.tokensPerStep",
        "reason": "FieldValueInvalid",
    }


def _shared_storage_rule(is_collectives: str) -> dict:
    path = "self.checkpoint.storagePath"
    local = f"(!{path}.matches('^[a-zA-Z][a-zA-Z0-9+.-]*://') || {path}.startsWith('file://'))"
    # The path with any file:// scheme removed, so a mountPath prefix compares.
    bare = f"({path}.startsWith('file://') ? {path}.substring(7) : {path})"
    under = (f"({bare} == m.mountPath || {bare}.startsWith(m.mountPath.endsWith('/') ? "
             "m.mountPath : m.mountPath + '/'))")
    same_source = " || ".join([
        "(has(h.persistentVolumeClaim) && has(v.persistentVolumeClaim) && "
        "h.persistentVolumeClaim.claimName == v.persistentVolumeClaim.claimName)",
        "(has(h.nfs) && has(v.nfs) && h.nfs.server == v.nfs.server && h.nfs.path == v.nfs.path)",
        # CSI: the same driver (comparing volumeAttributes, e.g. GCS FUSE's bucketName, is
        # beyond the apiserver's CEL cost budget for this rule).
        "(has(h.csi) && has(v.csi) && h.csi.driver == v.csi.driver)",
    ])
    # Matched by volume name (head and workers are distinct schema types, and one loop per
    # list keeps the rule inside the apiserver's cost budget).
    workers_mount = ("self.workers.volumeMounts.exists(w, w.name == m.name && w.mountPath == m.mountPath "
                     "&& !(has(w.readOnly) && w.readOnly) && has(w.subPath) == has(m.subPath) && "
                     "(!has(m.subPath) || w.subPath == m.subPath))")
    one_volume = ("self.head.volumes.exists(h, h.name == m.name && "
                  f"self.workers.volumes.exists(v, v.name == m.name && ({same_source})))")
    shared = ("has(self.head.volumeMounts) && has(self.head.volumes) && "
              "has(self.workers.volumeMounts) && has(self.workers.volumes) && "
              f"self.head.volumeMounts.exists(m, {under} && !(has(m.readOnly) && m.readOnly) && "
              f"{workers_mount} && {one_volume})")
    return {
        "rule": (f"{is_collectives} || !has(self.checkpoint) || "
                 f"!has(self.checkpoint.storagePath) || !{local} || ({shared})"),
        "message": SHARED_STORAGE_MESSAGE,
        "fieldPath": ".checkpoint.storagePath",
        "reason": "FieldValueInvalid",
    }


def spec_rules() -> list[dict]:
    """CEL rules on `spec` (cross-object: mode against tpu and checkpoint)."""
    is_collectives = "(has(self.mode) && self.mode == 'collectives')"
    return [
        {
            "rule": (f"{is_collectives} || (has(self.checkpoint) && "
                     "has(self.checkpoint.storagePath) && self.checkpoint.storagePath != '')"),
            "message": STORAGE_MESSAGE,
            "fieldPath": ".checkpoint.storagePath",
            "reason": "FieldValueRequired",
        },
        _shared_storage_rule(is_collectives),
        {
            # evalFraction is a number, so CEL sees a double: compare with 0.0.
            "rule": (f"{is_collectives} || !has(self.checkpoint) || "
                     "!has(self.checkpoint.scoreAttribute) || "
                     "self.checkpoint.scoreAttribute != 'eval_loss' || "
                     "!has(self.training) || !has(self.training.evalFraction) || "
                     "self.training.evalFraction > 0.0"),
            "message": EVAL_SCORE_MESSAGE,
            "fieldPath": ".checkpoint.scoreAttribute",
            "reason": "FieldValueInvalid",
        },
        *[{
            "rule": (f"{is_collectives} || !has(self.training) || !has(self.training.{name}) || "
                     "!has(self.training.evalFraction) || self.training.evalFraction > 0.0"),
            "message": EARLY_STOP_MESSAGE,
            "fieldPath": f".training.{name}",
            "reason": "FieldValueInvalid",
        } for name in EARLY_STOP_FIELDS],
        _global_batch_rule(is_collectives),
        _tokens_per_step_rule(is_collectives),
        {
            "rule": ("!has(self.noProgressTimeoutSeconds) || self.noProgressTimeoutSeconds == 0 "
                     f"|| self.noProgressTimeoutSeconds >= {MIN_NO_PROGRESS_TIMEOUT}"),
            "message": NO_PROGRESS_MESSAGE,
            "fieldPath": ".noProgressTimeoutSeconds",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"!has(self.rayVersion) || self.rayVersion.matches('{RAY_VERSION_AT_LEAST}')",
            "message": RAY_VERSION_MESSAGE,
            "fieldPath": ".rayVersion",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": "!has(self.workloadPriorityClassName) || has(self.queueName)",
            "message": PRIORITY_QUEUE_MESSAGE,
            "fieldPath": ".workloadPriorityClassName",
            "reason": "FieldValueRequired",
        },
    ]


def resources_rules() -> list[dict]:
    """CEL rules on a head/workers `resources` override."""
    return [{
        "rule": f"!has(self.{side}) || !('{g.TPU_RESOURCE}' in self.{side})",
        "message": TPU_OVERRIDE_MESSAGE,
        "fieldPath": f".{side}",
        "reason": "FieldValueForbidden",
    } for side in ("requests", "limits")]


def env_rules() -> list[dict]:
    """CEL rules on one extra environment variable of a pod group."""
    return [
        {"rule": "has(self.value) != has(self.valueFrom)", "message": ENV_VALUE_MESSAGE,
         "reason": "FieldValueInvalid"},
        {"rule": (f"!(self.name in {_cel_list(list(RESERVED_ENV))}) && "
                  f"!self.name.startsWith('{RESERVED_ENV_PREFIX}')"),
         "message": ENV_RESERVED_MESSAGE, "fieldPath": ".name",
         "reason": "FieldValueForbidden"},
    ]


def volume_rules() -> list[dict]:
    """CEL rules on one extra volume of a pod group."""
    count = " + ".join(f"(has(self.{source}) ? 1 : 0)" for source in VOLUME_SOURCES)
    return [
        {"rule": f"{count} == 1", "message": VOLUME_SOURCE_MESSAGE,
         "reason": "FieldValueInvalid"},
        {"rule": f"self.name != '{SHM_VOLUME}'", "message": SHM_VOLUME_MESSAGE,
         "fieldPath": ".name", "reason": "FieldValueForbidden"},
    ]


def volume_mount_rules() -> list[dict]:
    """CEL rules on one extra volume mount of a pod group."""
    return [{
        "rule": (f"self.mountPath != '{SHM_PATH}' && "
                 f"!self.mountPath.startsWith('{SHM_PATH}/')"),
        "message": SHM_MOUNT_MESSAGE, "fieldPath": ".mountPath",
        "reason": "FieldValueForbidden",
    }]


def pod_group_rules() -> list[dict]:
    """CEL rules across the fields of one pod group (head or workers)."""
    return [
        {"rule": ("!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) "
                  "&& self.volumes.exists(v, v.name == m.name))"),
         "message": MOUNT_VOLUME_MESSAGE, "fieldPath": ".volumeMounts",
         "reason": "FieldValueInvalid"},
        {"rule": (f"!has(self.labels) || "
                  f"self.labels.all(k, !k.startsWith('{RESERVED_LABEL_PREFIX}'))"),
         "message": LABEL_MESSAGE, "fieldPath": ".labels", "reason": "FieldValueForbidden"},
    ]


def check_spec(spec: TPUFineTuneSpec, one_machine: bool = False) -> None:
    """Raise SpecError for the first rule `spec` breaks (CEL twins first, then the rest).
    `one_machine`: every Ray process shares one filesystem (a local Ray head), so the
    shared-storage rule does not apply."""
    tpu = spec.tpu
    gen = g.generation(tpu.generation)
    problem = g.topology_error(gen, tpu.topology)
    if problem:
        raise SpecError("spec.tpu.topology", problem)
    if tpu.chips_per_host is not None:
        problem = g.chips_per_host_error(gen, tpu.topology, tpu.chips_per_host)
        if problem:
            raise SpecError("spec.tpu.chipsPerHost", problem)
    if tpu.slices > g.max_slices(gen, tpu.topology):
        raise SpecError("spec.tpu.slices", SLICES_MESSAGE)
    if spec.mode == "finetune":
        if not spec.checkpoint.storage_path:
            raise SpecError("spec.checkpoint.storagePath", STORAGE_MESSAGE)
        if not one_machine and not storage_is_shared(spec):
            raise SpecError("spec.checkpoint.storagePath", SHARED_STORAGE_MESSAGE)
        if spec.checkpoint.score_attribute == "eval_loss" and spec.training.eval_fraction == 0:
            raise SpecError("spec.checkpoint.scoreAttribute", EVAL_SCORE_MESSAGE)
        for name in EARLY_STOP_FIELDS:
            if getattr(spec.training, _snake(name)) is not None and spec.training.eval_fraction == 0:
                raise SpecError(f"spec.training.{name}", EARLY_STOP_MESSAGE)
        _check_global_batch(spec)
        _check_tokens_per_step(spec)
    if 0 < spec.no_progress_timeout_seconds < MIN_NO_PROGRESS_TIMEOUT:
        raise SpecError("spec.noProgressTimeoutSeconds", NO_PROGRESS_MESSAGE)
    if tuple(int(part) for part in spec.ray_version.split(".")) < MIN_RAY_VERSION:
        raise SpecError("spec.rayVersion", RAY_VERSION_MESSAGE)
    if spec.workload_priority_class_name and not spec.queue_name:
        raise SpecError("spec.workloadPriorityClassName", PRIORITY_QUEUE_MESSAGE)
    for group in ("head", "workers"):
        resources = getattr(spec, group).resources
        if resources is not None:
            _check_overrides(f"spec.{group}.resources", resources)
        _check_pod_group(f"spec.{group}", getattr(spec, group))
    _check_merged_resources(spec)


def storage_is_shared(spec: TPUFineTuneSpec) -> bool:
    """Whether every Ray pod sees the same checkpoint storage: a URI (gs://, s3://, ...) or a
    local path under one shared volume, of the same name, mounted writable at the same place
    on the head and the workers."""
    path = spec.checkpoint.storage_path or ""
    scheme, sep, rest = path.partition("://")
    if sep and scheme != "file" and re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*", scheme):
        return True
    bare = rest if sep and scheme == "file" else path

    def shared_mounts(group: PodGroup) -> dict[tuple[str, str, str | None], tuple]:
        sources = {v.name: _shared_source(v) for v in group.volumes or []}
        return {(m.name, m.mount_path, m.sub_path): sources.get(m.name)
                for m in group.volume_mounts or [] if not m.read_only and sources.get(m.name)}

    workers = shared_mounts(spec.workers)
    for key, source in shared_mounts(spec.head).items():
        mount_path = key[1]
        prefix = mount_path if mount_path.endswith("/") else mount_path + "/"
        if (bare == mount_path or bare.startswith(prefix)) and workers.get(key) == source:
            return True
    return False


def _shared_source(volume) -> tuple | None:
    """What makes two volumes one filesystem (the claim, the export, the CSI volume)."""
    if volume.persistent_volume_claim is not None:
        return ("pvc", volume.persistent_volume_claim.claim_name)
    if volume.nfs is not None:
        return ("nfs", volume.nfs.server, volume.nfs.path)
    if volume.csi is not None:
        return ("csi", volume.csi.driver)
    return None


def _check_global_batch(spec: TPUFineTuneSpec) -> None:
    """The trainer's batch plan: global batch = devices of every slice x batch size x
    accumulation (each slice a data-parallel replica of the others)."""
    wanted, devices, slices = spec.training.global_batch_blocks, slice_shape(spec).devices_per_slice, spec.tpu.slices
    micro = devices * slices * spec.training.batch_size_per_device
    if wanted and wanted % micro:
        per_slice = f" x {slices} slices" if slices > 1 else ""
        raise SpecError("spec.training.globalBatchBlocks",
                        f"{GLOBAL_BATCH_MESSAGE}: {wanted} is not a multiple of {devices} devices"
                        f"{per_slice} x {spec.training.batch_size_per_device} = {micro}")


def _check_tokens_per_step(spec: TPUFineTuneSpec) -> None:
    """The trainer's step of tokens: devices of every slice x blocks per device x block
    length x accumulation (--tokens-per-step)."""
    training, wanted = spec.training, spec.training.tokens_per_step
    if wanted is None:
        return
    if training.global_batch_blocks:
        raise SpecError("spec.training.tokensPerStep", f"{TOKENS_PER_STEP_MESSAGE}: globalBatchBlocks is "
                                                       f"{training.global_batch_blocks}; give one of the two")
    devices, slices = slice_shape(spec).devices_per_slice, spec.tpu.slices
    positions = devices * slices * training.batch_size_per_device * training.max_seq_len
    if wanted % positions:
        per_slice = f" x {slices} slices" if slices > 1 else ""
        raise SpecError("spec.training.tokensPerStep",
                        f"{TOKENS_PER_STEP_MESSAGE}: {wanted} is not a multiple of {devices} devices{per_slice} x "
                        f"{training.batch_size_per_device} x {training.max_seq_len} = {positions}; e.g. "
                        f"{max(positions, wanted // positions * positions)}")


def _check_unique(path: str, keys: list[str], what: str) -> None:
    """The apiserver's list-map check (x-kubernetes-list-map-keys)."""
    for index, key in enumerate(keys):
        if key in keys[:index]:
            raise SpecError(f"{path}[{index}]", f'Duplicate value: {what} "{key}"')


def _check_pod_group(path: str, group: PodGroup) -> None:
    for index, var in enumerate(group.env or ()):
        if (var.value is None) == (var.value_from is None):
            raise SpecError(f"{path}.env[{index}]", ENV_VALUE_MESSAGE)
        if var.name in RESERVED_ENV or var.name.startswith(RESERVED_ENV_PREFIX):
            raise SpecError(f"{path}.env[{index}].name", ENV_RESERVED_MESSAGE)
    _check_unique(f"{path}.env", [var.name for var in group.env or ()], "name")
    for index, volume in enumerate(group.volumes or ()):
        sources = [s for s in VOLUME_SOURCES if getattr(volume, _snake(s)) is not None]
        if len(sources) != 1:
            raise SpecError(f"{path}.volumes[{index}]", VOLUME_SOURCE_MESSAGE)
        if volume.name == SHM_VOLUME:
            raise SpecError(f"{path}.volumes[{index}].name", SHM_VOLUME_MESSAGE)
    _check_unique(f"{path}.volumes", [v.name for v in group.volumes or ()], "name")
    for index, mount in enumerate(group.volume_mounts or ()):
        if mount.mount_path == SHM_PATH or mount.mount_path.startswith(SHM_PATH + "/"):
            raise SpecError(f"{path}.volumeMounts[{index}].mountPath", SHM_MOUNT_MESSAGE)
    _check_unique(f"{path}.volumeMounts", [m.mount_path for m in group.volume_mounts or ()], "mountPath")
    names = {volume.name for volume in group.volumes or ()}
    if any(mount.name not in names for mount in group.volume_mounts or ()):
        raise SpecError(f"{path}.volumeMounts", MOUNT_VOLUME_MESSAGE)
    if any(key.startswith(RESERVED_LABEL_PREFIX) for key in group.labels or {}):
        raise SpecError(f"{path}.labels", LABEL_MESSAGE)


def _snake(camel: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)


def _check_overrides(path: str, resources: ResourceRequirements) -> None:
    side = next((side for side in ("requests", "limits") if g.TPU_RESOURCE in (getattr(resources, side) or {})), None)
    if side:
        raise SpecError(f"{path}.{side}", TPU_OVERRIDE_MESSAGE)


def _check_merged_resources(spec: TPUFineTuneSpec) -> None:
    """Python-only: pods whose request exceeds their limit, or whose memory limit cannot
    hold the /dev/shm volume, would be created and then never run."""
    for group, (requests, limits, shm) in plan_resources(spec).items():
        for key in requests.keys() & limits.keys():
            if parse_quantity(requests[key]) > parse_quantity(limits[key]):
                raise SpecError(f"spec.{group}.resources.requests.{key}",
                                f"{requests[key]} exceeds the limit {limits[key]}")
        if shm and "memory" in limits and parse_quantity(limits["memory"]) < parse_quantity(shm):
            raise SpecError(f"spec.{group}.resources.limits.memory",
                            f"{limits['memory']} cannot hold the {shm} /dev/shm volume "
                            "(memory-backed, counted against the limit)")
