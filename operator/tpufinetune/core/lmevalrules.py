"""spec.evaluation.lmEval's rules across the spec, in Python (validation.check_spec calls
`check_lm_eval`) and as their CEL twins (celrules.spec_rules takes `lm_eval_rules`), with the
same messages; and whether the export fits where it is evaluated (its CEL twin a lookup in the
table of the planner's models and generations that do not fit, unfit_pairs).

Where it is evaluated: the trainer's `lmeval` entry runs lm-eval as one Ray task holding one of
a worker's `TPU` resources (a chip; a chiplet on v7x), on one worker host, and loads the whole
export in bfloat16 onto that device as its export proof loads it (memplan's `proof` term: the
text weights and per-layer table, and an allowance). So it must fit one device's HBM less the
planner's headroom (every TPU worker pod's memory, which it passes through while loading, holds
more than a device's HBM). Only models the planner's
table knows are checked (any other is not refused, as in the memory plan), never the cpu
stand-in.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .cel import cel_string
from .errors import SpecError
from .memplan import GIB, HEADROOM, PROOF_OVERHEAD_BYTES
from .generations import GENERATIONS
from .memplan_shapes import KNOWN_MODELS, known_shape
from .sizing import slice_shape

if TYPE_CHECKING:
    from .specmodels import SpecFields

FIELD = "spec.evaluation.lmEval"
COLLECTIVES_MESSAGE = ("evaluates the fine-tune's export: mode collectives trains nothing and exports no model; "
                       "remove evaluation.lmEval or use mode finetune")
UNMERGED_MESSAGE = ("needs the merged export (status.exportedModelURI), which lm-eval loads as a model: set "
                    "training.lora.exportMerged true, or remove evaluation.lmEval")
LIMIT_MESSAGE = ("must be a fraction of each task's documents below 1 (e.g. 0.1) or a whole number of documents "
                 "(1 or more); unset evaluates every document")
TASKS_TWICE_MESSAGE = "names a task twice; name each once"


def _has_lm_eval(spec: SpecFields) -> bool:
    evaluation = getattr(spec, "evaluation", None)
    return evaluation is not None and evaluation.lm_eval is not None


def check_lm_eval(spec: SpecFields) -> None:
    """Raise SpecError for the first lmEval rule `spec` breaks (the CEL twins, then the fit)."""
    if not _has_lm_eval(spec):
        return
    lm_eval = spec.evaluation.lm_eval
    if len(set(lm_eval.tasks)) != len(lm_eval.tasks):  # the schema's list-type set
        raise SpecError(f"{FIELD}.tasks", TASKS_TWICE_MESSAGE)
    if lm_eval.limit is not None and lm_eval.limit >= 1 and lm_eval.limit != int(lm_eval.limit):
        raise SpecError(f"{FIELD}.limit", LIMIT_MESSAGE)
    if spec.mode == "collectives":
        raise SpecError(FIELD, COLLECTIVES_MESSAGE)
    lora = spec.training.lora_settings()
    if lora is not None and not lora.export_merged:
        raise SpecError(FIELD, UNMERGED_MESSAGE)
    refusal = fit_refusal(spec)
    if refusal:
        raise SpecError(FIELD, refusal)


def evaluation_bytes(model_id: str) -> int | None:
    """What loading the export for lm-eval takes, on its device and on its host: its bf16 text
    weights and per-layer table, and the export proof's allowance (None: a model the table does
    not know)."""
    shape = known_shape(model_id)
    if shape is None:
        return None
    return 2 * (shape.parameters + shape.per_layer_embedding) + PROOF_OVERHEAD_BYTES


def evaluated_model(spec: SpecFields, init_from: dict | None = None) -> str:
    """The model whose export lm-eval loads: spec.model.id; for a chained run (spec.model.initFrom)
    the source's base model once status.initFrom (`init_from`) records it, since that is what the
    run trains (its spec.model.id is then the default or that same base)."""
    recorded = (init_from or {}).get("modelId") if getattr(spec.model, "init_from", None) is not None else ""
    return recorded or spec.model.id


def fit_refusal(spec: SpecFields, init_from: dict | None = None) -> str:
    """Why the export cannot be evaluated on one device of one worker host ('' when it can, or
    is not known); `init_from`: a chained run's status.initFrom, once recorded."""
    return device_refusal(evaluated_model(spec, init_from), slice_shape(spec).generation)


def resolved_fit_refusal(spec: SpecFields, init_from: dict | None) -> str:
    """For the plan of a chained run whose source is recorded: why its export, of the source's
    base, cannot be evaluated ('' when it can, or nothing is evaluated). Admission could check
    only spec.model.id; this refuses the run before it asks for a slice, not after it trained."""
    if not lm_eval_tasks(spec) or not init_from or getattr(spec.model, "init_from", None) is None:
        return ""
    refusal = fit_refusal(spec, init_from)
    return f"{FIELD}: {refusal}" if refusal else ""


def device_refusal(model_id: str, gen) -> str:
    """fit_refusal for a model id and a TPU generation (the topology does not matter: one device)."""
    need = evaluation_bytes(model_id)
    if not gen.is_tpu or need is None:
        return ""
    what = f"{model_id} in bfloat16 needs {need / GIB:.1f} GiB"
    fix = "evaluate on a generation with more HBM per chip, or remove evaluation.lmEval"
    device_hbm = gen.hbm_gib_per_chip / gen.devices_per_chip * GIB
    usable = int(device_hbm * (1 - HEADROOM))
    if need > usable:
        device = "chip" if gen.devices_per_chip == 1 else f"chiplet (1/{gen.devices_per_chip} of a chip)"
        return (f"{what} (its weights and {PROOF_OVERHEAD_BYTES // GIB} GiB for lm-eval's forward) on the one "
                f"{gen.name} {device} lm-eval runs on, more than the {usable / GIB:.1f} GiB usable of its "
                f"{device_hbm / GIB:g} GiB of HBM ({int(HEADROOM * 100)}% headroom): {fix}")
    return ""


def unfit_pairs() -> dict[str, str]:
    """Every '<generation as written>/<known model id, lower case>' whose export cannot be evaluated,
    with its refusal: the table the CEL twin of fit_refusal looks a spec up in."""
    return {f"{alias}/{model_id}": device_refusal(model_id, gen)
            for gen in GENERATIONS for alias in gen.aliases for model_id in KNOWN_MODELS
            if device_refusal(model_id, gen)}


def lm_eval_rules() -> list[dict]:
    """The CEL twins of check_lm_eval's rules, on spec; the fit's twin looks the spec's generation and
    model up in unfit_pairs (the planner's models: model.id as the planner matches it, trimmed and
    lower case), its message the Python one with the figures."""
    lm_eval = "(has(self.evaluation) && has(self.evaluation.lmEval))"
    limit = "self.evaluation.lmEval.limit"
    merged = "self.training.lora.exportMerged"
    pair = "(self.tpu.generation + '/' + self.model.id.trim().lowerAscii())"
    unfit = unfit_pairs()
    unfit_keys = "[" + ", ".join(cel_string(key) for key in unfit) + "]"
    unfit_messages = "{" + ", ".join(f"{cel_string(key)}: {cel_string(text)}" for key, text in unfit.items()) + "}"
    return [
        # limit is a number, so CEL sees a double; its schema bound keeps int() in range.
        {"rule": f"!{lm_eval} || !has({limit}) || {limit} < 1.0 || double(int({limit})) == {limit}",
         "message": LIMIT_MESSAGE, "fieldPath": ".evaluation.lmEval.limit", "reason": "FieldValueInvalid"},
        {"rule": f"!{lm_eval} || !has(self.mode) || self.mode != 'collectives'",
         "message": COLLECTIVES_MESSAGE, "fieldPath": ".evaluation.lmEval", "reason": "FieldValueForbidden"},
        # training.lora unset is its defaults (exportMerged true); it is refused without lora or dpo.
        {"rule": (f"!{lm_eval} || !has(self.training) || !has(self.training.lora) || !has({merged}) || {merged}"),
         "message": UNMERGED_MESSAGE, "fieldPath": ".evaluation.lmEval", "reason": "FieldValueInvalid"},
        {"rule": (f"!{lm_eval} || !has(self.tpu) || !has(self.tpu.generation) || !has(self.model) "
                  f"|| !has(self.model.id) || !({pair} in {unfit_keys})"),
         "messageExpression": f"{unfit_messages}[{pair}]",
         "fieldPath": ".evaluation.lmEval", "reason": "FieldValueInvalid"},
    ]


def lm_eval_tasks(spec) -> tuple[str, ...]:
    """The tasks a spec evaluates its export on (() for none): the phase's plan of them."""
    return tuple(spec.evaluation.lm_eval.tasks) if spec.mode == "finetune" and _has_lm_eval(spec) else ()

