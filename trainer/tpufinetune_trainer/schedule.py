"""The learning-rate schedule: linear warmup, the peak held, then cosine or linear decay
over the last steps (warmup-stable-decay; a decay over every step after the warmup is
the classic schedule) (pure).

The whole schedule is one table, one entry per optimizer step, handed to the device
once; each step the optimizer's learning rate is read from it with a step counter that
lives on the device, so no Python number that changes every step reaches the device.
"""

from __future__ import annotations

import math

import numpy as np

SCHEDULES = ("cosine", "linear", "constant")


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return min(total_steps, int(math.ceil(total_steps * warmup_ratio)))


def decay_steps(total_steps: int, warmup: int, decay_ratio: float) -> int:
    """Steps of the decay: the last `decay_ratio` of all steps, never into the warmup."""
    return max(0, min(total_steps - warmup, int(math.ceil(total_steps * decay_ratio))))


def lr_table(peak: float, total_steps: int, warmup: int, schedule: str, min_ratio: float,
             decay: int | None = None) -> np.ndarray:
    """Learning rate of optimizer step s (from 0) for s in [0, total_steps): warmup to the
    peak, the peak held, then `decay` steps (None: every step after the warmup) down to
    min_ratio x peak."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    steps = np.arange(total_steps, dtype=np.float64)
    warm = (steps + 1) / max(warmup, 1)
    decay_span = total_steps - warmup if decay is None else min(decay, total_steps - warmup)
    decay_start = total_steps - decay_span
    progress = np.clip((steps - decay_start + 1) / max(decay_span, 1), 0.0, 1.0)
    if schedule == "cosine":
        shape = 0.5 * (1.0 + np.cos(np.pi * progress))
    elif schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = np.ones_like(progress)
    decayed = min_ratio + (1.0 - min_ratio) * shape
    return (peak * np.where(steps < warmup, warm, decayed)).astype(np.float32)
