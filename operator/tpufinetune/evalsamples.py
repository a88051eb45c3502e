"""`tpufinetune eval NAME --samples`: an epoch's generation samples, as the trainer wrote them
(tpufinetune_trainer/generation.py: `<storage>/<run>/eval-samples/epoch-N.jsonl`, one JSON
line per prompt: prompt, reference, output), chosen from status.history[].eval.samplesURI and
shown for a terminal. Pure: the caller reads the object (adapters/runlogs.py).
"""
from __future__ import annotations

import json
import unicodedata

NO_SAMPLES = ("it has no generation samples: the run does not set spec.training.evaluation.generate, no "
              "epoch has ended yet, or the trainer could not write them (its log says why)")
# Enough of a prompt's end to see what is being answered; a chat template's long preamble is cut.
PROMPT_TAIL_CHARS = 160
LABEL_WIDTH = len("reference  ")


def samples_epoch(history: list[dict] | None, wanted: int | None) -> tuple[int, str]:
    """(epoch, its samplesURI): `wanted`, else the last epoch that has samples. LookupError
    says what there is instead."""
    found = {int(entry["epoch"]): entry["eval"]["samplesURI"] for entry in history or []
             if entry.get("epoch") is not None and (entry.get("eval") or {}).get("samplesURI")}
    if not found:
        raise LookupError(NO_SAMPLES)
    if wanted is None:
        wanted = max(found)
    if wanted not in found:
        raise LookupError(f"epoch {wanted} has no generation samples (epochs with samples: "
                          f"{', '.join(str(epoch) for epoch in sorted(found))})")
    return wanted, found[wanted]


def parse_samples(text: str) -> list[dict]:
    """The samples file's lines as dicts. ValueError names a line that is not a JSON object."""
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number} is not JSON ({exc.msg})") from None
        if not isinstance(sample, dict):
            raise ValueError(f"line {number} is not a JSON object")
        samples.append(sample)
    return samples


def first_lines(text: str, limit: int | None) -> str:
    """The samples file as it is (--json), its first `limit` lines where one is given."""
    lines = [line for line in text.splitlines(keepends=True) if line.strip()]
    kept = "".join(lines if limit is None else lines[:limit])
    return kept if kept.endswith("\n") or not kept else kept + "\n"


def answer_matches(answer: str, reference: str) -> bool:
    """The trainer's exact match (generation.score): equal once whitespace is stripped."""
    return answer.strip() == reference.strip()


def _printable(text: str) -> str:
    """Control characters (an escape sequence a model generated) written out, not sent to the
    terminal; line breaks and tabs kept."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else repr(c)[1:-1] for c in text)


def prompt_tail(prompt: str) -> str:
    return prompt if len(prompt) <= PROMPT_TAIL_CHARS else "..." + prompt[-PROMPT_TAIL_CHARS:]


def _field(label: str, value: str) -> list[str]:
    """`label  value`, a multi-line value's further lines under its first."""
    lines = _printable(value).splitlines() or ["(empty)"]
    return [f"  {label.ljust(LABEL_WIDTH)}{lines[0]}", *(" " * (2 + LABEL_WIDTH) + line for line in lines[1:])]


def _text(sample: dict, key: str) -> str:
    value = sample.get(key)
    return value if isinstance(value, str) else "" if value is None else json.dumps(value)


def samples_listing(epoch: int, uri: str, samples: list[dict], limit: int | None) -> str:
    """A heading (the answers, how many equal their reference, where they are), then each
    sample shown: its number, whether its answer is an exact match, the prompt's end, a
    multimodal run's images (where the images the prompt was asked with were read), the
    reference and the answer."""
    shown = samples if limit is None else samples[:limit]
    matching = sum(answer_matches(_text(s, "output"), _text(s, "reference")) for s in samples)
    heading = f"epoch {epoch}: {len(samples)} answers, {matching} equal to their reference"
    if len(shown) < len(samples):
        heading += f"; the first {len(shown)} below"
    lines = [heading, f"({_printable(uri)})"]
    for number, sample in enumerate(shown, start=1):
        answer, reference = _text(sample, "output"), _text(sample, "reference")
        images = sample.get("images")
        lines += ["", f"#{number}  {'exact match' if answer_matches(answer, reference) else 'differs'}",
                  *_field("prompt", prompt_tail(_text(sample, "prompt"))),
                  *(_field("images", "\n".join(map(str, images))) if isinstance(images, list) and images else []),
                  *_field("reference", reference), *_field("answer", answer)]
    return "\n".join(lines) + "\n"
