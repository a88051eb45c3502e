"""The LM head's weight gradient (the tied embedding's) is a sum over every chunk of the
label rows: summed in fp32 and rounded to the compute dtype once, it is as close to the
exact gradient as one bf16 rounding of it; summed in bf16 it was rounded after each of the
128 chunks here, about eight times further off."""

from __future__ import annotations

import torch

from tpufinetune_trainer import loss

VOCAB, HIDDEN, ROWS, CHUNK = 512, 32, 1024, 8


def weight_grad(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    weight = weight.clone().requires_grad_()
    loss.ChunkedHeadLoss.apply(rows, weight, targets, None, CHUNK, True).backward()
    return weight.grad


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def test_the_head_weight_gradient_in_bf16_is_summed_in_fp32_and_rounded_once():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(ROWS, HIDDEN, generator=generator).bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) / 8).bfloat16()
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    exact = weight_grad(rows.double(), weight.double(), targets)  # the same bf16 inputs, in fp64
    ours = weight_grad(rows, weight, targets)
    assert ours.dtype == torch.bfloat16  # the gradient of the compute-dtype weight, as FSDP2 wants it
    one_rounding = relative_error(exact.bfloat16(), exact)
    assert relative_error(ours, exact) <= 1.25 * one_rounding, (relative_error(ours, exact), one_rounding)


def test_the_head_gradients_peak_is_the_fp32_sum_and_its_bf16_copy():
    assert loss.head_gradient_peak_bytes(262144, 1536) == 262144 * 1536 * 6
    assert loss.head_gradient_peak_bytes(262144, 1536, compute_bytes=4) == 262144 * 1536 * 4
