"""What the operator's memory plan chooses for a benchmark's model, as the trainer flags it passes.

The benchmarks run the trainer on CPU workers, where the plan has no figures to choose by
(memplan_sharding.choosable: a TPU generation and a model whose widths it knows) and the
trainer's own default, full sharding, is what runs. The product's default is the plan's
choice: for a model whose widths it knows (the table's; a config.json's once the trainer
has reported it: memplan_spec.with_model_config, where status.plan.replanned names the
choice). This asks the planner that question for the benchmark's model on a TPU slice of
as many devices as the benchmark has workers: `plan` builds the spec, the
operator's request of it (memplan_spec.request_of) and chooses again on the config's
widths as memplan_sharding.replanned does, then the trainer flags the operator passes for
the choice (jobspec.memory_flags, and --reshard-after-forward=false where the plan keeps
every block gathered).

No TPU slice has exactly 2 devices (the benchmarks' workers): the smallest are one chip
(v5e and v6e 1x1) and four. `slice_for` takes a single slice with exactly the count where
one exists, else that many one-chip slices (Multislice): the same devices, each holding
what one device of a slice holds whatever the slices (memplan.py), replicated across them.

Pure (no I/O): the caller reads config.json.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tpufinetune.core import generations, memplan, memplan_sharding, memplan_spec
from tpufinetune.core.api import parse_spec
from tpufinetune.core.jobspec import memory_flags

PREFERRED_GENERATION = "v6e"  # the tutorial's
# Only the spec's shape matters to the plan; these make it a valid spec.
IMAGE = "trainer:bench"
STORAGE = "gs://bench/checkpoints"


@dataclass(frozen=True)
class PlannedRun:
    """The plan of a benchmark's run and the trainer flags it passes."""

    generation: str
    topology: str
    slices: int
    choices: memplan_sharding.Choices
    plan: memplan.MemoryPlan
    flags: tuple[str, ...]

    @property
    def devices(self) -> int:
        return self.choices.devices * self.slices

    def words(self) -> str:
        """One paragraph for a benchmark's output: the slice, the decision, its bytes."""
        where = (f"{self.generation} {self.topology}" if self.slices == 1
                 else f"{self.slices} {self.generation} {self.topology} slices")
        moved = self.choices.collectives
        bytes_ = (f"; collectives a step per device {moved.total / 1e6:.2f} MB (all-gather "
                  f"{moved.all_gather / 1e6:.2f}, reduce-scatter {moved.reduce_scatter / 1e6:.2f}, "
                  f"all-reduce {moved.all_reduce / 1e6:.2f})" if moved is not None else "")
        return (f"the plan on {where} ({self.devices} devices): sharding {self.choices.sharding} "
                f"(group {self.choices.shard_group}, {self.choices.replicas} replicas), activation "
                f"checkpointing {self.choices.checkpointing}, every block kept gathered "
                f"{'yes' if self.plan.keep_gathered else 'no'}, {self.plan.per_chip_bytes / 2**20:.0f} MiB per "
                f"device of {self.plan.limit_bytes / 2**30:.1f} GiB{bytes_}; trainer flags: "
                f"{' '.join(self.flags) or '(none: the trainer defaults)'}")


def slice_for(workers: int) -> tuple[str, str, int]:
    """(generation, topology, slices) of `workers` TPU devices: one slice with exactly that
    many, the preferred generation first, else `workers` one-device slices."""
    tpus = sorted((gen for gen in generations.GENERATIONS if gen.is_tpu),
                  key=lambda gen: gen.name != PREFERRED_GENERATION)
    for gen in tpus:
        for topology in gen.valid_topologies():
            if generations.chips_in(topology) * gen.devices_per_chip == workers:
                return gen.name, topology, 1
    for gen in tpus:
        for topology in gen.valid_topologies():
            if generations.chips_in(topology) * gen.devices_per_chip == 1 \
                    and workers <= generations.max_slices(gen, topology):
                return gen.name, topology, workers
    raise ValueError(f"no TPU slice shape of {workers} devices")


def plan(config: dict, model_id: str, workers: int, batch_per_device: int, max_seq_len: int,
         method: str = "full") -> PlannedRun:
    """The operator's choices for a run of the model of `config` (its config.json) with the
    spec's other fields left to their defaults (sharding and activation checkpointing auto)."""
    generation, topology, slices = slice_for(workers)
    spec = parse_spec({
        "tpu": {"generation": generation, "topology": topology, **({"slices": slices} if slices > 1 else {})},
        "image": IMAGE, "checkpoint": {"storagePath": STORAGE}, "model": {"id": model_id},
        "training": {"method": method, "batchSizePerDevice": batch_per_device, "maxSeqLen": max_seq_len}})
    request = memplan_spec.request_of(spec)
    # As memplan_sharding.replanned chooses on the config's widths: what the spec pins stays
    # pinned (here nothing), the rest is chosen again.
    training = spec.training
    chosen = memplan_sharding.decide(
        replace(request, model_config=config, choices=None, shard_group=0, keep_gathered=False),
        training.sharding, training.activation_checkpointing, request.choices.micro_batches)
    planned = memplan.estimate(chosen)
    flags = memory_flags(training, chosen.choices)
    if planned.keep_gathered:  # as jobspec.trainer_argv passes it
        flags.append("--reshard-after-forward=false")
    return PlannedRun(generation, topology, slices, chosen.choices, planned, tuple(flags))


def trainer_settings(flags) -> dict:
    """The trainer's FinetuneConfig fields that `flags` set away from its defaults, as its
    command line reads them (its parser and its translation into the config): what a
    benchmark that builds the config itself passes for the plan's choice."""
    from dataclasses import fields

    from tpufinetune_trainer import cli

    def read(argv: list[str]):
        return cli._config(cli.build_parser().parse_args(["finetune", *argv]))  # the CLI's own translation

    default, planned = read([]), read(list(flags))
    return {f.name: getattr(planned, f.name) for f in fields(planned)
            if getattr(planned, f.name) != getattr(default, f.name)}
