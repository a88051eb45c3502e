"""The run's TensorBoard event files (tboard.py), read back with TensorBoard's own reader
(EventAccumulator) from the run's storage: the trainer's loop (Trainer.run, a one-rank gloo
group, FSDP2 on the tiny Gemma) writes every step's training figures and every epoch's
losses at their global steps, and a resumed attempt continues the step axis in its own
folder without a gap. Only ray.train.report (no Ray Train session in a plain process) and
the export (its own tests) are left out; the event line is recorded."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tpufinetune_trainer import notice, run_events, tboard
from tpufinetune_trainer.errors import Preempted
from tpufinetune_trainer.logship import ATTEMPT_ENV
from trainer_helpers import make_trainer

BATCH = 16  # examples per step: 144 training rows make a short epoch
EPOCHS = 2


def read(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in an attempt's folder, as TensorBoard reads it: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert os.listdir(folder), f"no event file in {folder}"
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def steps(series) -> list[int]:
    return [step for step, _ in series]


def same(series, expected: list[tuple[int, float]]) -> bool:
    """The same steps and, to float32's precision (an event's value is a float32), values."""
    return steps(series) == steps(expected) and [v for _, v in series] == pytest.approx(
        [v for _, v in expected], rel=1e-6)


@pytest.fixture
def run(trainer_assets, prepared, process_group, tmp_path, monkeypatch):
    """Trainer.run of a fresh or resumed start as attempt `attempt` of run `tb` under
    tmp_path/storage; returns (trainer, its events)."""
    import ray.train

    monkeypatch.setattr(ray.train, "report", lambda *args, **kwargs: None)

    def start(attempt: int, resume: bool = False, sigterm_at: int = 0, **overrides):
        events: list[tuple[str, dict]] = []

        def record(kind, **fields):
            events.append((kind, fields))
            if kind == "progress" and fields["step"] == sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)  # the pod's notice (notice.install_sigterm_handler's)

        monkeypatch.setattr(run_events, "emit", record)
        monkeypatch.setenv(ATTEMPT_ENV, str(attempt))
        settings = dict(run_name="tb", num_epochs=EPOCHS, batch_size_per_device=BATCH, progress_interval_s=1e-6,
                        lr_schedule="cosine", warmup_ratio=0.2, **overrides)
        trainer = make_trainer(trainer_assets.model, prepared, tmp_path / "storage", **settings)
        trainer.export = lambda: trainer.settle_checkpoint(wait=True)  # the last checkpoint, no export
        if resume:
            trainer.restore()
        try:
            trainer.run()
        except RuntimeError as exc:  # --fail-at-step
            assert "injected failure" in str(exc)
        except Preempted:  # the SIGTERM's checkpoint is written
            pass
        return trainer, events

    return start


def test_every_step_and_epoch_is_in_the_runs_storage_at_its_global_step(run, tmp_path):
    trainer, events = run(1)
    folder = tmp_path / "storage" / "tb" / "tensorboard" / "attempt-1"
    series = read(folder)
    total, per_epoch = trainer.total_steps, trainer.epoch_steps
    assert total == EPOCHS * per_epoch and per_epoch >= 4
    every = list(range(1, total + 1))
    for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s", "train/step_time_s"):
        assert steps(series[tag]) == every, tag
    progress = [fields for kind, fields in events if kind == "progress"]
    assert same(series["train/loss"], [(e["step"], e["loss"]) for e in progress])
    assert [v for _, v in series["train/learning_rate"]] == pytest.approx(list(trainer.lr_host), rel=1e-6)
    epochs = [fields for kind, fields in events if kind == "epoch"]
    assert [e["step"] for e in epochs] == [per_epoch, total]
    for tag, key in (("epoch/loss", "loss"), ("eval/loss", "eval_loss"), ("epoch/tokens_per_s", "tokens_per_s")):
        assert same(series[tag], [(e["step"], e[key]) for e in epochs]), (tag, series[tag])
    (plan,) = [fields for kind, fields in events if kind == "plan"]
    assert plan["tensorboard_uri"] == tboard.run_uri(str(tmp_path / "storage"), "tb")
    assert os.listdir(tmp_path / "storage" / "tb" / "tensorboard") == ["attempt-1"]
    # The start-up stages, once, after the first step: in order, compile off on cpu.
    (startup,) = [fields for kind, fields in events if kind == "startup"]
    assert startup["step"] == 1 and "first_step_compiled_s" not in startup
    assert 0 <= startup["model_loaded_s"] <= startup["first_step_s"], startup
    assert startup["started_at"] <= time.time() - startup["first_step_s"] + 1
    trainer.rank, trainer.startup.reported = 1, False  # another rank's first step reports nothing
    trainer.first_step_done(torch.zeros(()))
    assert [kind for kind, _ in events].count("startup") == 1


def test_a_resumed_attempt_continues_the_step_axis_in_its_own_folder(run, tmp_path, monkeypatch):
    """Attempt 1 checkpoints every 4 steps and dies after step 14 without its last flush (as
    a killed process would: the close is replaced); attempt 2 resumes from the step-12
    checkpoint. What attempt 1 flushed with each checkpoint reaches step 12; attempt 2 goes on
    from 13: every step once, every epoch's losses, across the two folders."""
    with monkeypatch.context() as killed:
        killed.setattr(tboard.Board, "close", lambda self: None)
        first, _ = run(1, checkpoint_every_steps=4, fail_at_step=14)
    assert first.epoch_steps < 12 < 14 < first.total_steps  # the restored step is in epoch 2
    second, events = run(2, resume=True, checkpoint_every_steps=4)
    assert second.resumed_from and second.resumed_from.rsplit("/", 1)[1].startswith("step_0000012-")
    root = tmp_path / "storage" / "tb" / "tensorboard"
    one, two = read(root / "attempt-1"), read(root / "attempt-2")
    assert steps(one["train/loss"]) == list(range(1, 13))
    assert steps(two["train/loss"]) == list(range(13, second.total_steps + 1))
    per_epoch, total = second.epoch_steps, second.total_steps
    assert steps(one["epoch/loss"]) == [per_epoch] and steps(two["epoch/loss"]) == [total]
    assert steps(one["eval/loss"]) == [4, 8, per_epoch, 12]  # the step checkpoints evaluate too
    assert steps(two["eval/loss"]) == [16, total]
    (plan,) = [fields for kind, fields in events if kind == "plan"]
    assert plan["resumed_step"] == 12 and plan["tensorboard_uri"] == tboard.run_uri(str(tmp_path / "storage"), "tb")
    (startup,) = [fields for kind, fields in events if kind == "startup"]  # this start's first step
    assert startup["step"] == 13 and startup["model_loaded_s"] <= startup["first_step_s"]


def test_a_failed_copy_is_said_once_never_raised_and_made_at_the_next_flush(tmp_path, capfd):
    blocker = tmp_path / "storage"
    blocker.write_text("a file where the run's folder should be")  # the copy cannot make its folder
    board = tboard.Board(str(blocker / "tb" / "tensorboard" / "attempt-1"))
    board.scalars(1, {"train/loss": 2.0})
    board.flush()
    board.scalars(2, {"train/loss": 1.5})
    board.flush()
    said = capfd.readouterr().err
    assert said.count("TensorBoard events not copied to") == 1 and board.errors == 2, said
    blocker.unlink()
    board.close()  # the next flush copies everything held locally
    assert read(blocker / "tb" / "tensorboard" / "attempt-1")["train/loss"] == [(1, 2.0), (2, 1.5)]


@pytest.mark.timeout(120)
def test_event_files_in_a_bucket_are_copied_again_as_they_grow(gcs, monkeypatch, tmp_path):
    """gs:// through the trainer's own storage client (the emulator the ground runs): each
    flush replaces the attempt's event file with its longer self; nothing is lost between."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    uri = gcs.unique_uri("tensorboard-test", "run") + "/tensorboard/attempt-1"
    board = tboard.Board(uri)
    for step in (1, 2, 3):
        board.scalars(step, {"train/loss": 1.0 / step})
    board.flush()
    (name,) = gcs.list(uri)
    assert steps(read(gcs.download(uri, tmp_path / "first"))["train/loss"]) == [1, 2, 3]
    for step in (4, 5):
        board.scalars(step, {"train/loss": 1.0 / step})
    board.close()
    assert gcs.list(uri) == [name]
    assert steps(read(gcs.download(uri, tmp_path / "second"))["train/loss"]) == [1, 2, 3, 4, 5]


def test_a_preempted_attempt_hands_the_step_axis_on_without_a_gap_or_a_repeat(run, tmp_path):
    """A SIGTERM during epoch 1 (the real signal, to the trainer's own handler): the notice's
    checkpoint and the flush that goes with it end attempt 1 at the notice's step S; attempt
    2 resumes from that checkpoint and writes from S + 1: every step once across the two."""
    previous = signal.getsignal(signal.SIGTERM)
    assert notice.install_sigterm_handler()
    try:
        first, events = run(1, sigterm_at=3)
    finally:
        signal.signal(signal.SIGTERM, previous)
        notice.reset()
    (noticed,) = [fields for kind, fields in events if kind == "notice"]
    at = noticed["step"]
    assert noticed["reason"] == "SIGTERM" and 3 <= at < first.total_steps, noticed
    second, _ = run(2, resume=True)
    assert second.resumed_from.rsplit("/", 1)[1].startswith(f"step_{at:07d}-")
    root = tmp_path / "storage" / "tb" / "tensorboard"
    one, two = read(root / "attempt-1"), read(root / "attempt-2")
    assert steps(one["train/loss"]) == list(range(1, at + 1))
    assert steps(two["train/loss"]) == list(range(at + 1, second.total_steps + 1))
    epoch_ends = steps(one.get("epoch/loss", [])) + steps(two["epoch/loss"])
    assert epoch_ends == [second.epoch_steps, second.total_steps]
