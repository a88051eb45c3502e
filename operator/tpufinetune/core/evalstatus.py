"""status.history[].eval: an epoch's generation metrics, part of the status (status.py); and status.evaluation's
model (lmevalstatus.py), re-exported."""
from __future__ import annotations

from pydantic import Field

from tpufinetune.core.lmevalstatus import LmEvalStatus  # noqa: F401  (status.evaluation: status.py imports it here)
from tpufinetune.core.statusbase import _Status


class GenerationMetrics(_Status):
    """An epoch's generation metrics (spec.training.evaluation.generate): greedy answers to held-out
    prompts scored against their responses."""

    exact_match: float | None = Field(None, ge=0, le=1, description="Share of answers equal to their response "
                                                                     "(whitespace stripped).")
    rouge_l: float | None = Field(None, alias="rougeL", ge=0, le=1, description="Mean ROUGE-L F1 (rouge-score).")
    bleu: float | None = Field(None, ge=0, le=100, description="Corpus BLEU, 0-100 (sacrebleu).")
    examples: int | None = Field(None, ge=0, description="Answers scored.")
    samples_uri: str | None = Field(None, alias="samplesURI", max_length=4096,
                                    description="The prompts, responses and answers, one JSON line each.")

