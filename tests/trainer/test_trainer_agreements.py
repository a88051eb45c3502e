"""When the ranks agree on a notice and the background save (notice.Agreements): after the
first step, then about AGREE_EVERY_S of steps later as rank 0 timed them, never after every
step of a fast slice; the others follow the distance the all_reduce carries (rank 0's)."""

from __future__ import annotations

from tpufinetune_trainer.notice import AGREE_EVERY_S, Agreements


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_fast_steps_agree_once_a_second_and_slow_ones_after_each_step():
    clock = Clock()
    lead = Agreements(0, clock=clock)
    assert lead.due(0)  # the first agreement: after the first step
    clock.now += 5.0  # loading and the compile: a slow first step
    assert lead.proposal(1) == 1
    lead.agreed(1, 1)
    assert not lead.due(1) and lead.due(2)
    clock.now += 0.05  # a 50 ms step
    distance = lead.proposal(2)
    assert distance == int(AGREE_EVERY_S / 0.05) == 20
    lead.agreed(2, distance)
    assert not any(lead.due(step) for step in range(3, 22)) and lead.due(22)
    clock.now += 19 * 3.0  # the steps slowed down to 3 s each (a longer block)
    assert lead.proposal(21) == 1


def test_only_rank_zero_proposes_and_every_rank_takes_the_agreed_distance():
    clock = Clock()
    other = Agreements(3, clock=clock)
    clock.now += 0.01
    assert other.proposal(1) == 0  # the all_reduce (MAX) takes rank 0's
    other.agreed(1, 20)
    assert other.next_step == 21
    other.agreed(21, 0)  # never less than a step
    assert other.next_step == 22
