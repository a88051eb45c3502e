"""After a restore the trainer says again every epoch the restored checkpoint holds, and the
operator's fold of those lines gives every epoch once in status.history.

The gap it closes was seen on the ground (test_fault_e2e.py): attempt 2 wrote epoch 3's
checkpoint, then its RayCluster was deleted before the operator read epoch 3's lines;
attempt 3 resumed from that checkpoint (the run's newest complete one, no step lost), so
without the replay status.history read [1, 2, 4, 5]. Pure: the trainer's own method and
event lines, the operator's own fold."""

from __future__ import annotations

import contextlib
import copy
import io
from types import SimpleNamespace

from tpufinetune.core.runevents import apply_event, split_malformed
from tpufinetune_trainer.events import parse_text
from tpufinetune_trainer.resume import checkpoint_name
from tpufinetune_trainer.train import Trainer

RUN = "gs://bucket/runs/tft-demo-1a2b"
FIRST, SECOND = "20261204T181241Z-24af", "20261204T182005Z-9c1e"


def entry(epoch: int, step: int, start: str, epoch_end: bool = True) -> dict:
    return {"epoch": epoch, "step": step, "loss": 3.0 - epoch / 10, "eval_loss": 3.1 - epoch / 10,
            "epoch_time_s": 12.5, "tokens_per_s": 900.0, "padded_tokens_per_s": 1000.0,
            "uri": f"{RUN}/{checkpoint_name(epoch_end, epoch, step, start)}", "save_s": 0.2, "write_s": 0.9}


# What the restored checkpoint (attempt 2's epoch 3) holds: epochs 1 and 2 of attempt 1, a
# step checkpoint inside epoch 3 written on notice, and epoch 3 itself.
SAVED = [entry(1, 10, FIRST), entry(2, 20, FIRST), entry(3, 25, SECOND, epoch_end=False), entry(3, 30, SECOND)]


def replayed_events(history: list[dict], epochs: int = 5) -> list[dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        Trainer.replay_record(SimpleNamespace(cfg=SimpleNamespace(num_epochs=epochs)), history)
    return parse_text(out.getvalue())


def folded(status: dict, events: list[dict]) -> dict:
    kept, dropped = split_malformed(status, events)
    assert not dropped, dropped  # nothing the status model or the API server would refuse
    status = copy.deepcopy(status)
    for event in kept:
        apply_event(status, event)
    return status


def test_the_epochs_lost_with_the_previous_cluster_reach_the_history_once():
    # What the operator had read: attempt 1's epochs 1 and 2 and their checkpoints.
    seen = folded({}, replayed_events(SAVED[:2]))
    assert [e["epoch"] for e in seen["history"]] == [1, 2]

    events = replayed_events(SAVED)
    assert all(e["replayed"] is True for e in events)
    # Only epoch ends: the step checkpoint inside epoch 3 is no epoch of its own.
    assert [(e["event"], e["epoch"]) for e in events] == [
        ("epoch", 1), ("checkpoint", 1), ("epoch", 2), ("checkpoint", 2), ("epoch", 3), ("checkpoint", 3)]
    status = folded(seen, events)
    assert [e["epoch"] for e in status["history"]] == [1, 2, 3]
    third = status["history"][2]
    assert third["checkpointURI"] == SAVED[3]["uri"] and third["step"] == 30 and third["loss"] == SAVED[3]["loss"]
    # The status points at the newest epoch and its checkpoint, the one resumed from.
    assert status["epoch"] == 3 and status["epochProgress"] == "3/5"
    assert status["checkpointURI"] == SAVED[3]["uri"] and status["checkpointStep"] == 30


def test_a_replay_of_what_the_operator_already_has_changes_nothing():
    status = folded({}, replayed_events(SAVED))
    assert folded(status, replayed_events(SAVED)) == status


def test_a_fresh_start_replays_nothing():
    assert replayed_events([]) == []
