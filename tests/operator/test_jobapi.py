"""The operator's own Job API client (adapters/jobapi.py) against a real local Ray head:
Ray's wire format (submit, details, logs, stop), Ray's refusals worded as Ray words them
(a duplicate submission id, an unknown job, a missing or wrong token). That the
operator's modules never import `ray`, the reason it exists, is tests/deploy/test_dockerfile.py's.
"""

from __future__ import annotations

import uuid

import pytest

from harness.waiting import wait_for
from tpufinetune.adapters.jobapi import AuthenticationError, JobApiClient

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def _status(client: JobApiClient, job_id: str) -> str:
    return client.job_or_none(job_id)["status"]


@pytest.mark.ray
def test_the_job_api_over_plain_http(ray_head):
    client = JobApiClient(ray_head.dashboard_url, ray_head.headers(), timeout=10)
    job_id = f"tft-jobapi-{uuid.uuid4().hex[:8]}"
    assert client.submit_job(entrypoint="echo hello-from-jobapi", submission_id=job_id,
                             runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1"}},
                             metadata={"run": "jobapi"}) == job_id
    info = client.job_or_none(job_id)
    assert info["submission_id"] == job_id and info["metadata"] == {"run": "jobapi"}
    assert info["runtime_env"]["env_vars"] == {"PYTHONUNBUFFERED": "1"}
    assert wait_for(lambda: _status(client, job_id) in TERMINAL and _status(client, job_id), 120,
                    "the echo job to end") == "SUCCEEDED"
    assert "hello-from-jobapi" in client.get_job_logs(job_id)

    # Ray 2.60's head answers 500, its body the job agent's 400 and why: match on the words.
    with pytest.raises(RuntimeError, match=r"^Request failed with status code \d+: (?s:.*)already exists"):
        client.submit_job(entrypoint="true", submission_id=job_id)

    long_id = f"tft-jobapi-long-{uuid.uuid4().hex[:8]}"
    client.submit_job(entrypoint="sleep 600", submission_id=long_id)
    wait_for(lambda: _status(client, long_id) == "RUNNING", 120, "the sleeping job to run")
    assert client.stop_if_exists(long_id) is True
    assert wait_for(lambda: _status(client, long_id) in TERMINAL and _status(client, long_id), 60,
                    "the sleeping job to stop") == "STOPPED"


@pytest.mark.ray
def test_an_unknown_job_is_none_and_nothing_to_stop_but_its_logs_are_a_404(ray_head):
    client = JobApiClient(ray_head.dashboard_url, ray_head.headers(), timeout=10)
    assert client.job_or_none("tft-jobapi-never-submitted") is None
    assert client.stop_if_exists("tft-jobapi-never-submitted") is False
    with pytest.raises(RuntimeError, match="status code 404"):
        client.get_job_logs("tft-jobapi-never-submitted")


@pytest.mark.ray
@pytest.mark.parametrize("headers, status, words", [
    ({}, 401, "^Authentication required: "),
    ({"Authorization": "Bearer wrong"}, 403, "^Authentication failed: "),
])
def test_a_refused_token_names_the_status(ray_head, headers, status, words):
    with pytest.raises(AuthenticationError, match=words) as refused:
        JobApiClient(ray_head.dashboard_url, headers, timeout=10).job_or_none("tft-jobapi-never-submitted")
    assert str(status) in str(refused.value)


def test_a_local_working_dir_is_refused_before_any_request():
    client = JobApiClient.__new__(JobApiClient)  # no head: the check comes first
    with pytest.raises(ValueError, match="local paths"):
        client.submit_job(entrypoint="true", runtime_env={"working_dir": "./"})
