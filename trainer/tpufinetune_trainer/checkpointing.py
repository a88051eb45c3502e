"""The loop's checkpoints and notices (a mixin of train.Trainer).

A checkpoint is started (`checkpoint`: asynchronous unless asked) and becomes known to Ray
Train, the history and the `checkpoint` event only once it is complete on every rank
(`settle_checkpoint`, `settled`, `complete_checkpoint`). At most one save is in flight.

After the steps the ranks agreed on in advance (notice.Agreements) they agree, in one
all_reduce on the gloo group, on the strongest notice any rank holds and on the save in
flight (`agree`); a notice makes every rank write that step's checkpoint (`on_notice`) and,
on SIGTERM, stop. At an epoch's end they agree once more (`agreed_at_epoch_end`)."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from . import notice, resume, storage
from .errors import Preempted


class Checkpointing:
    """Reads and writes the trainer's cfg, model, optimizer, history, pending, stager,
    saved_step, weights_uri, stopped, start_id, fingerprint and position."""

    def checkpoint(self, name: str, metrics: dict, state_extra: dict, synchronous: bool = False) -> str:
        """Start the sharded save of the current state straight to storage (a path or a URI);
        returns its location. An epoch's checkpoint is named `epoch_NNNN-<start>`, a step's
        `step_NNNNNNN-<start>` (report; resume.checkpoint_name). Asynchronous unless asked:
        training blocks only for the host copy of the shards, and Ray Train, the `checkpoint`
        event and self.history learn of the checkpoint only once it is complete on every rank
        (settle_checkpoint)."""
        self.settle_checkpoint(wait=True)  # at most one save in flight
        uri = ckpt.join_uri(self.cfg.storage_path, self.cfg.run_name, name)
        if self.stopped is not None:
            self.stopped.setdefault("uri", uri)
        entry = dict(metrics, uri=uri)
        # Ray Train ranks by the score attribute; a checkpoint saved without evaluation (on
        # notice) ranks last there instead of being logged as missing the key. Finite: Ray
        # Train keeps its checkpoint list as JSON, where NaN and infinities become null, and
        # a controller that restores a null score (the next attempt's) fails on it.
        worst = -sys.float_info.max if self.cfg.checkpoint_score_order == "max" else sys.float_info.max
        reported = {self.cfg.checkpoint_score_attribute: worst, **metrics}
        state = {"epoch": metrics["epoch"], "step": metrics["step"], "history": self.history + [entry],
                 "run_name": self.cfg.run_name, "start": self.start_id, "fingerprint": self.fingerprint,
                 **state_extra}
        pending = {"name": name, "entry": entry, "reported": reported, "epoch_end": resume.is_epoch_end(name)}
        if synchronous:
            start = time.perf_counter()
            ckpt.save_sharded(self.model, self.optimizer, uri, state, self.save_group)
            seconds = time.perf_counter() - start
            self.complete_checkpoint(pending, blocked_s=seconds, write_s=seconds)
        else:
            save = ckpt.async_save_sharded(self.model, self.optimizer, uri, state, self.save_group, self.stager)
            self.pending = dict(pending, save=save, waited_s=0.0)
        self.saved_step = metrics["step"]
        return uri

    def settle_checkpoint(self, wait: bool) -> None:
        """Collective (every rank calls it at the same step): if a save is in flight, agree
        whether it is complete on every rank, with one all_reduce on the gloo group, and if
        so report it. With `wait`, block until this rank's part is written first (the time
        counts as the save's). Every rank must call ray.train.report at the same point, and a
        rank's own future being done says nothing of the others', hence the agreement."""
        import concurrent.futures

        if self.pending is None:
            return
        save = self.pending["save"]
        if wait and not save.done():
            start = time.perf_counter()
            concurrent.futures.wait([save.future])
            self.pending["waited_s"] += time.perf_counter() - start
        flags = torch.tensor(self.save_flags(), dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.cpu_group)
        self.settled(*(bool(flag) for flag in flags.tolist()))

    def save_flags(self) -> tuple[int, int]:
        """This rank's part of the background save's agreement: (not done, failed); (0, 0)
        with none in flight."""
        if self.pending is None:
            return 0, 0
        save = self.pending["save"]
        return (0 if save.done() else 1), (1 if save.failure() is not None else 0)

    def settled(self, not_done: bool, failed: bool) -> None:
        """What the ranks agreed of the save in flight: report it once complete everywhere."""
        save = self.pending["save"]
        if failed:
            if save.failure() is not None:
                save.future.result()  # this rank's own failure
            raise RuntimeError(f"the checkpoint {self.pending['entry']['uri']} failed on another rank")
        if not_done:
            return
        pending, self.pending = self.pending, None
        self.complete_checkpoint(pending, blocked_s=save.blocked_s + pending["waited_s"], write_s=save.write_s)

    def complete_checkpoint(self, pending: dict, blocked_s: float, write_s: float) -> None:
        """A checkpoint is complete on every rank: report it to Ray Train (every rank, in
        place, no upload), add it to the history, emit its event. save_s is the training time
        it blocked (the host copy, plus any wait for it); write_s the time from its start to
        rank 0's trainer_state.json (this rank's last file otherwise)."""
        import ray.train
        from ray.train import CheckpointUploadMode

        entry, uri = pending["entry"], pending["entry"]["uri"]
        entry["save_s"], entry["write_s"] = round(blocked_s, 3), round(write_s, 3)
        fs, path = storage.filesystem(uri)
        ray.train.report(pending["reported"], checkpoint=ray.train.Checkpoint(path, filesystem=fs),
                         checkpoint_dir_name=pending["name"], checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        self.history.append(entry)
        self.weights_uri = uri
        if self.rank == 0:
            self.checkpoint_event(entry, pending["epoch_end"])

    # ------------------------------------------------------------------ notices
    def agree(self, metrics) -> None:
        """After a step the ranks agreed on in advance (self.agreements.due): every rank
        agrees on the strongest notice and the save in flight, in one all_reduce; a notice
        is acted on (`metrics`: the epoch's figures so far, computed only then), else a save
        complete everywhere is reported."""
        code, not_done, failed, steps_to_next = self.notice.agreed(
            self.cpu_group, *self.save_flags(), self.agreements.proposal(self.global_step))
        self.agreements.agreed(self.global_step, steps_to_next, self.step_counter)  # a device value
        if code:
            self.on_notice(code, metrics)
        elif self.pending is not None:
            self.settled(bool(not_done), bool(failed))

    def agreed_at_epoch_end(self) -> int:
        """Collective, at an epoch's end (every rank is there): the strongest notice any rank
        holds. Only a SIGTERM is acted on here; a request stays pending for the next
        step's agreement (the epoch's checkpoint is about to be written anyway)."""
        return self.notice.agreed(self.cpu_group)[0]

    def on_notice(self, code: int, metrics) -> None:
        """Every rank agreed on a notice after the same step: write that step's checkpoint
        (no evaluation: the fastest safe save) unless one was just written, report it, and
        on SIGTERM stop. The step in flight when the signal came is finished and kept."""
        received = time.perf_counter()
        request = self.notice.served()
        self.settle_checkpoint(wait=True)  # the one in flight may be this very step's
        if self.saved_step != self.global_step:
            # Synchronous: on SIGTERM it must be complete before the process goes.
            self.report(metrics(), epoch_end=False, evaluate=False, synchronous=True)
        uri = self.weights_uri
        fields = {"reason": notice.REASONS[code], "requested_by": request.get("reason"),
                  "detail": request.get("detail"), "epoch": self.epoch, "step": self.global_step,
                  "epoch_step": self.epoch_step, "uri": uri, "save_s": round(time.perf_counter() - received, 3)}
        if self.rank == 0:
            self.notice_event(fields)
        if code == notice.TERMINATING:
            notice.done()
            raise Preempted(f"SIGTERM: the checkpoint of step {self.global_step} is {uri}; the next attempt "
                            "resumes from it", fields)
