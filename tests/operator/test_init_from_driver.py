"""A chained run (spec.model.initFrom) driven by the driver against the in-memory stand-in:
the source is read only while the run waits; nothing is created until the source has
Succeeded; the plan is made again from status.initFrom (the source's base model) before the
RayCluster is asked for; from then on the source is never read again."""

from __future__ import annotations

from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import phases
from tpufinetune.driver import Run

from run_helpers import SPEC, MemoryCluster, body, in_loop, settings

BASE = "google/gemma-4-E4B-it"
EXPORT = "gs://bucket/sft/export"


class WithSource(MemoryCluster):
    """The stand-in, with another TPUFineTune of the namespace to read (None: there is none)."""

    def __init__(self):
        super().__init__()
        self.source: dict | None = None
        self.reads = 0

    async def read_run(self, namespace, name):
        self.reads += 1
        assert (namespace, name) == ("ns", "sft")
        return self.source


def sft(phase: str, **status) -> dict:
    return {"metadata": {"name": "sft", "uid": "uid-sft"},
            "spec": {"model": {"id": BASE}, "training": {"epochs": 2}}, "status": {"phase": phase, **status}}


@in_loop
async def test_the_driver_reads_the_source_while_waiting_then_plans_its_base_and_creates_the_cluster():
    cluster = WithSource()
    chained = body()
    chained["spec"] = {**SPEC, "model": {"initFrom": {"run": "sft"}}}
    run = Run(chained, cluster, RayJobs(), settings(status_write_interval=0))
    assert run.waits_on == "sft" and run.plan.memory_request is None

    await run.step()
    assert cluster.status["message"] == "no TPUFineTune sft in namespace ns yet; waiting for it to be applied and to succeed"
    cluster.source = sft("Running", epoch=1, epochs=2)
    await run.step()
    assert cluster.status["message"] == "waiting for TPUFineTune sft to succeed: it is Running, epoch 2 of 2"
    assert "create" not in cluster.calls and cluster.reads == 2

    cluster.source = sft("Succeeded", exportedModelURI=EXPORT)
    resolved = await run.step()
    assert cluster.status["initFrom"]["uri"] == EXPORT and resolved.wake_at is not None
    assert run.waits_on == "" and "create" not in cluster.calls

    await run.step()  # planned again from the record: the source's base model
    assert run.plan.memory_request.model_id == BASE and cluster.status["plan"]["basis"]
    assert cluster.status["phase"] == phases.PENDING and cluster.status["rayClusterName"]
    cluster.source = None  # deleted: nothing of this run depends on it any more
    await run.step()
    assert cluster.calls.count("create") == 1 and cluster.status["phase"] == phases.PROVISIONING
    assert cluster.reads == 3 and cluster.status["initFrom"]["uri"] == EXPORT


def test_a_sources_event_wakes_only_the_runs_chained_to_it_and_forgets_a_chain_once_edited_away():
    """resource_seen keeps the chains from the runs' own events (handlers.CHAINED): the source's
    next event wakes the run that waits on it, not an unrelated one; a spec edited to drop
    initFrom, or a deleted run, leaves the index."""
    import asyncio

    import kopf

    from tpufinetune.adapters import handlers

    class Waiting:
        generation, settling, status_taken, waits_on = 1, False, False, "sft"

        def __init__(self):
            self.wake = asyncio.Event()

    def body(name: str, spec: dict) -> kopf.Body:
        return kopf.Body({"metadata": {"name": name, "namespace": "n", "uid": name, "generation": 1}, "spec": spec})

    def seen(name: str, spec: dict, kind: str = "MODIFIED") -> None:
        asyncio.run(handlers.resource_seen(type=kind, body=body(name, spec)))

    dpo, other = Waiting(), Waiting()
    handlers.RUNS.update({("n", "dpo"): dpo, ("n", "other"): other})
    try:
        seen("dpo", {"model": {"initFrom": {"run": "sft"}}})
        seen("other", {"model": {"id": "google/gemma-4-E2B-it"}})
        seen("sft", {"epochs": 1})
        assert dpo.wake.is_set() and not other.wake.is_set()
        assert handlers.CHAINED == {("n", "sft"): {("n", "dpo")}}
        seen("dpo", {"model": {}})  # an edit away from the chain
        assert handlers.CHAINED == {} and handlers.CHAIN_OF == {}
        seen("dpo", {"model": {"initFrom": {"run": "sft"}}})
        seen("dpo", {}, kind="DELETED")
        assert handlers.CHAINED == {} and handlers.CHAIN_OF == {}
    finally:
        for key in (("n", "dpo"), ("n", "other"), ("n", "sft")):
            handlers.RUNS.pop(key, None)
            handlers.note_chain(key, None)
