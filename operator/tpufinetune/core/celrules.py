"""The CEL rules of the CRD: the admission-time twins of validation.check_spec.

Each rule here has a Python twin in `validation.check_spec` with the same condition and the
same message text (the CEL `messageExpression` rebuilds the Python f-string), so a spec is
refused with the same words by `kubectl apply` and by `tpufinetune render`. The rules read
the models (their defaults) and the generations table; api.schema_rules says which model's
schema carries which rules, and crdgen writes them into `crds/`.
"""
from __future__ import annotations

from . import generations as g
from .cel import cel_string
from .lmevalrules import lm_eval_rules
from .memplan_media import known_tokens_per_image
from .specmodels import DEFAULT_MODEL_ID, Training
from .towersspec import TOWER_LORA_TARGETS, Towers
from .validation import (
    DPO_FORMAT_MESSAGE, DPO_LOSS_ON_MESSAGE, DPO_METHOD_MESSAGE, DPO_TOKENS_MESSAGE, EARLY_STOP_FIELDS, EARLY_STOP_MESSAGE, EMBEDDINGS_CONTRADICT, ENV_RESERVED_MESSAGE, ENV_VALUE_MESSAGE, EVAL_SCORE_MESSAGE, GENERATE_EVAL_MESSAGE, GENERATE_METHOD_MESSAGE, GLOBAL_BATCH_MESSAGE, INIT_FROM_MODE_MESSAGE, INIT_FROM_SELF_MESSAGE, KEEP_BEST_METRIC_MESSAGE, KEEP_BEST_SCORE_MESSAGE, MEDIA_TOKENS_MESSAGE, TOWERS_AUDIO_MESSAGE, TOWERS_EXPORT_MESSAGE, TOWERS_MODE_MESSAGE, TOWERS_TRAINED_MESSAGE, TOWERS_WITH_MESSAGE, IPO_SMOOTHING_MESSAGE, LABEL_MESSAGE, LABEL_SMOOTHING_MESSAGE, LORA_METHOD_MESSAGE, MIN_NO_PROGRESS_TIMEOUT, MOUNT_VOLUME_MESSAGE, NO_PROGRESS_MESSAGE, PRIORITY_QUEUE_MESSAGE, RAY_VERSION_AT_LEAST, RAY_VERSION_MESSAGE, RESERVED_ENV, RESERVED_ENV_PREFIX, RESERVED_LABEL_PREFIX, SHARED_STORAGE_MESSAGE, SHM_MOUNT_MESSAGE, SHM_PATH, SHM_VOLUME, SHM_VOLUME_MESSAGE, SLICES_MESSAGE, STORAGE_MESSAGE, TOKENS_PER_STEP_MESSAGE, TPU_OVERRIDE_MESSAGE, VOLUME_SOURCES, VOLUME_SOURCE_MESSAGE,
)


def _cel_list(values: list[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


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
        {
            "rule": ("!has(self.training) || !has(self.training.evaluation) || "
                     "!has(self.training.evaluation.keepBestBy) || self.training.evaluation.keepBestBy == 'evalLoss' || "
                     "!has(self.checkpoint) || !has(self.checkpoint.scoreAttribute) || "
                     "self.checkpoint.scoreAttribute == 'auto'"),
            "message": KEEP_BEST_SCORE_MESSAGE,
            "fieldPath": ".training.evaluation.keepBestBy",
            "reason": "FieldValueInvalid",
        },
        _global_batch_rule(is_collectives),
        _tokens_per_step_rule(is_collectives),
        *lm_eval_rules(),
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
            "rule": f"!{is_collectives} || !has(self.model) || !has(self.model.initFrom)",
            "message": INIT_FROM_MODE_MESSAGE,
            "fieldPath": ".model.initFrom",
            "reason": "FieldValueForbidden",
        },
        *towers_spec_rules(is_collectives),
        {
            "rule": "!has(self.workloadPriorityClassName) || has(self.queueName)",
            "message": PRIORITY_QUEUE_MESSAGE,
            "fieldPath": ".workloadPriorityClassName",
            "reason": "FieldValueRequired",
        },
    ]


def towers_spec_rules(is_collectives: str) -> list[dict]:
    """CEL rules of spec.training.towers against the mode, the model and the block length
    (validation._check_towers): the images of an example within maxSeqLen for the ids the
    planner's table knows (lower-cased and trimmed, as memplan_shapes.known_shape compares)."""
    towers = "has(self.training) && has(self.training.towers)"
    model_id = (f"(has(self.model) && has(self.model.id) ? self.model.id : {cel_string(DEFAULT_MODEL_ID)})"
                ".trim().lowerAscii()")
    tokens = "{" + ", ".join(f"{cel_string(k)}: {v}" for k, v in sorted(known_tokens_per_image().items())) + "}"
    images = (f"(has(self.training.towers.maxImagesPerExample) ? self.training.towers.maxImagesPerExample : "
              f"{Towers.model_fields['max_images_per_example'].default})")
    length = f"(has(self.training.maxSeqLen) ? self.training.maxSeqLen : {Training.model_fields['max_seq_len'].default})"
    return [
        {"rule": f"!{is_collectives} || !({towers})",
         "message": TOWERS_MODE_MESSAGE, "fieldPath": ".training.towers", "reason": "FieldValueForbidden"},
        {"rule": f"!({towers}) || !({model_id} in {tokens}) || {images} * {tokens}[{model_id}] <= {length}",
         "message": MEDIA_TOKENS_MESSAGE, "fieldPath": ".training.towers.maxImagesPerExample",
         "reason": "FieldValueInvalid"},
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


def training_rules() -> list[dict]:
    """CEL rules on spec.training (LoRA's and DPO's settings against the method)."""
    dpo = "(has(self.method) && self.method == 'dpo')"
    return [{"rule": "(has(self.method) && (self.method == 'lora' || self.method == 'dpo')) || !has(self.lora)",
             "message": LORA_METHOD_MESSAGE, "fieldPath": ".lora", "reason": "FieldValueForbidden"},
            {"rule": f"{dpo} || !has(self.dpo)",
             "message": DPO_METHOD_MESSAGE, "fieldPath": ".dpo", "reason": "FieldValueForbidden"},
            # labelSmoothing is a number, so CEL sees a double: compare with 0.0.
            {"rule": ("!has(self.dpo) || !has(self.dpo.loss) || self.dpo.loss != 'ipo' || "
                      "!has(self.dpo.labelSmoothing) || self.dpo.labelSmoothing == 0.0"),
             "message": IPO_SMOOTHING_MESSAGE, "fieldPath": ".dpo.labelSmoothing", "reason": "FieldValueInvalid"},
            {"rule": "!has(self.dpo) || !has(self.dpo.labelSmoothing) || self.dpo.labelSmoothing < 0.5",
             "message": LABEL_SMOOTHING_MESSAGE, "fieldPath": ".dpo.labelSmoothing", "reason": "FieldValueInvalid"},
            {"rule": f"!({dpo} && has(self.lossOn) && self.lossOn == 'all')",
             "message": DPO_LOSS_ON_MESSAGE, "fieldPath": ".lossOn", "reason": "FieldValueInvalid"},
            {"rule": f"!({dpo} && has(self.tokensPerStep))",
             "message": DPO_TOKENS_MESSAGE, "fieldPath": ".tokensPerStep", "reason": "FieldValueForbidden"},
            {"rule": ("!has(self.datasetFormat) || (" + dpo + " ? self.datasetFormat in ['auto', 'preference'] : "
                      "self.datasetFormat != 'preference')"),
             "message": DPO_FORMAT_MESSAGE, "fieldPath": ".datasetFormat", "reason": "FieldValueInvalid"},
            *evaluation_rules(dpo),
            {"rule": "!has(self.towers) || !has(self.towers.audio)",
             "message": TOWERS_AUDIO_MESSAGE, "fieldPath": ".towers.audio", "reason": "FieldValueForbidden"},
            {"rule": (f"!has(self.towers) || !({dpo} || has(self.tokensPerStep) || "
                      "(has(self.lossOn) && self.lossOn == 'all'))"),
             "message": TOWERS_WITH_MESSAGE, "fieldPath": ".towers", "reason": "FieldValueForbidden"},
            {"rule": ("!has(self.towers) || !has(self.towers.vision) || self.towers.vision != 'trained' || "
                      "!has(self.method) || self.method != 'lora' || !has(self.lora) || "
                      "!has(self.lora.targetModules) || self.lora.targetModules.exists(m, m in "
                      + _cel_list(list(TOWER_LORA_TARGETS)) + ")"),
             "message": TOWERS_TRAINED_MESSAGE, "fieldPath": ".lora.targetModules", "reason": "FieldValueInvalid"},
            {"rule": "!has(self.towers) || !has(self.lora) || !has(self.lora.exportMerged) || self.lora.exportMerged",
             "message": TOWERS_EXPORT_MESSAGE, "fieldPath": ".lora.exportMerged", "reason": "FieldValueForbidden"},
            {"rule": "!(has(self.lora) && has(self.lora.trainEmbeddings) && self.lora.trainEmbeddings"
                     " && has(self.freezeEmbeddings) && self.freezeEmbeddings)",
             "message": EMBEDDINGS_CONTRADICT, "fieldPath": ".lora.trainEmbeddings",
             "reason": "FieldValueInvalid"}]


def evaluation_rules(dpo: str) -> list[dict]:
    """CEL rules of spec.training.evaluation against the rest of spec.training."""
    generate = "(has(self.evaluation) && has(self.evaluation.generate))"
    keep = "self.evaluation.keepBestBy"
    return [
        # evalFraction is a number, so CEL sees a double: compare with 0.0.
        {"rule": f"!{generate} || !has(self.evalFraction) || self.evalFraction > 0.0",
         "message": GENERATE_EVAL_MESSAGE, "fieldPath": ".evaluation.generate", "reason": "FieldValueInvalid"},
        {"rule": f"!({generate} && ({dpo} || (has(self.lossOn) && self.lossOn == 'all')))",
         "message": GENERATE_METHOD_MESSAGE, "fieldPath": ".evaluation.generate", "reason": "FieldValueForbidden"},
        # generate.metrics unset is all of them (its default).
        {"rule": (f"!has(self.evaluation) || !has({keep}) || {keep} == 'evalLoss' || ({generate} && "
                  f"(!has(self.evaluation.generate.metrics) || {keep} in self.evaluation.generate.metrics))"),
         "message": KEEP_BEST_METRIC_MESSAGE, "fieldPath": ".evaluation.keepBestBy", "reason": "FieldValueInvalid"},
    ]


def object_rules() -> list[dict]:
    """CEL rules on the whole object: only there can a rule read metadata.name (pydantic never
    sees it; the operator refuses the same at the run's first step)."""
    return [{"rule": ("!has(self.spec.model) || !has(self.spec.model.initFrom) || "
                      "self.spec.model.initFrom.run != self.metadata.name"),
             "message": INIT_FROM_SELF_MESSAGE, "fieldPath": ".spec.model.initFrom.run",
             "reason": "FieldValueInvalid"}]
