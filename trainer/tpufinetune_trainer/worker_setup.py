"""What a worker builds before its first step (a mixin of train.Trainer), in torchtitan's
order: device -> process groups and mesh -> the storage probe -> the model on the meta
device, sharded, each rank reading its own slices (sharded_load.py) -> the run's plan
(steps, blocks per device, the loss head's caps) -> optimizer and schedule -> the method's
preparation and the held-out blocks on the device. The loop's position starts in
train.Trainer; a restore (restore.py) comes after all of this."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from . import compile_cache, generation, init_checkpoint, resume, run_events
from . import loss as head
from .backends import compile_enabled, compute_dtype, setup_device, use_compile_cache
from .data import BatchPlan, EpochPlan, epoch_step_count, plan_run, rank_eval_share
from .device_blocks import DeviceBlocks
from .masks import MaskBuilder
from .methods import for_config as method_for
from .model import freeze_input_embeddings, load_tokenizer
from .parallelize import apply_activation_checkpointing, build_mesh
from .schedule import decay_steps, lr_table, warmup_steps
from .sharded_load import load_sharded


def param_groups(params: list, weight_decay: float) -> list[dict]:
    """AdamW's groups: weight decay on matrices (and embeddings) only; none on 1-D (and
    scalar) parameters, the norm scales and biases, which decay would pull towards 0 (a norm
    scale of 0 silences its layer). A DTensor's `ndim` is its full tensor's."""
    decay = [p for p in params if p.ndim >= 2]
    plain = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class Setup:
    """Sets, on the trainer: device, cpu_group, save_group, examples, eval_data,
    generation_items, method, pad_id, tokenizer, dtype, compiled, attn_implementation,
    model, label_head, params, masks, example_labels, epoch_steps, total_steps, plan,
    planned, the optimizer and its schedule (optimizer, lr, lr_table, lr_host,
    step_counter, warmup, decay), fingerprint, start_id, eval_blocks, eval_index,
    train_cap, eval_cap."""

    def set_up(self, data: dict, local_rank: int) -> None:
        cfg, backend, rank, world = self.cfg, self.backend, self.rank, self.world
        # Before torch_tpu is imported and anything compiles: both read the cache's place then.
        # Without --compile-cache-dir, this host's copy of the run's cache in its storage
        # (compile_cache.py; on TPU seeded already by load_tpu_runtime, nothing fetched again).
        self.run_compile_cache = compile_cache.run_cache_uri(cfg, backend)
        self.compile_cache_dir = cfg.compile_cache_dir
        if self.run_compile_cache:
            local, fetched = compile_cache.seed(self.run_compile_cache)
            self.compile_cache_dir = str(local)
            if local_rank == 0:
                run_events.say(f"Compile cache: {local} from {self.run_compile_cache} ({fetched} file(s) fetched)")
        self.compile_cache = use_compile_cache(self.compile_cache_dir, backend)
        self.shares_compile_cache = bool(self.run_compile_cache) and local_rank == 0
        self.device = setup_device(backend, local_rank)
        self.cpu_group = ckpt.cpu_group()  # DCP plans and barriers: pickled objects, never over ICI
        # DCP's background writes only: a group shared with this thread's collectives could
        # pair them differently on different ranks.
        self.save_group = ckpt.cpu_group()
        mesh = build_mesh(backend.device_type, world, cfg.num_slices, self.cpu_group, cfg.shard_group)
        if rank == 0 and mesh.ndim > 1 and cfg.shard_group:
            run_events.say(f"HSDP over {cfg.num_slices} slice(s) in shard groups of {mesh.size(1)}: sharded within a "
                           f"group, replicated across; mesh {mesh.mesh_dim_names} rows (ranks by group) "
                           f"{mesh.mesh.tolist()}")
        elif rank == 0 and mesh.ndim > 1:
            run_events.say(f"HSDP over {cfg.num_slices} slices: sharded within a slice, replicated across; mesh "
                           f"{mesh.mesh_dim_names} rows (ranks by slice) {mesh.mesh.tolist()}")
        self.probe_checkpoint_storage(mesh)
        self.examples = data["train"]
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
        self.build_model(mesh)
        shape = self.plan_steps()
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
        self.place_held_out(shape.most_label_tokens)

    def probe_checkpoint_storage(self, mesh) -> None:
        """Save and load a tiny sharded state the way every checkpoint will (ckpt.startup_probe)
        before the model is loaded: a storage, gloo or device-to-host problem fails the run in
        seconds (StorageError, naming the storage and the cause) instead of after an epoch."""
        location = ckpt.join_uri(self.cfg.storage_path, self.cfg.run_name, ckpt.PROBE_DIR)
        probe = ckpt.startup_probe(location, mesh, self.device, self.cpu_group)
        if self.rank == 0:
            removed = "removed" if probe["removed"] else f"NOT removed ({probe['remove_error']})"
            run_events.say(f"Checkpoint probe: {self.world} ranks saved and loaded a sharded state at {location} "
                           f"in {probe['seconds']} s ({len(probe['files'])} files, {ckpt.WRITE_THREADS} per rank "
                           f"written in parallel); {removed}")

    def build_model(self, mesh) -> None:
        """Master weights in fp32; FSDP computes in self.dtype (see parallelize.py). Built on
        the meta device and sharded there; each rank reads only its own slices (sharded_load.py)."""
        cfg = self.cfg
        self.compiled = compile_enabled(self.backend, cfg.compile)
        self.attn_implementation = cfg.attn_implementation(self.backend.attn_implementation)
        self.model, loaded = load_sharded(cfg.model_id, self.attn_implementation, mesh, self.dtype,
                                          compile=self.compiled, device=self.device, full=cfg.model_load == "full",
                                          lora=cfg if cfg.uses_lora else None,
                                          reshard_after_forward=cfg.reshard_after_forward,
                                          fallback=cfg.model_load == "sharded-or-full",
                                          multimodal=cfg.multimodal)
        self.startup.mark("model_loaded")
        if self.rank == 0:
            run_events.say(f"Model {cfg.model_id}: {loaded}")
        if cfg.init_checkpoint:  # before the method uses the weights: a new run from another's checkpoint
            words = init_checkpoint.load(self.model, cfg.init_checkpoint, cfg.model_id, self.cpu_group)
            self.startup.mark("model_loaded")
            if self.rank == 0:
                run_events.say(words)
        # Both before the parameter list and the optimizer (a frozen weight gets no state).
        apply_activation_checkpointing(self.model, cfg.activation_checkpointing)
        if cfg.freeze_embeddings:
            freeze_input_embeddings(self.model)
        if cfg.multimodal:  # the towers as asked (media.py); the audio tower never trains yet
            from .media import freeze_towers

            freeze_towers(self.model, cfg.vision_tower)
        # Else transformers' full-logits forward: asked for, or a head loss.py does not reproduce.
        self.label_head = cfg.loss_head == "labels" and self.method.label_head and head.uses_label_head(self.model)
        if self.label_head:
            head.install(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.masks = MaskBuilder(self.model.config, cfg.max_seq_len, self.device, self.dtype,
                                 self.attn_implementation)

    def plan_steps(self):
        """A step is the tutorial's batch of examples; its blocks per device are fixed for the
        run: what the fullest step of any epoch needs (static shapes). Returns plan_run's
        shape (the whole run's maxima)."""
        cfg = self.cfg
        self.example_labels = self.method.example_weights(self.examples)  # SFT: label tokens; DPO: 1 a pair
        base = cfg.batch_plan()
        self.epoch_steps = epoch_step_count(self.examples.lengths, base)
        self.total_steps = self.epoch_steps * cfg.num_epochs
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        epochs = -(-self.total_steps // self.epoch_steps)  # the epochs the run reaches (--max-steps)
        # Both whole-run maxima (blocks per device, the loss head's label cap) in one pass;
        # each epoch's plan is built when the loop reaches it (Trainer.epoch_plan).
        shape = plan_run(self.examples.lengths, self.example_labels, base, epochs, cfg.seed, cfg.max_seq_len)
        self.plan: BatchPlan = shape.plan
        self.planned: tuple[int, EpochPlan] | None = None  # (epoch, its plan): the current epoch's only
        return shape

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

    def place_held_out(self, most_label_tokens: int) -> None:
        """This rank's share of the held-out blocks on its device, and its order over them
        (filler slots take the filler block), both copied once for every evaluation; and the
        rows of the loss head's label buffer: the most label tokens of any micro-batch the
        run takes (static for the whole run; loss.py)."""
        cfg, world = self.cfg, self.world
        self.eval_blocks, self.eval_index = None, None
        if self.eval_data:
            share, order = rank_eval_share(self.eval_data, world, self.plan.blocks, self.rank)
            self.eval_blocks = DeviceBlocks(share, self.device, self.pad_id)
            self.eval_index = torch.from_numpy(np.where(order < 0, self.eval_blocks.filler, order)).to(self.device)
        positions = self.plan.blocks * cfg.max_seq_len
        self.train_cap = head.label_cap(most_label_tokens, positions)
        self.eval_cap = head.label_cap(head.most_eval_label_tokens(self.eval_data, world, self.plan.blocks),
                                       positions) if self.eval_data else positions
