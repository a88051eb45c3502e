"""spec.model.initFrom, a chained run (an SFT run, then a DPO run from its result): what the run
asks of its source, the source as the operator reads it, what the run waits for, what it records
once the source has Succeeded (status.initFrom), and the model every attempt then trains from and
plans for. Pure: no I/O (the driver reads the source; phaseinit.py is the phase's step).
"""
from __future__ import annotations

from dataclasses import dataclass

from .memplan import Request
from .memplan_spec import request_of as memory_request_of
from .specmodels import DEFAULT_MODEL_ID


@dataclass(frozen=True)
class InitRequest:
    """What a run's spec asks of its source (spec.model.initFrom)."""

    run: str
    artifact: str = "export"
    # spec.model.id when set away from its default: the source's base must then be this one.
    # The schema fills the default into every object, so the default itself means "unset".
    model_id: str = ""


def request_of(spec) -> InitRequest | None:
    init = getattr(spec.model, "init_from", None)
    if init is None:
        return None
    given = spec.model.id if spec.model.id != DEFAULT_MODEL_ID else ""
    return InitRequest(run=init.run, artifact=init.artifact, model_id=given)


@dataclass(frozen=True)
class SourceView:
    """The source TPUFineTune as the API server holds it now."""

    exists: bool
    uid: str = ""
    phase: str = ""
    deleting: bool = False
    message: str = ""
    reason: str = ""  # its Failed condition's reason
    epoch: int = 0  # epochs done
    epochs: int = 0
    progress: str = ""  # status.progress.summary, e.g. "37% 120/320 ETA 12m"
    base_model: str = ""  # the base model its weights build on (a chained source's own base)
    exported_model_uri: str = ""
    checkpoint_uri: str = ""  # its best checkpoint once it has Succeeded
    adapter_only: bool = False  # LoRA with exportMerged false: its export is the adapter alone
    chained_from: str = ""  # its own status.initFrom.uri: the weights it trained from, not a base


def source_view(body: dict | None) -> SourceView:
    """The source's object (None: there is none) as this run reads it."""
    if not body:
        return SourceView(exists=False)
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    model, training = spec.get("model") or {}, spec.get("training") or {}
    lora = training.get("lora")
    uses_lora = training.get("method") == "lora" or (training.get("method") == "dpo" and lora is not None)
    chained = status.get("initFrom") or {}
    failed = next((c for c in status.get("conditions") or [] if c.get("type") == "Failed"), {})
    return SourceView(
        exists=True, uid=str(meta.get("uid") or ""), phase=str(status.get("phase") or ""),
        deleting=bool(meta.get("deletionTimestamp")), message=str(status.get("message") or ""),
        reason=str(failed.get("reason") or ""), epoch=int(status.get("epoch") or 0),
        epochs=int(status.get("epochs") or (training.get("epochs") or 0)),
        progress=str((status.get("progress") or {}).get("summary") or ""),
        base_model=str(chained.get("modelId") or model.get("id") or DEFAULT_MODEL_ID),
        exported_model_uri=str(status.get("exportedModelURI") or ""),
        checkpoint_uri=str(status.get("checkpointURI") or ""),
        adapter_only=uses_lora and (lora or {}).get("exportMerged") is False,
        chained_from=str(chained.get("uri") or ""))


@dataclass(frozen=True)
class Outcome:
    """What the run does with its source now: wait (reason, message), fail (reason, message)
    or record (`recorded`: status.initFrom)."""

    reason: str
    message: str
    failed: bool = False
    recorded: dict | None = None


def outcome(namespace: str, request: InitRequest, view: SourceView | None) -> Outcome:
    run = request.run
    waiting = f"waiting for TPUFineTune {run} to succeed"
    if view is None:  # not read this step (the operator could not read it)
        return Outcome("SourceUnknown", f"{waiting}: it could not be read yet")
    if not view.exists:
        return Outcome("SourceMissing", f"no TPUFineTune {run} in namespace {namespace} yet; "
                                        "waiting for it to be applied and to succeed")
    if view.deleting:
        return Outcome("SourceDeleting", f"{waiting}: it is being deleted; waiting for a new one")
    if view.phase == "Failed":
        why = f" ({view.reason}: {view.message})" if view.reason else (f" ({view.message})" if view.message else "")
        return Outcome("InitFromFailed", f"TPUFineTune {run} failed{why}, so this run has nothing to start from: "
                                         f"fix {run} and run it again (delete and apply it), then apply this "
                                         "TPUFineTune again", failed=True)
    if view.phase != "Succeeded":
        return Outcome(f"Source{view.phase or 'NotStarted'}", f"{waiting}: {_doing(view)}")
    return _resolved(request, view)


def _doing(view: SourceView) -> str:
    if not view.phase:
        return "it has not started yet"
    if view.phase == "Running" and view.epochs:
        epoch = min(view.epoch + 1, view.epochs)
        return f"it is Running, epoch {epoch} of {view.epochs}" + (f" ({view.progress})" if view.progress else "")
    return f"it is {view.phase}" + (f" ({view.message})" if view.message else "")


def _resolved(request: InitRequest, view: SourceView) -> Outcome:
    run = request.run
    if request.artifact == "checkpoint":
        uri, what = view.checkpoint_uri, "no checkpoint (status.checkpointURI)"
        if uri and view.chained_from:
            return Outcome("InitFromUnavailable", f"TPUFineTune {run} trained from {view.chained_from} (its own "
                                                  "initFrom), so its checkpoint does not build on a base model: "
                                                  "set spec.model.initFrom.artifact to export", failed=True)
    else:
        uri, what = view.exported_model_uri, "no exported model (status.exportedModelURI)"
        if not uri and view.adapter_only:
            what += (", only its LoRA adapter (its spec.training.lora.exportMerged is false); run it again with "
                     "exportMerged true, or set spec.model.initFrom.artifact to checkpoint")
    if not uri:
        return Outcome("InitFromUnavailable", f"TPUFineTune {run} succeeded with {what}: this run has nothing "
                                              "to start from", failed=True)
    if request.model_id and request.model_id != view.base_model:
        return Outcome("InitFromMismatch", f"spec.model.id is {request.model_id} but TPUFineTune {run} trained "
                                           f"{view.base_model}: leave spec.model.id unset with initFrom, or set it "
                                           f"to {view.base_model}", failed=True)
    recorded = {"run": run, "uid": view.uid, "artifact": request.artifact, "uri": uri, "modelId": view.base_model}
    return Outcome("Resolved", f"TPUFineTune {run} succeeded: training from its {request.artifact} {uri} "
                               f"(base model {view.base_model})", recorded=recorded)


def model_flags(spec, recorded: dict | None) -> list[str]:
    """The trainer's model flags: spec.model.id; or, for a chained run, what status.initFrom
    recorded (every attempt the same, whatever became of the source since). An unresolved chain
    (only `tpufinetune render` builds its job) names what it waits for."""
    request = request_of(spec)
    if request is None:
        return [f"--model-id={spec.model.id}"]
    if not recorded:
        return [f"--model-id=(the {request.artifact} of TPUFineTune {request.run}, once it has Succeeded)"]
    if recorded["artifact"] == "checkpoint":
        return [f"--model-id={recorded['modelId']}", f"--init-checkpoint={recorded['uri']}"]
    return [f"--model-id={recorded['uri']}"]


def memory_request(spec, recorded: dict | None) -> Request | None:
    """The memory planner's request: the spec's model; for a chained run the source's base model
    (its architecture: a LoRA run's merged export is a full model of it), known once resolved
    (None until then, and for mode collectives)."""
    if request_of(spec) is None:
        return memory_request_of(spec)
    return memory_request_of(spec, model_id=recorded["modelId"]) if recorded else None


def preview(spec, sources: dict) -> dict | None:
    """What status.initFrom would record, for `tpufinetune render`: the source among `sources`
    (the file's other specs, by name), its base model from its spec, its URI a placeholder until it
    has Succeeded. None when the spec is not chained or its source is not among them."""
    request = request_of(spec)
    source = sources.get(request.run) if request is not None else None
    if source is None:
        return None
    others = {name: other for name, other in sources.items() if name != request.run}  # a loop ends here
    base = (preview(source, others) or {}).get("modelId", source.model.id)
    return {"run": request.run, "uid": "", "artifact": request.artifact, "modelId": base,
            "uri": f"(the {request.artifact} of TPUFineTune {request.run}, once it has Succeeded)"}
