"""One rank of a real gloo group running one start of a run: the Trainer builds the tiny
Gemma, trains and checkpoints, or resumes.

Run as a process by tests/trainer/test_trainer_resume.py, once per rank:
`python trainer_resume_worker.py MODE OUT PORT RANK WORLD SETTINGS_JSON`, SETTINGS_JSON
holding `model`, `dataset`, `split`, `storage`, `run_name`, `batch`, optionally
`resume_from`, and, by mode:
- `save`: train `steps[-1]` steps from the start (no restore), writing a step checkpoint
  after each of `steps` the way a checkpoint on notice is written (Trainer.report,
  synchronous, no evaluation); OUT gets the start's id and the checkpoints' locations.
- `resume`: Trainer.restore() from what the run's storage holds; OUT gets where it resumed
  (or the error every rank raised).
- `kill`: as `save`, but the first write to each checkpoint file writes its bytes, leaves
  `<OUT>.writing` naming the file, and then never returns, so the test can SIGKILL the
  process while the checkpoint is half written.
Only ray.train.report and the event line are replaced (by recorders): there is no Ray Train
session in a plain process.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tpufinetune_trainer import run_events, train
from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.data import pad_id_of, prepare
from tpufinetune_trainer.model import load_tokenizer

LENGTH = 256


def rank_trainer(settings: dict, rank: int, world: int) -> train.Trainer:
    cfg = FinetuneConfig(model_id=settings["model"], dataset=settings["dataset"], dataset_split=settings["split"],
                         storage_path=settings["storage"], run_name=settings["run_name"], num_workers=world,
                         device="cpu", max_seq_len=LENGTH, batch_size_per_device=settings["batch"], num_epochs=1,
                         learning_rate=3e-3, resume_from=settings.get("resume_from")).validate()
    tokenizer = load_tokenizer(cfg.model_id)
    data = prepare(cfg.dataset, cfg.dataset_split, tokenizer, LENGTH, cfg.eval_fraction, cfg.seed)
    return train.Trainer(cfg, BACKENDS["cpu"], {"train": data.train, "eval": data.eval, "pad_id": pad_id_of(tokenizer)},
                         rank=rank, world=world, local_rank=0)


def stall_mid_write(marker: Path) -> None:
    """Every checkpoint file's first write lands on disk, then the writer stops for good
    (the test kills it)."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystem.create_stream

    class Stalling:
        def __init__(self, stream, path):
            self.stream, self.path = stream, path

        def write(self, data):
            written = self.stream.write(data)
            self.stream.flush()
            # Named whole or not at all: the test reads it as soon as it exists. One name
            # per writer thread: two threads sharing one would empty each other's.
            partial = marker.with_name(f"{marker.name}.{threading.get_ident()}.tmp")
            partial.write_text(str(self.path))
            partial.rename(marker)
            while True:
                time.sleep(60)
            return written

        def __getattr__(self, name):
            return getattr(self.stream, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            yield Stalling(stream, path) if "w" in mode and str(path).endswith(".distcp") else stream

    filesystem.FileSystem.create_stream = create_stream


def save(trainer: train.Trainer, steps: list[int], before_last=None) -> list[str]:
    locations = []
    loss_sum = torch.zeros(())
    start = time.perf_counter()
    for _ in range(steps[-1]):
        trainer.train_step(loss_sum)
        trainer.epoch_step += 1
        trainer.global_step += 1
        if trainer.global_step in steps:
            if trainer.global_step == steps[-1] and before_last is not None:
                before_last()
            metrics = trainer.epoch_metrics(loss_sum, 0, 0, time.perf_counter() - start, trainer.global_step)
            trainer.report(metrics, epoch_end=False, evaluate=False, synchronous=True)
            locations.append(trainer.weights_uri)
    return locations


def main(mode: str, out: str, port: int, rank: int, world: int, settings: dict) -> None:
    import ray.train

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    reports: list[str] = []
    ray.train.report = lambda metrics, checkpoint=None, **kwargs: reports.append(checkpoint.path)
    run_events.emit = lambda kind, **fields: None
    trainer = rank_trainer(settings, rank, world)
    result: dict = {"start_id": trainer.start_id}
    if mode == "resume":
        try:
            trainer.restore()
            result.update(resumed_from=trainer.resumed_from, step=trainer.global_step, epoch=trainer.epoch,
                          epoch_step=trainer.epoch_step)
        except Exception as exc:  # noqa: BLE001 - the test reads what every rank raised
            result.update(error_type=type(exc).__name__, error=str(exc))
    else:
        marker = Path(f"{out}.writing")
        result["locations"] = save(trainer, settings["steps"],
                                   (lambda: stall_mid_write(marker)) if mode == "kill" else None)
        result["reported"] = reports
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode_, out_, port_, rank_, world_, settings_ = sys.argv[1:]
    main(mode_, out_, int(port_), int(rank_), int(world_), json.loads(settings_))
