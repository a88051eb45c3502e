"""The memory planner: will a fine-tune fit its slice, known before the slice is held.

Pure (no I/O): the operator checks a spec with it before any RayCluster exists, and
`tpufinetune render` prints it offline. What it counts is what the trainer holds
(trainer/tpufinetune_trainer: parallelize.py, train.py, loss.py), per device:

- full fine-tune (FSDP2): fp32 master weights, fp32 gradients and AdamW's two fp32 moments,
  16 B per trainable parameter sharded over the shard group (memplan_sharding.py: the slice's
  devices, fewer or one), replicated across groups and slices (a device holds the same
  whatever spec.tpu.slices);
- LoRA: the frozen base in bf16 (lora.inject), sharded; the 16 B only for the adapters of
  the layers spec.training.lora.targetModules names; bytes per element of the adapted
  layers' inputs beyond a full step's activations, and with dropout for each one's dropped
  copy and noise, measured per compute dtype;
- Gemma's per-layer embedding table (PLE): frozen, in the compute dtype, replicated on
  every device (kept out of FSDP);
- the all-gathered compute-dtype copies: the root unit (the embedding, tied to the head)
  stays gathered through the step, and about two blocks at a time (one computing, one
  prefetched), plus one block's unsharded gradients on their way to the reduce-scatter;
- activations saved for the backward: per layer and token a few hidden- and MLP-wide
  tensors, and with eager attention (the TPU's default) each layer's probabilities, heads x
  L^2 per block, and one layer's scores while it runs; sdpa keeps no scores, but each layer
  keeps its boolean mask turned additive (L^2 in the compute dtype). The attention width is
  averaged over the layers (Gemma 4's full-attention layers have wider heads). Activation
  checkpointing (spec.training.activationCheckpointing) keeps less: `block`, each block's input plus
  one block's activations while it is recomputed; `selective`, everything but the
  attention's (its width and its scores), plus one block's attention while recomputed;
  and the attention masks of a micro-batch, a few L x L tensors shared by every layer;
- the loss head (loss.py): the head weight's gradient (scaled in place, no second copy)
  and its fp32 reduce copy, none of it with frozen embeddings (the head is tied), and two
  fp32 chunk buffers of CHUNK_ROWS x vocab (--loss-head full: every position's logits);
- DPO (method dpo): full or LoRA as above, over the full logits, with its reference
  (memplan_dpo.py: stored log-probabilities for full, the base with adapters off for LoRA);
- each epoch's generation (spec.training.evaluation.generate): between steps, on the
  resident state alone, so the peak is the larger of it and the step's (memplan_generate.py).

The usable share of a chip is HBM x (1 - HEADROOM): the runtime, the compiler's
temporaries and fragmentation take the rest. Figures are estimates, checked against
measured peaks on CPU on configurations their constants were not fitted to
(benchmarks/bench_memplan.py's HELD_OUT, bench_memplan_dpo.py's for DPO; docs/trainer.md,
"Memory plan").
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import generations as g
from . import memplan_dpo as dpo
from . import memplan_generate as gen_plan
from . import memplan_media as media_plan
from .memplan_blocks import (  # noqa: F401  (re-exported: the benchmarks, the tests)
    EAGER_TRANSIENT_MATRICES, SAVED_ATTENTION_MATRICES, SAVED_PER_ATTENTION_WIDTH, SAVED_PER_HIDDEN,
    SAVED_PER_INTERMEDIATE, UPCAST_ATTENTION_MATRICES, UPCAST_PER_ATTENTION_WIDTH, UPCAST_PER_HIDDEN, activation_bytes)
from .memplan_shapes import DEFAULT_LORA_TARGETS, KNOWN_MODELS, ModelShape, known_shape, shape_for, \
    shape_from_config  # noqa: F401  (re-exported: validation, the benchmarks)

GIB = 2**30
# Share of a chip's HBM (and of a worker pod's memory) the plan leaves unused.
HEADROOM = 0.10
# Per device process on a host: Python, torch, Ray's worker and its data (an allowance).
RUNTIME_BYTES_PER_DEVICE = 2 * GIB
# export.PROOF_OVERHEAD_BYTES: rank 0's host beyond the weights its export proof loads.
PROOF_OVERHEAD_BYTES = 2**30
# loss.CHUNK_ROWS: rows of one fp32 logits chunk in the loss head.
CHUNK_ROWS = 256
# LoRA, bytes per token and layer and per input element of each adapted layer, by compute
# dtype (its bytes: 4 fp32, 2 bf16): what a LoRA step keeps beyond a full one's activations
# (LORA_SAVED_BYTES), and with dropout (spec.training.lora.dropout > 0) what each adapted
# layer's own dropped copy and the noise it was multiplied by add (LORA_DROPOUT_BYTES; torch's
# dropout outside the fused CUDA kernel keeps the noise in the input's dtype). Fitted per
# dtype to bench_memplan's FITTED rows on one model (S1, 1024 x 2 tokens, sdpa): fp32 l2
# (dropout 0) and l1 (0.05), bf16 l4 and l3. Not one tensor: torch's saved tensors of a
# LoRA forward are fewer than a full one's (frozen norms keep no normed copy), the rest is
# the allocator's retention of each adapted layer's transients, which does not follow the
# dtype (bf16: 0.31 of fp32's bytes, not 0.5). One pair for both dtypes (8 B and 8 B,
# fitted in fp32) put the fitted bf16 l3 at 1.16 of its measured peak.
LORA_SAVED_BYTES = {4: 6.6, 2: 2.1}
LORA_DROPOUT_BYTES = {4: 7.5, 2: 3.2}
# sdpa given a boolean mask (masks.py's for sdpa) turns it into an additive one in the
# compute dtype and keeps that for the backward, in every layer: L^2 per block and layer
# in the compute dtype, whatever the heads (measured: one CPU sdpa call, 4096 tokens, keeps
# 4 B x L^2 in fp32 and 2 B in bf16 with 2 heads or 4). With activation checkpointing only
# the recomputed block's. It was planned as 6 B per head and L^2 once, fitted to
# bench_memplan's f8 (fp32, 2 heads, 3 layers: the same 12 B per L^2), which overcounted
# bf16 (the held-out n1, bf16 at 4096 tokens, 1.32).
SDPA_MASK_COPIES = 1
# Long sequences: what the constants do not follow past their fitted lengths (the CPU's sdpa
# with a mask, kernel workspaces growing with L^2) is added as the margin measured on the
# held-out configurations: activations x LONG_MARGIN from LONG_FROM tokens a block.
LONG_FROM = 4096
LONG_MARGIN = 0.0
# The attention masks of a micro-batch (masks.py), bytes per block and L^2: the full and
# sliding masks (additive in the compute dtype for eager, boolean for sdpa) and about four
# boolean L x L intermediates and constants (causal and window bands, same segment).
MASK_BOOLEANS = 4
# Keeping every block's gathered copy from forward to backward (the trainer's
# --reshard-after-forward false) saves one all-gather per block per micro-batch and costs
# the whole model's copy in the compute dtype. Asked for only where the plan with it stays
# within this share of the usable memory: the margin covers the estimate's error (within
# 25% of the measured peaks, docs/trainer.md "Memory plan").
KEEP_GATHERED_SHARE = 0.75
LOSS_HEADS = ("labels", "full")  # the trainer's --loss-head
FULL_LOGITS = 5  # --loss-head full: fp32 [tokens, vocab] tensors held (docs/trainer.md, "Loss head")
METHODS = ("full", "lora", "dpo")
CHECKED = ("table", "config", "stated")  # the bases a plan is checked on
CHECKPOINTING = ("none", "block", "selective")


@dataclass(frozen=True)
class Breakdown:
    """Bytes one device holds at the step's peak, by what holds them."""

    weights: int  # fp32 master weights (full) or the frozen compute-dtype base (LoRA), sharded
    grads: int
    optimizer: int
    frozen_tables: int  # PLE, replicated
    gathered: int  # all-gathered compute-dtype copies and one block's unsharded gradients
    activations: int
    loss_head: int
    margin: int = 0  # added past LONG_FROM tokens: the error measured there (LONG_MARGIN)
    towers: int = 0  # a multimodal run's vision tower and projector (memplan_media.py)

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer + self.frozen_tables + self.gathered
                + self.activations + self.loss_head + self.margin + self.towers)


def device_bytes(shape: ModelShape, method: str, devices: int, max_seq_len: int, batch_per_device: int,
                 compute_bytes: int = 2, eager_attention: bool = True, lora_rank: int = 16,
                 lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS, checkpointing: str = "none",
                 freeze_embeddings: bool = False, lora_embeddings: bool = False,
                 keep_gathered: bool = False, lora_dropout: float = 0.0, loss_head: str = "labels",
                 dpo_reference: str | None = None) -> Breakdown:
    """What one of `devices` devices holds at the peak of a training step. `lora_embeddings`
    (spec.training.lora.trainEmbeddings): LoRA also trains the embedding (and a head tied to
    it) as full fine-tuning does: fp32 master, gradient, two AdamW moments. `keep_gathered`:
    every block's gathered copy stays from forward to backward (not two blocks at a time).
    `loss_head` full: transformers' logits of every position (the trainer's --loss-head full).
    `dpo_reference` (memplan_dpo.REFERENCES): a DPO step of `method` (full or lora), over the
    full logits with that reference; None: SFT."""
    if method not in METHODS[:2]:
        raise ValueError(f"unknown method {method!r}; expected full or lora (DPO: dpo_reference)")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"unknown activation checkpointing {checkpointing!r}; expected one of "
                         f"{', '.join(CHECKPOINTING)}")
    if loss_head not in LOSS_HEADS:
        raise ValueError(f"unknown loss head {loss_head!r}; expected one of {', '.join(LOSS_HEADS)}")
    full = method == "full"
    # Frozen embeddings (tied to the head) keep their fp32 master copy but no gradient or AdamW state.
    embedding_trains = not freeze_embeddings if full else lora_embeddings
    trainable = ((shape.parameters - (shape.embedding if freeze_embeddings else 0)) if full
                 else shape.lora_parameters(lora_rank, lora_targets) + (shape.embedding if lora_embeddings else 0))
    # LoRA: the frozen base in bf16 whatever the compute dtype (lora.inject; a trained
    # embedding is fp32, counted in trainable).
    frozen = shape.parameters - (shape.embedding if lora_embeddings else 0)
    base = 4 * shape.parameters if full else 2 * frozen + 4 * trainable
    tokens = max_seq_len * batch_per_device
    upcast = 4 if compute_bytes < 4 else 0
    scores = ((SAVED_ATTENTION_MATRICES * compute_bytes + UPCAST_ATTENTION_MATRICES * upcast) * shape.heads
              * batch_per_device * max_seq_len ** 2 if eager_attention else 0)
    masks = batch_per_device * max_seq_len ** 2 * (2 * (compute_bytes if eager_attention else 1) + MASK_BOOLEANS)
    workspace = batch_per_device * max_seq_len ** 2 * (
        EAGER_TRANSIENT_MATRICES * compute_bytes * shape.heads if eager_attention
        else SDPA_MASK_COPIES * compute_bytes * (shape.layers if checkpointing == "none" else 1))
    block_grads = (compute_bytes + 4) * shape.block_parameters if full else 0
    # The head weight's gradient in the compute dtype (scaled in place) and its fp32 reduce copy.
    head_grad = (compute_bytes + 4) * shape.embedding if embedding_trains else 0
    # Labels: two fp32 chunk buffers; full: transformers' logits of every position, about five
    # fp32 [tokens, vocab] tensors (logits, the softcap's, log-softmax, their gradients).
    logits = (dpo.logit_bytes(tokens, shape.vocab, compute_bytes, dpo_reference) if dpo_reference
              else 2 * CHUNK_ROWS * shape.vocab * 4 if loss_head == "labels" else FULL_LOGITS * tokens * shape.vocab * 4)
    lora_bytes = 0 if full else int(shape.lora_inputs(lora_targets) * (
        _of_dtype(LORA_SAVED_BYTES, compute_bytes) + (_of_dtype(LORA_DROPOUT_BYTES, compute_bytes)
                                                      if lora_dropout > 0 else 0)))
    activations = activation_bytes(shape, tokens, scores, compute_bytes, checkpointing, lora_bytes) + masks + workspace
    return Breakdown(
        weights=_ceil_div(base, devices),
        grads=_ceil_div(4 * trainable, devices),
        optimizer=_ceil_div(8 * trainable, devices),
        frozen_tables=compute_bytes * shape.per_layer_embedding,
        gathered=(compute_bytes * (shape.embedding + (shape.layers if keep_gathered else 2) * shape.block_parameters)
                  + block_grads),
        activations=activations,
        loss_head=head_grad + logits + 2 * tokens * shape.hidden * compute_bytes,
        margin=int(activations * LONG_MARGIN) if max_seq_len >= LONG_FROM else 0,
    )


def _of_dtype(table: dict[int, float], compute_bytes: int) -> float:
    """A per-dtype constant (keyed by the compute dtype's bytes); another dtype scales fp32's."""
    return table[compute_bytes] if compute_bytes in table else table[4] * compute_bytes / 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // max(b, 1))


@dataclass(frozen=True)
class Request:
    """What a run asks for, as the planner needs it."""

    model_id: str
    method: str
    generation: str
    topology: str
    max_seq_len: int
    batch_per_device: int
    lora_rank: int = 16
    host_memory_bytes: int | None = None  # a worker pod's memory limit (None: not checked)
    activation_checkpointing: str = "none"
    attention: str | None = None  # eager or sdpa; None: the device's (eager on TPU, sdpa on the cpu stand-in)
    freeze_embeddings: bool = False
    lora_embeddings: bool = False  # spec.training.lora.trainEmbeddings
    stated_parameters: int | None = None  # spec.model.parameters, for a model not in the table
    shard_group: int = 0  # devices the state is sharded over (memplan_sharding); 0: the slice's
    choices: object | None = None  # memplan_sharding.Choices: what was chosen for the run, and by whom
    slices: int = 1  # replicas of the slice (HSDP): named in the plan, never dividing the state
    keep_gathered: bool = False  # every block's gathered copy kept from forward to backward
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS  # spec.training.lora.targetModules
    lora_dropout: float = 0.0  # spec.training.lora.dropout
    loss_head: str = "labels"  # the trainer's --loss-head
    model_config: dict | None = None  # the model's config.json where at hand: its widths win over the table's
    dpo_lora: bool = False  # method dpo: LoRA's adapters train (spec.training.lora), not every weight
    dpo_reference_free: bool = False  # spec.training.dpo.referenceFree
    generate_max_new_tokens: int = 0  # spec.training.evaluation.generate.maxNewTokens; 0: nothing generated
    generate_examples: int = 0  # its examples: with few, a device answers fewer at a time
    vision_tower: str = ""  # spec.training.towers.vision (frozen or trained); "": a text-only run


@dataclass(frozen=True)
class MemoryPlan:
    basis: str  # "table" (a known model), "stated" (a size the spec states: a lower bound) or "unknown"
    method: str
    generation: str
    topology: str
    model: str
    per_chip_bytes: int = 0  # 0 on the cpu stand-in (no HBM)
    limit_bytes: int = 0  # usable HBM per chip: HBM x (1 - HEADROOM)
    host_bytes: int = 0  # per host (worker pod)
    host_limit_bytes: int = 0
    breakdown: Breakdown | None = None
    smallest_fit: str = ""  # the smallest topology (or method) that fits, when this does not
    slices: int = 1
    keep_gathered: bool = False  # planned with every block gathered from forward to backward
    widths_from: str = ""  # where the model's widths come from (the table's source or its config.json)
    reference: str = ""  # method dpo: memplan_dpo.REFERENCES, the reference planned
    generating: gen_plan.GenerationPlan | None = None  # each epoch's generation (evaluation.generate)
    media: media_plan.MediaPlan | None = None  # a multimodal run's vision tower (training.towers)
    choices: object | None = None  # memplan_sharding.Choices, the request's
    # The model's config.json the widths came from (memplan_shapes.CONFIG_KEYS), when they did.
    model_config: dict | None = field(default=None, compare=False)

    @property
    def placement(self) -> str:
        """`v6e 4x4`, or `v6e 4x4 x 2 slices` (each slice holding a whole replica)."""
        return f"{self.generation} {self.topology}" + (f" x {self.slices} slices" if self.slices > 1 else "")

    @property
    def generation_bytes(self) -> int | None:
        """What generation adds per device beside the state kept between steps (None: none)."""
        return self.generating.bytes if self.generating is not None else None

    @property
    def generating_sets_peak(self) -> bool:
        return (self.generating is not None and self.breakdown is not None
                and self.generating.peak_bytes > self.breakdown.total)

    @property
    def fits(self) -> bool | None:
        """None when not checked (an unknown model)."""
        if self.basis not in CHECKED:
            return None
        hbm_ok = not self.limit_bytes or self.per_chip_bytes <= self.limit_bytes
        host_ok = not self.host_limit_bytes or self.host_bytes <= self.host_limit_bytes
        return hbm_ok and host_ok

    def summary(self) -> str:
        if self.method not in METHODS:
            return f"method {self.method} is not one the planner knows: its memory was not checked"
        if self.basis not in CHECKED:
            return (f"model {self.model} is not in the planner's table: its memory was not checked "
                    f"(known: {', '.join(sorted({s.name for s in KNOWN_MODELS.values()}))})")
        parts = []
        if self.limit_bytes:
            parts.append(f"{_gib(self.per_chip_bytes)} HBM per chip of {_gib(self.limit_bytes)} usable "
                         f"({self.placement}, {int(HEADROOM * 100)}% headroom)")
        if self.host_limit_bytes:
            parts.append(f"{_gib(self.host_bytes)} RAM per host of {_gib(self.host_limit_bytes)} usable")
        elif self.host_bytes:
            parts.append(f"{_gib(self.host_bytes)} RAM per host")
        if self.keep_gathered:
            parts.append("every block kept gathered from forward to backward")
        if self.breakdown is not None and self.breakdown.margin:
            parts.append(f"{_gib(self.breakdown.margin)} of it the margin measured past {LONG_FROM} tokens")
        if self.reference:
            parts.append(dpo.WORDS[self.reference])
        if self.media is not None:
            parts.append(self.media.words())
        if self.generating is not None and self.breakdown is not None:
            parts.append(self.generating.words(self.breakdown.total))
        parts += [self.choices.words()] if self.choices is not None else []
        if self.widths_from:
            parts.append(f"widths: {self.widths_from}")
        stated = " (its stated size: weights, gradients and optimizer state only)" if self.basis == "stated" else ""
        return f"{self.method} fine-tune of {self.model}{stated}: " + "; ".join(parts)

    def refusal(self) -> str:
        """Why the run cannot fit, naming the figure, the limit and what would ('' if it fits)."""
        if self.fits is not False:
            return ""
        if self.limit_bytes and self.per_chip_bytes > self.limit_bytes:
            while_ = gen_plan.WHILE if self.generating_sets_peak else ""
            what = (f"needs {_gib(self.per_chip_bytes)} of HBM per chip{while_}, more than the "
                    f"{_gib(self.limit_bytes)} usable on {self.generation} ({self.generation} chips hold "
                    f"{_gib(int(self.limit_bytes / (1 - HEADROOM)))}, {int(HEADROOM * 100)}% kept as headroom)")
        else:
            what = (f"needs {_gib(self.host_bytes)} of RAM per host, more than the "
                    f"{_gib(self.host_limit_bytes)} usable of the worker pod's memory")
        lora = "DPO with LoRA " if self.method == "dpo" else "method lora "
        hint = (f"; smallest that fits: {self.smallest_fit}" if self.smallest_fit else
                f"; nothing on {self.generation} fits, even {lora}at batchSizePerDevice 1")
        across = "; more slices do not help: each holds a whole replica" if self.slices > 1 else ""
        return f"{self.method} fine-tune of {self.model} on {self.placement} {what}{hint}{across}"


def _gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def estimate(request: Request) -> MemoryPlan:
    """The plan of `request`; when it does not fit, with the smallest fit named (a pinned
    sharding's first: memplan_sharding's `fits_instead`)."""
    plan = _plan(request)
    if plan.fits is False:
        plan = replace(plan, smallest_fit=getattr(request.choices, "fits_instead", "") or smallest_fit(request))
    return plan


def refuses(plan: MemoryPlan) -> bool:
    """Whether a run is refused: a known model that does not fit a TPU slice. The cpu stand-in
    (a rehearsal) and unknown models are never refused."""
    return plan.fits is False and g.generation(plan.generation).is_tpu


def _plan(request: Request) -> MemoryPlan:
    gen = g.generation(request.generation)
    shape = shape_for(request.model_id, request.model_config)
    common = dict(method=request.method, generation=gen.name, topology=request.topology, model=request.model_id,
                  slices=request.slices, choices=request.choices)
    if request.method not in METHODS:  # a method this planner does not know: not checked
        return MemoryPlan(basis="unknown", **common)
    if shape is None:
        return _stated_plan(request, gen, common)
    if gen.is_tpu:
        chips = g.chips_in(request.topology)
        devices = chips * gen.devices_per_chip
        per_host_devices = min(chips, max(m.chips_per_host for m in gen.machines_for(request.topology)
                                          or gen.machines)) * gen.devices_per_chip
    else:
        devices = per_host_devices = int(request.topology)
    # On a TPU the step computes in bf16 with eager attention unless sdpa is asked for; the
    # cpu stand-in in fp32 (sdpa unless eager is asked for).
    eager = gen.is_tpu if request.attention is None else request.attention == "eager"
    method = dpo.trainable(request.method, request.dpo_lora)
    reference = dpo.reference_of(request.dpo_lora, request.dpo_reference_free) if request.method == "dpo" else None
    part = device_bytes(shape, method, request.shard_group or devices, request.max_seq_len, request.batch_per_device,
                        compute_bytes=2 if gen.is_tpu else 4, eager_attention=eager, dpo_reference=reference,
                        lora_rank=request.lora_rank, checkpointing=request.activation_checkpointing,
                        freeze_embeddings=request.freeze_embeddings, lora_embeddings=request.lora_embeddings,
                        keep_gathered=request.keep_gathered, lora_targets=request.lora_targets,
                        lora_dropout=request.lora_dropout, loss_head=request.loss_head)
    towers = media_plan.towers_for(shape, request.model_config) if request.vision_tower else None
    # The tower's forward transients are gone before the step's activations and logits exist.
    media = media_plan.plan(towers, request.vision_tower, shape.hidden, method, request.shard_group or devices,
                            request.max_seq_len, request.batch_per_device, 2 if gen.is_tpu else 4,
                            eager, text_step_bytes=part.activations + part.loss_head, lora_rank=request.lora_rank,
                            lora_targets=request.lora_targets) if towers is not None else None
    if media is not None:
        part = replace(part, towers=media.bytes)
    generating = gen_plan.of_request(request, shape, part, method == "full", 2 if gen.is_tpu else 4, eager, devices)
    peak = gen_plan.peak(part.total, generating)
    # Host: each device's process, and the host copy of its sharded state an asynchronous
    # checkpoint stages (weights and AdamW; HostStager); the cpu stand-in's device is the host.
    # Rank 0's pod (every pod has the same limit) also holds the export proof at the run's end
    # (export.proof_host_bytes): the exported model in bf16 (text weights, per-layer table; with
    # LoRA the adapter's on its base) and an allowance.
    # A multimodal run stages its towers' trained state too, and its export holds them.
    staged = part.weights + part.optimizer + (media.staged_bytes if media else 0)
    adapters = shape.lora_parameters(request.lora_rank, request.lora_targets) if method == "lora" else 0
    proof = 2 * (shape.parameters + shape.per_layer_embedding + adapters + (media.parameters if media else 0)) \
        + PROOF_OVERHEAD_BYTES
    host = per_host_devices * (RUNTIME_BYTES_PER_DEVICE + staged + (0 if gen.is_tpu else peak)) + proof
    host_limit = int(request.host_memory_bytes * (1 - HEADROOM)) if request.host_memory_bytes else 0
    return MemoryPlan(
        basis="config" if request.model_config else "table", **common, model_config=request.model_config,
        per_chip_bytes=peak * gen.devices_per_chip if gen.is_tpu else 0, generating=generating,
        limit_bytes=int(gen.hbm_gib_per_chip * GIB * (1 - HEADROOM)) if gen.is_tpu else 0,
        host_bytes=host, host_limit_bytes=host_limit, breakdown=part, keep_gathered=request.keep_gathered,
        widths_from=shape.widths_from, reference=reference or "", media=media)


def _stated_plan(request: Request, gen, common: dict) -> MemoryPlan:
    """A model the table does not know, from the size the spec states: its sharded state
    alone (fp32 weights, gradients and two AdamW moments; with LoRA the frozen bf16 base),
    a lower bound, so a run refused on it cannot fit whatever its activations."""
    if not request.stated_parameters or not gen.is_tpu:
        return MemoryPlan(basis="unknown", **common)
    devices = g.chips_in(request.topology) * gen.devices_per_chip
    sized = ModelShape(f"{request.stated_parameters} parameters", request.stated_parameters, layers=1, hidden=0,
                       intermediate=0, heads=0, head_dim=0, vocab=0)
    part = device_bytes(sized, dpo.trainable(request.method, request.dpo_lora), request.shard_group or devices,
                        request.max_seq_len, request.batch_per_device)
    per_device = part.weights + part.grads + part.optimizer
    return MemoryPlan(basis="stated", **common, per_chip_bytes=per_device * gen.devices_per_chip,
                      limit_bytes=int(gen.hbm_gib_per_chip * GIB * (1 - HEADROOM)))


def smallest_fit(request: Request) -> str:
    """What would fit, smallest change first: activation checkpointing per block, then a larger
    topology of the same generation (each with and without it); then method lora (on the
    requested topology, then larger ones); then a smaller batchSizePerDevice with either
    method. '' when nothing does. Every candidate keeps the request's worker pod memory."""
    gen = g.generation(request.generation)
    if not gen.is_tpu:
        return ""
    fewer_tokens = gen_plan.fix(request, lambda candidate: _plan(candidate).fits)
    if fewer_tokens:  # the step fits: the generation does not
        return fewer_tokens
    larger = [t for t in gen.valid_topologies() if g.chips_in(t) > g.chips_in(request.topology)]
    # The lighter method: lora for SFT, DPO's LoRA (its reference then the base, adapters off) for DPO.
    lighter = ("dpo", True) if request.method == "dpo" else ("lora", False)
    # A trained vision tower has a lighter method too: LoRA, adapters on its projections (memplan_media).
    methods = list(dict.fromkeys([(request.method, request.dpo_lora), lighter]))
    batches = [request.batch_per_device]
    while batches[-1] > 1:
        batches.append(batches[-1] // 2)
    # Activations recomputed per block cost compute, not chips: tried on each topology
    # before the next larger one.
    checkpointing = list(dict.fromkeys((request.activation_checkpointing, "block")))
    for batch in batches:
        for method, dpo_lora in methods:
            for topology in [request.topology] + larger:
                for recompute in checkpointing:
                    candidate = replace(request, topology=topology, method=method, dpo_lora=dpo_lora,
                                        batch_per_device=batch, activation_checkpointing=recompute)
                    if _plan(candidate).fits:
                        return _describe(request, candidate)
    return ""


def keeps_gathered(request: Request) -> bool:
    """Whether the trainer should keep every block's gathered copy from forward to backward: a
    model of the table on a TPU slice whose plan with it fits (the worker pod's memory included:
    the copy is in HBM, not on the host), within KEEP_GATHERED_SHARE of the usable HBM. Never for
    a model the table does not know, nor on the cpu stand-in: no figure to hold it to."""
    if request.method not in METHODS or shape_for(request.model_id, request.model_config) is None \
            or not g.generation(request.generation).is_tpu:
        return False
    plan = _plan(replace(request, keep_gathered=True))
    return bool(plan.fits) and plan.per_chip_bytes <= KEEP_GATHERED_SHARE * plan.limit_bytes


def _describe(request: Request, candidate: Request) -> str:
    changes = []
    if candidate.dpo_lora != request.dpo_lora:
        changes.append(f"DPO with LoRA (training.lora, rank {candidate.lora_rank})")
    if candidate.method != request.method:
        changes.append(f"method {candidate.method}" + (f" (rank {candidate.lora_rank})" if candidate.method == "lora"
                                                        else ""))
    if candidate.batch_per_device != request.batch_per_device:
        changes.append(f"batchSizePerDevice {candidate.batch_per_device}")
    if candidate.activation_checkpointing != request.activation_checkpointing:
        changes.append(f"activationCheckpointing {candidate.activation_checkpointing}")
    changes.append(f"topology {candidate.topology} ({g.chips_in(candidate.topology)} chips)")
    return ", ".join(changes)
