"""A start continues its run (a mixin of train.Trainer): which checkpoint (`resume_choice`,
rank 0), whether it is this run's and where it puts the loop (resume.py), and the load of
its shards into the model and the optimizer, in place (`restore`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from . import resume, run_events
from .errors import ConfigError, StorageError


class Restore:
    """Sets the trainer's position, history, weights_uri and early-stopping state."""

    def restore(self, ray_checkpoint: str | None = None) -> None:
        """Continue the run from its newest complete checkpoint, if it is this run's. Rank 0
        chooses (`resume_choice`) and every rank checks the same state: the checkpoint's
        fingerprint must be this run's and its saved step where its position puts it in this
        plan (resume.py), else every rank raises ResumeMismatch, naming what differs. Every
        rank reads only its own shards, in place."""
        decision: list = [None]
        if self.rank == 0:
            try:
                decision[0] = ("chosen", *self.resume_choice(ray_checkpoint))
            except Exception as exc:  # noqa: BLE001 - every rank raises it, none waits in a collective
                decision[0] = ("failed", exc)
        dist.broadcast_object_list(decision, src=0, group=self.cpu_group)
        if decision[0][0] == "failed":
            raise decision[0][1]
        _, location, source, state = decision[0]
        if not location:
            return
        checked = resume.check(state, self.fingerprint, location)
        epoch, done, step = resume.position(state, self.epoch_steps, location)
        self.restored = True
        self.resumed_from = location
        self.init_optimizer_state()
        ckpt.load_sharded(self.model, self.optimizer, location, self.cpu_group)
        self._attach_lr()  # the loaded param groups carry a copy of the learning rate
        self.history = list(state.get("history", []))
        self.weights_uri = location
        # The saved step and position, never one derived from this run's plan.
        self.epoch, self.epoch_step, self.global_step = epoch, done, step
        # A step checkpoint inside the epoch, or at its last step (a notice there): the
        # epoch's end (evaluation, epoch checkpoint) is still to do, even with no step left.
        self.end_pending = bool(done) and not resume.is_epoch_end(location)
        if done:
            self.carried = (float(state.get("epoch_loss_sum", 0.0)), int(state.get("epoch_label_tokens", 0)))
        self.training_s_before = float(state.get("training_s", 0.0))
        self.stale_evals = int(state.get("stale_evals", 0))
        self.saved_step = self.global_step
        self.step_counter.fill_(min(self.global_step, max(self.total_steps - 1, 0)))  # once, at start
        self.startup.mark("model_loaded")  # the restored weights are the ones the first step trains
        if self.rank == 0:
            self.replay_record(self.history)
            where = f"epoch {epoch - 1}" if not done else f"epoch {epoch} step {done}/{self.epoch_steps}"
            run_events.say(f"Resumed from {location} at {where} (global step {self.global_step}): {source}"
                           + ("" if checked else "; it carries no fingerprint (an earlier trainer wrote it), so "
                              "only its step was checked"))

    def resume_choice(self, ray_checkpoint: str | None) -> tuple[str | None, str | None, dict | None]:
        """Rank 0: (location, why it, its trainer state) of the checkpoint to continue from,
        or Nones. The newest complete checkpoint of the run's directory across every start
        (checkpoint.latest_complete): it holds whatever Ray Train registered (its restore,
        across jobs of one run name, or a restart under --max-failures), and also a
        checkpoint every rank wrote that Ray Train had not registered yet. Without one,
        --resume-from, which must be complete."""
        run_dir = ckpt.join_uri(self.cfg.storage_path, self.cfg.run_name)  # Ray Train's layout
        location = ckpt.latest_complete(run_dir)
        if location:
            if location == ray_checkpoint:
                source = "Ray Train's latest"
            elif ray_checkpoint:
                source = (f"the newest complete one in the run's directory (Ray Train's latest, {ray_checkpoint}, "
                          f"is {'older' if ckpt.is_complete(ray_checkpoint) else 'incomplete or gone'})")
            else:
                source = "the newest complete one in the run's directory"
        elif ray_checkpoint and ckpt.is_complete(ray_checkpoint):
            location, source = ray_checkpoint, "Ray Train's latest"
        elif self.cfg.resume_from:
            location, source = self.cfg.resume_from, "--resume-from"
            if not ckpt.is_complete(location):
                raise ConfigError(f"--resume-from {location} is not a complete checkpoint (its trainer state, DCP "
                                  "metadata or a shard the metadata names is missing or short): resume from a "
                                  "complete one")
        elif ray_checkpoint:  # never start the run over while Ray Train holds it has a checkpoint
            raise StorageError(f"Ray Train's latest checkpoint {ray_checkpoint} is incomplete or gone, and the "
                               f"run's directory {run_dir} holds no complete checkpoint: the run cannot continue "
                               "from where it was; start a new run (another --run-name)")
        else:
            return None, None, None
        return location, source, ckpt.read_trainer_state(location)

    def init_optimizer_state(self) -> None:
        """AdamW's state, made on the parameters' device before a restore loads into it: one
        step of zero gradients at a learning rate of 0 (the device tensor every group holds),
        which moves no weight. Without it DCP's get_state_dict makes the state itself, its
        rate for that step a new CPU tensor, which a capturable optimizer on an accelerator
        must not take."""
        if self.optimizer.state:
            return
        for param in self.params:
            param.grad = torch.zeros_like(param)
        rate = self.lr.clone()
        self.lr.zero_()
        self.optimizer.step()
        self.lr.copy_(rate)
        self.optimizer.zero_grad(set_to_none=True)
