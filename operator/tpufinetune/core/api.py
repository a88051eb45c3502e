"""The TPUFineTune API: the models composed with their rules.

The layers below it: the models (specmodels.py, apimodels.py, notify.py's subscription:
pydantic types, the single source of the CRD schema), then what reads them (validation.py's
checks, celrules.py's CEL twins of those checks, sizing.py, memplan.py). Here the two meet:
`TPUFineTuneSpec` is the spec type that runs `validation.check_spec` on every validation,
`schema_rules` says which model's schema carries which CEL rules (`crdgen` writes both into
`crds/`), and `parse_spec` / `parse_stored_spec` turn a user's or a stored spec into a model
or a SpecError naming the field. Every name other modules import from the API is here.
"""
from __future__ import annotations

import copy
import re
import unicodedata
from typing import Callable

from pydantic import BaseModel, ValidationError, ValidationInfo, model_validator

from . import celrules, validation
from .errors import SpecError
from .names import API_VERSION, GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION  # noqa: F401  (re-exported)

from .apimodels import (  # noqa: F401  (re-exported: the API's models, one module)
    CONTROL_CHARACTERS, DNS_SUBDOMAIN, PRINTABLE, ConfigMapSource, CSISource, EmptyDirSource,
    EnvSecretSource, EnvVar, MemorySettings, NFSSource, PersistentVolumeClaimSource, PodGroup,
    Quantity, ResourceMap, ResourceRequirements, SecretKeyRef, SecretSource, Toleration, Volume,
    VolumeMount, _Model,
)
from .notify import NotifySubscription  # noqa: F401  (re-exported: spec.notify)
from .specmodels import (  # noqa: F401  (re-exported)
    DATASET_FORMATS, DEFAULT_DATASET_ID, DEFAULT_LORA_TARGET_MODULES, DPO, DPO_LOSSES, DEFAULT_MODEL_ID, DEFAULT_NO_PROGRESS_TIMEOUT,
    DEFAULT_RAY_VERSION, DEFAULT_TERMINATION_GRACE_SECONDS, INT32_MAX, LORA_MODULE_NAMES,
    LORA_TARGET_MODULES, MIN_NO_PROGRESS_TIMEOUT, SCORE_ATTRIBUTES, TRAINING_METHODS, Checkpoint,
    DatasetSource, GenerationName, LoRA, LoraModuleName, ModelSource, Preflight, ScoreAttribute,
    SpecFields, TPUSlice, Training,
)
from .validation import EMBEDDINGS_CONTRADICT, INIT_FROM_SELF_MESSAGE, mixture_of_experts_refusal  # noqa: F401  (re-exported)


class TPUFineTuneSpec(SpecFields):
    """A TPUFineTune spec: its fields (specmodels.SpecFields) and, on every validation
    (`model_validate` too), the rules across them (`validation.check_spec`)."""

    @model_validator(mode="after")
    def _cross_field_rules(self, info: ValidationInfo) -> TPUFineTuneSpec:
        validation.check_spec(self, one_machine=bool((info.context or {}).get(ONE_MACHINE)))
        return self


def schema_rules() -> dict[type[BaseModel], Callable[[], list[dict]]]:
    """Each model whose schema carries CEL rules (x-kubernetes-validations), and its rules:
    the admission-time twins of `validation.check_spec` (crdgen writes them into the CRD)."""
    return {
        TPUFineTuneSpec: celrules.spec_rules, TPUSlice: celrules.tpu_rules,
        Training: celrules.training_rules, ResourceRequirements: celrules.resources_rules,
        EnvVar: celrules.env_rules, Volume: celrules.volume_rules,
        VolumeMount: celrules.volume_mount_rules, PodGroup: celrules.pod_group_rules,
    }


# Validation context: every Ray process of the run shares one machine's filesystem (a local
# Ray head, `tpufinetune run --local`), so a local checkpoint path needs no shared volume.
ONE_MACHINE = "one_machine"


def parse_spec(spec: dict, one_machine: bool = False) -> TPUFineTuneSpec:
    """Validate a TPUFineTune `spec` as admission does (an unknown field is refused);
    SpecError if invalid. The CLI and `run --local` check what a user wrote with it."""
    return _parse(spec, ignore_unknown=False, one_machine=one_machine)[0]


def parse_stored_spec(spec: dict, one_machine: bool = False) -> tuple[TPUFineTuneSpec, tuple[str, ...]]:
    """A spec as the API server stored it, the operator's view: (the model, the paths of
    the fields this version does not know, which were ignored). Everything else is
    validated as `parse_spec` does; SpecError if invalid.

    Admission refuses unknown fields, so the operator meets one only when the installed
    CRD is newer than the operator (an operator rollback, or the CRDs upgraded first):
    the run then proceeds with what this version understands, and says which fields it
    ignored, rather than failing a valid object. The models stay `extra="forbid"`: they
    are the CRD's source, and the CRD keeps refusing unknown fields."""
    return _parse(spec, ignore_unknown=True, one_machine=one_machine)


def _parse(spec: dict, ignore_unknown: bool, one_machine: bool = False) -> tuple[TPUFineTuneSpec, tuple[str, ...]]:
    if not isinstance(spec, dict):
        raise SpecError("spec", "must be a mapping")
    ignored: list[str] = []
    known = spec
    while True:
        try:
            return (TPUFineTuneSpec.model_validate(known, context={ONE_MACHINE: one_machine}),
                    tuple(sorted(ignored)))
        except ValidationError as exc:
            unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
            if not ignore_unknown or not unknown:
                raise _spec_error(exc) from None
            if known is spec:
                known = copy.deepcopy(spec)
            for loc in unknown:
                _drop(known, loc)
                ignored.append(_field_path(loc))


def _drop(spec: dict, loc: tuple) -> None:
    """Remove the value at pydantic's location `loc` (keys and list indexes) from `spec`."""
    parent = spec
    for part in loc[:-1]:
        parent = parent[part]
    del parent[loc[-1]]


def _spec_error(exc: ValidationError) -> SpecError:
    first = exc.errors()[0]
    inner = (first.get("ctx") or {}).get("error")
    if isinstance(inner, SpecError):
        return inner
    path = _field_path(first["loc"])
    kind, given = first["type"], first.get("input")
    if kind == "missing":
        return SpecError(path, "is required")
    if kind == "extra_forbidden":
        return SpecError(path, "unknown field")
    if kind == "literal_error":
        return SpecError(path, f'"{given}" is not valid; expected {first["ctx"]["expected"]}')
    if kind == "string_pattern_mismatch" and CONTROL_CHARACTERS in first["ctx"]["pattern"] and _has_control(given):
        return SpecError(path, f"{CONTROL_MESSAGE}; got {given!r}")
    message = re.sub(r"^(Input|String|Dictionary|List) should", "must",
                     first["msg"].removeprefix("Value error, "))
    if given is not None and kind != "value_error" and not isinstance(given, (dict, list)):
        message += f" (got {given!r})"
    return SpecError(path, message)


CONTROL_MESSAGE = "must hold no control character (a line break, tab, ...): remove it"


def _has_control(text: object) -> bool:
    """Whether `text` holds a character of apimodels.CONTROL_CHARACTERS (Unicode's Cc, and
    the line and paragraph separators)."""
    return isinstance(text, str) and any(unicodedata.category(c) == "Cc" or c in "\u2028\u2029" for c in text)


def _field_path(loc: tuple) -> str:
    """pydantic's location as kubectl prints it: spec.workers.env[0].name."""
    path = "spec"
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path

