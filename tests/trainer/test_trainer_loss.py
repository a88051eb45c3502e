"""The loss head at label positions only (loss.py) against transformers' full logits, in
one process (a real world-size-1 gloo group, FSDP2): the same summed loss and gradients
with Gemma's final-logit softcap, padded and chunked; no label is ever dropped. The
2-rank gradient test (test_trainer_gradients.py) runs the same head under FSDP2 on two
ranks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tpufinetune_trainer import loss
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.data import IGNORE_INDEX, BatchPlan, plan_epoch, plan_run, rank_blocks
from tpufinetune_trainer.errors import ConfigError
from tpufinetune_trainer.train import Trainer
from trainer_helpers import BLOCK_LENGTH, make_trainer

LENGTH = BLOCK_LENGTH
# A cap that bites on the tiny random model, whose logits are ~0.1: omitting it changes the
# loss by far more than the tolerance (checked below, in the test itself).
SOFTCAP = 0.05


@pytest.fixture(scope="module")
def softcapped(trainer_assets, tmp_path_factory):
    """The tiny Gemma 4 with `final_logit_softcapping` set (as Gemma's releases set it)."""
    model = tmp_path_factory.mktemp("softcapped") / "model"
    shutil.copytree(trainer_assets.model, model)
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = SOFTCAP
    (model / "config.json").write_text(json.dumps(config))
    return model


def loss_and_grads(trainer: Trainer, batch: dict, head: bool) -> tuple[float, list[torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    if head:
        summed = trainer.token_loss_sum(batch, trainer.train_cap)
    else:
        summed = trainer.full_logits_loss_sum(batch, trainer.masks(batch["segment_ids"]))
    summed.backward()
    grads = [p.grad.full_tensor().clone() for p in trainer.params]
    trainer.model.zero_grad(set_to_none=True)
    return float(summed.detach()), grads


def first_micro_batch(trainer: Trainer) -> dict:
    trainer.load_window()
    return trainer.train_blocks.gather(torch.arange(trainer.plan.blocks))


def test_the_label_head_gives_the_full_logits_loss_and_gradients_with_the_softcap(
        softcapped, prepared, process_group, tmp_path, monkeypatch):
    monkeypatch.setattr(loss, "CHUNK_ROWS", 100)  # several chunks, the last one short
    trainer = make_trainer(softcapped, prepared, tmp_path)
    assert trainer.label_head and trainer.model.config.get_text_config().final_logit_softcapping == SOFTCAP
    batch = first_micro_batch(trainer)
    labels = int((batch["targets"] != IGNORE_INDEX).sum())
    positions = batch["targets"].numel()
    # Padded: the cap holds more rows than this micro-batch has labels, and fewer than
    # its positions, so rows are gathered, some of them padding.
    assert labels < trainer.train_cap < positions and trainer.train_cap % loss.CHUNK_ROWS
    full, full_grads = loss_and_grads(trainer, batch, head=False)
    ours, our_grads = loss_and_grads(trainer, batch, head=True)
    assert abs(ours - full) <= 1e-5 * abs(full), (ours, full)
    assert sum(bool(torch.any(g != 0)) for g in full_grads) > len(full_grads) // 2
    for name, a, b in zip([n for n, p in trainer.model.named_parameters() if p.requires_grad], full_grads,
                          our_grads):
        assert torch.linalg.vector_norm(a - b) <= 1e-5 * torch.linalg.vector_norm(a) + 1e-9, name
    # The comparison can fail: without the softcap the head's loss and gradients are far
    # from the full logits' ones (by 10 and 100 times the tolerance above).
    original = loss.chunk_loss_and_grad
    monkeypatch.setattr(loss, "chunk_loss_and_grad", lambda rows, weight, targets, softcap, with_grad:
                        original(rows, weight, targets, None, with_grad))
    without, without_grads = loss_and_grads(trainer, batch, head=True)
    assert abs(without - full) > 1e-4 * abs(full), (without, full)
    difference = torch.linalg.vector_norm(torch.cat([(a - b).flatten() for a, b in zip(full_grads, without_grads)]))
    assert difference > 1e-3 * torch.linalg.vector_norm(torch.cat([a.flatten() for a in full_grads]))


def test_the_evaluation_loss_is_the_full_logits_one(softcapped, prepared, process_group, tmp_path):
    """`--loss-head full` (transformers' logits) is the reference and the fallback."""
    ours = make_trainer(softcapped, prepared, tmp_path).evaluate()
    reference = make_trainer(softcapped, prepared, tmp_path, loss_head="full")
    assert not reference.label_head
    full = reference.evaluate()
    assert ours is not None and abs(ours - full) <= 1e-5 * full
    with pytest.raises(ConfigError, match="--loss-head must be one of labels, full"):
        FinetuneConfig(storage_path=str(tmp_path), loss_head="logits").validate()


def test_the_label_head_in_bf16_compute_stays_within_bf16_of_the_full_logits(softcapped, prepared, process_group,
                                                                             tmp_path):
    """The TPU's dtypes on the CPU: bf16 head and hidden states, fp32 softcap and loss (the
    full logits path caps in bf16, so the two differ by bf16 rounding only)."""
    trainer = make_trainer(softcapped, prepared, tmp_path, compute_dtype="bfloat16")
    batch = first_micro_batch(trainer)
    full, full_grads = loss_and_grads(trainer, batch, head=False)
    ours, our_grads = loss_and_grads(trainer, batch, head=True)
    assert abs(ours - full) <= 1e-2 * abs(full), (ours, full)
    assert {g.dtype for g in our_grads} == {torch.float32}
    cosine = [float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0)) for a, b in zip(full_grads, our_grads)
              if torch.any(a != 0)]
    assert min(cosine) > 0.99, min(cosine)


def test_label_rows_keep_every_label_in_order_then_pad_with_unlabelled_positions():
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 50, (3, 40), generator=generator)
    targets[torch.rand(3, 40, generator=generator) < 0.7] = IGNORE_INDEX
    flat = targets.flatten()
    labelled = flat[flat != IGNORE_INDEX]
    count = labelled.numel()
    exact = flat[loss.label_rows(targets, count)]
    assert torch.equal(exact, labelled)  # every label, once, in order
    padded = flat[loss.label_rows(targets, count + 9)]
    assert torch.equal(padded[:count], labelled) and bool(torch.all(padded[count:] == IGNORE_INDEX))


def test_the_chunked_head_gradient_is_the_exact_one():
    """float64 central differences against the gradient the forward computes, softcap on, 3
    chunks (not gradcheck: it runs the backward twice on one forward, which the head refuses)."""
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(7, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.tensor([3, IGNORE_INDEX, 0, 10, 4, IGNORE_INDEX, 7])
    summed = loss.ChunkedHeadLoss.apply(rows, weight, targets, 0.7, 3, True)
    summed.backward()
    step = 1e-6
    for tensor in (rows, weight):
        numeric = torch.zeros_like(tensor)
        for index in np.ndindex(*tensor.shape):
            values = []
            for sign in (1, -1):
                with torch.no_grad():
                    tensor[index] += sign * step
                    values.append(float(loss.ChunkedHeadLoss.apply(rows, weight, targets, 0.7, 3, False)))
                    tensor[index] -= sign * step
            numeric[index] = (values[0] - values[1]) / (2 * step)
        assert torch.allclose(tensor.grad, numeric, atol=1e-6, rtol=1e-5)
    # The gradients were handed on, not kept: a second backward is refused with a reason.
    summed = loss.ChunkedHeadLoss.apply(rows, weight, targets, 0.7, 3, True)
    summed.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        summed.backward()


def test_the_cap_holds_every_micro_batch_of_the_run_and_a_smaller_one_is_refused(prepared):
    """The cap is the most labels of any micro-batch of the run (every rank, every epoch);
    a cap one row short is refused on the host, before the step, never applied."""
    examples, epochs, seed = prepared["train"], 3, 42
    lengths, labels = examples.lengths, examples.label_tokens
    base = BatchPlan(2, 2, 2)
    shape = plan_run(lengths, labels, base, epochs, seed, LENGTH)  # the cap the trainer takes
    plan, most = shape.plan, shape.most_label_tokens
    plans = [plan_epoch(lengths, labels, plan, epoch, seed, LENGTH) for epoch in range(1, epochs + 1)]
    seen = [rank_blocks(examples, planned, rank, LENGTH, 0).label_tokens.reshape(len(planned), plan.accum,
                                                                                 plan.blocks).sum(axis=-1)
            for planned in plans for rank in range(plan.world)]
    assert max(int(s.max()) for s in seen) == most and len(set(np.concatenate(seen).ravel().tolist())) > 1
    assert loss.label_cap(most, 2 * LENGTH) >= most
    assert loss.label_cap(3, 2 * LENGTH) == loss.ROW_ALIGN and loss.label_cap(10_000, 2 * LENGTH) == 2 * LENGTH
    blocks = rank_blocks(examples, plans[0], 0, LENGTH, 0)
    everything = np.arange(len(blocks)).reshape(len(plans[0]), plan.accum, plan.blocks)
    loss.check_cap(blocks, everything, int(seen[0].max()), "test")
    with pytest.raises(RuntimeError, match="more than the loss head's"):
        loss.check_cap(blocks, everything, int(seen[0].max()) - 1, "test")


def test_an_epoch_whose_micro_batch_exceeds_the_cap_fails_before_its_first_step(softcapped, prepared,
                                                                                 process_group, tmp_path):
    trainer = make_trainer(softcapped, prepared, tmp_path, max_steps=1)
    trainer.train_cap = loss.ROW_ALIGN  # below the run's largest micro-batch
    with pytest.raises(RuntimeError, match="more than the loss head's"):
        trainer.train_epoch()
    assert trainer.global_step == 0


class FreshAllocations(TorchDispatchMode):
    """The largest tensor any op allocates (an output sharing no storage with its inputs)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def previous_backward(ctx, grad):
    """The head's backward before it scaled in place: a product beside the kept gradient."""
    grad_rows, grad_weight = ctx.grads
    return grad_rows * grad.to(grad_rows.dtype), grad_weight * grad.to(grad_weight.dtype), None, None, None, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_backward_allocates_no_second_weight_sized_gradient(dtype, monkeypatch):
    """The same gradients as the previous backward (a product per input), and no tensor the
    size of the head's weight allocated in the backward: the one the forward computed is
    scaled in place and becomes the weight's gradient itself. The previous backward fails
    the allocation check (it is run here too)."""
    generator = torch.Generator().manual_seed(2)
    vocab, hidden, n = 4096, 64, 48
    rows = torch.randn(n, hidden, generator=generator).to(dtype)
    weight = torch.randn(vocab, hidden, generator=generator).div(8).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=generator)
    targets[::5] = IGNORE_INDEX

    def backward_with(backward):
        monkeypatch.setattr(loss.ChunkedHeadLoss, "backward", staticmethod(backward))
        r, w = rows.clone().requires_grad_(), weight.clone().requires_grad_()
        summed = loss.ChunkedHeadLoss.apply(r, w, targets, 0.5, 16, True)
        with FreshAllocations() as seen:
            (summed / 7).backward()
        return r.grad, w.grad, seen.largest

    now_rows, now_weight, now_largest = backward_with(loss.ChunkedHeadLoss.backward)
    old_rows, old_weight, old_largest = backward_with(previous_backward)
    assert torch.equal(now_rows, old_rows) and torch.equal(now_weight, old_weight)
    weight_bytes = weight.numel() * weight.element_size()
    assert old_largest >= weight_bytes  # the check sees the previous backward's copy
    assert now_largest < weight_bytes, (now_largest, weight_bytes)


def test_a_frozen_head_weight_gets_no_gradient_buffer():
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(10, 8, generator=generator, requires_grad=True)
    weight = torch.randn(50, 8, generator=generator)  # frozen: no requires_grad
    targets = torch.randint(0, 50, (10,), generator=generator)
    reference_weight = weight.clone().requires_grad_()
    reference_rows = rows.detach().clone().requires_grad_()
    loss.ChunkedHeadLoss.apply(rows, weight, targets, None, 4, True).backward()
    loss.ChunkedHeadLoss.apply(reference_rows, reference_weight, targets, None, 4, True).backward()
    assert weight.grad is None and torch.allclose(rows.grad, reference_rows.grad)
