"""status.attempts[].startup, pure: where each attempt's time before its first optimizer
step went, the operator's figures (RayCluster ready, job submitted) and the trainer's
`startup` event folded into the attempt it belongs to; the time-to-first-step histogram's
observations, once per attempt."""

from tpufinetune.core import phases, startup
from tpufinetune.core.phases import JobView
from tpufinetune.core.podstatus import HEALTHY
from tpufinetune.core.status import checked_status

from phase_helpers import READY, V6E, at, running_with_slice, step


def trainer_startup(minutes: float, first_step_s: float = 40.0, **extra) -> dict:
    """The trainer's event of a driver that started `minutes` after T0 (its wall clock)."""
    return {"event": "startup", "v": 1, "step": 1, "started_at": at(minutes).timestamp(), "data_ready_s": 12.5,
            "workers_ready_s": 20.0, "model_loaded_s": 31.25, "first_step_s": first_step_s, **extra}


def test_the_first_attempts_startup_counts_from_its_start_with_the_trainers_stages():
    status = running_with_slice()  # started at 0, its slice ready and the job submitted at 10 min
    d = step(status, plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
             events=(trainer_startup(10 + 5 / 60, first_step_compiled_s=36.0),))
    (entry,) = d.status["attempts"]
    assert entry["startup"] == {
        "clusterReadySeconds": 600.0, "jobSubmittedSeconds": 600.0, "driverStartedSeconds": 605.0,
        "firstStepSeconds": 645.0,
        "trainer": {"dataReadySeconds": 12.5, "workersReadySeconds": 20.0, "modelLoadedSeconds": 31.25,
                    "firstStepCompiledSeconds": 36.0, "firstStepSeconds": 40.0}}
    assert checked_status(d.status) is d.status
    # The same event read again, or a worker group Ray Train restarted inside the job
    # reporting its own: the attempt's first start-up stays.
    again = step(d.status, plan=V6E, now=at(20), cluster=READY, job=JobView("RUNNING"),
                 events=(trainer_startup(19, first_step_s=5.0),))
    assert again.status["attempts"][0]["startup"] == entry["startup"]


def test_a_retrys_startup_is_its_own_and_leaves_the_first_attempts_as_it_was():
    status = step(running_with_slice(), plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
                  events=(trainer_startup(10),)).status
    first_startup = status["attempts"][0]["startup"]
    d = step(status, plan=V6E, now=at(40), cluster=READY, job=JobView("FAILED"),
             events=({"event": "failure", "type": "RuntimeError", "message": "boom"},),
             log_tail="RuntimeError: boom", slice_health=HEALTHY)
    assert d.phase == phases.SUBMITTING  # the retry keeps the healthy slice: ready from its start
    d = step(d.status, plan=V6E, now=at(41), cluster=READY, job=None)
    d = step(d.status, plan=V6E, now=at(42), cluster=READY, job=JobView("RUNNING"))
    before = d.status
    # The retry's trainer (no compile) reports; its driver started 30 s after the submit.
    d = step(before, plan=V6E, now=at(44), cluster=READY, job=JobView("RUNNING"),
             events=(trainer_startup(42.5, first_step_s=60.0),))
    first, second = d.status["attempts"]
    assert first["startup"] == first_startup
    assert second["startup"]["clusterReadySeconds"] == 0.0
    assert second["startup"]["jobSubmittedSeconds"] == 120.0  # entered Running 2 min after its start at 40
    assert (second["startup"]["driverStartedSeconds"], second["startup"]["firstStepSeconds"]) == (150.0, 210.0)
    assert "firstStepCompiledSeconds" not in second["startup"]["trainer"]
    assert startup.first_steps(before, d.status) == [("retry", 210.0)]
    assert startup.first_steps(d.status, d.status) == []  # a later step: nothing new
    assert checked_status(d.status) is d.status


def test_an_older_trainer_without_the_event_leaves_startup_absent():
    status = running_with_slice()
    d = step(status, plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
             events=({"event": "plan", "total_steps": 20, "resumed_step": None},
                     {"event": "progress", "step": 3, "total_steps": 20}))
    assert "startup" not in d.status["attempts"][0]
    assert startup.first_steps(status, d.status) == []


def test_an_ended_jobs_late_line_is_not_the_next_attempts_startup():
    status = running_with_slice()
    d = step(status, plan=V6E, now=at(40), cluster=READY, job=JobView("FAILED"),
             events=({"event": "failure", "type": "RuntimeError", "message": "boom"},),
             log_tail="RuntimeError: boom", slice_health=HEALTHY)
    d = step(d.status, plan=V6E, now=at(41), cluster=READY, job=None, events=(trainer_startup(10),))
    assert all("startup" not in entry for entry in d.status["attempts"])


def test_a_skewed_driver_clock_is_kept_between_the_submit_and_the_event_being_read():
    ahead = step(running_with_slice(), plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
                 events=(trainer_startup(30),)).status["attempts"][0]["startup"]
    assert (ahead["driverStartedSeconds"], ahead["firstStepSeconds"]) == (720.0, 720.0)  # read at 12 min
    behind = step(running_with_slice(), plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
                  events=(trainer_startup(2),)).status["attempts"][0]["startup"]
    assert (behind["driverStartedSeconds"], behind["firstStepSeconds"]) == (600.0, 640.0)  # not before the submit
    # Without the driver's mark (or a stage), the first step is when the operator read it.
    for odd in ({"first_step_s": "soon"}, {"started_at": 1e20, "first_step_s": 3.0}, {"started_at": -1}):
        bare = step(running_with_slice(), plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
                    events=({"event": "startup", "step": 1, **odd},)).status["attempts"][0]["startup"]
        assert {k: v for k, v in bare.items() if k != "trainer"} == {
            "clusterReadySeconds": 600.0, "jobSubmittedSeconds": 600.0, "firstStepSeconds": 720.0}, odd


def test_the_histogram_sees_each_attempts_first_step_once():
    status = running_with_slice()
    d = step(status, plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"), events=(trainer_startup(10),))
    assert startup.first_steps(status, d.status) == [("first", 640.0)]
    assert startup.first_steps(d.status, d.status) == []
    assert startup.first_steps(None, d.status) == [("first", 640.0)]  # nothing known before it
    assert startup.first_steps({}, {}) == []


def test_the_metric_observes_once_per_attempt_by_kind():
    from tpufinetune.adapters import metrics

    def observed(kind):
        return metrics.REGISTRY.get_sample_value("tpufinetune_time_to_first_step_seconds_count",
                                                 {"attempt_kind": kind}) or 0.0

    status = running_with_slice()
    d = step(status, plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"), events=(trainer_startup(10),))
    first, retry = observed("first"), observed("retry")
    metrics.first_steps(status, d.status)
    metrics.first_steps(d.status, d.status)  # the next step: already observed
    assert (observed("first") - first, observed("retry") - retry) == (1.0, 0.0)


def test_a_warm_retrys_data_source_and_compile_cache_are_kept_with_its_stages():
    """What the start did not have to do again, from the trainer's event: where its data came
    from (the trainer's words mapped to the status's), the examples it tokenized, and rank 0's
    compile cache hits and misses; an attempt's startup line says it."""
    cold = step(running_with_slice(), plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
                events=(trainer_startup(10, data_source="tokenized", tokenized_examples=48,
                                        compile_cache_hits=0, compile_cache_misses=2),)).status
    assert {k: v for k, v in cold["attempts"][0]["startup"]["trainer"].items() if not k.endswith("Seconds")} == {
        "dataSource": "Tokenized", "tokenizedExamples": 48, "compileCacheHits": 0, "compileCacheMisses": 2}
    for words, source in (("published", "RunStorage"), ("local_cache", "LocalCache")):
        warm = step(running_with_slice(), plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
                    events=(trainer_startup(10, data_source=words, tokenized_examples=0,
                                            compile_cache_hits=2, compile_cache_misses=0),)).status
        entry = warm["attempts"][0]
        trainer = entry["startup"]["trainer"]
        assert (trainer["dataSource"], trainer["tokenizedExamples"], trainer["compileCacheHits"],
                trainer["compileCacheMisses"]) == (source, 0, 2, 0)
        assert checked_status(warm) is warm
    assert startup.summary(entry) == ("attempt 1: first step 640 s after its start (40.0 s after its job was "
                                      "submitted); data from the host's cache (0 examples tokenized); "
                                      "compile cache 2 hits, 0 misses")
    assert startup.summary({"attempt": 2}) == ""  # no first step yet


def test_a_newer_trainers_unknown_data_source_or_odd_counts_are_left_out():
    d = step(running_with_slice(), plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
             events=(trainer_startup(10, data_source="peer", tokenized_examples=-1, compile_cache_hits=True,
                                     compile_cache_misses=1.5),))
    trainer = d.status["attempts"][0]["startup"]["trainer"]
    assert trainer == {"dataReadySeconds": 12.5, "workersReadySeconds": 20.0, "modelLoadedSeconds": 31.25,
                       "firstStepSeconds": 40.0}
    assert checked_status(d.status) is d.status


def test_the_data_sources_are_the_trainers():
    from tpufinetune_trainer import startup as trainer_startup_module

    assert tuple(startup.DATA_SOURCE_NAMES) == trainer_startup_module.DATA_SOURCES
    assert set(startup.TRAINER_COUNTS) | set(startup.TRAINER_DURATIONS) | {"data_source"} == set(
        trainer_startup_module.FACTS)


def test_a_retry_that_resumed_at_an_epochs_end_says_how_long_that_end_took_before_its_first_step():
    """A retry whose checkpoint was at an epoch's last step does that epoch's end (evaluation,
    answers) first: its status keeps those seconds beside the first step that includes them,
    and its line says so; a value that is no number is left out."""
    d = step(running_with_slice(), plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
             events=(trainer_startup(10, first_step_s=51.0, resumed_epoch_end_s=18.4),))
    entry = d.status["attempts"][0]
    assert entry["startup"]["trainer"]["resumedEpochEndSeconds"] == 18.4
    assert entry["startup"]["trainer"]["firstStepSeconds"] == 51.0
    assert checked_status(d.status) is d.status
    assert startup.summary(entry).endswith("; 18.4 s of them the resumed epoch's end (evaluation)")
    odd = step(running_with_slice(), plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
               events=(trainer_startup(10, resumed_epoch_end_s="18"),)).status
    assert "resumedEpochEndSeconds" not in odd["attempts"][0]["startup"]["trainer"]


def test_run_local_prints_each_attempts_startup_once():
    import asyncio
    import io

    from tpufinetune.local import LocalBackend

    status = step(running_with_slice(), plan=V6E, now=at(12), cluster=READY, job=JobView("RUNNING"),
                  events=(trainer_startup(10, data_source="published", tokenized_examples=0),)).status
    out = io.StringIO()
    backend = LocalBackend("http://127.0.0.1:9", out)
    for _ in range(2):  # a later write: printed already
        asyncio.run(backend.write_status(None, {"attempts": status["attempts"]}, status, ""))
    (line,) = out.getvalue().splitlines()
    assert line.endswith("attempt 1: first step 640 s after its start (40.0 s after its job was submitted); "
                         "data from the run's storage (0 examples tokenized)"), line
