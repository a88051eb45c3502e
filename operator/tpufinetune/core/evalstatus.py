"""status.history[].eval: an epoch's generation metrics, part of the status (status.py); and status.evaluation's
model (lmevalstatus.py), re-exported."""
from __future__ import annotations

from pydantic import Field

from tpufinetune.core.lmevalstatus import LmEvalStatus  # noqa: F401  (status.evaluation: status.py imports it here)
from tpufinetune.core.statusbase import _Status


# Bounds of history[].eval.samples: an epoch's first answers, each text cut (the full record is the
# epoch's samples file).
GENERATION_SAMPLE_LIMIT = 3
GENERATION_TEXT_LIMIT = 256
# A multimodal prompt's first images, each its end, wherever status shows a sample (history[].eval.samples,
# export.sample).
PROMPT_IMAGE_LIMIT = 8
IMAGE_PATH_LIMIT = 256


class GenerationSample(_Status):
    """One held-out prompt's greedy answer of the epoch."""

    output: str = Field(max_length=GENERATION_TEXT_LIMIT, description="The answer (its start).")
    reference: str | None = Field(None, max_length=GENERATION_TEXT_LIMIT,
                                  description="The held-out response it is scored against (its start).")
    images: list[str] | None = Field(None, max_length=PROMPT_IMAGE_LIMIT, description="A multimodal run's: the "
                                     "images the prompt was asked with, where they were read (each its end).")


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
    samples: list[GenerationSample] | None = Field(None, max_length=GENERATION_SAMPLE_LIMIT,
                                                   description="The epoch's first answers (all in samplesURI).")

