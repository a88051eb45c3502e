"""DPO's loss, pure (tensors in, tensors out; no model, no I/O), matched to TRL.

From the summed response log-probabilities of the policy and of the reference for each
pair's chosen and rejected response (tests/trainer/test_dpo_loss.py holds it to TRL
1.16's DPOTrainer within 1e-5):

- `sigmoid` (Rafailov et al.): -log sigmoid(beta * ((pc - rc) - (pr - rr))). With
  `label_smoothing` e > 0, conservative DPO (the label taken as flipped with probability
  e): (1 - e) * -log sigmoid(beta * d) + e * -log sigmoid(-beta * d). TRL's `sigmoid` had
  this until its 1.0 refactor; 1.16 keeps the formula in its `aot` losses, which for one
  pair are exactly it (the test compares there).
- `ipo` (Azar et al., Eq. 17): (d / n - 1 / (2 * beta))^2 with each log-ratio divided by its
  response's token count n, as TRL does. Label smoothing has no meaning there: refused.
- `reference_free`: the reference's log-probabilities taken as 0 (the implicit reward is
  the policy's log-probability alone); no reference forward is needed.

Rewards are beta * (policy - reference) log-probabilities per response; the margin is
chosen minus rejected; accuracy the share of pairs whose chosen reward is strictly higher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("sigmoid", "ipo")
DEFAULT_BETA = 0.1


@dataclass(frozen=True)
class DPOSettings:
    beta: float = DEFAULT_BETA
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    reference_free: bool = False

    def problems(self) -> list[str]:
        """What cannot work, each naming the flag and the fix (empty when sound)."""
        found = []
        if self.loss not in LOSSES:
            found.append(f"--dpo-loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if not self.beta > 0:
            found.append(f"--dpo-beta must be > 0 (it is {self.beta}); 0.1 is the usual value")
        if not 0.0 <= self.label_smoothing < 0.5:
            found.append(f"--dpo-label-smoothing must be in [0, 0.5) (it is {self.label_smoothing}): it is the "
                         "probability that a pair's preference is flipped")
        if self.loss == "ipo" and self.label_smoothing:
            found.append("--dpo-label-smoothing applies to --dpo-loss sigmoid only (conservative DPO); IPO has no "
                         "label smoothing: set it to 0 or use --dpo-loss sigmoid")
        return found

    def as_dict(self) -> dict:
        return {"beta": self.beta, "loss": self.loss, "label_smoothing": self.label_smoothing,
                "reference_free": self.reference_free}


@dataclass
class PairLosses:
    """Per pair: the loss, and the chosen and rejected rewards (detached)."""
    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    def sums(self) -> torch.Tensor:
        """[loss, chosen reward, rejected reward, margin, correct] summed over the pairs
        (fp32, detached): what an epoch accumulates on the device and divides by its pairs."""
        margin = self.chosen_rewards - self.rejected_rewards
        return torch.stack([self.losses.detach().sum(), self.chosen_rewards.sum(), self.rejected_rewards.sum(),
                            margin.sum(), (margin > 0).float().sum()]).float()


# The order of PairLosses.sums, and the names the epoch's metrics take.
SUM_KEYS = ("loss", "rewards_chosen", "rewards_rejected", "margin", "accuracy")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
             ref_rejected: torch.Tensor | None, settings: DPOSettings, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None) -> PairLosses:
    """Per-pair DPO losses and rewards from summed response log-probabilities ([pairs]).
    The reference's may be None only with `reference_free`. `ipo` needs each response's
    token count."""
    beta = settings.beta
    if settings.reference_free:
        ref_chosen = torch.zeros_like(policy_chosen)
        ref_rejected = torch.zeros_like(policy_rejected)
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    if settings.loss == "sigmoid":
        delta = chosen_ratio - rejected_ratio
        losses = -F.logsigmoid(beta * delta)
        if settings.label_smoothing:
            eps = settings.label_smoothing
            losses = (1 - eps) * losses - eps * F.logsigmoid(-beta * delta)
    elif settings.loss == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss needs each response's token count")
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {settings.loss!r}")
    return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def metrics_of(sums: list[float], pairs: int) -> dict:
    """The epoch's means from PairLosses.sums added up over its pairs."""
    return {key: value / max(pairs, 1) for key, value in zip(SUM_KEYS, sums)}


def segment_logps(logits: torch.Tensor, targets: torch.Tensor, segment_ids: torch.Tensor, segments: int,
                  ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of the scored targets, and their count, per segment of each
    row: ([rows, segments] each, fp32; segment s of a row at column s - 1). `targets[t]` is
    what position t predicts (ignore_index where nothing is scored); a position counts for
    its own segment. A row of one sequence is one segment (segment ids all 1)."""
    scored = targets != ignore_index
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).long().unsqueeze(-1)).squeeze(-1)
    picked = torch.where(scored, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
    column = (segment_ids.long() - 1).clamp(min=0, max=segments - 1)
    sums = torch.zeros(targets.shape[0], segments, dtype=torch.float32, device=logits.device)
    counts = torch.zeros_like(sums)
    return sums.scatter_add(1, column, picked), counts.scatter_add(1, column, scored.float())
