"""What the memory plan chooses for a run: the activation checkpointing and the shard group.

Pure (no I/O). Unset (or `auto`), spec.training.activationCheckpointing and
spec.training.sharding are chosen here, from the plan (core/memplan.py), in this order:

1. Activation checkpointing: `none` (every activation kept) when the run fits, else the
   cheapest mode that does, `selective` (the attention recomputed) then `block` (every
   block recomputed); `block` when none fits (the refusal then names what would). Tried
   with the spec's sharding, or, when auto, sharded over the whole slice: recomputing
   costs compute on every step, sharding further only communication that overlaps it, so
   the shard group never buys back recomputation.
2. The shard group G, the devices one copy of the model state (fp32 weights, gradients,
   AdamW's moments) is sharded over: `replicate` (G = 1: every device holds it all, one
   gradient all-reduce a step) when it fits one device; else `hybrid`, the smallest power
   of two G below the slice's devices (and dividing them) that fits (sharded within each
   group of G, replicated across the groups: the trainer's 2-D mesh, as for several
   slices); else `full` (sharded over the whole slice). With several slices the replicas
   span slices x groups; a device holds the same whatever spec.tpu.slices.

A value the spec pins is kept: a pinned sharding that does not fit is refused
(DoesNotFit) naming training.sharding and what fits. Only a TPU slice with a model the
plan knows has figures to choose by: elsewhere (the cpu stand-in, a model neither in the
table nor in a config.json at hand) auto is `none` and `full`, what the trainer did before
it could be told otherwise.

Once the trainer reports the model's own config.json the plan is made again from its
widths (memplan_spec.with_model_config), and the choices stay those the run was started
with: the trainer already runs them. The run is refused there only when they cannot fit;
where the config's widths would have chosen otherwise, the plan says so (`replanned`).
Nothing keeps those widths for a later attempt or run, which choose as this one did: the
spec's training.sharding and training.activationCheckpointing are how to run the choice.

The collectives of a step (`Collectives`), per device, as ring algorithms move them (each
device sends, and receives, (n - 1)/n of a tensor an all-gather or reduce-scatter over n
devices returns whole, and 2 (n - 1)/n of one an all-reduce sums): every micro-batch
all-gathers the weights in the compute dtype for the forward and again each block's for
its backward (not with every block kept gathered; the root, the embedding tied to the
head, stays gathered) and reduce-scatters the trainable parameters' fp32 gradients within
the group; once a step their shard is all-reduced across the replicas (trainer:
parallelize.micro_batch_backward).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from . import generations as g
from . import memplan_dpo as dpo
from .memplan import Request, _plan, keeps_gathered, shape_for, smallest_fit

CHECKPOINTING_AUTO = ("none", "selective", "block")  # cheapest first
PLAN, SPEC = "plan", "spec"  # who chose (status.plan's chosenBy)


@dataclass(frozen=True)
class Collectives:
    """Bytes each device sends in one optimizer step, by collective."""

    all_gather: int
    reduce_scatter: int
    all_reduce: int

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce


@dataclass(frozen=True)
class Choices:
    """The run's activation checkpointing and shard group, and who chose each."""

    checkpointing: str
    checkpointing_by: str
    sharding: str  # full | hybrid | replicate
    shard_group: int  # devices one copy of the state is sharded over
    devices: int  # the slice's
    replicas: int  # copies of the state: groups per slice x slices
    sharding_by: str
    collectives: Collectives | None = None  # None: a model the plan has no widths of
    micro_batches: int = 1  # a step's gradient accumulation (the collectives' count)
    fits_instead: str = ""  # a pinned sharding that does not fit: what would
    replanned: str = ""  # what the model's config.json would have chosen instead

    @property
    def group_flag(self) -> int:
        """The trainer's --shard-group: 0 (no flag) for the whole slice."""
        return 0 if self.sharding == "full" else self.shard_group

    def words(self) -> str:
        by = {PLAN: "chosen by the plan", SPEC: "as the spec sets"}
        group = (f"every device holds the whole state, replicated {self.replicas}x" if self.sharding == "replicate"
                 else f"sharded over {self.shard_group} of {self.devices} devices, {self.replicas} replicas"
                 if self.sharding == "hybrid" else f"sharded over the slice's {self.devices} devices")
        moved = (f", {_gb(self.collectives.total)} of collectives per device a step"
                 if self.collectives is not None else "")
        out = (f"activation checkpointing {self.checkpointing} ({by[self.checkpointing_by]}); sharding "
               f"{self.sharding} ({by[self.sharding_by]}: {group}{moved})")
        return out + (f"; {self.replanned}" if self.replanned else "")

    def status(self) -> dict:
        """status.plan's activationCheckpointing and sharding (planstatus.py)."""
        sharding = {"mode": self.sharding, "shardGroup": self.shard_group, "replicas": self.replicas,
                    "chosenBy": self.sharding_by}
        if self.collectives is not None:
            sharding.update(collectiveBytesPerStep=self.collectives.total, allGatherBytes=self.collectives.all_gather,
                            reduceScatterBytes=self.collectives.reduce_scatter,
                            allReduceBytes=self.collectives.all_reduce)
        out = {"activationCheckpointing": {"mode": self.checkpointing, "chosenBy": self.checkpointing_by},
               "sharding": sharding}
        if self.replanned:
            out["replanned"] = self.replanned
        return out


def _gb(value: int) -> str:
    return f"{value / 1e9:.1f} GB"


def slice_devices(request: Request) -> int:
    gen = g.generation(request.generation)
    return g.chips_in(request.topology) * gen.devices_per_chip if gen.is_tpu else int(request.topology)


def groups(devices: int) -> list[int]:
    """Hybrid's shard groups, smallest first: powers of two from 2 below `devices`, dividing it."""
    out, size = [], 2
    while size < devices:
        if devices % size == 0:
            out.append(size)
        size *= 2
    return out


def _fits(request: Request) -> bool:
    return bool(_plan(request).fits)


def choosable(request: Request) -> bool:
    """Whether the plan has figures to choose by: a known method and model on a TPU slice."""
    return (request.method in ("full", "lora", "dpo") and g.generation(request.generation).is_tpu
            and shape_for(request.model_id, request.model_config) is not None)


def _with_group(request: Request, mode: str, devices: int) -> tuple[str, int] | None:
    """(mode, G) for `mode`, auto the least sharded that fits; None for a pinned one that
    does not fit. Pinned where nothing can check it: kept (hybrid its smallest group).
    A hybrid with no group below the slice is the whole slice's: full."""
    if mode == "full" or (mode == "auto" and not choosable(request)):
        return "full", devices
    candidates = {"replicate": [1], "hybrid": groups(devices), "auto": [1, *groups(devices)]}[mode]
    if mode == "hybrid" and not candidates:
        return "full", devices
    if not choosable(request):
        return mode, candidates[0]
    for group in candidates:
        if _fits(replace(request, shard_group=group)):
            return ("replicate" if group == 1 else "hybrid"), group
    return ("full", devices) if mode == "auto" else None


def decide(request: Request, sharding: str | None, checkpointing: str | None, micro_batches: int = 1) -> Request:
    """`request` (as the spec asks, its activation_checkpointing not yet read) with the
    choices made: its activation checkpointing, its shard group (0: the whole slice), every
    block kept gathered where memplan.keeps_gathered, and `choices` saying so.
    `micro_batches`: the step's gradient accumulation."""
    sharding, checkpointing = sharding or "auto", checkpointing or "auto"
    devices = slice_devices(request)
    by_plan = checkpointing == "auto"
    if by_plan:
        # Against the spec's sharding, or the whole slice's when auto (the least memory).
        trial = replace(request, shard_group=1 if sharding == "replicate" and devices > 1 else 0)
        fitting = [mode for mode in CHECKPOINTING_AUTO
                   if _fits(replace(trial, activation_checkpointing=mode))] if choosable(request) else ["none"]
        checkpointing = fitting[0] if fitting else CHECKPOINTING_AUTO[-1]
    request = replace(request, activation_checkpointing=checkpointing)
    chosen = _with_group(request, sharding, devices)
    fits_instead = ""
    if chosen is None:  # a pinned replicate or hybrid that does not fit
        mode, group = _with_group(request, "auto", devices)
        fits_instead = _instead(replace(request, shard_group=0 if mode == "full" else group), mode, group, devices)
        # Planned as pinned: one device, or hybrid's largest group (its least memory).
        mode, group = sharding, 1 if sharding == "replicate" else groups(devices)[-1]
    else:
        mode, group = chosen
    request = replace(request, shard_group=0 if mode == "full" else group)
    if keeps_gathered(request):
        request = replace(request, keep_gathered=True)
    choices = Choices(checkpointing, PLAN if by_plan else SPEC, mode, group, devices,
                      (devices // group) * request.slices, PLAN if sharding == "auto" else SPEC,
                      collectives_of(request, group, devices, micro_batches), micro_batches, fits_instead)
    return replace(request, choices=choices)


def _instead(request: Request, mode: str, group: int, devices: int) -> str:
    what = (f"sharding {mode} (training.sharding)" if mode == "full" else
            f"sharding {mode} (training.sharding; shard group {group} of {devices} devices)")
    if _fits(request):
        return what
    further = smallest_fit(request)
    return f"{what}, {further}" if further else ""


def collectives_of(request: Request, group: int, devices: int, micro_batches: int = 1) -> Collectives | None:
    """One step's collectives per device with the state sharded over `group` of the slice's
    `devices` (module docstring); None for a model the plan has no widths of."""
    shape = shape_for(request.model_id, request.model_config)
    if shape is None:
        return None
    compute = 2 if g.generation(request.generation).is_tpu else 4
    method = dpo.trainable(request.method, request.dpo_lora)
    if method == "full":
        trainable = shape.parameters - (shape.embedding if request.freeze_embeddings else 0)
    else:
        trainable = shape.lora_parameters(request.lora_rank, request.lora_targets) + (
            shape.embedding if request.lora_embeddings else 0)
    gathered = shape.parameters + (0 if request.keep_gathered else shape.parameters - shape.embedding)
    within = (group - 1) / group
    replicas = (devices // group) * request.slices
    return Collectives(all_gather=int(micro_batches * compute * gathered * within),
                       reduce_scatter=int(micro_batches * 4 * trainable * within),
                       all_reduce=int(2 * 4 * trainable / group * (replicas - 1) / replicas))


def replanned(request: Request, config: dict) -> Request:
    """The run's request once the model's config.json is read: the choices kept (the trainer
    runs them), the collectives counted on its widths, and what it would have chosen, said."""
    choices = request.choices
    configured = replace(request, model_config=config)
    if choices is None:
        return configured
    # What the spec pinned stays pinned; what the plan chose is chosen again on the config's widths.
    fresh = decide(replace(configured, keep_gathered=False, choices=None, shard_group=0),
                   choices.sharding if choices.sharding_by == SPEC else "auto",
                   choices.checkpointing if choices.checkpointing_by == SPEC else "auto", choices.micro_batches).choices
    differ = [f"{what} {new}" for what, old, new in (
        ("activation checkpointing", choices.checkpointing, fresh.checkpointing),
        ("sharding", f"{choices.sharding} (group {choices.shard_group})",
         f"{fresh.sharding} (group {fresh.shard_group})")) if old != new]
    # Only the spec decides a later attempt's or run's choices (its model's widths are not kept
    # for them): the way to run with the config's choice is to write it.
    note = (f"the model's config.json would choose {', '.join(differ)}; this run keeps what it started with "
            "(write training.sharding and training.activationCheckpointing to run with that choice)") if differ else ""
    return replace(configured, choices=replace(
        choices, collectives=collectives_of(configured, choices.shard_group, choices.devices, choices.micro_batches),
        replanned=note))

