"""The base of every status model (core/status.py, core/planstatus.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class _Status(BaseModel):
    # Unknown keys are ignored, not refused: status is read back from the apiserver.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True,
                              extra="ignore")
