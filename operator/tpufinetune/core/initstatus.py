"""status.initFrom: what a chained run (spec.model.initFrom) resolved its source to, part of the
status (status.py). Recorded once, when the source has Succeeded; every attempt trains from it."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from tpufinetune.core.statusbase import _Status


class InitFromStatus(_Status):
    """The source run's result this run trains from, as it was when the source Succeeded: a later edit
    to the source, or its deletion, changes nothing here."""

    run: str = Field(max_length=253, description="The source TPUFineTune's name (this namespace).")
    uid: str = Field(max_length=128, description="Its metadata.uid when it was resolved.")
    artifact: Literal["export", "checkpoint"] = Field(description="What of it: its export or its best checkpoint.")
    uri: str = Field(max_length=4096, description="The export (status.exportedModelURI) or the checkpoint "
                                                  "(status.checkpointURI) this run starts from.")
    model_id: str = Field(max_length=512, description="The source's base model (its spec.model.id): planned "
                                                      "for memory, and loaded under a checkpoint.")
