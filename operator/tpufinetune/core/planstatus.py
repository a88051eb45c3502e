"""status.plan: the memory planner's estimate (core/memplan.py) as the status shows it, and
what it read of the model's own config.json."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tpufinetune.core.statusbase import _Status


class ModelConfigStatus(_Status):
    """What the planner read of the model's own config.json (its text model's), as the
    trainer reported it (core/memplan_shapes.py's config_from_event)."""

    model_type: str | None = Field(None, max_length=64, description="config.json's model_type.")
    num_hidden_layers: int | None = Field(None, ge=1, description="Decoder layers.")
    hidden_size: int | None = Field(None, ge=1, description="Hidden width.")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width.")
    num_attention_heads: int | None = Field(None, ge=1, description="Query heads.")
    num_key_value_heads: int | None = Field(None, ge=1, description="Key and value heads.")
    head_dim: int | None = Field(None, ge=1, description="Head width (sliding-window layers).")
    global_head_dim: int | None = Field(None, ge=1, description="Head width of the full-attention layers.")
    vocab_size: int | None = Field(None, ge=1, description="Vocabulary (the tied embedding's rows).")
    hidden_size_per_layer_input: int | None = Field(None, ge=1, description="Per-layer embedding width.")
    vocab_size_per_layer_input: int | None = Field(None, ge=1, description="Per-layer embedding rows.")
    full_attention_layers: int | None = Field(None, ge=0, description="Layers attending to the whole "
                                                                        "sequence (from layer_types).")


class CheckpointingPlanStatus(_Status):
    """The activation checkpointing the run trains with (core/memplan_sharding.py)."""

    mode: Literal["none", "selective", "block"] | None = Field(None, description="The trainer's "
                                                                                 "--activation-checkpointing.")
    chosen_by: Literal["plan", "spec"] | None = Field(
        None, description="plan: spec.training.activationCheckpointing is auto (unset) and the memory plan "
                          "chose the cheapest mode that fits; spec: as the spec sets it.")


class ShardingPlanStatus(_Status):
    """How the model state is spread over the slice's devices (core/memplan_sharding.py)."""

    mode: Literal["full", "hybrid", "replicate"] | None = Field(
        None, description="full: sharded over every device of the slice; hybrid: within groups of "
                          "shardGroup devices, replicated across them; replicate: every device holds it all.")
    shard_group: int | None = Field(None, ge=1, description="Devices one copy of the state is sharded over "
                                                            "(the trainer's --shard-group).")
    replicas: int | None = Field(None, ge=1, description="Copies of the state: groups per slice x slices.")
    chosen_by: Literal["plan", "spec"] | None = Field(
        None, description="plan: spec.training.sharding is auto (unset) and the memory plan chose the "
                          "least sharding that fits; spec: as the spec sets it.")
    collective_bytes_per_step: int | None = Field(
        None, ge=0, description="Bytes each device sends in one optimizer step: allGatherBytes + "
                                "reduceScatterBytes + allReduceBytes, counted from the plan's model shape "
                                "(ring algorithms; docs/trainer.md, \"Sharding chosen by the plan\").")
    all_gather_bytes: int | None = Field(None, ge=0, description="The weights gathered in the compute dtype, "
                                                                 "forward and backward, every micro-batch.")
    reduce_scatter_bytes: int | None = Field(None, ge=0, description="The fp32 gradients reduce-scattered "
                                                                     "within the group, every micro-batch.")
    all_reduce_bytes: int | None = Field(None, ge=0, description="The gradient shard all-reduced across "
                                                                 "the replicas, once a step.")


class TowersPlanStatus(_Status):
    """A multimodal run's vision tower in the plan (spec.training.towers; core/memplan_media.py)."""

    vision: Literal["frozen", "trained"] | None = Field(None, description="The vision tower planned: frozen "
                                                                          "(bf16 weights only) or trained.")
    vision_parameters: int | None = Field(None, ge=0, description="The vision tower's parameters.")
    projector_parameters: int | None = Field(None, ge=0, description="The projectors' into the language model "
                                                                     "(the vision one trains with method full).")
    audio_parameters: int | None = Field(None, ge=0, description="The audio tower's, loaded with the model and "
                                                                 "frozen (audio fine-tuning is not built yet); 0 "
                                                                 "for a model without one.")
    bytes_per_device: int | None = Field(None, ge=0, description="What the tower and projector add per device "
                                                                 "(weights, trained state, activations), within "
                                                                 "perChipHBMBytes.")
    activation_bytes: int | None = Field(None, ge=0, description="The tower's activations at the processor's "
                                                                 "image resolution, the pixels and the projected "
                                                                 "soft tokens of a micro-batch (what its forward "
                                                                 "alone holds is gone before the language model's "
                                                                 "step: only what exceeds that step's is in "
                                                                 "bytesPerDevice).")
    tokens_per_image: int | None = Field(None, ge=1, description="Tokens one image takes in a block at most "
                                                                 "(its soft tokens and two boundary tokens).")
    images_per_block: int | None = Field(None, ge=1, description="Images planned per block: as many as "
                                                                 "maxSeqLen holds (packed examples share blocks).")
    media_tokens_per_block: int | None = Field(None, ge=0, description="imagesPerBlock x tokensPerImage.")
    widths_from: str | None = Field(None, max_length=512, description="Where the tower's widths come from.")


class MemoryPlanStatus(_Status):
    """The memory planner's estimate for the run (core/memplan.py), written before any
    RayCluster exists, and again from the model's own config.json once the trainer has
    read it (before any weight is loaded)."""

    basis: Literal["table", "config", "stated", "unknown"] | None = Field(
        None, description="table: the model is in the planner's table and was checked; config: "
                          "checked on the widths of the model's own config.json, as the trainer read "
                          "it (they win over the table's); stated: checked on spec.model.parameters "
                          "(weights, gradients and optimizer state only, a lower bound); unknown: "
                          "none of them, and its memory was not checked.")
    widths_from: str | None = Field(None, max_length=512, description="Where the model's widths (layers, "
                                                                      "hidden size, MLP, heads) came from.")
    model_config_read: ModelConfigStatus | None = Field(None, alias="modelConfig",
                                                        description="The model's config.json, as planned from.")
    method: str | None = Field(None, max_length=32, description="The fine-tune method planned (full, lora, dpo).")
    fits: bool | None = Field(None, description="Whether the estimate fits the slice (absent when "
                                                "unknown).")
    per_chip_hbm_bytes: int | None = Field(None, ge=0, alias="perChipHBMBytes",
                                           description="Estimated peak HBM per chip.")
    limit_bytes: int | None = Field(None, ge=0, description="Usable HBM per chip (HBM less the "
                                                            "planner's headroom).")
    host_ram_bytes: int | None = Field(None, ge=0, alias="hostRAMBytes",
                                       description="Estimated memory per host (worker pod).")
    host_ram_limit_bytes: int | None = Field(None, ge=0, alias="hostRAMLimitBytes",
                                             description="Usable memory of a worker pod.")
    smallest_fit: str | None = Field(None, max_length=256, description="When it does not fit: the "
                                                                      "smallest topology (or method) "
                                                                      "that would, or where only the "
                                                                      "generation does not, its "
                                                                      "maxNewTokens that would.")
    generation_bytes: int | None = Field(
        None, ge=0, description="With training.evaluation.generate: what each epoch's generation adds per device "
                                "to the state kept between steps (the key/value cache of a micro-batch of "
                                "prompts of up to maxSeqLen tokens and maxNewTokens new ones, the prompts' "
                                "forward, the last position's logits). Generation runs between steps, so the "
                                "peak (perChipHBMBytes) is the larger of the step's and the generation's, not "
                                "their sum. Absent without generation.")
    activation_checkpointing: CheckpointingPlanStatus | None = Field(
        None, description="The activation checkpointing planned (and passed to the trainer).")
    sharding: ShardingPlanStatus | None = Field(None, description="The sharding planned (and passed to the "
                                                                  "trainer).")
    replanned: str | None = Field(
        None, max_length=512, description="Planned again from the model's config.json: what its widths would "
                                          "have chosen where that differs from what the run was started "
                                          "with (kept: the trainer runs it; later attempts choose as this one did, "
                                          "unless the spec writes the choice).")
    towers: TowersPlanStatus | None = Field(None, description="With training.towers: the vision tower planned. "
                                                              "Absent for a text-only run.")
    message: str | None = Field(None, max_length=1024, description="The estimate in words.")
