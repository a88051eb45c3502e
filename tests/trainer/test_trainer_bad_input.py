"""Bad input ends with one `failure` event naming the problem and a non-zero exit, never a hang."""

from __future__ import annotations

import shlex
import shutil

import pytest

from harness.waiting import wait_for
from trainer_helpers import events_of, offline_env, run_trainer, write_jsonl

pytestmark = pytest.mark.ray


def base_args(assets, storage) -> dict:
    return {"--model-id": str(assets.model), "--dataset": str(assets.data), "--dataset-split": "train[:64]",
            "--num-workers": "2", "--num-epochs": "1", "--device": "cpu", "--storage-path": str(storage)}


def _argv(args: dict) -> list[str]:
    return ["finetune", *[x for kv in args.items() for x in kv]]


def _case_missing_columns(tmp, assets):
    path = write_jsonl(tmp / "qa.jsonl", [{"question": "q?", "answer": "a."}] * 10)
    return {"--dataset": str(path)}, "DataError", "missing column(s) ['instruction', 'response']"


def _case_empty_split(tmp, assets):
    return {"--dataset-split": "train[5000:]"}, "DataError", "has no rows"


def _case_missing_model_directory(tmp, assets):
    return {"--model-id": str(tmp / "no-such-model")}, "ModelError", "no model directory"


def _case_unwritable_storage(tmp, assets):
    blocker = tmp / "a-file"
    blocker.write_text("not a directory")
    return {"--storage-path": str(blocker / "checkpoints")}, "StorageError", "is not writable"


def _case_prompt_longer_than_max_seq_len(tmp, assets):
    rows = [{"instruction": "Please read this. " * 60, "context": "", "response": "Done."}] * 8
    path = write_jsonl(tmp / "long.jsonl", rows)
    return {"--dataset": str(path), "--max-seq-len": "64"}, "DataError", "prompt longer than --max-seq-len=64"


def _case_a_step_of_more_tokens_than_the_data(tmp, assets):
    # 64 short rows hold a few thousand tokens; one step of 2 workers x 64 blocks of 512 is 65536.
    return ({"--tokens-per-step": "65536", "--batch-size-per-device": "64", "--max-seq-len": "512"}, "DataError",
            "fewer than one step's --tokens-per-step 65536")


def _case_tokens_per_step_not_a_multiple(tmp, assets):
    return ({"--tokens-per-step": "1000", "--batch-size-per-device": "1", "--max-seq-len": "512"}, "ConfigError",
            "--tokens-per-step 1000 (spec.training.tokensPerStep) is not a multiple of 2 devices")


def _case_unknown_device(tmp, assets):
    return {"--device": "quantum"}, "UsageError", "invalid choice: 'quantum'"


CASES = {name[len("_case_"):]: fn for name, fn in list(globals().items()) if name.startswith("_case_")}


def _check_failure(rc: int, events: list, kind: str, text: str) -> None:
    assert rc != 0
    failure = next(e for e in events if e.kind == "failure")
    assert events[-1] is failure and [e.kind for e in events].count("failure") == 1, events
    assert failure["type"] == kind and text in failure["message"], failure
    assert not [e for e in events if e.kind == "start"]  # found before any worker (or slice) was reserved
    if kind == "UsageError":
        assert rc == 2


# Every input check runs in the driver before Ray is reached, so the cases call the CLI's
# main() in this process (no interpreter start per case); one case runs the real command.
IN_PROCESS = sorted(set(CASES) - {"unwritable_storage"})


@pytest.mark.parametrize("case", IN_PROCESS)
def test_bad_input_fails_with_a_named_problem(case, trainer_assets, tmp_path, capsys, monkeypatch):
    from tpufinetune_trainer import cli

    for name, value in offline_env({}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # nothing here may reach a Ray cluster
    overrides, kind, text = CASES[case](tmp_path, trainer_assets)
    args = dict(base_args(trainer_assets, tmp_path / "storage"), **overrides)
    rc = cli.main(_argv(args))
    output = capsys.readouterr().out
    _check_failure(rc, events_of(output), kind, text)


def test_the_command_fails_with_a_named_problem_and_its_exit_code(ray_head, trainer_assets, tmp_path):
    """The real `tpufinetune-train`, as the job entrypoint runs it: one case end to end."""
    overrides, kind, text = CASES["unwritable_storage"](tmp_path, trainer_assets)
    args = dict(base_args(trainer_assets, tmp_path / "storage"), **overrides)
    run = run_trainer(_argv(args), offline_env(ray_head.env()), timeout=300)  # a hang fails here
    _check_failure(run.rc, run.events, kind, text)


@pytest.mark.slow
def test_a_worker_failure_ends_the_job_with_a_failure_event(ray_head, trainer_assets, tmp_path):
    """Weights that cannot be read pass the driver's checks (config and tokenizer load)
    and fail inside the Ray Train workers; the job must fail, not retry or hang."""
    broken = tmp_path / "broken-model"
    shutil.copytree(trainer_assets.model, broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)
    args = dict(base_args(trainer_assets, tmp_path / "storage"), **{"--model-id": str(broken)})
    client = ray_head.job_client()
    job_id = client.submit_job(entrypoint=shlex.join(["tpufinetune-train", *_argv(args)]))
    wait_for(lambda: client.get_job_status(job_id).is_terminal(), 420, "the job to end (it hung)", interval=2)
    logs = client.get_job_logs(job_id)
    assert str(client.get_job_status(job_id).value) == "FAILED", logs[-4000:]
    events = events_of(logs)
    assert [e.kind for e in events] == ["model", "start", "failure"]  # the config read, started, one failure
    assert events[-1]["type"] == "ModelError" and str(broken) in events[-1]["message"]


def test_a_checkpoint_storage_the_workers_cannot_use_fails_before_training(ray_head, trainer_assets, tmp_path):
    """The driver's write check passes (the run's directory is writable) but the workers'
    startup probe cannot make its directory there: the job ends with one StorageError naming
    the storage, right after the workers start, before the model is loaded or a step taken."""
    from tpufinetune_trainer.checkpoint import PROBE_DIR

    storage = tmp_path / "storage"
    (storage / "probe-blocked").mkdir(parents=True)
    (storage / "probe-blocked" / PROBE_DIR).write_text("a file where the probe's directory goes")
    args = dict(base_args(trainer_assets, storage), **{"--run-name": "probe-blocked"})
    run = run_trainer(_argv(args), offline_env(ray_head.env()), timeout=300)
    assert run.rc != 0
    assert [e.kind for e in run.events] == ["model", "start", "failure"], run.tail()
    failure = run.events[-1]
    assert failure["type"] == "StorageError", failure
    assert f"Checkpoint storage {storage / 'probe-blocked' / PROBE_DIR}" in failure["message"]
    assert "could not create its directory" in failure["message"] and "FileExistsError" in failure["message"]
