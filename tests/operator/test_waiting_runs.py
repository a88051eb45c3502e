"""A waiting run (pending, queued, provisioning) whose backend watches its RayCluster, pods
and Workload takes no steps at rest: it sleeps until a change wakes it, its own timer
(provisioning timeout, activeDeadlineSeconds) comes, or the idle resync. A thousand
queued runs then cost the operator's event loop nothing between changes.

The backend is the driver tests' in-memory stand-in, marked as watched, so that what is
shown is the driver's own loop: when it steps, and when a wake-up could be lost. That the
real watches deliver the changes that wake a run is shown against a real API server in
test_kube_backend_cost.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta, timezone

from tpufinetune import driver
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.driver import Run

from harness.timing import within
from run_helpers import MemoryCluster, body, in_loop, settings

# Poll intervals a run that polled would take a look in each of: the span of the checks.
POLLS = 20
# Steps a run takes on its way to rest, each but the last with a poll's sleep at most (the
# one that wrote "waiting for RayCluster" and the one after).
TRANSITION_STEPS = 3


class WatchedCluster(MemoryCluster):
    """The stand-in, watched: counts the run's looks, and can turn ready (a watch event
    that wakes the run) in the middle of a look, after answering."""

    watched = True

    def __init__(self):
        super().__init__()
        self.ready = False  # the pods never get ready unless a test says so
        self.looks = 0
        self.looked = asyncio.Event()  # set at every look
        self.ready_after_look: int | None = None
        self.run: Run | None = None

    async def observe(self, ident, name):
        view = await super().observe(ident, name)
        self.looks += 1
        self.looked.set()
        if self.looks == self.ready_after_look:
            # The change lands while this step is still deciding on the old view.
            self.ready = True
            self.run.wake.set()
        return view


@contextlib.asynccontextmanager
async def provisioning(cluster: WatchedCluster, **values):
    """A run looping (Run.run) until it waits for its RayCluster; stopped, and its loop
    ended within 5 s, on the way out (the stop ends a long sleep at once). `run.asleep`
    holds the length of each sleep of its loop as it begins."""
    # Writes are not spaced: every step's write goes at once, so a step is seen when it looks.
    run = Run(body(), cluster, RayJobs(), settings(status_write_interval=0, **values))
    cluster.run = run
    run.asleep = asyncio.Queue()
    sleep = run._sleep

    async def recorded_sleep(stopped, seconds: float) -> None:  # the loop's own sleep, observed
        cluster.looked.clear()  # from here on, `looked` is a look after this sleep began
        run.asleep.put_nowait(seconds)
        await sleep(stopped, seconds)

    run._sleep = recorded_sleep
    stopped = asyncio.Event()
    task = asyncio.create_task(run.run(stopped))
    try:
        while not cluster.status.get("message", "").startswith("waiting for RayCluster") \
                and cluster.status.get("phase") != phases.FAILED:
            await asyncio.sleep(0.01)
        yield run
    finally:
        stopped.set()
        await asyncio.wait_for(task, 5)


async def resting(run: Run) -> float:
    """Waits until the run's loop sleeps, last, for longer than a poll (a run at rest sleeps
    until the idle resync or its timer); returns that sleep's length. Any look after that
    sleep began is `cluster.looked`. A loop that only ever sleeps a poll interval fails
    here, after the polls a waiting run may take on its way to rest."""
    poll = run.settings.poll_interval
    polls = 0
    while True:
        seconds = await asyncio.wait_for(run.asleep.get(), within(driver.IDLE_RESYNC_S))
        if seconds > poll and run.asleep.empty():
            return seconds
        polls += seconds <= poll
        if polls > TRANSITION_STEPS:
            raise AssertionError(f"the waiting run still sleeps only a poll interval ({poll} s) at a time")


async def no_look_within(cluster: WatchedCluster, seconds: float) -> None:
    """Waits `seconds` for a look of the run; fails if one comes."""
    try:
        await asyncio.wait_for(cluster.looked.wait(), seconds)
    except asyncio.TimeoutError:
        return
    raise AssertionError(f"the run looked again within {seconds} s (look {cluster.looks})")


async def until_phase(cluster: WatchedCluster, phase: str, within: float) -> None:
    async def reached():
        while cluster.status.get("phase") != phase:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(reached(), within)


def test_the_timers_of_a_waiting_run():
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    plan = phases.Plan(cluster_name="c", epochs=1, provision_timeout=timedelta(minutes=30),
                       active_deadline=timedelta(hours=2))
    provisioning_since = {"phase": phases.PROVISIONING, "phaseTransitionTime": cond.timestamp(now),
                          "startTime": cond.timestamp(now - timedelta(hours=1, minutes=45))}
    # The deadline (15 min away) comes before the provisioning timeout (30 min).
    assert phases.next_timer(plan, provisioning_since) == now + timedelta(minutes=15)
    queued = {"phase": phases.QUEUED, "phaseTransitionTime": cond.timestamp(now)}  # no startTime: no clock
    assert phases.next_timer(plan, queued) is None
    no_deadline = phases.Plan(cluster_name="c", epochs=1, provision_timeout=timedelta(minutes=30))
    assert phases.next_timer(no_deadline, provisioning_since) == now + timedelta(minutes=30)
    finished = {**provisioning_since, "phase": phases.FAILED}
    assert phases.next_timer(plan, finished) is None


@in_loop
async def test_a_watched_run_waiting_for_its_cluster_takes_no_steps_until_a_change_wakes_it():
    cluster = WatchedCluster()
    async with provisioning(cluster) as run:  # polls every 0.05 s when not waiting
        slept = await resting(run)
        # Asleep: a run that polled would look every poll interval; this one looks no more
        # for POLLS of them (its sleep lasts longer still: the idle resync or its timer).
        assert slept >= POLLS * run.settings.poll_interval, slept
        await no_look_within(cluster, POLLS * run.settings.poll_interval)
        cluster.ready = True
        run.wake.set()  # what the RayCluster watch does
        await until_phase(cluster, phases.SUBMITTING, within=5)


@in_loop
async def test_a_change_that_arrives_during_a_step_is_not_lost():
    cluster = WatchedCluster()
    async with provisioning(cluster) as run:
        cluster.ready_after_look = cluster.looks + 1
        run.wake.set()  # one more look, during which the cluster turns ready and wakes the run
        # Cleared after the step, the wake-up would be lost until the idle resync (a minute).
        await until_phase(cluster, phases.SUBMITTING, within=10)


@in_loop
async def test_a_waiting_run_still_fails_at_its_provisioning_timeout():
    cluster = WatchedCluster()
    assert driver.IDLE_RESYNC_S >= 30  # so the timeout below can only come from the timer
    async with provisioning(cluster, provision_timeout=1.0):
        await until_phase(cluster, phases.FAILED, within=10)
        assert cond.find(cluster.status, cond.FAILED)["reason"] == "ProvisioningTimeout", cluster.status


@in_loop
async def test_stopping_the_operator_ends_a_waiting_runs_sleep_at_once():
    cluster = WatchedCluster()
    async with provisioning(cluster) as run:
        # Asleep now, for up to the idle resync; leaving stops it (within 5 s, provisioning).
        assert await resting(run) > 5


@in_loop
async def test_an_unwatched_backend_keeps_polling():
    cluster = WatchedCluster()
    cluster.watched = False  # run --local, or a backend without watches
    async with provisioning(cluster) as run:
        looks = cluster.looks

        async def polled() -> None:
            while cluster.looks - looks < 5:
                cluster.looked.clear()
                await cluster.looked.wait()

        # Five looks come within POLLS poll intervals (one each, and time to spare).
        await asyncio.wait_for(polled(), POLLS * run.settings.poll_interval)
