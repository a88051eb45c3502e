"""The per-worker training loop, run by every Ray Train worker.

A start: set up (worker_setup.py: device, model, plan, optimizer, held-out data) ->
restore (restore.py) -> epochs of steps (this file), each epoch ending in an evaluation
and a checkpoint (evaluation.py, checkpointing.py), with notices agreed after the steps
agreed in advance (checkpointing.py) -> the best checkpoint exported and proven (finish.py).
What rank 0 says and emits is assembled in run_events.py. Only rank 0 prints.

The hot loop never makes the host wait for the device: token counts come from the host's
plan (every rank knows the global batch's label count), the packed blocks and every
step's block indices and count reach the device in one host-to-device copy per window of
LOAD_WINDOW_STEPS steps (a step selects its row there), the attention masks are built there
from segment ids, the learning rate is read from a table on the device, and the loss is
summed on the device in fp32, the LM head at label positions only (loss.py). The host reads
a device value once per epoch (the loss), at a checkpoint, at most once per --progress-interval
on rank 0, once after each start's first step on rank 0 (its start-up stages, startup.py), at each epoch's end, and, on rank 0, at each agreement the step counter the last
one left (notice.Agreements: an interval old, so the device has usually produced it)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import checkpoint as ckpt
from . import compile_cache
from . import logship
from . import loss as head
from . import notice
from . import run_events
from . import tboard
from .backends import BACKENDS, Backend
from .checkpointing import Checkpointing
from .config import FinetuneConfig
from .data import IGNORE_INDEX, EpochPlan, plan_epoch, rank_blocks, window_rows
from .device_blocks import DeviceBlocks
from .evaluation import Evaluation
from .finish import Finish
from .parallelize import clip_grad_norm, micro_batch_backward
from .restore import Restore
from .run_events import ProgressWindow, RunEvents
from .startup import Startup
from .worker_setup import Setup
# Imported from here by the driver (finetune.py) and benchmarks/.
from .run_events import quiet_progress_bars  # noqa: F401
from .worker_setup import param_groups  # noqa: F401

# Steps whose packed blocks are on the device at once (Trainer.load_window): one
# host-to-device copy per window, and memory for a window's blocks, not an epoch's.
LOAD_WINDOW_STEPS = 256


class Trainer(Setup, Restore, Evaluation, Checkpointing, Finish, RunEvents):
    """One worker's run. Its parts: Setup (worker_setup.py), Restore (restore.py),
    Evaluation (evaluation.py), Checkpointing (checkpointing.py: checkpoints, notices),
    Finish (finish.py: the export), RunEvents (run_events.py: lines and events); the loop
    is here."""

    def __init__(self, cfg: FinetuneConfig, backend: Backend, data: dict, rank: int, world: int, local_rank: int,
                 startup: Startup | None = None):
        self.cfg, self.backend, self.rank, self.world = cfg, backend, rank, world
        # This attempt's start-up stages (startup.py), reported once after the first step.
        self.startup = startup if startup is not None else Startup()
        self.set_up(data, local_rank)  # device, groups, model, plan, optimizer, held-out data
        self.history: list[dict] = []
        self.epoch, self.epoch_step, self.global_step = 1, 0, 0
        self.end_pending = False  # restored inside an epoch whose end is still to do (restore)
        self.carried = (0.0, 0)  # (loss sum, label tokens) of the resumed epoch's earlier steps
        self.weights_uri: str | None = None  # which checkpoint's weights the model holds
        self.restored = False
        self.resumed_from: str | None = None
        self.notice = notice.NoticeWatch(rank)  # SIGTERM only; train_func adds Ray's KV requests
        self.agreements = notice.Agreements(rank)  # after which steps the ranks agree on both
        self.saved_step = -1  # the global step of the last checkpoint written or being written
        self.pending: dict | None = None  # the checkpoint being written in the background
        self.stager = ckpt.HostStager()  # its host copy, kept from one checkpoint to the next
        # Early stopping: training seconds (across attempts, from the checkpoint's state),
        # evaluations in a row without a lower eval loss, and why the run stopped early.
        self.training_s_before, self.started = 0.0, time.perf_counter()
        self.stale_evals = 0
        self.stopped: dict | None = None
        self.grad_norm: torch.Tensor | None = None  # the last step's global norm before clipping
        self.board = tboard.Board("", enabled=False)  # run() opens rank 0's (tboard.py)
        # The loaded window (load_window): (epoch, first step, end step) of the steps whose
        # blocks this rank holds on the host and on the device, their inputs on the device,
        # and the row of the next step there.
        self.window: tuple[int, int, int] | None = None
        self.window_steps = LOAD_WINDOW_STEPS
        self.epoch_blocks = None
        self.train_blocks: DeviceBlocks | None = None
        self.epoch_inputs: torch.Tensor | None = None
        self.epoch_row: torch.Tensor | None = None

    # ------------------------------------------------------------------ epochs
    def run(self) -> None:
        self.started = time.perf_counter()
        self.board = tboard.Board(tboard.attempt_uri(self.cfg.storage_path, self.cfg.run_name, self.start_id),
                                  enabled=self.rank == 0)
        try:
            if self.rank == 0:
                self.announce()
            while (self.global_step < self.total_steps or self.end_pending) and self.stopped is None:
                began = time.perf_counter()
                metrics = self.train_epoch()
                # A resume at an epoch's last step: that epoch's end comes before this start's first step.
                resumed_end = self.restored and not self.startup.reported
                if self.stopped is None:
                    # A SIGTERM in the epoch's last steps: its step saved now, without the
                    # evaluation, which can outlast the pod's share of the notice (resume
                    # then does the epoch's end: resume.position).
                    if self.agreed_at_epoch_end() == notice.TERMINATING:
                        self.on_notice(notice.TERMINATING, lambda: metrics)
                    self.report(metrics, epoch_end=True)
                    self.share_compile_cache()
                    if resumed_end:
                        self.startup.note(resumed_epoch_end_s=round(time.perf_counter() - began, 3))
                    # The next epoch's first step agrees: a SIGTERM during the epoch's end
                    # (after the checks in report) waits one step, not a stretch of them.
                    self.agreements.soon(self.global_step)
            self.export()
        finally:  # the end, a failure or a preemption: what was written is in storage
            self.board.close()
            self.share_compile_cache()
        notice.done()

    def share_compile_cache(self) -> None:
        """Local rank 0 of each host, at each checkpoint and at the end: the compile cache's
        files the run's storage lacks uploaded (compile_cache.py), so a retry compiles
        nothing this attempt compiled. A failed upload costs a retry compiles, never the run."""
        if not getattr(self, "shares_compile_cache", False):
            return
        try:
            copied = compile_cache.upload(Path(self.compile_cache_dir), self.run_compile_cache)
        except OSError as e:
            run_events.say(f"Compile cache: could not upload to {self.run_compile_cache}: {e}")
            return
        if copied:
            run_events.say(f"Compile cache: {copied} new file(s) uploaded to {self.run_compile_cache}")

    def training_s(self) -> float:
        """Seconds of training so far, earlier attempts included (loading and export not)."""
        return self.training_s_before + time.perf_counter() - self.started

    def train_epoch(self) -> dict:
        """Steps of the current epoch from self.epoch_step on; checkpoints every
        --checkpoint-every-steps and stops at --max-steps."""
        cfg = self.cfg
        self.model.train()
        self.method.start_epoch()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        window = ProgressWindow(time.perf_counter())
        label_tokens = real_tokens = steps = 0
        start = time.perf_counter()
        epoch = self.epoch_plan  # train_step loads its blocks a window of steps at a time
        while self.epoch_step < self.epoch_steps and self.global_step < self.total_steps:
            step = self.epoch_step
            self.train_step(loss_sum)  # its input is the table's row (epoch_inputs)
            self.epoch_step += 1
            self.global_step += 1
            if not self.startup.reported:
                self.first_step_done(loss_sum)
            if self.global_step == cfg.fail_at_step and not self.restored:
                self.settle_checkpoint(wait=True)  # the test's resume point is then deterministic
                raise RuntimeError(f"injected failure after step {self.global_step} (--fail-at-step)")
            steps += 1
            label_tokens += int(epoch.label_tokens[step])
            real_tokens += int(epoch.real_tokens[step])
            window.add(self.rank_label_tokens(step), int(epoch.real_tokens[step]))
            if self.rank == 0 and window.due(cfg.progress_interval_s):
                self.emit_progress(window, loss_sum)
            if cfg.checkpoint_every_steps and self.global_step % cfg.checkpoint_every_steps == 0 \
                    and self.epoch_step < self.epoch_steps and self.global_step < self.total_steps:
                elapsed = time.perf_counter() - start
                self.report(self.epoch_metrics(loss_sum, label_tokens, real_tokens, elapsed, steps),
                            epoch_end=False)
                self.share_compile_cache()
                self.model.train()
            if self.agreements.due(self.global_step):  # a notice, and the save in flight (checkpointing.py)
                self.agree(lambda: self.epoch_metrics(loss_sum, label_tokens, real_tokens,
                                                      time.perf_counter() - start, steps))
            if self.stopped is not None:
                break
        if self.rank == 0 and window.steps:
            # The epoch's last window: at a step every rank agrees on (the epoch's end, whose
            # metrics all_reduce follows), so status.progress and its curve are current at
            # each epoch's end, however short the epoch.
            self.emit_progress(window, loss_sum)
        self.drop_window()  # free the epoch's last blocks
        return self.epoch_metrics(loss_sum, label_tokens, real_tokens, time.perf_counter() - start, steps)

    # ------------------------------------------------------------------ one step
    def token_loss_sum(self, batch: dict, cap: int | None = None) -> torch.Tensor:
        """Summed cross-entropy over the label tokens of a micro-batch, in fp32. The head
        runs at `cap` gathered label positions (loss.py; None: every position), or, for a
        model whose head loss.py does not reproduce, over transformers' full logits."""
        masks = self.masks(batch["segment_ids"])
        if self.label_head:
            cap = batch["targets"].numel() if cap is None else cap
            return self.model.label_loss_sum(batch["input_ids"], batch["position_ids"], masks, batch["targets"], cap)
        return self.full_logits_loss_sum(batch, masks)

    def full_logits_loss_sum(self, batch: dict, masks) -> torch.Tensor:
        """transformers' forward: the logits of every position, then the loss (the reference
        the label-position head is tested against)."""
        out = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=masks,
                         use_cache=False)
        return F.cross_entropy(out.logits.flatten(0, 1).float(), batch["targets"].flatten().long(),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    def train_step(self, loss_sum: torch.Tensor) -> None:
        """The next optimizer step of the current epoch (self.epoch), from the epoch's table
        on the device: the step takes its row there by the device step counter."""
        if not self.holds(self.epoch_step):
            self.load_window()
        step_input = self.epoch_inputs.index_select(0, self.epoch_row).squeeze(0)
        self.epoch_row += 1
        self.step_from(step_input, loss_sum)

    @property
    def epoch_plan(self) -> EpochPlan:
        """The current epoch's plan, built when first asked for (a pure function of the data,
        the plan and the seed: a resume mid-epoch gets the same); only the current one is kept."""
        if self.planned is None or self.planned[0] != self.epoch:
            self.planned = None  # the previous epoch's plan goes before the next is built
            self.planned = (self.epoch, plan_epoch(self.examples.lengths, self.example_labels, self.plan,
                                                   self.epoch, self.cfg.seed, self.cfg.max_seq_len))
        return self.planned[1]

    def holds(self, step: int) -> bool:
        """Whether the loaded window holds step `step` of the current epoch."""
        return self.window is not None and self.window[0] == self.epoch and self.window[1] <= step < self.window[2]

    def load_window(self) -> None:
        """This rank's packed blocks of the next `window_steps` steps of the current epoch
        (from self.epoch_step) and each step's input (data.window_rows), copied to the device
        in one copy each, a short last window padded to the others' shape; the loop takes a
        step's row by the device step counter. Host and device hold one window, not the
        epoch. Every micro-batch is checked against the loss head's cap first."""
        plan, epoch, first = self.plan, self.epoch_plan, self.epoch_step
        size, end = min(self.window_steps, len(epoch)), min(len(epoch), first + self.window_steps)
        self.drop_window()  # the previous window's memory goes first
        self.epoch_blocks = rank_blocks(self.examples, epoch, self.rank, self.cfg.max_seq_len, self.pad_id,
                                        steps=slice(first, end), fill=self.method.fill)
        per_step = plan.accum * plan.blocks
        index = np.arange((end - first) * per_step, dtype=np.int64).reshape(end - first, plan.accum, plan.blocks)
        head.check_cap(self.epoch_blocks, index, self.train_cap, f"epoch {self.epoch} steps {first + 1} to {end}")
        self.train_blocks = DeviceBlocks(self.epoch_blocks, self.device, self.pad_id, rows=size * per_step)
        rows = window_rows(index.reshape(end - first, per_step), epoch.label_tokens[first:end], size)
        self.epoch_inputs = torch.from_numpy(rows).to(self.device)
        self.epoch_row = torch.zeros((1,), dtype=torch.int64, device=self.device)
        self.window = (self.epoch, first, end)

    def drop_window(self) -> None:
        """Free the loaded window's host and device blocks."""
        self.window = self.epoch_blocks = self.train_blocks = self.epoch_inputs = None

    def rank_label_tokens(self, step: int) -> int:
        """Label tokens of this rank's blocks in step `step` of the loaded window."""
        per_step, row = self.plan.accum * self.plan.blocks, step - self.window[1]
        return int(self.epoch_blocks.label_tokens[row * per_step:(row + 1) * per_step].sum())

    def step_from(self, step_input: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """One optimizer step from a device row: this rank's block indices, then the global
        batch's label count. Every response token weighs the same: the loss is the global sum
        divided by the global count. FSDP averages gradients over ranks, so each rank scales
        by the world size to make that average a sum."""
        index = step_input[:-1].view(self.plan.accum, self.plan.blocks)
        scale = self.world / step_input[-1].clamp(min=1).to(torch.float32)
        for micro in range(self.plan.accum):
            summed = self.method.loss_sum(self, self.train_blocks.gather(index[micro]), self.train_cap)
            micro_batch_backward(self.model, summed * scale, micro, self.plan.accum)  # HSDP: all-reduce at the last
            loss_sum += summed.detach()
        if self.cfg.max_grad_norm > 0:
            self.grad_norm = clip_grad_norm(self.params, self.cfg.max_grad_norm)  # stays on the device
        self.lr.copy_(self.lr_table.index_select(0, self.step_counter).squeeze(0))
        self.step_counter += 1
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def epoch_metrics(self, loss_sum: torch.Tensor, label_tokens: int, real_tokens: int, elapsed: float,
                      steps: int) -> dict:
        """Global metrics of the epoch so far: one fp32 all_reduce of the loss sum."""
        total = loss_sum.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        carried_sum, carried_tokens = self.carried
        summed = float(total.item()) + carried_sum
        loss = summed / max(label_tokens + carried_tokens, 1)
        padded = steps * self.plan.global_blocks * self.cfg.max_seq_len
        return {"epoch": self.epoch, "step": self.global_step, "loss": loss, "epoch_time_s": elapsed,
                "tokens_per_s": real_tokens / max(elapsed, 1e-9), "padded_tokens_per_s": padded / max(elapsed, 1e-9),
                "steps": steps, "epoch_step": self.epoch_step, "epoch_loss_sum": summed,
                "epoch_label_tokens": label_tokens + carried_tokens,
                "batch_shapes": [[self.plan.blocks, self.cfg.max_seq_len]],
                "method": self.method_sums(label_tokens)}

    def method_sums(self, counted: int) -> dict:
        """The method's own epoch figures (DPO's rewards, margin, accuracy over the `counted`
        pairs of this start; SFT has none). Collective for DPO."""
        return self.method.epoch_sums(self, counted)


def train_func(config: dict) -> None:
    """Ray Train entry point (one call per worker): its output is kept with the attempt's
    logs as `worker-<world rank>` (logship)."""
    import ray.train

    ctx = ray.train.get_context()
    cfg = config["cfg"]
    uri = logship.attempt_logs_uri(cfg["storage_path"], cfg["run_name"])
    with logship.shipping(logship.worker_stream(ctx.get_world_rank()), uri, num_workers=ctx.get_world_size()):
        _train_worker(config)


def _train_worker(config: dict) -> None:
    import ray
    import ray.train
    import ray.train.torch

    run_events.quiet_progress_bars()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    backend = BACKENDS[config["backend"]]
    cfg = FinetuneConfig(**config["cfg"])
    startup = Startup.of(config.get("startup"))
    startup.mark("workers_ready")
    if rank == 0:
        run_events.start_event(cfg, backend, world, ctx.get_local_world_size(), config)
    data = ray.get(config["data"])
    # On GPU, Ray Train decides which visible CUDA device is this worker's.
    local = ray.train.torch.get_device().index if backend.name == "cuda" else ctx.get_local_rank()
    trainer = Trainer(cfg, backend, data, rank, world, local, startup)
    trainer.notice = notice.ray_kv_watch(rank, cfg.run_name)
    registered = ray.train.get_checkpoint()
    trainer.restore(ckpt.checkpoint_location(registered) if registered is not None else None)
    trainer.run()
