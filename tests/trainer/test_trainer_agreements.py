"""When the ranks agree on a notice and the background save (notice.Agreements): after the
first step, then about AGREE_EVERY_S of steps later as rank 0 timed them, never after every
step of a fast slice; the others follow the distance the all_reduce carries (rank 0's). On
an asynchronous device the steps are timed as the device completes them (a fake clock and
a device that runs behind its host)."""

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


class AsyncDevice:
    """A device that runs behind its host, as a TPU's dispatch queue does: dispatching a
    step costs the host DISPATCH_S of the fake clock, and the device completes it STEP_S
    after it completed the one before. A value a step produced is read (`item`) only once
    the device has produced it: the host's clock waits until then."""

    DISPATCH_S, STEP_S = 0.01, 0.1

    def __init__(self, clock: Clock):
        self.clock, self.done_at = clock, clock.now

    def step(self) -> "Produced":
        self.clock.now += self.DISPATCH_S
        self.done_at = max(self.done_at, self.clock.now) + self.STEP_S
        return Produced(self, self.done_at)


class Produced:
    def __init__(self, device: AsyncDevice, at: float):
        self.device, self.at = device, at

    def clone(self) -> "Produced":
        return self

    def item(self) -> int:
        self.device.clock.now = max(self.device.clock.now, self.at)
        return 1


def test_an_asynchronous_device_is_timed_by_the_steps_it_completed_not_by_dispatch():
    """The host dispatches a step in 10 ms and the device takes 100 ms: timed by dispatch the
    next agreement would be 100 steps (10 s of device time) away, and a Spot notice's 30 s
    could pass before three of them; timed by completed steps it is AGREE_EVERY_S of the
    device's steps away, and the host never runs more than about one interval ahead."""
    clock = Clock()
    device = AsyncDevice(clock)
    lead = Agreements(0, clock=clock)
    distances, device_times = [], []
    for step in range(1, 400):
        produced = device.step()
        if lead.due(step):
            distance = lead.proposal(step)
            lead.agreed(step, distance, produced)
            distances.append(distance)
            device_times.append(produced.at)
            assert produced.at - clock.now <= 1.5 * AGREE_EVERY_S  # the host is not far ahead of the device
    per_device_step = int(AGREE_EVERY_S / AsyncDevice.STEP_S)
    assert distances[:2] == [1, 1]  # not yet two completed steps to time
    assert set(distances[2:]) <= {per_device_step - 1, per_device_step}, distances  # float rounding
    gaps = [b - a for a, b in zip(device_times, device_times[1:])]
    assert max(gaps) <= AGREE_EVERY_S + AsyncDevice.STEP_S, gaps  # a notice waits about a second of device time
