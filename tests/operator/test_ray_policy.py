"""One policy for every Ray call of a run (driver.Run._ray): the run's token derived first,
and any failure, the token's included, counted by the unreachable clock and said in the
status; deletion needs neither Ray nor the signing key.

The backend is the in-memory stand-in for Kubernetes of run_helpers (these are the
driver's own rules); its signing key is unreadable the way RayTokens reports it
(SigningKeyError, with the words RayTokens uses). On the ground the real Secret is broken
instead: test_operator_bounds_e2e.py. The Ray side is a real closed port."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client

from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.adapters.raytokens import RayTokens, SigningKeyError
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.driver import Run

from run_helpers import SPEC, MemoryCluster, body, closed_address, in_loop, running, settings

NO_KEY = "Secret tpufinetune-system/tpufinetune-ray-token-key has no data.key"


class KeylessCluster(MemoryCluster):
    """A cluster whose run's Ray token cannot be derived: the signing key is unreadable."""

    async def ray_token(self, ident):
        raise SigningKeyError(NO_KEY)


@in_loop
async def test_a_token_that_cannot_be_derived_is_ray_unreachable_with_its_reason_then_ends_the_attempt():
    closed, address = closed_address()
    cluster = KeylessCluster(address)
    cluster.exists = True
    run = Run(body(running(address)), cluster, RayJobs(timeout=0.5), settings(ray_unreachable_timeout=1))
    decision = await run.step()  # used to raise SigningKeyError at the top of every step
    assert decision.phase == phases.RUNNING
    assert f"the Ray token for {address} could not be derived: {NO_KEY}" in cluster.status["message"]
    assert cluster.events == ["RayUnreachable"]
    await asyncio.sleep(1.1)
    decision = await run.step()
    closed.close()
    assert decision.phase == phases.FAILED
    failed = cond.find(decision.status, cond.FAILED)
    assert failed["reason"] == "RayUnreachable" and NO_KEY in failed["message"]
    assert cluster.calls[-1] == "delete" and not cluster.exists


@in_loop
async def test_a_run_is_deleted_without_its_token_or_its_head():
    closed, address = closed_address()
    cluster = KeylessCluster(address)
    cluster.exists = True  # ready, its job running: the stop is asked for, best effort
    live = body(running(address), deletionTimestamp="2026-01-01T00:00:00Z")
    run = Run(live, cluster, RayJobs(timeout=0.5), settings())
    decision = await asyncio.wait_for(run.step(deleting=True), 30)  # used to raise SigningKeyError
    closed.close()
    assert decision.phase == phases.DELETING
    assert cluster.calls[-1] == "delete" and not cluster.exists
    assert not (await run.observe(deleting=True)).cluster.exists  # the finalizer may go


@in_loop
async def test_a_preflight_whose_head_does_not_answer_is_under_the_unreachable_clock():
    closed, address = closed_address()
    cluster = MemoryCluster(address)
    cluster.exists = True
    live = body({**running(address), "phase": phases.SUBMITTING,
                 "preflight": {"phase": "Running", "attempt": 1, "jobId": "tft-uid-1-1-preflight"}})
    live["spec"] = {**SPEC, "preflight": {"enabled": True}}
    run = Run(live, cluster, RayJobs(timeout=0.5), settings(ray_unreachable_timeout=1))
    assert run.plan.preflight
    decision = await run.step()
    assert decision.phase == phases.SUBMITTING and "Ray unreachable" in decision.status["message"]
    await asyncio.sleep(1.1)
    decision = await run.step()  # used to fail step after step: preflight's calls had no clock
    closed.close()
    assert decision.phase == phases.FAILED
    assert cond.find(decision.status, cond.FAILED)["reason"] == "RayUnreachable"
    assert cluster.calls[-1] == "delete"


@pytest.mark.parametrize("data,words", [
    ({}, "has no data.key; put the current key there .* or delete the Secret and the operator creates a new key"),
    ({"key": "%%% not base64"}, "data.key is not base64"),  # used to pass through as a binascii.Error
])
def test_an_unreadable_signing_key_is_named_with_the_fix(data, words):
    tokens = RayTokens(client.ApiClient(), "tpufinetune-system")
    tokens._read_or_create = lambda: data  # what the Secret holds
    with pytest.raises(SigningKeyError, match=words):
        tokens.keyring()
