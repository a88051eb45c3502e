"""Every window of an epoch reaches the device in one shape: the last one, whose steps are
fewer when the epoch is not a multiple of the window, is padded with filler blocks and
filler rows, so the gather and the step it feeds are not compiled again for another size
(XLA compiles per shape). Its real steps are the unpadded ones, and a step taken from it
trains as one taken from a window of the whole epoch."""

from __future__ import annotations

import numpy as np
import torch

from tpufinetune_trainer.data import window_rows
from trainer_helpers import make_trainer

WINDOW = 4


def shapes(trainer) -> tuple:
    blocks = trainer.train_blocks
    return tuple(tuple(getattr(blocks, n).shape) for n in ("input_ids", "targets", "position_ids", "segment_ids")) \
        + (tuple(trainer.epoch_inputs.shape),)


def test_the_last_window_of_an_epoch_has_every_windows_shape(trainer_assets, prepared, process_group, tmp_path):
    windowed = make_trainer(trainer_assets.model, prepared, tmp_path / "w")
    windowed.window_steps = WINDOW
    steps = windowed.epoch_steps
    assert steps % WINDOW, f"the epoch's {steps} steps must leave a short last window"
    windowed.load_window()
    first = shapes(windowed)
    last_start = steps - steps % WINDOW
    windowed.epoch_step = last_start
    windowed.load_window()
    assert windowed.window == (windowed.epoch, last_start, steps)  # a short window of steps % WINDOW steps
    assert shapes(windowed) == first

    whole = make_trainer(trainer_assets.model, prepared, tmp_path / "whole")
    whole.epoch_step = last_start
    whole.window_steps = steps  # one window: from last_start on, no padding needed
    whole.load_window()
    short = steps - last_start
    assert torch.equal(windowed.epoch_inputs[:short, -1], whole.epoch_inputs[:short, -1])
    for row in range(short):
        a = windowed.train_blocks.gather(windowed.epoch_inputs[row, :-1])
        b = whole.train_blocks.gather(whole.epoch_inputs[row, :-1])
        assert all(torch.equal(a[name], b[name]) for name in a)
    # A padded row takes only filler blocks and counts no labels.
    filler = windowed.train_blocks.gather(windowed.epoch_inputs[short, :-1])
    assert int(windowed.epoch_inputs[short, -1]) == 0 and bool((filler["targets"] == -100).all())

    for trainer in (windowed, whole):  # the last steps train alike from either window
        loss_sum = torch.zeros(())
        for _ in range(short):
            trainer.train_step(loss_sum)
            trainer.epoch_step += 1
        trainer.loss = float(loss_sum)
    assert windowed.loss == whole.loss
    for a, b in zip(windowed.params, whole.params):
        assert torch.equal(a.detach().full_tensor(), b.detach().full_tensor())


def test_window_rows_pads_with_the_filler_and_no_labels():
    index = np.arange(6).reshape(2, 3)
    rows = window_rows(index, np.array([5, 7]), 4)
    assert rows.tolist() == [[0, 1, 2, 5], [3, 4, 5, 7], [6, 6, 6, 0], [6, 6, 6, 0]]
