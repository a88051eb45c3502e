"""Memory at length, in one process (a real world-size-1 gloo group, FSDP2, the tiny Gemma 4):
activation checkpointing gives the same loss and gradients as keeping every activation,
and does recompute; frozen embeddings get no gradient and no AdamW state; the attention
kernel is the one asked for."""

from __future__ import annotations

import pytest
import torch

from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.errors import ConfigError
from tpufinetune_trainer.model import decoder_blocks
from tpufinetune_trainer.train import Trainer
from trainer_helpers import make_trainer


def first_step(trainer: Trainer) -> tuple[float, dict[str, torch.Tensor], int]:
    """The loss sum, gradients by name and calls of the first block's q_proj of step 0
    (optimizer step and zeroing held back). q_proj's forward hook fires once per forward
    of it, so a recomputation in the backward counts twice."""
    trainer.optimizer.step = lambda *a, **k: None
    trainer.optimizer.zero_grad = lambda *a, **k: None
    calls = []
    projection = decoder_blocks(trainer.model)[0].self_attn.q_proj
    hook = projection.register_forward_hook(lambda *args: calls.append(1))
    loss_sum = torch.zeros(())
    trainer.train_step(loss_sum)
    hook.remove()
    grads = {name: p.grad.full_tensor() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return float(loss_sum), grads, len(calls)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["block", "selective"])
def test_checkpointed_activations_give_the_same_loss_and_gradients(mode, trainer_assets, prepared, process_group,
                                                                   tmp_path):
    keeping = make_trainer(trainer_assets.model, prepared, tmp_path, max_grad_norm=0)
    checkpointing = make_trainer(trainer_assets.model, prepared, tmp_path, max_grad_norm=0, activation_checkpointing=mode)
    # Evaluation (no gradients) runs the checkpointed modules as plain forwards.
    assert checkpointing.evaluate() == pytest.approx(keeping.evaluate(), rel=1e-6)
    kept_loss, kept, kept_calls = first_step(keeping)
    loss, grads, calls = first_step(checkpointing)
    assert (kept_calls, calls) == (1, 2)  # the backward ran the attention's forward again
    assert loss == pytest.approx(kept_loss, rel=1e-6)
    assert grads.keys() == kept.keys() and len(grads) > 10
    for name, grad in grads.items():
        assert torch.any(kept[name] != 0) or name.endswith("bias"), name
        assert torch.linalg.vector_norm(grad - kept[name]) <= 1e-5 * torch.linalg.vector_norm(kept[name]) + 1e-9, name


@pytest.mark.timeout(300)
def test_frozen_embeddings_get_no_gradient_and_no_optimizer_state(trainer_assets, prepared, process_group, tmp_path):
    trainer = make_trainer(trainer_assets.model, prepared, tmp_path, max_grad_norm=0, freeze_embeddings=True, max_steps=2)
    embedding = trainer.model.get_input_embeddings().weight
    head = trainer.model.get_output_embeddings().weight
    assert head is embedding  # Gemma ties its head: frozen with the embedding
    before = embedding.full_tensor().clone()
    others = {id(p): p.full_tensor().clone() for p in trainer.params}
    assert not embedding.requires_grad and all(p is not embedding for p in trainer.params)
    loss_sum = torch.zeros(())
    trainer.train_step(loss_sum)
    trainer.train_step(loss_sum)
    assert torch.isfinite(loss_sum) and float(loss_sum) > 0
    assert embedding.grad is None and embedding not in trainer.optimizer.state
    assert torch.equal(embedding.full_tensor(), before)
    assert len(trainer.optimizer.state) == len(trainer.params)
    assert all(not torch.equal(p.full_tensor(), others[id(p)]) for p in trainer.params if p.ndim >= 2)


@pytest.mark.timeout(300)
def test_the_attention_kernel_is_the_one_asked_for(trainer_assets, prepared, process_group, tmp_path):
    trainer = make_trainer(trainer_assets.model, prepared, tmp_path, max_grad_norm=0, attention="eager")
    assert trainer.model.config.get_text_config()._attn_implementation == "eager" and trainer.masks.additive
    default = make_trainer(trainer_assets.model, prepared, tmp_path, max_grad_norm=0)
    assert default.attn_implementation == BACKENDS["cpu"].attn_implementation == "sdpa"
    assert not default.masks.additive
    eager_loss, eager_grads, _ = first_step(trainer)
    sdpa_loss, sdpa_grads, _ = first_step(default)
    assert eager_loss == pytest.approx(sdpa_loss, rel=1e-5)  # the same model, another kernel
    with pytest.raises(ConfigError, match="--attention"):
        FinetuneConfig(storage_path=str(tmp_path), attention="flash").validate()
    with pytest.raises(ConfigError, match="--activation-checkpointing"):
        FinetuneConfig(storage_path=str(tmp_path), activation_checkpointing="all").validate()
