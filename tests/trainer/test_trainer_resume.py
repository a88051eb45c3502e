"""A resume continues the same run only, from a complete checkpoint, and no two starts of a
run share a checkpoint's name. Each start is a real process (or two: a real gloo group)
running the Trainer on the tiny Gemma (tests/trainer/trainer_resume_worker.py).

- A start whose fingerprint differs from the checkpoint's (batch size, dataset, world
  size) is refused by every rank with a ResumeMismatch naming each field, old -> new; the
  driver refuses it before any worker starts. The same settings resume at the saved step.
- A start SIGKILLed while it writes a checkpoint leaves a directory that is never taken as
  complete, and never touches another start's checkpoint of the same step.
- Two starts writing the same steps into one run write different directories, and a
  resume takes the newest start's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.waiting import wait_for
from tpufinetune_trainer import checkpoint as ckpt
from trainer_helpers import offline_env, run_rank_processes, run_trainer, write_jsonl

WORKER = Path(__file__).with_name("trainer_resume_worker.py")
SPLIT = "train[:160]"
BATCH = 2  # examples per device per step of the first start (world size 1)
STEPS = [2, 4]  # its step checkpoints


def settings(assets, storage: Path, **overrides) -> dict:
    return {"model": str(assets.model), "dataset": str(assets.data), "split": SPLIT, "storage": str(storage),
            "run_name": "run", "batch": BATCH, "steps": STEPS, **overrides}


def start(mode: str, out: Path, chosen: dict, world: int = 1) -> list[dict]:
    run_rank_processes(WORKER, world, lambda rank, port: [mode, str(out), str(port), str(rank), str(world),
                                                          json.dumps(chosen)])
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(world)]


def files_digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def first(trainer_assets, tmp_path_factory):
    """The run's first start: steps 1-4 from scratch, step checkpoints after 2 and 4."""
    root = tmp_path_factory.mktemp("first")
    (saved,) = start("save", root / "out", settings(trainer_assets, root / "storage"))
    return root / "storage", saved


@pytest.fixture
def storage_copy(first, tmp_path) -> Path:
    """A copy of the first start's storage, for one test to resume from or write into."""
    copy = tmp_path / "storage"
    shutil.copytree(first[0], copy)
    return copy


def test_the_first_start_names_its_checkpoints_its_own_and_writes_them_complete(first, trainer_assets):
    storage, saved = first
    names = [Path(location).name for location in saved["locations"]]
    assert names == [f"step_{step:07d}-{saved['start_id']}" for step in STEPS]
    assert saved["reported"] == saved["locations"]
    for location, step in zip(saved["locations"], STEPS):
        state = ckpt.read_trainer_state(location)
        assert ckpt.is_complete(location) and state["step"] == step and state["start"] == saved["start_id"]
        fingerprint = state["fingerprint"]
        assert (fingerprint["world_size"], fingerprint["batch_size_per_device"], fingerprint["dataset"]) == \
            (1, BATCH, str(trainer_assets.data))
        assert Path(location).parent == storage / "run"
        assert re.fullmatch(r"\d+ examples, digest [0-9a-f]{16}", fingerprint["train_examples"]), fingerprint


def test_the_same_settings_resume_at_the_saved_step(trainer_assets, storage_copy, tmp_path):
    (resumed,) = start("resume", tmp_path / "out", settings(trainer_assets, storage_copy))
    assert "error" not in resumed, resumed["error"]
    assert Path(resumed["resumed_from"]).name.startswith("step_0000004-")
    assert (resumed["step"], resumed["epoch"], resumed["epoch_step"]) == (4, 1, 4)


@pytest.mark.parametrize("change", ["batch size", "dataset", "world size"])
def test_a_resume_of_another_run_is_refused_naming_what_differs(change, trainer_assets, storage_copy, tmp_path):
    if change == "batch size":
        chosen, world, named = settings(trainer_assets, storage_copy, batch=4), 1, ["--batch-size-per-device 2 -> 4"]
    elif change == "dataset":
        rows = [json.loads(line) for line in Path(trainer_assets.data).read_text().splitlines()[:160]]
        other = write_jsonl(tmp_path / "other.jsonl", rows[::-1])  # the same rows, in another order
        chosen, world = settings(trainer_assets, storage_copy, dataset=str(other)), 1
        named = [f'--dataset "{trainer_assets.data}" -> "{other}"', 'training examples "']
    else:
        # Two ranks of one example each: the same 2 examples per step as the first start's one rank of two.
        chosen, world, named = settings(trainer_assets, storage_copy, batch=1), 2, ["world size (--num-workers) 1 -> 2"]
    ranks = start("resume", tmp_path / "out", chosen, world)
    for result in ranks:  # every rank refuses, the same way (none waits in a collective)
        assert result.get("error_type") == "ResumeMismatch", result
        assert result["error"] == ranks[0]["error"]
        assert result["error"].startswith(f"Refusing to resume from {storage_copy / 'run' / 'step_0000004-'}")
        for words in named:
            assert words in result["error"], result["error"]
        assert "start a new run" in result["error"]


def test_the_driver_refuses_another_run_before_any_worker_starts(trainer_assets, storage_copy):
    """The CLI as the Ray job runs it, with no Ray cluster at all: the refusal comes before
    Ray is asked for anything."""
    argv = ["finetune", "--model-id", str(trainer_assets.model), "--dataset", str(trainer_assets.data),
            "--dataset-split", SPLIT, "--num-workers", "2", "--batch-size-per-device", "1", "--max-seq-len", "256",
            "--num-epochs", "1", "--learning-rate", "3e-3", "--device", "cpu", "--storage-path", str(storage_copy),
            "--run-name", "run"]
    env = offline_env({k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    run = run_trainer(argv, env, timeout=240)
    assert run.rc == 1, run.tail()
    failure = run.one("failure")
    assert failure["type"] == "ResumeMismatch", failure
    assert "world size (--num-workers) 1 -> 2" in failure["message"] and "--batch-size-per-device 2 -> 1" in \
        failure["message"]
    assert not run.of("start") and "Starting Ray Train" not in run.output


def test_a_resume_from_uri_retention_deleted_gives_way_to_the_runs_newest_complete_checkpoint(
        trainer_assets, first, storage_copy, tmp_path):
    """The operator hands each attempt the last `checkpoint` event's URI; once a later
    attempt has written newer checkpoints, retention may have deleted that one. The run's own
    newest complete checkpoint is what a resume takes, so the URI being gone stops nothing;
    only a --resume-from that would be resumed from must be a checkpoint."""
    from tpufinetune_trainer import finetune
    from tpufinetune_trainer.config import FinetuneConfig
    from tpufinetune_trainer.errors import ConfigError

    gone = str(storage_copy / "run" / f"step_0000002-{first[1]['start_id']}")
    shutil.rmtree(gone)
    chosen = settings(trainer_assets, storage_copy, resume_from=gone)
    cfg = FinetuneConfig(model_id=chosen["model"], dataset=chosen["dataset"], dataset_split=SPLIT,
                         storage_path=str(storage_copy), run_name="run", num_workers=1, device="cpu", max_seq_len=256,
                         batch_size_per_device=BATCH, num_epochs=1, learning_rate=3e-3, resume_from=gone)
    finetune.check(cfg)  # the driver's input checks
    finetune.check_resume(cfg, finetune.prepare_data(cfg)[0])
    (resumed,) = start("resume", tmp_path / "out", chosen)
    assert resumed.get("resumed_from") == first[1]["locations"][-1].replace(str(first[0]), str(storage_copy)), resumed
    assert resumed["step"] == 4
    # A new run (its directory empty) has only the URI to go by: it must be a checkpoint.
    cfg.run_name = "another"
    with pytest.raises(ConfigError, match=r"--resume-from .* is not a checkpoint of this trainer \(no DCP .metadata\)"):
        finetune.check(cfg)


def test_a_checkpoint_killed_while_written_is_never_taken_as_complete(trainer_assets, first, storage_copy, tmp_path):
    """A second start of the run writes step 4 again and is SIGKILLed inside its first
    write to the checkpoint's files. The half-written directory is not complete, the first
    start's step 4 is untouched, and a resume takes that one."""
    run_dir = storage_copy / "run"
    earlier = run_dir / Path(first[1]["locations"][-1]).name
    before = files_digest(earlier)
    out, world, port = tmp_path / "killed", 1, free_port()
    chosen = json.dumps(settings(trainer_assets, storage_copy))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
    writer = subprocess.Popen([sys.executable, str(WORKER), "kill", str(out), str(port), "0", str(world), chosen],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = Path(f"{out}.writing")
    try:
        wait_for(lambda: marker.exists() or writer.poll() is not None, 180, "the writer to be inside a write",
                 interval=0.2)
        assert writer.poll() is None, writer.communicate()[0][-4000:]
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.communicate()
    assert writer.returncode == -signal.SIGKILL
    half = Path(marker.read_text()).parent  # the directory the killed start was writing
    assert half.parent == run_dir and any(p.stat().st_size > 0 for p in half.glob("*.distcp"))
    assert half != earlier, "the second start rewrote the first start's checkpoint in place"
    assert not ckpt.is_complete(str(half))
    assert ckpt.latest_complete(str(run_dir)) == str(earlier)
    assert files_digest(earlier) == before  # not a byte of it changed
    (resumed,) = start("resume", tmp_path / "after", settings(trainer_assets, storage_copy))
    assert resumed.get("resumed_from") == str(earlier) and resumed["step"] == 4, resumed


def test_two_starts_of_one_run_never_reuse_a_checkpoint_name(trainer_assets, first, storage_copy, tmp_path):
    """A second start writes steps 2 and 4 into the same run again (as a start that resumed
    from before them would): its own directories; the first start's stay as they were, so
    Ray Train's retention, which deletes by path what it registered, can only ever delete
    the start's own. A resume takes the newest start's step 4."""
    run_dir = storage_copy / "run"
    earlier = [run_dir / Path(location).name for location in first[1]["locations"]]
    before = [files_digest(directory) for directory in earlier]
    (again,) = start("save", tmp_path / "again", settings(trainer_assets, storage_copy))
    later = [Path(location) for location in again["locations"]]
    assert again["start_id"] != first[1]["start_id"]
    assert not set(later) & set(earlier), (later, earlier)
    assert [p.name for p in later] == [f"step_{step:07d}-{again['start_id']}" for step in STEPS]
    assert all(ckpt.is_complete(str(p)) for p in earlier + later)
    assert [files_digest(directory) for directory in earlier] == before
    assert ckpt.latest_complete(str(run_dir)) == str(later[-1])


def test_a_resume_continues_from_the_saved_step_and_refuses_one_its_position_contradicts():
    from tpufinetune_trainer.errors import ResumeMismatch
    from tpufinetune_trainer.resume import position

    assert position({"epoch": 1, "epoch_step": 4, "step": 4}, 72, "x") == (1, 4, 4)  # inside epoch 1
    assert position({"epoch": 2, "epoch_step": 72, "step": 144}, 72, "gs://b/r/epoch_0002-s") == (3, 0, 144)
    # A step checkpoint at the epoch's last step (a notice there): the epoch's end, its
    # evaluation and epoch checkpoint, is still to do.
    assert position({"epoch": 2, "epoch_step": 72, "step": 144}, 72, "gs://b/r/step_0000144-s") == (2, 72, 144)
    assert position({"epoch": 2, "step": 144}, 72, "x") == (3, 0, 144)  # an earlier trainer's epoch checkpoint
    assert position({"epoch": 2, "epoch_step": 10, "step": 82}, 72, "x") == (2, 10, 82)  # --max-steps 82 ended it
    # Saved at step 40 by a plan of 30 steps an epoch: this plan of 36 would put it at step 46.
    with pytest.raises(ResumeMismatch, match=r"Refusing to resume from gs://b/run/step_0000040-s: it saved step 40, "
                                             r"but its position \(epoch 2, 10 steps in\) is step 46 with this run's "
                                             r"36 steps per epoch"):
        position({"epoch": 2, "epoch_step": 10, "step": 40}, 36, "gs://b/run/step_0000040-s")


def test_a_restore_makes_the_optimizer_state_with_the_runs_own_learning_rate_tensor(
        trainer_assets, prepared, process_group, tmp_path):
    """Before the load, AdamW's state is made by one step at a rate of 0 held in the run's
    own rate tensor (on the device where the optimizer is capturable), not by DCP's
    get_state_dict, which swaps in a new CPU tensor for that step; no weight moves, and the
    restored state is the saved one."""
    from tpufinetune_trainer import resume
    from tpufinetune_trainer.backends import BACKENDS
    from tpufinetune_trainer.config import FinetuneConfig
    from tpufinetune_trainer.train import Trainer
    from trainer_helpers import BLOCK_LENGTH

    import torch

    def make() -> Trainer:
        cfg = FinetuneConfig(model_id=str(trainer_assets.model), storage_path=str(tmp_path), run_name="run",
                             num_workers=1, device="cpu", max_seq_len=BLOCK_LENGTH, batch_size_per_device=2,
                             num_epochs=1, learning_rate=3e-3).validate()
        return Trainer(cfg, BACKENDS["cpu"], prepared, rank=0, world=1, local_rank=0)

    saved = make()
    saved.train_step(torch.zeros(()))
    state = {"epoch": 1, "epoch_step": 1, "step": 1, "fingerprint": saved.fingerprint, "start": saved.start_id}
    location = tmp_path / "run" / resume.checkpoint_name(False, 1, 1, saved.start_id)
    ckpt.save_sharded(saved.model, saved.optimizer, str(location), state, saved.cpu_group)
    fresh = make()
    rates, step = [], fresh.optimizer.step

    def recorded_step(*args, **kwargs):
        rates.append([(group["lr"] is fresh.lr, float(group["lr"])) for group in fresh.optimizer.param_groups])
        return step(*args, **kwargs)

    fresh.optimizer.step = recorded_step
    weights = [p.detach().full_tensor().clone() for p in fresh.params]
    fresh.restore()
    assert rates == [[(True, 0.0)] * len(fresh.optimizer.param_groups)], rates  # one step, at 0, in the run's tensor
    # The groups hold the run's tensor again, with the saved groups' rate in it (each step sets its own).
    assert all(group["lr"] is fresh.lr for group in fresh.optimizer.param_groups)
    assert float(fresh.lr) == float(saved.lr) > 0
    assert fresh.global_step == 1 and fresh.resumed_from == str(location)
    assert any(not torch.equal(a, p.detach().full_tensor()) for a, p in zip(weights, fresh.params))  # loaded
    for a, b in zip(saved.params, fresh.params):
        assert torch.equal(a.detach().full_tensor(), b.detach().full_tensor())
    for a, b in zip(saved.optimizer.state.values(), fresh.optimizer.state.values()):
        assert all(torch.equal(a[key].full_tensor() if hasattr(a[key], "full_tensor") else a[key],
                               b[key].full_tensor() if hasattr(b[key], "full_tensor") else b[key]) for key in a)
