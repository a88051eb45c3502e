"""The LM head and its cross-entropy at label positions only, in chunks.

Transformers' forward computes the logits of every position: over Gemma's 262144-token
vocabulary that is 512 MiB of fp32 logits per 512-token block (with the bf16 copy, the
softcap's intermediates and the gradient, ~2 GB), while only the response tokens (~22% on
dolly) carry a label. Here the model's body (`model.model`) gives the hidden states, the
rows at label positions are gathered into a buffer of a fixed number of rows (`cap`:
static shapes, one graph), and the head, Gemma's final-logit softcap (in fp32) and the
summed cross-entropy run over that buffer `CHUNK_ROWS` rows at a time. In training the
forward also computes each chunk's gradients (of its rows and of the head's weight) and
drops its logits, so the logits of at most one chunk exist at any time, none are
computed twice, and the backward only scales the gradients it was handed.

Exactly transformers' head (Gemma4ForConditionalGeneration.forward and the other classes
of HEADS): `logits = lm_head(hidden)`, then `cap * tanh(logits / cap)` when the text
config's `final_logit_softcapping` is set. One difference, on purpose: transformers caps
in the compute dtype (bf16 on a TPU) and the old loss cast to fp32 afterwards; here the
logits are cast to fp32 first, so the cap and the loss are both fp32.

FSDP2: the head's weight (tied to the input embedding) belongs to the root unit, which
FSDP all-gathers in the root's forward hooks. `install` registers `label_loss_sum` as a
forward method of the root (`register_fsdp_forward_method`), so the same hooks run around
it: the weight read inside is the all-gathered one and its gradient is reduce-scattered
as after a plain forward.

The cap: the most label tokens any micro-batch of the run holds, known on the host before
the first step (every epoch's order is a seeded permutation and its steps are packed from
it: data.plan_run finds it in one pass, without keeping the plans), rounded
up to ROW_ALIGN rows. Fewer labels are padded with positions whose target is the ignore
index (zero loss, zero gradient); more can never be gathered, and the trainer checks every
step's micro-batches against the cap on the host before the epoch starts (`check_cap`).
"""

from __future__ import annotations

import types

import numpy as np
import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX, Packed, eval_order
from .errors import ModelError

# Rows of one chunk: its fp32 logits are CHUNK_ROWS x vocab x 4 bytes (256 MiB for Gemma's
# 262144 tokens); two such buffers and the head weight's gradient are what the head adds
# (the gradient is summed in fp32: HEAD_GRAD_ACCUMULATOR_BYTES).
CHUNK_ROWS = 256
# Bytes per element of the head weight's gradient while the forward sums it over the chunks
# (fp32, whatever the compute dtype), and, at the end of the sum, the compute dtype's copy
# beside it: vocab x hidden x (4 + 2) bytes at once in bf16, where a bf16 sum held 2.
HEAD_GRAD_ACCUMULATOR_BYTES = 4


def head_gradient_peak_bytes(vocab: int, hidden: int, compute_bytes: int = 2) -> int:
    """The head weight's gradient at its largest in the forward (the memory plan's figure):
    the fp32 sum and, as it is rounded, its copy in the compute dtype (none in fp32)."""
    copy = compute_bytes if compute_bytes < HEAD_GRAD_ACCUMULATOR_BYTES else 0
    return vocab * hidden * (HEAD_GRAD_ACCUMULATOR_BYTES + copy)


# The cap is a multiple of this (TPU tiles are 8 or 16 rows), and at least this.
ROW_ALIGN = 16
# Model types whose transformers forward is exactly `lm_head`, then the optional final
# softcap, as reproduced here. Any other model keeps transformers' full-logits forward.
HEADS = ("gemma", "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "llama", "mistral", "qwen2", "qwen3")


def label_cap(most_labels: int, positions: int) -> int:
    """Rows of the label buffer: `most_labels` rounded up to ROW_ALIGN, at most the
    micro-batch's `positions` (then every position is a row and nothing is gathered)."""
    aligned = max(ROW_ALIGN, -(-most_labels // ROW_ALIGN) * ROW_ALIGN)
    return min(aligned, positions)


def micro_batch_labels(packed: Packed, blocks: np.ndarray) -> np.ndarray:
    """Label tokens of each micro-batch in `blocks` ([..., per_device] block indices;
    index len(packed) or -1 is a label-free filler block)."""
    counts = np.concatenate([packed.label_tokens, [0]])
    index = np.where((blocks < 0) | (blocks >= len(packed)), len(packed), blocks)
    return counts[index].sum(axis=-1)


def most_eval_label_tokens(packed: Packed, world: int, per_device: int) -> int:
    """The most label tokens of any evaluation micro-batch of any rank (data.eval_order)."""
    most = 0
    for rank in range(world):
        order = eval_order(len(packed), world, per_device, rank)
        most = max(most, int(micro_batch_labels(packed, order.reshape(-1, per_device)).max(initial=0)))
    return most


def check_cap(packed: Packed, blocks: np.ndarray, cap: int, where: str) -> None:
    """Refuse (never drop labels) when a micro-batch holds more label tokens than `cap`."""
    counts = micro_batch_labels(packed, blocks)
    if counts.size and int(counts.max()) > cap:
        raise RuntimeError(f"{where}: a micro-batch holds {int(counts.max())} label tokens, more than the loss "
                           f"head's {cap} rows; the cap must come from the same block order (data.plan_run)")


def label_rows(targets: torch.Tensor, cap: int) -> torch.Tensor:
    """[cap] flat positions of `targets` ([batch, length]): every label position, in
    order, then positions without a label. A stable sort on the device (no host read,
    a static shape): labels sort before the rest."""
    unlabelled = (targets.flatten() == IGNORE_INDEX).to(torch.int32)
    return torch.argsort(unlabelled, stable=True)[:cap]


def chunk_loss_and_grad(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None,
                        with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed cross-entropy of one chunk and, with `with_grad`, the gradient of that sum
    with respect to the chunk's logits (before the softcap), in fp32 and in the compute
    dtype (the weight's gradient is accumulated from the first, the rows' computed from the
    second). The logits are fp32 (or wider) from the head's output on; the [rows, vocab]
    buffers are reused in place, so at most two fp32 ones exist at once (and the loop drops
    them before the next chunk)."""
    logits = F.linear(rows, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        capped = logits.div_(softcap).tanh_()  # Gemma's cap * tanh(logits / cap), in fp32
        z = capped * softcap
    else:
        capped, z = None, logits
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)
    picked = z.gather(1, safe).squeeze(1)
    # logsumexp with z's buffer as its workspace: z becomes exp(z - max), then softmax(z).
    top = z.amax(dim=1, keepdim=True)
    exp_sum = z.sub_(top).exp_().sum(dim=1, keepdim=True)
    summed = ((exp_sum.log() + top).squeeze(1) - picked).mul(valid).sum()
    if not with_grad:
        return summed, None, None
    # d(sum)/dz = softmax(z) - onehot(target) on labelled rows (0 elsewhere), and through
    # the softcap dz/dlogits = 1 - tanh^2.
    dz = z.div_(exp_sum)
    dz.scatter_add_(1, safe, -torch.ones_like(safe, dtype=dz.dtype))
    dz.mul_(valid.unsqueeze(1))
    if capped is not None:
        dz.mul_(capped.mul_(capped).neg_().add_(1))
    return summed, dz, dz.to(rows.dtype)


class ChunkedHeadLoss(torch.autograd.Function):
    """Summed cross-entropy of `rows` ([n, hidden]) under the head `weight` ([vocab,
    hidden]), `chunk` rows at a time. When a gradient is wanted the forward computes it
    too, chunk by chunk (the gradients of the rows, [n, hidden], and of the weight, the
    size of the weight, which the backward would allocate first thing anyway), so no
    chunk's logits outlive the chunk and none are computed twice; the backward only
    scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, rows, weight, targets, softcap, chunk, with_grad):
        # Only the gradients autograd will ask for: a frozen head (--freeze-embeddings with
        # tied weights) needs no [vocab, hidden] buffer at all.
        rows_grad = with_grad and ctx.needs_input_grad[0]
        weight_grad = with_grad and ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        grad_rows = torch.empty_like(rows) if rows_grad else None
        # The weight's gradient is a sum over every chunk: accumulated in fp32 (from each
        # chunk's fp32 logit gradient), then rounded to the weight's dtype once. In bf16 the
        # sum would be rounded after every chunk, and a small chunk's part lost beside a
        # large sum.
        wide = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if weight_grad else None
        for start in range(0, rows.shape[0], chunk):
            end = start + chunk
            part = rows[start:end]
            summed, dlogits_wide, dlogits = chunk_loss_and_grad(part, weight, targets[start:end], softcap,
                                                                rows_grad or weight_grad)
            total = total + summed
            if rows_grad:
                torch.mm(dlogits, weight, out=grad_rows[start:end])
            if weight_grad:
                grad_weight.addmm_(dlogits_wide.t(), part.to(wide))
            del dlogits, dlogits_wide  # before the next chunk allocates its own
        if grad_weight is not None and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)  # the fp32 sum goes here, before the backward
        # Kept on ctx, not save_for_backward: the backward takes them away (below).
        ctx.grads = (grad_rows, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad):
        # Taken off ctx, scaled in place and handed on: a product would be a second [vocab,
        # hidden] buffer beside the kept one, and a tensor ctx still referenced could not
        # become the weight's gradient as it is (autograd would copy it). So the backward
        # runs once per forward; a second one (retain_graph) is refused.
        if ctx.grads is None:
            raise RuntimeError("the label-position loss head hands its gradients on in its first backward; "
                               "a second backward through the same forward (retain_graph) is not supported")
        (grad_rows, grad_weight), ctx.grads = ctx.grads, None
        if grad_rows is not None:
            grad_rows.mul_(grad.to(grad_rows.dtype))
        if grad_weight is not None:
            grad_weight.mul_(grad.to(grad_weight.dtype))
        return grad_rows, grad_weight, None, None, None, None


def head_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, softcap: float | None,
                  cap: int, chunk: int = CHUNK_ROWS) -> torch.Tensor:
    """Summed fp32 cross-entropy of the label positions of `hidden` ([batch, length,
    hidden]) against `targets` ([batch, length], IGNORE_INDEX where unlabelled)."""
    flat_targets = targets.flatten().long()
    flat_hidden = hidden.flatten(0, 1)
    if cap < flat_targets.numel():
        index = label_rows(targets, cap)
        flat_hidden, flat_targets = flat_hidden.index_select(0, index), flat_targets.index_select(0, index)
    # Under no_grad (evaluation) autograd still marks inputs that require grad as needing
    # it inside a Function; decide here whether gradients are computed at all.
    with_grad = torch.is_grad_enabled() and (flat_hidden.requires_grad or weight.requires_grad)
    return ChunkedHeadLoss.apply(flat_hidden, weight, flat_targets, softcap, chunk, with_grad)


def uses_label_head(model) -> bool:
    """Whether `model`'s head is one this module reproduces exactly (HEADS, no bias)."""
    head = model.get_output_embeddings()
    kinds = {getattr(model.config, "model_type", None), getattr(model.config.get_text_config(), "model_type", None)}
    return bool(kinds & set(HEADS)) and head is not None and getattr(head, "bias", None) is None


def label_loss_sum(model, input_ids, position_ids, attention_mask, targets, cap: int) -> torch.Tensor:
    """The summed cross-entropy of a micro-batch's label tokens (a method of `model`)."""
    body = getattr(model, model.base_model_prefix)
    hidden = body(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                  use_cache=False).last_hidden_state
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    return head_loss_sum(hidden, targets, model.get_output_embeddings().weight, softcap, cap, CHUNK_ROWS)


def install(model) -> None:
    """Give `model` a `label_loss_sum` method that FSDP2 wraps in its root's forward hooks
    (a no-op registration on a model that is not sharded)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if not uses_label_head(model):
        raise ModelError(f"{type(model).__name__}: its head is not one the label-position loss reproduces "
                         f"({', '.join(HEADS)}, without a bias)")
    model.label_loss_sum = types.MethodType(label_loss_sum, model)
    register_fsdp_forward_method(model, "label_loss_sum")
