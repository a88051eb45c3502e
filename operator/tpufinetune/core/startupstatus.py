"""status.attempts[].startup: where an attempt's time before its first optimizer step went,
part of the status (status.py); folded by core/startup.py."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from tpufinetune.core.statusbase import _Status

# Where a start took its prepared (tokenized) data from; core/startup.py maps the trainer's
# own words to these.
DATA_SOURCES = ("Tokenized", "LocalCache", "RunStorage")


def _seconds(description: str):
    return Field(None, ge=0, description=description)


class TrainerStartup(_Status):
    """The trainer's own stages (its `startup` event), seconds since the job's driver
    started; absent: not reached, or not reported by an older trainer."""

    data_ready_seconds: float | None = _seconds("The driver checked the inputs and tokenized the data.")
    workers_ready_seconds: float | None = _seconds("The Ray Train workers were up (placed, torch imported, "
                                                   "process group joined).")
    model_loaded_seconds: float | None = _seconds("The weights the first step trains from were in place "
                                                  "(loaded, sharded and, on a resume, restored).")
    first_step_compiled_seconds: float | None = _seconds("With torch.compile on: the first step was traced and "
                                                         "compiled (absent without compilation).")
    first_step_seconds: float | None = _seconds("The first optimizer step was done on rank 0's device.")
    # What the start did not have to do again: a retry starts warm.
    data_source: Literal[DATA_SOURCES] | None = Field(  # type: ignore[valid-type]
        None, description="Where the driver took the tokenized data from. Tokenized: it tokenized the dataset "
                          "(a first start). LocalCache: its host's disk already held the prepared data. "
                          "RunStorage: it fetched the copy an earlier attempt published to the run's storage "
                          "(<storagePath>/<run>/data/), tokenizing nothing.")
    tokenized_examples: int | None = Field(None, ge=0, description="Examples the driver tokenized in this "
                                                                   "start: 0 when it started warm.")
    compile_cache_hits: int | None = Field(None, ge=0, description="With torch.compile on: compiled graphs rank 0 "
                                                                   "found in the compile cache, which earlier "
                                                                   "attempts keep in the run's storage "
                                                                   "(<storagePath>/<run>/compile-cache/).")
    compile_cache_misses: int | None = Field(None, ge=0, description="With torch.compile on: graphs rank 0 "
                                                                     "compiled anew before its first step.")
    resumed_epoch_end_seconds: float | None = _seconds(
        "On a resume at an epoch's last step: the seconds that epoch's end (its evaluation and answers, left by "
        "the earlier attempt) took before this start's first step; firstStepSeconds includes them.")


class StartupTimes(_Status):
    """Where the attempt's time before its first optimizer step went: seconds from the
    attempt's start (attempts[].startTime), and the trainer's own stages."""

    cluster_ready_seconds: float | None = _seconds("Its RayCluster was ready (the last worker pod Ready; 0 "
                                                   "for a retry that kept the slice).")
    job_submitted_seconds: float | None = _seconds("Its Ray job was submitted (the run entered Running).")
    driver_started_seconds: float | None = _seconds("The job's driver started (the trainer's mark on its "
                                                    "host's clock, kept between the submission and the "
                                                    "first step being read).")
    first_step_seconds: float | None = _seconds("The first optimizer step was done: the time to first step.")
    trainer: TrainerStartup | None = Field(None, description="The trainer's stages, seconds since the job's "
                                                             "driver started.")
