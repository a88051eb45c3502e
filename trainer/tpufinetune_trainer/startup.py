"""Where an attempt's time before its first optimizer step goes (event `startup`). Pure:
standard library only, imported first by the job's entrypoint (cli.py), so its mark is
taken before the heavy imports.

Each stage is seconds since the job's driver started. The driver's own stages are read on
its monotonic clock; the workers run in other processes, on other hosts, where no
monotonic clock is shared, so they count from the driver's wall-clock mark (hosts keep
their clocks in step; a stage is never earlier than the one before it). Rank 0 emits the
stages once, after its first optimizer step.
"""

from __future__ import annotations

import time

# In the order they happen: the driver checked the inputs and tokenized the data; the Ray
# Train workers are up (placed, torch imported, process group joined); the weights the first
# step trains from are in place (loaded, sharded and, on a resume, restored); with
# torch.compile on, the first step's host calls returned (it traces and compiles there);
# the first step is done on rank 0's device.
STAGES = ("data_ready", "workers_ready", "model_loaded", "first_step_compiled", "first_step")
# What the start did not have to do again (a retry starts warm): where the driver took the
# prepared data from and how many examples it tokenized; with torch.compile, rank 0's
# inductor FX-graph cache hits and misses up to its first step. And, on a resume at an
# epoch's last step, the seconds that epoch's end (its evaluation and answers, left by the
# earlier attempt) took before this start's first step, which first_step includes.
DATA_SOURCES = ("tokenized", "local_cache", "published")
FACTS = ("data_source", "tokenized_examples", "compile_cache_hits", "compile_cache_misses", "resumed_epoch_end_s")

_STARTED_WALL, _STARTED = time.time(), time.monotonic()


class Startup:
    """An attempt's stage times. `origin`: the driver's mark (wall clock, seconds since the
    epoch); `stages`: the ones the driver already measured."""

    def __init__(self, origin: float | None = None, stages: dict[str, float] | None = None,
                 facts: dict | None = None) -> None:
        self.origin = time.time() if origin is None else float(origin)
        self.stages: dict[str, float] = dict(stages or {})
        self.facts: dict = dict(facts or {})
        self.reported = False

    @classmethod
    def of(cls, handed: dict | None) -> "Startup":
        """A worker's clock from what the driver handed over (`handover`); without it (a
        Trainer built outside a job) it counts from now."""
        if not handed:
            return cls()
        return cls(handed.get("origin"), handed.get("stages"), handed.get("facts"))

    def handover(self) -> dict:
        """What a worker needs to go on counting (plain data: Ray pickles it)."""
        return {"origin": self.origin, "stages": dict(self.stages), "facts": dict(self.facts)}

    def elapsed(self) -> float:
        return time.time() - self.origin

    def mark(self, stage: str) -> float:
        """`stage` reached now (marked again: the later time counts); never before an
        earlier stage."""
        if stage not in STAGES:
            raise ValueError(f"unknown start-up stage {stage!r}; expected one of {STAGES}")
        earlier = [self.stages[s] for s in STAGES[:STAGES.index(stage)] if s in self.stages]
        self.stages[stage] = round(max([self.elapsed(), *earlier, 0.0]), 3)
        return self.stages[stage]

    def note(self, **facts) -> None:
        """Facts of this start (FACTS), reported with the stages."""
        unknown = set(facts) - set(FACTS)
        if unknown:
            raise ValueError(f"unknown start-up facts {sorted(unknown)}; expected some of {FACTS}")
        if facts.get("data_source", DATA_SOURCES[0]) not in DATA_SOURCES:
            raise ValueError(f"unknown data_source {facts['data_source']!r}; expected one of {DATA_SOURCES}")
        self.facts.update(facts)

    def fields(self) -> dict:
        """The `startup` event's fields: `<stage>_s` for each stage reached, the driver's
        mark (`started_at`, for the operator's own clock) and the facts noted."""
        return {"started_at": round(self.origin, 3), **{f"{s}_s": self.stages[s] for s in STAGES if s in self.stages},
                **{f: self.facts[f] for f in FACTS if f in self.facts}}


class _DriverStartup(Startup):
    """The driver's own clock: monotonic, from this module's import."""

    def elapsed(self) -> float:
        return time.monotonic() - _STARTED


DRIVER: Startup = _DriverStartup(_STARTED_WALL)
