"""Fold the trainer's machine events (docs/protocol.md) into the resource status. Pure.

Applying the same event twice gives the same status (history is keyed by epoch), so
re-reading a log after an operator restart cannot double-count anything.
"""

from __future__ import annotations

HISTORY_LIMIT = 20  # enough for `kubectl get -o yaml`; the full record is in the job log


def _round(value, digits: int):
    return None if value is None else round(float(value), digits)


def _history_entry(status: dict, epoch: int) -> dict:
    history = status.setdefault("history", [])
    for entry in history:
        if entry.get("epoch") == epoch:
            return entry
    entry = {"epoch": epoch}
    history.append(entry)
    history.sort(key=lambda e: e["epoch"])
    del history[:-HISTORY_LIMIT]
    return entry


def _on_start(status: dict, event: dict) -> None:
    devices = event.get("world_size")
    backend = event.get("backend", "")
    status["message"] = f"{event.get('mode', 'run')} started on {devices} workers ({backend})"


def _on_epoch(status: dict, event: dict) -> None:
    epoch = int(event["epoch"])
    epochs = int(event.get("epochs") or status.get("epochs") or epoch)
    metrics = {
        "loss": _round(event.get("loss"), 4),
        "evalLoss": _round(event.get("eval_loss"), 4),
        "tokensPerSecond": _round(event.get("tokens_per_s"), 1),
        "epochTimeSeconds": _round(event.get("epoch_time_s"), 2),
    }
    metrics = {k: v for k, v in metrics.items() if v is not None}
    _history_entry(status, epoch).update(metrics)
    if epoch >= int(status.get("epoch") or 0):
        status.update(metrics, epoch=epoch, epochs=epochs, epochProgress=f"{epoch}/{epochs}")
        loss = f"loss={metrics['loss']}" if "loss" in metrics else ""
        status["message"] = f"epoch {epoch}/{epochs} done {loss}".strip()


def _on_checkpoint(status: dict, event: dict) -> None:
    uri = event.get("uri")
    if not uri:
        return
    status["checkpointURI"] = uri
    if event.get("epoch") is not None:
        _history_entry(status, int(event["epoch"]))["checkpointURI"] = uri


def _on_result(status: dict, event: dict) -> None:
    if event.get("best_checkpoint_uri"):
        status["checkpointURI"] = event["best_checkpoint_uri"]
    if event.get("exported_model_uri"):
        status["exportedModelURI"] = event["exported_model_uri"]


def _on_failure(status: dict, event: dict) -> None:
    status["trainerFailure"] = {
        "type": str(event.get("type") or "Error")[:128],
        "message": str(event.get("message") or "")[:1024],
    }


def _on_collectives(status: dict, event: dict) -> None:
    passed = bool(event.get("passed"))
    world = event.get("world_size")
    if passed:
        message = f"all_reduce sum {event.get('all_reduce_sum')} and tensor-parallel parity OK on {world} ranks"
    else:
        message = f"ranks {event.get('failed_ranks')} disagree (expected sum {event.get('expected_sum')})"
    status["collectives"] = {"passed": passed, "ranks": world, "message": message}


HANDLERS = {
    "start": _on_start,
    "epoch": _on_epoch,
    "checkpoint": _on_checkpoint,
    "result": _on_result,
    "failure": _on_failure,
    "collectives": _on_collectives,
}


def apply_event(status: dict, event: dict) -> None:
    """Fold one event into status in place; unknown event kinds are ignored so an older
    operator keeps working with a newer trainer."""
    handler = HANDLERS.get(event.get("event", ""))
    if handler is not None:
        handler(status, event)
