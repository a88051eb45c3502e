"""spec.evaluation.lmEval's rules across the spec, in Python (validation.check_spec calls
`check_lm_eval`) and as their CEL twins (celrules.spec_rules takes `lm_eval_rules`), with the
same messages; and the one check CEL cannot make, whether the export fits the evaluating host.

The evaluating host: the trainer's `lmeval` entry loads the export in bfloat16 into one worker
host's memory, as its export proof does (memplan's `proof` term), so what must fit is the
model's bf16 weights and the proof's allowance within that worker pod's memory less the
planner's headroom. Only models the planner's table knows are checked (any other is not
refused, as in the memory plan), and never the cpu stand-in.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import SpecError
from .memplan import GIB, HEADROOM, PROOF_OVERHEAD_BYTES
from .memplan_shapes import known_shape
from .quantity import parse_quantity
from .sizing import plan_resources, slice_shape

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
    refusal = host_fit_refusal(spec)
    if refusal:
        raise SpecError(FIELD, refusal)


def evaluation_host_bytes(model_id: str) -> int | None:
    """What loading the export for lm-eval takes on the evaluating host: its bf16 text weights
    and per-layer table, and the export proof's allowance (None: a model the table does not know)."""
    shape = known_shape(model_id)
    if shape is None:
        return None
    return 2 * (shape.parameters + shape.per_layer_embedding) + PROOF_OVERHEAD_BYTES


def host_fit_refusal(spec: SpecFields) -> str:
    """Why the export cannot be evaluated on one worker host ('' when it can, or is not known)."""
    if not slice_shape(spec).generation.is_tpu:
        return ""
    need = evaluation_host_bytes(spec.model.id)
    memory = plan_resources(spec)["workers"][1].get("memory")
    if need is None or not memory:
        return ""
    usable = int(int(parse_quantity(str(memory))) * (1 - HEADROOM))
    if need <= usable:
        return ""
    machine = slice_shape(spec).machine.machine_type
    return (f"{spec.model.id} in bfloat16 needs {need / GIB:.1f} GiB on the evaluating worker host (its weights "
            f"and {PROOF_OVERHEAD_BYTES // GIB} GiB for the loader), more than the {usable / GIB:.1f} GiB usable of "
            f"a {machine} worker pod ({memory} memory limit, {int(HEADROOM * 100)}% headroom): use a machine "
            f"with more memory per host (tpu.chipsPerHost, a larger topology, workers.resources.limits.memory) "
            f"or remove evaluation.lmEval")


def lm_eval_rules() -> list[dict]:
    """The CEL twins of check_lm_eval's rules, on spec (the fit is Python-only: the planner's table
    and merged quantities)."""
    lm_eval = "(has(self.evaluation) && has(self.evaluation.lmEval))"
    limit = "self.evaluation.lmEval.limit"
    merged = "self.training.lora.exportMerged"
    return [
        # limit is a number, so CEL sees a double; its schema bound keeps int() in range.
        {"rule": f"!{lm_eval} || !has({limit}) || {limit} < 1.0 || double(int({limit})) == {limit}",
         "message": LIMIT_MESSAGE, "fieldPath": ".evaluation.lmEval.limit", "reason": "FieldValueInvalid"},
        {"rule": f"!{lm_eval} || !has(self.mode) || self.mode != 'collectives'",
         "message": COLLECTIVES_MESSAGE, "fieldPath": ".evaluation.lmEval", "reason": "FieldValueForbidden"},
        # training.lora unset is its defaults (exportMerged true); it is refused without lora or dpo.
        {"rule": (f"!{lm_eval} || !has(self.training) || !has(self.training.lora) || !has({merged}) || {merged}"),
         "message": UNMERGED_MESSAGE, "fieldPath": ".evaluation.lmEval", "reason": "FieldValueInvalid"},
    ]


def lm_eval_tasks(spec) -> tuple[str, ...]:
    """The tasks a spec evaluates its export on (() for none): the phase's plan of them."""
    return tuple(spec.evaluation.lm_eval.tasks) if spec.mode == "finetune" and _has_lm_eval(spec) else ()

