"""Epochs planned lazily and faster, with not one output changed: a resumed run continues
at a data offset computed from the plans, so the new planner (data.py) must give exactly
what the planner of commit e61390f gave. That planner is kept here, verbatim, as the
reference (`Reference`), and both run on random lengths (ties and a partial last step
included) over several plans, seeds and block lengths."""

from __future__ import annotations

import bisect
import heapq
import itertools

import numpy as np
import pytest

from tpufinetune_trainer import data
from tpufinetune_trainer.data import BatchPlan


class Reference:
    """data.py's planner at commit e61390f (every epoch planned up front), verbatim but
    for `self`; and the cap the trainer took from those plans (loss.most_label_tokens then)."""

    BALANCE_WINDOW_STEPS = 16

    @staticmethod
    def bin_pack(lengths, max_seq_len):
        order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
        bins: list[list[int]] = []
        free: list[tuple[int, int]] = []  # (free tokens, bin index), sorted
        for i in order:
            need = int(lengths[i])
            at = bisect.bisect_left(free, (need, -1))
            if at == len(free):
                bins.append([i])
                bisect.insort(free, (max_seq_len - need, len(bins) - 1))
            else:
                room, b = free.pop(at)
                bins[b].append(i)
                bisect.insort(free, (room - need, b))
        return bins

    @staticmethod
    def epoch_permutation(num_examples, epoch, seed):
        return np.random.default_rng(seed + epoch).permutation(num_examples)

    @staticmethod
    def steps_per_epoch(num_examples, plan):
        return -(-num_examples // plan.global_examples)

    def epoch_steps(self, lengths, plan, epoch, seed):
        order = self.epoch_permutation(len(lengths), epoch, seed)
        size, steps = plan.global_examples, self.steps_per_epoch(len(lengths), plan)
        rng = np.random.default_rng([seed, epoch])
        out: list[np.ndarray] = []
        for first in range(0, steps, self.BALANCE_WINDOW_STEPS):
            window = range(first, min(steps, first + self.BALANCE_WINDOW_STEPS))
            pool = order[first * size:window[-1] * size + size]
            room = [len(order[s * size:(s + 1) * size]) for s in window]
            members: list[list[int]] = [[] for _ in window]
            heap = [(0, k) for k in range(len(window))]
            for i in sorted(range(len(pool)), key=lambda i: (-int(lengths[pool[i]]), i)):
                tokens, k = heapq.heappop(heap)
                members[k].append(int(pool[i]))
                if len(members[k]) < room[k]:
                    heapq.heappush(heap, (tokens + int(lengths[pool[i]]), k))
            out += [np.array(sorted(members[k]), dtype=np.int64) for k in rng.permutation(len(window))]
        return out

    def step_bins(self, lengths, examples, max_seq_len):
        return [[int(examples[i]) for i in members] for members in self.bin_pack(lengths[examples], max_seq_len)]

    def blocks_per_device(self, lengths, plan, epochs, seed, max_seq_len):
        slots = plan.world * plan.accum
        most = 1
        for epoch in range(1, epochs + 1):
            for examples in self.epoch_steps(lengths, plan, epoch, seed):
                most = max(most, len(self.step_bins(lengths, examples, max_seq_len)))
        return -(-most // slots)

    def plan_epoch(self, lengths, label_tokens, plan, epoch, seed, max_seq_len):
        grouped = self.epoch_steps(lengths, plan, epoch, seed)
        steps = len(grouped)
        slots = np.full((steps, plan.accum, plan.world, plan.blocks), -1, dtype=np.int64)
        blocks: list[list[int]] = []
        labels = np.zeros(steps, dtype=np.int64)
        real = np.zeros(steps, dtype=np.int64)
        for step, examples in enumerate(grouped):
            bins = self.step_bins(lengths, examples, max_seq_len)
            if len(bins) > plan.global_blocks:
                raise RuntimeError(f"epoch {epoch} step {step} needs {len(bins)} blocks, more than the plan's "
                                   f"{plan.global_blocks}; blocks_per_device must come from the same order")
            for j, members in enumerate(bins):
                rank, place = j % plan.world, j // plan.world
                slots[step, place // plan.blocks, rank, place % plan.blocks] = len(blocks)
                blocks.append(members)
            labels[step] = int(label_tokens[examples].sum())
            real[step] = int(lengths[examples].sum())
        return data.EpochPlan(blocks, slots, labels, real)

    @staticmethod
    def label_tokens(labels):  # data.Examples.label_tokens
        scored = labels.values != data.IGNORE_INDEX
        starts = labels.offsets[:-1]
        scored[starts[labels.lengths > 0]] = False
        counted = np.zeros(len(scored) + 1, dtype=np.int64)
        np.cumsum(scored, out=counted[1:])
        return counted[labels.offsets[1:]] - counted[starts]

    @staticmethod
    def most_label_tokens(epochs, example_labels):
        most = 0
        for epoch in epochs:
            per_block = np.array([int(example_labels[members].sum()) for members in epoch.blocks] + [0],
                                 dtype=np.int64)
            if epoch.slots.size:
                most = max(most, int(per_block[epoch.slots].sum(axis=-1).max()))  # -1 (padding) picks the 0
        return most


REFERENCE = Reference()


def random_lengths(count: int, seed: int, longest: int) -> np.ndarray:
    """Lengths 1..longest, few distinct values (many ties), some whole blocks long."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice(rng.integers(1, longest + 1, 12), count)
    lengths[rng.random(count) < 0.05] = longest
    return lengths.astype(np.int64)


def same_steps(ours: list[np.ndarray], reference: list[np.ndarray]) -> bool:
    return len(ours) == len(reference) and all(a.dtype == b.dtype and np.array_equal(a, b)
                                               for a, b in zip(ours, reference))


def same_plan(ours: data.EpochPlan, reference: data.EpochPlan) -> bool:
    return (ours.blocks == reference.blocks and ours.slots.dtype == reference.slots.dtype
            and np.array_equal(ours.slots, reference.slots)
            and np.array_equal(ours.label_tokens, reference.label_tokens)
            and np.array_equal(ours.real_tokens, reference.real_tokens))


# (examples, max_seq_len, seed): counts that leave a partial last step and a short last
# window for most plans, some large enough for several whole windows, and one (1024) that
# most plans cut into whole windows only.
DATA = [(1, 64, 0), (7, 64, 1), (37, 96, 2), (101, 128, 3), (250, 64, 4), (613, 256, 5), (1024, 128, 7),
        (1201, 512, 6)]
PLANS = [BatchPlan(world, per_device, accum) for world in (1, 2, 4) for accum in (1, 2) for per_device in (1, 2, 3, 4)]


@pytest.mark.parametrize("together", [1, data.DEAL_TOGETHER])
@pytest.mark.parametrize("count,max_seq_len,seed", DATA)
def test_steps_and_packing_are_the_references(count, max_seq_len, seed, together, monkeypatch):
    """Windows of full steps dealt one by one or together (numpy, a place at a time)."""
    monkeypatch.setattr(data, "DEAL_TOGETHER", together)
    lengths = random_lengths(count, seed, max_seq_len)
    for plan, epoch in itertools.product(PLANS, (1, 2)):
        steps = data.epoch_steps(lengths, plan, epoch, seed + 40)
        assert same_steps(steps, REFERENCE.epoch_steps(lengths, plan, epoch, seed + 40)), (plan, epoch)
        for examples in steps[:3] + steps[-2:]:
            assert data.steps_bins(lengths, [examples], max_seq_len)[0] == \
                REFERENCE.step_bins(lengths, examples, max_seq_len)


@pytest.mark.parametrize("count,max_seq_len,seed", DATA)
def test_the_run_shape_and_every_epoch_plan_are_the_references(count, max_seq_len, seed):
    """The whole-run maxima in one pass (data.plan_run) are the reference's blocks per
    device and its cap over every epoch's plan; each epoch planned alone is its plan."""
    lengths = random_lengths(count, seed, max_seq_len)
    labels = np.random.default_rng(seed + 1).integers(0, lengths + 1)  # labels <= length
    epochs, run_seed = 3, seed + 7
    for base in PLANS:
        blocks = REFERENCE.blocks_per_device(lengths, base, epochs, run_seed, max_seq_len)
        plan = BatchPlan(base.world, base.per_device, base.accum, blocks)
        plans = [REFERENCE.plan_epoch(lengths, labels, plan, epoch, run_seed, max_seq_len)
                 for epoch in range(1, epochs + 1)]
        shape = data.plan_run(lengths, labels, base, epochs, run_seed, max_seq_len)
        assert shape.plan == plan
        assert shape.most_label_tokens == REFERENCE.most_label_tokens(plans, labels), base
        for epoch in (3, 1, 2):  # in any order, as a resume takes them
            assert same_plan(data.plan_epoch(lengths, labels, plan, epoch, run_seed, max_seq_len), plans[epoch - 1])


def test_bin_pack_is_the_references_for_lists_ties_and_overlong_examples():
    rng = np.random.default_rng(9)
    for count in (0, 1, 2, 5, 40, 300):
        for longest in (8, 64, 512):
            lengths = rng.integers(0, longest + 20, count)  # 0 and over the block length too
            assert data.bin_pack(lengths, longest) == REFERENCE.bin_pack(lengths, longest)
            assert data.bin_pack(lengths.tolist(), longest) == REFERENCE.bin_pack(lengths.tolist(), longest)
            some = rng.permutation(count)[:count // 2]  # any examples, in any order
            assert data.steps_bins(lengths, [some], longest) == [REFERENCE.step_bins(lengths, some, longest)]


@pytest.mark.parametrize("part_tokens", [1, 7, 1 << 20])
def test_label_tokens_are_the_references_in_any_parts(part_tokens, monkeypatch):
    """Counted a part of the rows at a time, empty rows and a row of one token included."""
    monkeypatch.setattr(data, "LABEL_COUNT_TOKENS", part_tokens)
    rng = np.random.default_rng(4)
    rows = [rng.choice([data.IGNORE_INDEX, 5], int(n)).tolist() for n in rng.integers(0, 9, 300)]
    examples = data.Examples(rows, rows)
    assert examples.label_tokens.tolist() == REFERENCE.label_tokens(examples.labels).tolist()
    assert data.Examples([[], [5], []], [[], [5], []]).label_tokens.tolist() == [0, 0, 0]
    assert data.Examples([[]], [[]]).label_tokens.tolist() == [0]


def test_a_plan_too_small_for_a_step_is_refused_as_before():
    lengths = random_lengths(200, 3, 128)
    base = BatchPlan(2, 4, 1)
    small = BatchPlan(2, 4, 1, data.plan_run(lengths, lengths, base, 1, 0, 128).plan.blocks - 1)
    with pytest.raises(RuntimeError) as ours:
        data.plan_epoch(lengths, lengths, small, 1, 0, 128)
    with pytest.raises(RuntimeError) as reference:
        REFERENCE.plan_epoch(lengths, lengths, small, 1, 0, 128)
    # The same step and counts; the remedy now names plan_run (blocks_per_device is gone).
    assert str(ours.value).split(";")[0] == str(reference.value).split(";")[0]
    assert "plan_run" in str(ours.value)


def test_the_cap_is_for_the_blocks_per_device_the_run_ends_with():
    """Which blocks share a micro-batch depends on the blocks per device, set by the
    run's fullest step (here in epoch 2): epoch 1's most labels at the fewer blocks it
    needs alone would be too small a cap for it in the run."""
    lengths = random_lengths(101, 3, 128)
    labels = np.random.default_rng(4).integers(0, lengths + 1)
    one, three = (data.plan_run(lengths, labels, BatchPlan(1, 2, 2), epochs, 10, 128) for epochs in (1, 3))
    assert (one.plan.blocks, three.plan.blocks) == (1, 2)
    first = REFERENCE.plan_epoch(lengths, labels, three.plan, 1, 10, 128)
    assert three.most_label_tokens >= REFERENCE.most_label_tokens([first], labels) > one.most_label_tokens
