"""The memory plan of a TPUFineTune spec: the planner's request as the spec asks (with the
activation checkpointing, the shard group and the keep-gathered decision made:
memplan_sharding.py), its plan again once the trainer reports the model's own
config.json, and the plan as status.plan shows it. Pure (no I/O)."""
from __future__ import annotations

from dataclasses import replace

from . import memplan_sharding
from .memplan import DEFAULT_LORA_TARGETS, CHECKED, MemoryPlan, Request, estimate
from .memplan_shapes import config_status


def status_of(plan: MemoryPlan) -> dict:
    """status.plan (core/status.py's MemoryPlanStatus)."""
    out: dict = {"basis": plan.basis, "method": plan.method, "message": plan.summary()}
    if plan.widths_from:
        out["widthsFrom"] = plan.widths_from
    if plan.model_config:
        out["modelConfig"] = config_status(plan.model_config)
    if plan.basis in CHECKED:
        out.update(fits=plan.fits, hostRAMBytes=plan.host_bytes)
        if plan.limit_bytes:
            out.update(perChipHBMBytes=plan.per_chip_bytes, limitBytes=plan.limit_bytes)
        if plan.host_limit_bytes:
            out["hostRAMLimitBytes"] = plan.host_limit_bytes
        if plan.smallest_fit:
            out["smallestFit"] = plan.smallest_fit
        if plan.generation_bytes is not None:
            out["generationBytes"] = plan.generation_bytes
    if plan.choices is not None:
        out.update(plan.choices.status())
    if plan.media is not None:
        out["towers"] = plan.media.status()
    return out


def plan_spec(spec) -> MemoryPlan | None:
    """The plan of a TPUFineTune spec (None for mode collectives: nothing is trained), as
    the trainer will run it: with the activation checkpointing and shard group chosen, and
    every block kept gathered where `keeps_gathered` (jobspec passes the trainer's flags
    from this plan)."""
    request = request_of(spec)
    return estimate(request) if request is not None else None


def with_model_config(request: Request, config: dict) -> MemoryPlan:
    """The plan again once the trainer has read the model's own config.json (its `model`
    event): its widths win over the table's. The choices (activation checkpointing, shard
    group, keep-gathered) stay the request's: the trainer already runs with them; where the
    config's widths would choose otherwise the plan says so (memplan_sharding.replanned)."""
    return estimate(memplan_sharding.replanned(request, config))


def request_of(spec, model_id: str | None = None) -> Request | None:
    """The planner's request of a spec (None for mode collectives; `model_id`, a chained run's
    source's base model, in place of spec.model.id), with the choices made
    (memplan_sharding.decide). The method (with DPO, whether adapters train and its reference), LoRA rank
    and memory settings are read defensively: older specs have none (full, no checkpointing,
    the device's attention, trained embeddings)."""
    if spec.mode != "finetune":
        return None
    from .quantity import parse_quantity
    from .sizing import plan_resources

    training = spec.training
    # The LoRA settings the run uses: the defaults (dropout 0.05, seven targets) when method
    # lora leaves spec.training.lora unset.
    settings = getattr(training, "lora_settings", None)
    lora = settings() if settings is not None else getattr(training, "lora", None)
    memory = plan_resources(spec)["workers"][1].get("memory")
    method = getattr(training, "method", "full") or "full"
    # Method dpo trains adapters where spec.training.lora is set (its reference then the base
    # with them off), else every weight; spec.training.dpo.referenceFree drops the reference.
    dpo_settings = getattr(training, "dpo_settings", None)
    dpo = dpo_settings() if dpo_settings is not None and method == "dpo" else None
    # spec.training.evaluation.generate: each epoch's answers to held-out prompts (unset: none).
    generate = getattr(getattr(training, "evaluation", None), "generate", None)
    # spec.training.towers: a multimodal run (unset: text only, the language model alone).
    towers = getattr(training, "towers", None)
    request = Request(
        model_id=model_id or spec.model.id, method=method, dpo_lora=method == "dpo" and lora is not None,
        dpo_reference_free=bool(getattr(dpo, "reference_free", False)),
        generation=spec.tpu.generation, topology=spec.tpu.topology, max_seq_len=training.max_seq_len,
        batch_per_device=training.batch_size_per_device,
        lora_rank=int(getattr(lora, "rank", 0) or 16),
        host_memory_bytes=int(parse_quantity(str(memory))) if memory else None,
        attention=getattr(training, "attention", None),
        freeze_embeddings=bool(getattr(training, "freeze_embeddings", None)),
        lora_embeddings=bool(getattr(lora, "train_embeddings", None)),
        stated_parameters=getattr(spec.model, "parameters", None), slices=spec.tpu.slices,
        lora_targets=tuple(getattr(lora, "target_modules", None) or DEFAULT_LORA_TARGETS),
        lora_dropout=float(getattr(lora, "dropout", 0.0) or 0.0) if lora is not None else 0.0,
        generate_max_new_tokens=int(generate.max_new_tokens) if generate is not None else 0,
        generate_examples=int(generate.examples) if generate is not None else 0,
        vision_tower=towers.vision if towers is not None else "",
        # A multimodal step's loss runs over transformers' full logits (the trainer's media_sft).
        loss_head="full" if towers is not None else "labels")
    return memplan_sharding.decide(request, getattr(training, "sharding", None),
                                   getattr(training, "activation_checkpointing", None), _micro_batches(spec))


def _micro_batches(spec) -> int:
    """A step's gradient accumulation: globalBatchBlocks (or tokensPerStep) over one
    micro-batch of every device (1 when unset)."""
    from .sizing import total_devices

    training = spec.training
    micro = total_devices(spec) * training.batch_size_per_device
    if getattr(training, "tokens_per_step", None):
        return max(1, -(-training.tokens_per_step // (micro * training.max_seq_len)))
    return max(1, (getattr(training, "global_batch_blocks", 0) or micro) // micro)
