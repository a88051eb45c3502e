"""The rules across a spec's fields, in Python, for the operator and `tpufinetune render`,
and their messages.

Written twice from one set of messages: as CEL for admission (celrules.py) and here, in
`check_spec`, with the same condition and the same message text (the CEL
`messageExpression` rebuilds the Python f-string), so a spec is refused with the same
words by `kubectl apply` and by `tpufinetune render`. Checks CEL cannot express (quantity
arithmetic across merged defaults, the memory planner's table of models) exist only in
Python and run in the operator before anything is created. The rules read the models
(specmodels.py, apimodels.py), never define them.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from . import generations as g
from .errors import SpecError
from .memplan import KNOWN_MODELS, known_shape
from .memplan_media import tokens_per_image
from .towersspec import TOWER_LORA_TARGETS
from .quantity import parse_quantity
from .sizing import SLICE_INDEX_ENV, plan_resources, slice_shape
from .lmevalrules import check_lm_eval
from .specmodels import MIN_NO_PROGRESS_TIMEOUT

if TYPE_CHECKING:
    from .apimodels import PodGroup, ResourceRequirements
    from .specmodels import SpecFields

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

# The pod settings users may add to the Ray pods (apimodels.PodGroup) never replace what the
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
LORA_METHOD_MESSAGE = "applies to method lora or dpo only; set method: lora (or dpo), or remove lora"
LABEL_SMOOTHING_MESSAGE = "must be less than 0.5: it is the probability that a pair's preference is flipped"
DPO_METHOD_MESSAGE = "applies to method dpo only; set method: dpo, or remove dpo"
IPO_SMOOTHING_MESSAGE = ("applies to loss sigmoid only (conservative DPO); IPO has no label smoothing: "
                         "set it to 0 or use loss: sigmoid")
DPO_LOSS_ON_MESSAGE = ("does not apply to method dpo: its loss is on the responses of each pair; "
                       "remove lossOn (or set responses)")
DPO_TOKENS_MESSAGE = ("does not apply to method dpo: a step is a batch of pairs (batchSizePerDevice, "
                      "globalBatchBlocks); remove tokensPerStep")
DPO_FORMAT_MESSAGE = ("must be auto or preference with method dpo, and preference only with method dpo: "
                      "DPO trains on preference pairs (chosen and rejected), the other methods on "
                      "supervised rows")
EMBEDDINGS_CONTRADICT = "contradicts freezeEmbeddings: true; drop one of them"
GENERATE_EVAL_MESSAGE = ("needs training.evalFraction greater than 0: it answers held-out prompts, and with "
                         "none held out there are none; set training.evalFraction (e.g. 0.05) or remove generate")
GENERATE_METHOD_MESSAGE = ("needs held-out responses to score against: not with method dpo (pairs) or lossOn "
                           "all (no prompt and response told apart); remove generate")
KEEP_BEST_METRIC_MESSAGE = ("must be evalLoss or one of generate.metrics (the figures each epoch has); add it "
                            "to training.evaluation.generate.metrics or keep the best by evalLoss")
METRICS_TWICE_MESSAGE = "names a metric twice; name each once"
INIT_FROM_MODE_MESSAGE = "applies to mode finetune only: a collectives check trains no model; remove initFrom"
INIT_FROM_SELF_MESSAGE = "names this TPUFineTune itself: name the run this one starts from (e.g. its SFT run)"
TOWERS_AUDIO_MESSAGE = "audio fine-tuning is not built yet; remove spec.training.towers.audio"
TOWERS_MODE_MESSAGE = "applies to mode finetune only: a collectives check trains no model; remove towers"
MEDIA_TOKENS_MESSAGE = ("is more images than a block holds: each takes its processor's tokens (Gemma 4: 280 soft "
                        "tokens and a begin and an end token, 282 an image), and maxImagesPerExample of them exceed "
                        "training.maxSeqLen; lower maxImagesPerExample or raise maxSeqLen")
TOWERS_WITH_MESSAGE = ("does not apply yet with method dpo, tokensPerStep or lossOn all (the trainer's multimodal "
                       "path has none of them); remove towers or those settings")
TOWERS_TRAINED_MESSAGE = ("names none of the vision tower's projections: with towers.vision trained, LoRA puts "
                          "adapters on those of them named here; add some of " + ", ".join(TOWER_LORA_TARGETS)
                          + ", or set towers.vision frozen")
TOWERS_EXPORT_MESSAGE = ("must stay true with training.towers: the adapter alone would lack the trained vision "
                         "projector; remove exportMerged: false")
KEEP_BEST_SCORE_MESSAGE = ("ranks checkpoints by a generation metric itself: checkpoint.scoreAttribute must be "
                           "auto; set it to auto or keep the best by evalLoss")


def check_spec(spec: SpecFields, one_machine: bool = False) -> None:
    """Raise SpecError for the first rule `spec` breaks (CEL twins first, then the rest).
    `one_machine`: every Ray process shares one filesystem (a local Ray head), so the
    shared-storage rule does not apply."""
    refusal = mixture_of_experts_refusal(spec.model.id)
    if refusal:
        raise SpecError("spec.model.id", refusal)
    if spec.model.init_from is not None and spec.mode == "collectives":
        raise SpecError("spec.model.initFrom", INIT_FROM_MODE_MESSAGE)
    _check_towers(spec)
    training = spec.training
    if training.lora is not None and training.method not in ("lora", "dpo"):
        raise SpecError("spec.training.lora", LORA_METHOD_MESSAGE)
    _check_dpo(training)
    _check_evaluation(spec)
    if training.lora is not None and training.lora.train_embeddings and training.freeze_embeddings:
        raise SpecError("spec.training.lora.trainEmbeddings", EMBEDDINGS_CONTRADICT)
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
    check_lm_eval(spec)  # its fit reads the merged worker memory


def _check_dpo(training) -> None:
    """Method dpo's settings against the rest of spec.training (the trainer's check_dpo)."""
    dpo = training.method == "dpo"
    if training.dpo is not None and not dpo:
        raise SpecError("spec.training.dpo", DPO_METHOD_MESSAGE)
    if training.dpo is not None and training.dpo.loss == "ipo" and training.dpo.label_smoothing:
        raise SpecError("spec.training.dpo.labelSmoothing", IPO_SMOOTHING_MESSAGE)
    if dpo and training.loss_on == "all":
        raise SpecError("spec.training.lossOn", DPO_LOSS_ON_MESSAGE)
    if dpo and training.tokens_per_step is not None:
        raise SpecError("spec.training.tokensPerStep", DPO_TOKENS_MESSAGE)
    fmt = training.dataset_format
    if (dpo and fmt not in ("auto", "preference")) or (not dpo and fmt == "preference"):
        raise SpecError("spec.training.datasetFormat", DPO_FORMAT_MESSAGE)


def _check_evaluation(spec: SpecFields) -> None:
    """training.evaluation against the rest of the spec (the trainer's check_generation)."""
    training, evaluation = spec.training, spec.training.evaluation
    if evaluation is None:
        return
    generate = evaluation.generate
    if generate is not None and len(set(generate.metrics)) != len(generate.metrics):  # the schema's list-type set
        raise SpecError("spec.training.evaluation.generate.metrics", METRICS_TWICE_MESSAGE)
    if generate is not None and training.eval_fraction == 0:
        raise SpecError("spec.training.evaluation.generate", GENERATE_EVAL_MESSAGE)
    if generate is not None and (training.method == "dpo" or training.loss_on == "all"):
        raise SpecError("spec.training.evaluation.generate", GENERATE_METHOD_MESSAGE)
    if evaluation.keep_best_by != "evalLoss":
        if generate is None or evaluation.keep_best_by not in generate.metrics:
            raise SpecError("spec.training.evaluation.keepBestBy", KEEP_BEST_METRIC_MESSAGE)
        if spec.checkpoint.score_attribute != "auto":
            raise SpecError("spec.training.evaluation.keepBestBy", KEEP_BEST_SCORE_MESSAGE)


def _check_towers(spec: SpecFields) -> None:
    """spec.training.towers against the rest of the spec (what the trainer's multimodal path
    would refuse at its start): no audio yet, no collectives check, and the images an example
    may hold within a block, for a model whose processor the planner's table knows."""
    towers = spec.training.towers
    if towers is None:
        return
    if towers.audio is not None:
        raise SpecError("spec.training.towers.audio", TOWERS_AUDIO_MESSAGE)
    if spec.mode == "collectives":
        raise SpecError("spec.training.towers", TOWERS_MODE_MESSAGE)
    training = spec.training
    if training.method == "dpo" or training.tokens_per_step is not None or training.loss_on == "all":
        raise SpecError("spec.training.towers", TOWERS_WITH_MESSAGE)
    if (towers.vision == "trained" and training.method == "lora" and training.lora is not None
            and not set(training.lora.target_modules) & set(TOWER_LORA_TARGETS)):
        raise SpecError("spec.training.lora.targetModules", TOWERS_TRAINED_MESSAGE)
    if training.lora is not None and not training.lora.export_merged:
        raise SpecError("spec.training.lora.exportMerged", TOWERS_EXPORT_MESSAGE)
    per_image = tokens_per_image(spec.model.id)
    wanted = towers.max_images_per_example * (per_image or 0)
    if per_image is not None and wanted > spec.training.max_seq_len:
        raise SpecError("spec.training.towers.maxImagesPerExample",
                        f"{MEDIA_TOKENS_MESSAGE}: {towers.max_images_per_example} x {per_image} = {wanted} tokens, "
                        f"more than maxSeqLen {spec.training.max_seq_len}")


def mixture_of_experts_refusal(model_id: str) -> str:
    """Why a model the planner's table knows as mixture-of-experts is refused; '' otherwise.
    The trainer runs experts as the transformers implementation does, one expert after
    another, which wastes most of a TPU; until a grouped-experts path exists a MoE run is
    refused by name rather than run badly. (The trainer refuses one it reads the config of.)"""
    shape = known_shape(model_id)
    if shape is None or not shape.experts:
        return ""
    dense = sorted({s.name for s in KNOWN_MODELS.values() if not s.experts})
    return (f'"{model_id}" is a mixture-of-experts model ({shape.experts} experts), which the trainer '
            f"cannot run well yet (no grouped-experts path): use a dense Gemma 4 model instead, e.g. "
            + ", ".join(f"google/{name}-it" for name in dense))


def storage_is_shared(spec: SpecFields) -> bool:
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


def _check_global_batch(spec: SpecFields) -> None:
    """The trainer's batch plan: global batch = devices of every slice x batch size x
    accumulation (each slice a data-parallel replica of the others)."""
    wanted, devices, slices = spec.training.global_batch_blocks, slice_shape(spec).devices_per_slice, spec.tpu.slices
    micro = devices * slices * spec.training.batch_size_per_device
    if wanted and wanted % micro:
        per_slice = f" x {slices} slices" if slices > 1 else ""
        raise SpecError("spec.training.globalBatchBlocks",
                        f"{GLOBAL_BATCH_MESSAGE}: {wanted} is not a multiple of {devices} devices"
                        f"{per_slice} x {spec.training.batch_size_per_device} = {micro}")


def _check_tokens_per_step(spec: SpecFields) -> None:
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


def _check_merged_resources(spec: SpecFields) -> None:
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
