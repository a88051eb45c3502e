"""The per-worker training loop, run by every Ray Train worker.

Built in a fixed order: device -> model -> parallelize (+compile) -> optimizer ->
schedule -> data on the device -> restore -> steps (train, progress, eval, sharded
checkpoints) -> export of the best checkpoint. Only rank 0 prints.

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

import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import checkpoint as ckpt
from . import export
from . import logship
from . import loss as head
from . import notice
from . import resume
from . import storage
from .startup import Startup
from . import generation, tboard
from .backends import BACKENDS, Backend, compile_enabled, compute_dtype, setup_device, use_compile_cache
from .config import FinetuneConfig
from .errors import ConfigError, Preempted, StorageError
from .data import IGNORE_INDEX, BatchPlan, EpochPlan, Examples, Packed, epoch_step_count, plan_epoch, plan_run, \
    rank_blocks, rank_eval_share, window_rows
from .events import emit
from .masks import MaskBuilder
from .methods import for_config as method_for
from .model import base_directory, freeze_input_embeddings, load_tokenizer
from .parallelize import apply_activation_checkpointing, build_mesh, clip_grad_norm, micro_batch_backward
from .schedule import decay_steps, lr_table, warmup_steps
from .sharded_load import load_sharded

# Steps whose packed blocks are on the device at once (Trainer.load_window): one
# host-to-device copy per window, and memory for a window's blocks, not an epoch's.
LOAD_WINDOW_STEPS = 256

# Under <storage>/<run name>/, beside the model's `export`: the LoRA adapter (--method lora).
ADAPTER_EXPORT_DIR = "export-adapter"


def quiet_progress_bars() -> None:
    import datasets
    from transformers.utils import logging

    logging.disable_progress_bar()
    datasets.disable_progress_bars()


def say(line: str) -> None:
    """A human log line. Not print(): Ray Train patches print in workers and the line
    would reach the job log twice."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def is_better(a: float, b: float, order: str) -> bool:
    return a < b if order == "min" else a > b


def best_entry(history: list[dict], attribute: str, order: str) -> dict | None:
    """The checkpoint with the best score (earliest wins a tie, as in Ray)."""
    best = None
    for entry in history:
        score = entry.get(attribute)
        if entry.get("uri") and score is not None and (best is None or is_better(score, best[attribute], order)):
            best = entry
    return best


def param_groups(params: list, weight_decay: float) -> list[dict]:
    """AdamW's groups: weight decay on matrices (and embeddings) only; none on 1-D (and
    scalar) parameters, the norm scales and biases, which decay would pull towards 0 (a norm
    scale of 0 silences its layer). A DTensor's `ndim` is its full tensor's."""
    decay = [p for p in params if p.ndim >= 2]
    plain = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class DeviceBlocks:
    """Packed blocks copied to the device in one transfer (the evaluation's once, a
    window's training blocks). A micro-batch is gathered there by indices; from index `len(packed)`
    on, to `rows`, all-padding filler blocks (no labels; every window one shape: no recompile).

    Token ids, position ids and segment ids are int32 (the embedding lookup, the rotary
    positions and the masks take them; half of int64's device memory and bandwidth); the
    targets are int32 too and become int64 only per micro-batch, for cross_entropy."""

    def __init__(self, packed: Packed, device, pad_id: int, rows: int = 0):
        length, fillers = packed.input_ids.shape[1], max(rows - len(packed), 0) + 1  # padded to `rows` + 1

        def with_filler(array: np.ndarray, fill: np.ndarray) -> torch.Tensor:
            filled = np.concatenate([array, np.repeat(fill[None, :], fillers, axis=0)])
            return torch.from_numpy(filled.astype(np.int32)).to(device)

        self.input_ids = with_filler(packed.input_ids, np.full(length, pad_id, np.int64))
        # targets[t] = labels[t + 1]: what position t predicts, so the loss needs no slicing.
        targets = np.full_like(packed.labels, IGNORE_INDEX)
        targets[:, :-1] = packed.labels[:, 1:]
        self.targets = with_filler(targets, np.full(length, IGNORE_INDEX, np.int64))
        self.position_ids = with_filler(packed.position_ids, np.arange(length, dtype=np.int64))
        self.segment_ids = with_filler(packed.segment_ids, np.ones(length, np.int64))
        self.filler = len(packed)
        # --method dpo, full: the stored reference's sums in the blocks' segment layout (fp32).
        reference = getattr(packed, "reference", None)
        self.reference = None if reference is None else torch.from_numpy(np.concatenate(
            [reference, np.zeros((fillers, reference.shape[1]), np.float32)])).to(device)

    def gather(self, index: torch.Tensor) -> dict:
        names = ("input_ids", "targets", "position_ids", "segment_ids") + (() if self.reference is None
                                                                            else ("reference",))
        return {name: getattr(self, name).index_select(0, index) for name in names}


class Trainer:
    def __init__(self, cfg: FinetuneConfig, backend: Backend, data: dict, rank: int, world: int, local_rank: int,
                 startup: Startup | None = None):
        self.cfg, self.backend, self.rank, self.world = cfg, backend, rank, world
        # This attempt's start-up stages (startup.py), reported once after the first step.
        self.startup = startup if startup is not None else Startup()
        # Before torch_tpu is imported and anything compiles: both read the cache's place then.
        self.compile_cache = use_compile_cache(cfg.compile_cache_dir, backend)
        self.device = setup_device(backend, local_rank)
        self.cpu_group = ckpt.cpu_group()  # DCP plans and barriers: pickled objects, never over ICI
        # DCP's background writes only: a group shared with this thread's collectives could
        # pair them differently on different ranks.
        self.save_group = ckpt.cpu_group()
        mesh = build_mesh(backend.device_type, world, cfg.num_slices, self.cpu_group)
        if rank == 0 and cfg.num_slices > 1:
            say(f"HSDP over {cfg.num_slices} slices: sharded within a slice, replicated across; mesh "
                f"{mesh.mesh_dim_names} rows (ranks by slice) {mesh.mesh.tolist()}")
        self.probe_checkpoint_storage(mesh)
        self.examples: Examples = data["train"]
        self.eval_data = data.get("eval")
        # The held-out prompts and responses each epoch's generation answers (generation.py).
        self.generation_items = (generation.held_out(self.eval_data, cfg.generate_examples)
                                 if cfg.generate_examples and self.eval_data is not None else [])
        # What the run trains and how a micro-batch becomes its loss (methods/): SFT or DPO.
        self.method = method_for(cfg)
        self.pad_id = int(data["pad_id"])
        self.tokenizer = load_tokenizer(cfg.model_id) if rank == 0 else None
        self.dtype = compute_dtype(backend, cfg.compute_dtype)
        torch.manual_seed(cfg.seed)
        # Master weights in fp32; FSDP computes in self.dtype (see parallelize.py). Built on
        # the meta device and sharded there; each rank reads only its own slices (sharded_load.py).
        self.compiled = compile_enabled(backend, cfg.compile)
        self.attn_implementation = cfg.attn_implementation(backend.attn_implementation)
        self.model, loaded = load_sharded(cfg.model_id, self.attn_implementation, mesh, self.dtype,
                                          compile=self.compiled, device=self.device, full=cfg.model_load == "full",
                                          lora=cfg if cfg.uses_lora else None,
                                          reshard_after_forward=cfg.reshard_after_forward,
                                          fallback=cfg.model_load == "sharded-or-full")
        self.startup.mark("model_loaded")
        if rank == 0:
            say(f"Model {cfg.model_id}: {loaded}")
        # Both before the parameter list and the optimizer (a frozen weight gets no state).
        apply_activation_checkpointing(self.model, cfg.activation_checkpointing)
        if cfg.freeze_embeddings:
            freeze_input_embeddings(self.model)
        # Else transformers' full-logits forward: asked for, or a head loss.py does not reproduce.
        self.label_head = cfg.loss_head == "labels" and self.method.label_head and head.uses_label_head(self.model)
        if self.label_head:
            head.install(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.masks = MaskBuilder(self.model.config, cfg.max_seq_len, self.device, self.dtype,
                                 self.attn_implementation)
        # A step is the tutorial's batch of examples; its blocks per device are fixed for the
        # run: what the fullest step of any epoch needs (static shapes).
        self.example_labels = self.method.example_weights(self.examples)  # SFT: label tokens; DPO: 1 a pair
        base = cfg.batch_plan()
        self.epoch_steps = epoch_step_count(self.examples.lengths, base)
        self.total_steps = self.epoch_steps * cfg.num_epochs
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        epochs = -(-self.total_steps // self.epoch_steps)  # the epochs the run reaches (--max-steps)
        # Both whole-run maxima (blocks per device, the loss head's label cap) in one pass;
        # each epoch's plan is built when the loop reaches it (epoch_plan).
        shape = plan_run(self.examples.lengths, self.example_labels, base, epochs, cfg.seed, cfg.max_seq_len)
        self.plan: BatchPlan = shape.plan
        self.planned: tuple[int, EpochPlan] | None = None  # (epoch, its plan): the current epoch's only
        self._build_optimizer()
        # What a resume must match (resume.py), and this start's id: its checkpoints' names
        # are its own, never another start's (rank 0's id, so every rank names alike).
        self.fingerprint = resume.fingerprint(cfg, world, self.examples)
        start = [resume.new_start_id() if rank == 0 else None]
        dist.broadcast_object_list(start, src=0, group=self.cpu_group)
        self.start_id: str = start[0]
        # Before any restore (DPO's stored reference is the starting model's): the held-out
        # data as the loop takes it (packed blocks).
        self.eval_data = self.method.prepare(self, self.eval_data)
        # This rank's share of the held-out blocks on its device, and its order over them
        # (filler slots take the filler block), both copied once for every evaluation.
        self.eval_blocks, self.eval_index = None, None
        if self.eval_data:
            share, order = rank_eval_share(self.eval_data, world, self.plan.blocks, rank)
            self.eval_blocks = DeviceBlocks(share, self.device, self.pad_id)
            self.eval_index = torch.from_numpy(np.where(order < 0, self.eval_blocks.filler, order)).to(self.device)
        # Rows of the loss head's label buffer: the most label tokens of any micro-batch the
        # run takes (static for the whole run; loss.py).
        positions = self.plan.blocks * cfg.max_seq_len
        self.train_cap = head.label_cap(shape.most_label_tokens, positions)
        self.eval_cap = head.label_cap(head.most_eval_label_tokens(self.eval_data, world, self.plan.blocks),
                                       positions) if self.eval_data else positions
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
        self.epoch_blocks: Packed | None = None
        self.train_blocks: DeviceBlocks | None = None
        self.epoch_inputs: torch.Tensor | None = None
        self.epoch_row: torch.Tensor | None = None

    def probe_checkpoint_storage(self, mesh) -> None:
        """Save and load a tiny sharded state the way every checkpoint will (ckpt.startup_probe)
        before the model is loaded: a storage, gloo or device-to-host problem fails the run in
        seconds (StorageError, naming the storage and the cause) instead of after an epoch."""
        location = ckpt.join_uri(self.cfg.storage_path, self.cfg.run_name, ckpt.PROBE_DIR)
        probe = ckpt.startup_probe(location, mesh, self.device, self.cpu_group)
        if self.rank == 0:
            removed = "removed" if probe["removed"] else f"NOT removed ({probe['remove_error']})"
            say(f"Checkpoint probe: {self.world} ranks saved and loaded a sharded state at {location} in "
                f"{probe['seconds']} s ({len(probe['files'])} files, {ckpt.WRITE_THREADS} per rank written in "
                f"parallel); {removed}")

    def _build_optimizer(self) -> None:
        cfg, capturable = self.cfg, self.backend.capturable_optimizer
        lr_device = self.device if capturable else torch.device("cpu")
        self.lr = torch.tensor(cfg.learning_rate, dtype=torch.float32, device=lr_device)
        # capturable keeps AdamW's step count and bias corrections on the device; the
        # CPU optimizer is not capturable, and its fused kernel takes the tensor lr.
        self.optimizer = torch.optim.AdamW(param_groups(self.params, cfg.weight_decay), lr=self.lr,
                                           capturable=capturable, foreach=capturable,
                                           fused=self.backend.fused_optimizer or None)
        self.warmup = warmup_steps(self.total_steps, cfg.warmup_ratio)
        self.decay = decay_steps(self.total_steps, self.warmup, cfg.decay_ratio)
        self.lr_host = lr_table(cfg.learning_rate, self.total_steps, self.warmup, cfg.lr_schedule, cfg.min_lr_ratio,
                                self.decay)
        self.lr_table = torch.from_numpy(self.lr_host).to(lr_device)
        self.step_counter = torch.zeros(1, dtype=torch.int64, device=lr_device)

    def _attach_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    # ------------------------------------------------------------------ restore
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
            say(f"Resumed from {location} at {where} (global step {self.global_step}): {source}"
                + ("" if checked else "; it carries no fingerprint (an earlier trainer wrote it), so only its "
                   "step was checked"))

    def replay_record(self, history: list[dict]) -> None:
        """Rank 0, after a restore: the `epoch` and `checkpoint` events of every epoch the
        restored checkpoint holds, again (`replayed: true`). The checkpoint resumed from may
        be one whose events were lost with the previous attempt's cluster (written, then the
        cluster deleted before its lines were read); the operator keys its history by epoch,
        so a replay of what it already has changes nothing, and one it never saw fills the
        gap: every epoch once in status.history, none lost."""
        for entry in history:
            if not resume.is_epoch_end(entry.get("uri", "")):
                continue
            fields = {k: entry.get(k) for k in ("epoch", "step", "loss", "eval_loss", "epoch_time_s",
                                                 "tokens_per_s", "padded_tokens_per_s")}
            fields.update({k: entry[k] for k in (*generation.METRIC_KEYS.values(), generation.EXAMPLES_KEY) if k in entry})
            emit("epoch", epochs=self.cfg.num_epochs, replayed=True, **fields)
            emit("checkpoint", epoch=entry.get("epoch"), step=entry.get("step"), epoch_end=True,
                 uri=entry["uri"], save_s=entry.get("save_s"), write_s=entry.get("write_s"), replayed=True)

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

    # ------------------------------------------------------------------ epochs
    def run(self) -> None:
        self.started = time.perf_counter()
        self.board = tboard.Board(tboard.attempt_uri(self.cfg.storage_path, self.cfg.run_name, self.start_id),
                                  enabled=self.rank == 0)
        try:
            if self.rank == 0:
                self.announce()
            while (self.global_step < self.total_steps or self.end_pending) and self.stopped is None:
                metrics = self.train_epoch()
                if self.stopped is None:
                    # A SIGTERM in the epoch's last steps: its step saved now, without the
                    # evaluation, which can outlast the pod's share of the notice (resume
                    # then does the epoch's end: resume.position).
                    if self.agreed_at_epoch_end() == notice.TERMINATING:
                        self.on_notice(notice.TERMINATING, lambda: metrics)
                    self.report(metrics, epoch_end=True)
                    # The next epoch's first step agrees: a SIGTERM during the epoch's end
                    # (after the checks in report) waits one step, not a stretch of them.
                    self.agreements.soon(self.global_step)
            self.export()
        finally:  # the end, a failure or a preemption: what was written is in storage
            self.board.close()
        notice.done()

    def first_step_done(self, loss_sum: torch.Tensor) -> None:
        """This start's first optimizer step: rank 0 reports the start-up stages (event
        `startup`). With torch.compile the host calls return once the step is traced and
        compiled; one host read then waits for the device to finish it (once a start)."""
        self.startup.reported = True
        if self.rank != 0:
            return
        if self.compiled:
            self.startup.mark("first_step_compiled")
        float(loss_sum.item())
        self.startup.mark("first_step")
        emit("startup", step=self.global_step, **self.startup.fields())

    def training_s(self) -> float:
        """Seconds of training so far, earlier attempts included (loading and export not)."""
        return self.training_s_before + time.perf_counter() - self.started

    def announce(self) -> None:
        cfg, plan = self.cfg, self.plan
        if plan.tokens_per_step:
            step_words = (f"{plan.world} devices x {plan.blocks} blocks of {cfg.max_seq_len} tokens x {plan.accum} "
                          f"accumulation = {plan.tokens_per_step} tokens per optimizer step (--tokens-per-step: full "
                          f"blocks, about {self.examples_per_step():.1f} examples); ")
        else:
            step_words = (f"{plan.world} devices x {plan.per_device} examples x {plan.accum} accumulation = "
                          f"{plan.global_examples} examples per optimizer step, packed into {plan.blocks} blocks of "
                          f"{cfg.max_seq_len} tokens per device per micro-batch "
                          f"({plan.global_blocks * cfg.max_seq_len} tokens per step); ")
        say("Plan: " + step_words +
            f"{self.epoch_steps} steps per epoch, {self.total_steps} in all; lr {cfg.learning_rate:g} "
            f"(warmup {self.warmup} steps, {self.schedule_words()}); "
            f"clip {cfg.max_grad_norm:g}; compute {str(self.dtype).removeprefix('torch.')}, master weights "
            f"float32{self.method_words()}; "
            + ("blocks resharded after forward" if cfg.reshard_after_forward
               else "blocks kept gathered from forward to backward") + f"; compile {'on' if self.compiled else 'off'}"
            + (f" (cache {cfg.compile_cache_dir})" if self.compile_cache else "") + "; loss head "
            + (f"at label positions ({self.train_cap} rows of {plan.blocks * cfg.max_seq_len} per micro-batch)"
               if self.label_head else "over every position (full logits)"))
        emit("plan", global_batch_examples=0 if plan.tokens_per_step else plan.global_examples,
             tokens_per_step=plan.tokens_per_step or None, blocks_per_device=plan.blocks,
             global_batch_blocks=plan.global_blocks, global_batch_tokens=plan.global_blocks * cfg.max_seq_len,
             accumulation=plan.accum, steps_per_epoch=self.epoch_steps, total_steps=self.total_steps,
             warmup_steps=self.warmup, lr_schedule=cfg.lr_schedule, compute_dtype=str(self.dtype).split(".")[-1],
             compile=self.compiled, reshard_after_forward=cfg.reshard_after_forward, resumed_step=self.global_step if self.resumed_from else None,
             resumed_from=self.resumed_from, tensorboard_uri=tboard.run_uri(cfg.storage_path, cfg.run_name))
        say(f"TensorBoard: this attempt's events go to {self.board.uri} (tensorboard --logdir "
            f"{tboard.run_uri(cfg.storage_path, cfg.run_name)})")

    def examples_per_step(self) -> float:
        """Examples per step of the current epoch's plan, on average."""
        epoch = self.epoch_plan
        return sum(map(len, epoch.blocks)) / max(1, len(epoch))

    def method_words(self) -> str:
        cfg = self.cfg
        if not cfg.uses_lora:
            return " (DPO)" if cfg.method == "dpo" else ""
        trained = sum(p.numel() for p in self.params)
        frozen = sum(p.numel() for p in self.model.parameters() if not p.requires_grad)
        what = "adapters and the embedding" if getattr(cfg, "lora_train_embeddings", False) else "adapters only"
        return (f" for LoRA's {what} (rank {cfg.lora_rank}, alpha {cfg.lora_alpha:g} on "
                f"{cfg.lora_target_modules}: {trained:,} parameters trained, {frozen:,} frozen in bfloat16)")

    def schedule_words(self) -> str:
        cfg = self.cfg
        if cfg.lr_schedule == "constant":
            return "constant"
        return (f"peak held for {self.total_steps - self.warmup - self.decay} steps, {cfg.lr_schedule} to "
                f"{cfg.learning_rate * cfg.min_lr_ratio:g} over the last {self.decay}")

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
                self.model.train()
            if self.agreements.due(self.global_step):
                code, not_done, failed, steps_to_next = self.notice.agreed(
                    self.cpu_group, *self.save_flags(), self.agreements.proposal(self.global_step))
                self.agreements.agreed(self.global_step, steps_to_next, self.step_counter)  # a device value
                if code:
                    self.on_notice(code, lambda: self.epoch_metrics(loss_sum, label_tokens, real_tokens,
                                                                    time.perf_counter() - start, steps))
                elif self.pending is not None:
                    self.settled(bool(not_done), bool(failed))
            if self.stopped is not None:
                break
        if self.rank == 0 and window.steps:
            # The epoch's last window: at a step every rank agrees on (the epoch's end, whose
            # metrics all_reduce follows), so status.progress and its curve are current at
            # each epoch's end, however short the epoch.
            self.emit_progress(window, loss_sum)
        self.drop_window()  # free the epoch's last blocks
        return self.epoch_metrics(loss_sum, label_tokens, real_tokens, time.perf_counter() - start, steps)

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
            emit("notice", **fields)
            self.board.flush()
        if code == notice.TERMINATING:
            notice.done()
            raise Preempted(f"SIGTERM: the checkpoint of step {self.global_step} is {uri}; the next attempt "
                            "resumes from it", fields)

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

    def emit_progress(self, window: "ProgressWindow", loss_sum: torch.Tensor) -> None:
        """Rank 0 only, throttled: the loss is rank 0's mean over the window, the gradient
        norm the last step's global norm before clipping (null with clipping off); reading
        both is this window's one host sync."""
        now = time.perf_counter()
        if self.grad_norm is None:
            current, grad_norm = float(loss_sum.item()), None
        else:
            current, grad_norm = torch.stack([loss_sum.detach().float(), self.grad_norm.detach().float()]).tolist()
        loss = (current - window.loss_mark) / max(window.label_tokens, 1)
        window.loss_mark = current
        seconds = now - window.start
        fields = dict(epoch=self.epoch, epochs=self.cfg.num_epochs, step=self.global_step,
                      total_steps=self.total_steps, epoch_step=self.epoch_step, epoch_steps=self.epoch_steps,
                      loss=round(loss, 4), lr=float(self.lr_host[min(self.global_step, self.total_steps) - 1]),
                      grad_norm=None if grad_norm is None else round(grad_norm, 4),
                      tokens_per_s=round(window.real_tokens / max(seconds, 1e-9), 1),
                      step_time_s=round(seconds / max(window.steps, 1), 4), training_s=round(self.training_s(), 1))
        emit("progress", **fields)
        self.board.progress(fields)
        window.reset(now)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.eval_blocks is None:
            return None
        per_device, indices = self.plan.blocks, self.eval_index
        self.model.eval()
        self.method.start_eval()
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for step in range(len(indices) // per_device):
            total += self.method.loss_sum(self, self.eval_blocks.gather(indices[step * per_device:(step + 1) * per_device]),
                                          self.eval_cap, training=False)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        label_tokens = int(self.eval_data.label_tokens.sum())  # known on the host
        return float(total.item()) / label_tokens if label_tokens else None

    # ------------------------------------------------------------------ checkpoints
    def agreed_at_epoch_end(self) -> int:
        """Collective, at an epoch's end (every rank is there): the strongest notice any rank
        holds. Only a SIGTERM is acted on here; a request stays pending for the next
        step's agreement (the epoch's checkpoint is about to be written anyway)."""
        return self.notice.agreed(self.cpu_group)[0]

    def report(self, m: dict, epoch_end: bool, evaluate: bool = True, synchronous: bool = False) -> None:
        cfg = self.cfg
        eval_loss = self.evaluate() if evaluate else None  # overlaps the previous save's writes
        # Each epoch's generation metrics (collective; --generate-examples), before a notice's
        # agreement as the loss: a SIGTERM during either makes this epoch's save the notice's.
        generated, samples = ({}, {})
        if epoch_end and eval_loss is not None and self.generation_items:
            generated, samples = generation.evaluate_generation(self)
        # A SIGTERM during the epoch's evaluation: the epoch's own checkpoint is the notice's,
        # written now (synchronously) instead of after the next step.
        terminating = epoch_end and not synchronous and self.agreed_at_epoch_end() == notice.TERMINATING
        synchronous = synchronous or terminating
        # The previous save completes first: at most one in flight, and early stopping and
        # the new checkpoint's history see every earlier checkpoint.
        self.settle_checkpoint(wait=True)
        metrics = {"epoch": m["epoch"], "step": m["step"], "loss": round(m["loss"], 4),
                   "eval_loss": None if eval_loss is None else round(eval_loss, 4),
                   "epoch_time_s": round(m["epoch_time_s"], 2), "tokens_per_s": round(m["tokens_per_s"], 1),
                   "padded_tokens_per_s": round(m["padded_tokens_per_s"], 1)}
        # The method's own figures (DPO: rewards, margin, accuracy, on the held-out pairs too),
        # new keys beside SFT's, which stay as they were.
        extra = dict(m.get("method") or {})
        if eval_loss is not None:
            extra.update(self.method.eval_sums(self))
        metrics.update({k: round(v, 4) for k, v in extra.items()})
        metrics.update(generated)
        if self.rank == 0 and epoch_end:
            self.print_epoch(metrics)
            emit("epoch", epochs=cfg.num_epochs, steps=m["steps"], total_steps=self.total_steps,
                 batch_shapes=m["batch_shapes"], **metrics,
                 **({"eval_samples_uri": samples["uri"], "generate_s": round(samples["seconds"], 3)} if samples else {}))
        if self.rank == 0:  # every step up to this checkpoint's is in storage before it is
            self.board.evaluation(metrics, epoch_end)
            self.board.samples(metrics["step"], samples)
            self.board.flush()
        if eval_loss is not None:
            self.early_stop_check(eval_loss)
        state_extra = {"epoch_step": m["epoch_step"], "epoch_steps": self.epoch_steps,
                       "epoch_loss_sum": m["epoch_loss_sum"], "epoch_label_tokens": m["epoch_label_tokens"],
                       "training_s": round(self.training_s(), 3), "stale_evals": self.stale_evals}
        name = resume.checkpoint_name(epoch_end, m["epoch"], m["step"], self.start_id)
        args = (name, {k: v for k, v in metrics.items() if v is not None}, state_extra)
        # The flag only when set: benchmarks/bench_trainer.py wraps checkpoint(name, metrics, state_extra).
        if synchronous:
            self.checkpoint(*args, synchronous=True)
        else:
            self.checkpoint(*args)
        if epoch_end:
            self.epoch, self.epoch_step, self.carried = self.epoch + 1, 0, (0.0, 0)
            self.end_pending = False
        if terminating:
            self.on_notice(notice.TERMINATING, lambda: m)  # saved above: says so, and stops

    def early_stop_check(self, eval_loss: float) -> None:
        """After an evaluation: stop at --target-eval-loss, or after --early-stopping-patience
        evaluations in a row that did not lower the best eval loss."""
        cfg = self.cfg
        best = min((e["eval_loss"] for e in self.history if e.get("eval_loss") is not None), default=None)
        self.stale_evals = 0 if best is None or eval_loss < best else self.stale_evals + 1
        common = {"epoch": self.epoch, "step": self.global_step, "eval_loss": round(eval_loss, 4),
                  "training_s": round(self.training_s(), 3)}
        if cfg.target_eval_loss and eval_loss <= cfg.target_eval_loss:
            self.stopped = {"reason": "TargetEvalLoss", "target_eval_loss": cfg.target_eval_loss, **common}
        elif cfg.early_stopping_patience and self.stale_evals >= cfg.early_stopping_patience:
            self.stopped = {"reason": "Patience", "patience": cfg.early_stopping_patience,
                            "best_eval_loss": best, **common}

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
            emit("checkpoint", epoch=entry["epoch"], step=entry["step"], epoch_end=pending["epoch_end"], uri=uri,
                 save_s=entry["save_s"], write_s=entry["write_s"])
            if self.stopped is not None and self.stopped["uri"] == uri:
                emit("early_stop", **self.stopped)

    def print_epoch(self, m: dict) -> None:
        eval_part = f" | eval_loss={m['eval_loss']:.4f}" if m["eval_loss"] is not None else ""
        say(f"Epoch {m['epoch']}/{self.cfg.num_epochs} | loss={m['loss']:.4f} | epoch_time={m['epoch_time_s']:.2f}s"
            f" | tokens/s={m['tokens_per_s']:.1f}{eval_part}"
            f" | padded_tokens/s={m['padded_tokens_per_s']:.1f} (tokens/s counts real tokens only)"
            + self.method.words(m) + generation.words(m))

    # ------------------------------------------------------------------ export
    def export(self) -> None:
        cfg = self.cfg
        self.settle_checkpoint(wait=True)  # the last checkpoint is complete and in the history
        self.stager.release()  # no more checkpoints: the host copy goes before rank 0 gathers the model
        best = best_entry(self.history, cfg.checkpoint_score_attribute, cfg.checkpoint_score_order)
        if self.stopped is not None and self.stopped["reason"] == "TargetEvalLoss":
            # The checkpoint that reached the target is the one asked for.
            best = next(e for e in self.history if e["uri"] == self.stopped["uri"])
        if best is None:
            raise RuntimeError("no checkpoint to export (was every epoch already done?)")
        best = self.exportable(best)
        if best["uri"] != self.weights_uri:
            ckpt.load_sharded(self.model, None, best["uri"], self.cpu_group)
        destination = ckpt.join_uri(cfg.storage_path, cfg.run_name, "export")
        start = time.perf_counter()
        base = base_directory(cfg.model_id) if self.rank == 0 else None
        adapter_uri = None
        if cfg.uses_lora:
            adapter_uri = ckpt.join_uri(cfg.storage_path, cfg.run_name, ADAPTER_EXPORT_DIR)
            ckpt.export_adapter(self.model, adapter_uri, cfg, self.cpu_group)
        merged = not cfg.uses_lora or cfg.lora_export_merged
        if merged:
            done = ckpt.export_hf(self.model, self.tokenizer, destination, self.cpu_group, base,
                                  lora_scaling=cfg.lora_alpha / cfg.lora_rank if cfg.uses_lora else None)
        else:
            destination = None  # --lora-export-merged false: the adapter only
        export_s = time.perf_counter() - start
        prompts = export.proof_prompts(self.eval_data, self.examples) if self.rank == 0 else []
        proof = export.prove_collective(self.rank, self.cpu_group, destination, adapter_uri, cfg.model_id,
                                        self.tokenizer, prompts, base)
        if self.rank == 0:
            which = (f"epoch {best.get('epoch')} step {best.get('step')} ({cfg.checkpoint_score_attribute}="
                     f"{best.get(cfg.checkpoint_score_attribute)})")
            if adapter_uri:
                say(f"Exported the LoRA adapter of {which} in peft's format to {adapter_uri}")
            if merged:
                say(f"Exported {which} to {destination}{' (the adapter merged in)' if adapter_uri else ''} in "
                    f"{done['dtype']} in {export_s:.1f}s; from the base: {done['towers']} tower "
                    f"weights, {', '.join(done['copied']) or 'no other file'}"
                    + ("" if base is not None else f" (no directory of {cfg.model_id} to copy its other files from)"))
            say(export.proof_words(proof))
            final = {k: v for k, v in self.history[-1].items() if k not in ("uri", "save_s", "write_s")}
            emit("result", best_checkpoint_uri=best["uri"], best_epoch=best["epoch"], best_step=best.get("step"),
                 exported_model_uri=destination, exported_adapter_uri=adapter_uri, metrics=final,
                 stopped_early=self.stopped["reason"] if self.stopped else None)

    def exportable(self, best: dict) -> dict:
        """`best` if its weights are loaded or its files are all still there; else the newest
        complete checkpoint of this run. After --resume-from, the history carries the earlier
        run's checkpoints, and that run's --keep-checkpoints may have deleted the best one
        since. Rank 0 looks and says why; every rank exports the same one."""
        decision = [best]
        if self.rank == 0 and best["uri"] != self.weights_uri and not ckpt.is_complete(best["uri"]):
            run_dir = ckpt.join_uri(self.cfg.storage_path, self.cfg.run_name)
            newest = ckpt.latest_complete(run_dir) or self.weights_uri
            state = ckpt.read_trainer_state(newest) if newest != self.weights_uri else {}
            entries = self.history + list(state.get("history", []))
            decision[0] = next((e for e in reversed(entries) if e.get("uri") == newest),
                               {"uri": newest, "epoch": state.get("epoch"), "step": state.get("step")})
            say(f"The best checkpoint {best['uri']} ({self.cfg.checkpoint_score_attribute}="
                f"{best.get(self.cfg.checkpoint_score_attribute)}) is gone or incomplete (an earlier run's "
                f"--keep-checkpoints may have deleted it); exporting the newest complete one, {newest}")
        dist.broadcast_object_list(decision, src=0, group=self.cpu_group)
        return decision[0]


class ProgressWindow:
    """What rank 0 has seen since its last progress event (host numbers only)."""

    def __init__(self, start: float):
        self.loss_mark = 0.0
        self.reset(start)

    def reset(self, start: float) -> None:
        self.start, self.steps, self.label_tokens, self.real_tokens = start, 0, 0, 0

    def add(self, label_tokens: int, real_tokens: int) -> None:
        self.steps += 1
        self.label_tokens += label_tokens
        self.real_tokens += real_tokens

    def due(self, interval_s: float) -> bool:
        return self.steps > 0 and time.perf_counter() - self.start >= interval_s


def device_layout(backend: Backend, world: int, local_world: int) -> list[str]:
    """One entry per rank, `host<N>/<device>:<local>` (Ray Train packs ranks by node)."""
    local_world = max(local_world, 1)
    return [f"host{r // local_world}/{backend.device_type}:{r % local_world}" for r in range(world)]


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

    quiet_progress_bars()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    backend = BACKENDS[config["backend"]]
    cfg = FinetuneConfig(**config["cfg"])
    startup = Startup.of(config.get("startup"))
    startup.mark("workers_ready")
    if rank == 0:
        emit("start", mode="finetune", world_size=world, backend=backend.dist_backend, device=backend.device_type,
             devices=device_layout(backend, world, ctx.get_local_world_size()), run_name=cfg.run_name,
             prompt_format=config.get("prompt_format"), dataset_format=config.get("dataset_format"))
    data = ray.get(config["data"])
    # On GPU, Ray Train decides which visible CUDA device is this worker's.
    local = ray.train.torch.get_device().index if backend.name == "cuda" else ctx.get_local_rank()
    trainer = Trainer(cfg, backend, data, rank, world, local, startup)
    trainer.notice = notice.ray_kv_watch(rank, cfg.run_name)
    registered = ray.train.get_checkpoint()
    trainer.restore(ckpt.checkpoint_location(registered) if registered is not None else None)
    trainer.run()
