"""A plan that changes only between attempts: an edit the operator's checks refuse leaves the
applied generation's plan in force (watchdog, deadline, TTL) and is shown, naming the field;
the usage an attempt already cost is never rescaled by an edit.

The driver's tests use the in-memory stand-in for Kubernetes of run_helpers; the Ray side
is a real closed port."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.core.initsource import InitRequest
from tpufinetune.driver import Run

from phase_helpers import PLAN, READY, T0, step
from run_helpers import SPEC, body, closed_address, in_loop, MemoryCluster, running, settings

WATCHED = {**SPEC, "noProgressTimeoutSeconds": 900, "activeDeadlineSeconds": 7200, "ttlSecondsAfterFinished": 600}
# Admission takes it; the operator's own checks refuse it (a checkpoint scored on an
# evaluation that never runs).
REFUSED = {**WATCHED, "checkpoint": {**SPEC["checkpoint"], "scoreAttribute": "eval_loss"},
           "training": {"evalFraction": 0}}


def watched_run():
    """A running run whose generation 1 (WATCHED) is applied, its head's port closed."""
    closed, address = closed_address()
    cluster = MemoryCluster(address)
    cluster.exists = True
    live = body({**running(address), "observedGeneration": 1})
    live["spec"] = dict(WATCHED)
    return closed, cluster, live, Run(live, cluster, RayJobs(timeout=0.3), settings())


@in_loop
async def test_a_refused_edit_keeps_the_applied_plan_and_says_which_field():
    closed, cluster, live, run = watched_run()
    applied = run.plan
    assert applied.no_progress_timeout == timedelta(seconds=900)
    live["metadata"]["generation"] = 2
    live["spec"] = dict(REFUSED)
    decision = await run.step()
    closed.close()
    assert run.spec_error and "spec.checkpoint.scoreAttribute" in run.spec_error
    # Watchdog, deadline, TTL: the applied generation's, not turned off.
    assert run.plan == applied
    assert decision.phase == phases.RUNNING
    shown = cond.find(cluster.status, cond.SPEC_VALID)
    assert shown["status"] == "False" and shown["reason"] == "InvalidSpec"
    assert "generation 2 is refused" in shown["message"] and "spec.checkpoint.scoreAttribute" in shown["message"]
    assert "generation 1's plan" in shown["message"]
    assert "SpecRefused" in cluster.events
    assert run.spec is not None  # the applied generation's spec, for what the attempt still needs


@in_loop
async def test_a_valid_spec_again_clears_the_refusal():
    closed, cluster, live, run = watched_run()
    live["metadata"]["generation"], live["spec"] = 2, dict(REFUSED)
    await run.step()
    live["metadata"]["generation"], live["spec"] = 3, dict(WATCHED)
    await run.step()
    closed.close()
    assert not run.spec_error
    assert cond.find(cluster.status, cond.SPEC_VALID)["status"] == "True"


@in_loop
async def test_a_restarted_operator_keeps_the_applied_plan_the_status_records():
    """The stored object holds only the latest generation's spec: a new operator process
    learns the applied one from status.appliedSpec, for a refused edit as for one that
    waits for the next attempt."""
    closed, cluster, live, run = watched_run()
    applied = run.plan
    await run.step()
    assert json.loads(cluster.status["appliedSpec"]) == WATCHED and cluster.status["observedGeneration"] == 1
    bigger = {**WATCHED, "tpu": {"generation": "cpu", "topology": "2"}}
    for generation, edit, refused in ((2, REFUSED, True), (3, bigger, False)):
        live["metadata"]["generation"], live["spec"] = generation, dict(edit)
        await run.step()
        assert cluster.status["observedGeneration"] == 1  # applied only at the next attempt
        assert json.loads(cluster.status["appliedSpec"]) == WATCHED
        restarted = Run({**live, "status": dict(cluster.status)}, cluster, RayJobs(timeout=0.3), settings())
        assert bool(restarted.spec_error) is refused
        assert restarted.plan == run.plan
        # Without the record it would go by the edit: no watchdog (the refused one), or the
        # running attempt's usage counted at two hosts (the bigger one).
        assert restarted.plan.no_progress_timeout == applied.no_progress_timeout == timedelta(seconds=900)
        assert (restarted.plan.hosts, restarted.plan.chips) == (applied.hosts, applied.chips)
    assert restarted.latest_plan.hosts == 2 != applied.hosts
    closed.close()


def test_a_status_without_a_usable_record_goes_by_the_latest_generation():
    _, _, live, _ = watched_run()
    live["metadata"]["generation"], live["spec"] = 2, {**WATCHED, "noProgressTimeoutSeconds": 60}
    for record in (None, "{not json", json.dumps({"model": 7})):
        status = {**live["status"], "appliedSpec": record} if record else dict(live["status"])
        run = Run({**live, "status": status}, MemoryCluster("http://127.0.0.1:9"), RayJobs(timeout=0.3), settings())
        assert run.plan.no_progress_timeout == timedelta(seconds=60), record


def test_the_plan_in_force():
    applied = phases.Plan(cluster_name="demo-rc", epochs=2, chips=8, hosts=2,
                          no_progress_timeout=timedelta(seconds=900))
    off = phases.Plan(cluster_name="demo-rc", epochs=0)  # what an invalid spec plans
    assert phases.plan_in_force(off, applied, refused=True) == applied
    bigger = phases.Plan(cluster_name="demo-rc", epochs=2, chips=16, hosts=4, active_deadline=timedelta(hours=1))
    kept = phases.plan_in_force(bigger, applied, refused=False)
    assert (kept.chips, kept.hosts, kept.active_deadline) == (8, 2, timedelta(hours=1))
    assert phases.plan_in_force(bigger, None, refused=False) == bigger


def test_usage_already_spent_is_not_rescaled_by_an_edit():
    applied = phases.Plan(cluster_name="demo-rc", epochs=2, chips=8, hosts=2)
    status = {**running("http://head:8265"), "phaseTransitionTime": cond.timestamp(T0)}
    first = step(status, plan=applied, cluster=READY, job=phases.JobView("RUNNING"),
                 events=({"event": "progress", "epoch": 1, "epochs": 2, "step": 1, "loss": 1.0},))
    hour = T0 + timedelta(hours=1)
    event = ({"event": "progress", "epoch": 1, "epochs": 2, "step": 2, "loss": 0.9},)
    # The edit doubled the slice: the running attempt still holds the old one.
    in_force = phases.plan_in_force(phases.Plan(cluster_name="demo-rc", epochs=2, chips=16, hosts=4), applied, False)
    after = step(first.status, plan=in_force, cluster=READY, job=phases.JobView("RUNNING"), events=event, now=hour)
    assert after.status["usage"]["chipHours"] == 8.0
    assert PLAN.chips == 0  # (the shared plan is a cpu one; this test sizes its own)


def test_a_valid_edit_holds_only_the_attempts_slice_until_the_next_attempt():
    """Every field of the plan but HELD_UNTIL_NEXT_ATTEMPT comes from a valid edit at once
    (docs/api.md, "An edit to a running run", says which and why); those come from the
    applied generation."""
    applied = phases.Plan(cluster_name="a", epochs=1)
    latest_values = {"cluster_name": "b", "epochs": 2, "max_retries": 3, "provision_timeout": timedelta(1),
                     "submit_timeout": timedelta(2), "suspended": True, "cluster_hash": "h", "hosts": 4, "chips": 16,
                     "active_deadline": timedelta(3), "ttl_after_finished": timedelta(4),
                     "no_progress_timeout": timedelta(5), "queue": "q", "preflight": True, "memory": {"m": 1},
                     "does_not_fit": "no", "logs_root": "gs://l", "memory_request": "r",
                     # A chained run's source is recorded once in status.initFrom, which every attempt
                     # uses; lm-eval's tasks act after the fine-tune, so an edit takes them at once.
                     "init_from": InitRequest(run="sft"), "lm_eval_tasks": ("arc_easy",)}
    assert set(latest_values) == {f.name for f in dataclasses.fields(phases.Plan)}  # a new field is decided here
    in_force = phases.plan_in_force(phases.Plan(**latest_values), applied, refused=False)
    held = {name for name in latest_values if getattr(in_force, name) == getattr(applied, name)}
    assert held == set(phases.HELD_UNTIL_NEXT_ATTEMPT) == {"chips", "hosts", "queue"}
    documented = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    assert "### An edit to a running run" in documented and "HELD_UNTIL_NEXT_ATTEMPT" in documented
    for spec_field in ("suspend", "activeDeadlineSeconds", "noProgressTimeoutSeconds", "ttlSecondsAfterFinished",
                       "maxRetries", "preflight", "queueName"):
        assert f"`{spec_field}`" in documented.split("### An edit to a running run")[1].split("\n## ")[0], spec_field


@in_loop
async def test_a_queue_name_added_mid_attempt_waits_while_the_deadline_and_retries_act_at_once():
    closed, cluster, live, run = watched_run()
    live["metadata"]["generation"] = 2
    live["spec"] = {**WATCHED, "queueName": "team-a", "maxRetries": 2, "activeDeadlineSeconds": 60}
    await run.step()
    closed.close()
    assert run.plan.queue == ""  # the running attempt's cluster is not Kueue's
    assert run.plan.max_retries == 2 and run.plan.active_deadline == timedelta(seconds=60)
    assert run.latest_plan.queue == "team-a"
