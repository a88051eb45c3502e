"""One rank of a real gloo group that runs the trainer's asynchronous checkpoints.

Run as a process by tests/trainer/test_trainer_async_checkpoint.py, once per rank:
`python trainer_async_ckpt_worker.py STORAGE OUT_PREFIX PORT RANK WORLD` (STORAGE: a
file:// or gs:// URI; a gs:// one needs STORAGE_EMULATOR_HOST). The Trainer's own
checkpoint methods (train.Trainer.checkpoint, settle_checkpoint, complete_checkpoint) run on
a Trainer holding a tiny FSDP2 model sharded over both ranks; only ray.train.report and the
event line are replaced, by recorders. Every file write to storage goes through a gate the
worker holds shut, so a save stays in flight for as long as the test says. Writes
`OUT_PREFIX.<rank>.json`: what happened, in order, and what was checked on the way.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from tpufinetune_trainer import checkpoint as ckpt
from tpufinetune_trainer import storage
from tpufinetune_trainer import run_events, train
from tpufinetune_trainer.parallelize import build_mesh

log: list[dict] = []  # in order: save starts, reports to Ray Train, events
written: list[str] = []  # every path a save opened for writing
gate = threading.Event()


def gated_create_stream(original):
    def create_stream(self, path, mode):
        if "w" in mode:
            written.append(str(path))
            assert gate.wait(60), "the test never opened the gate"
        return original(self, path, mode)
    return create_stream


def model_and_optimizer(world: int, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    fully_shard(model, mesh=build_mesh("cpu", world))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, seed: int) -> None:
    """One optimizer step (FSDP's collectives on the default group, this thread)."""
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 16, generator=generator)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def full_state(model, optimizer) -> list[torch.Tensor]:
    """Every weight and AdamW moment, gathered (collective)."""
    tensors = [p.full_tensor() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [state["exp_avg"].full_tensor(), state["exp_avg_sq"].full_tensor()]
    return [t.clone() for t in tensors]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def stub_trainer(storage_uri: str, rank: int, world: int):
    trainer = train.Trainer.__new__(train.Trainer)
    trainer.cfg = SimpleNamespace(storage_path=storage_uri, run_name="run", checkpoint_score_attribute="loss",
                                  checkpoint_score_order="min")
    trainer.rank, trainer.world = rank, world
    trainer.model, trainer.optimizer = model_and_optimizer(world, 0)
    trainer.cpu_group, trainer.save_group = ckpt.cpu_group(), ckpt.cpu_group()
    trainer.history, trainer.stopped, trainer.pending = [], None, None
    trainer.saved_step, trainer.weights_uri = -1, None
    trainer.start_id, trainer.fingerprint = "start", {"world_size": world}
    trainer.stager = ckpt.HostStager()
    return trainer


def main(storage_uri: str, out_prefix: str, port: int, rank: int, world: int) -> None:
    import ray.train

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ckpt.ArrowFileSystem.create_stream = gated_create_stream(ckpt.ArrowFileSystem.create_stream)

    def report(metrics, checkpoint=None, checkpoint_dir_name=None, checkpoint_upload_mode=None):
        location = storage.uri_of(checkpoint.filesystem, checkpoint.path)
        log.append({"what": "report", "name": checkpoint_dir_name, "location": location,
                    "complete": ckpt.is_complete(location), "mode": str(checkpoint_upload_mode),
                    "step": metrics["step"]})

    def emit(kind, **fields):
        log.append({"what": "event", "kind": kind, "complete": ckpt.is_complete(fields["uri"]), **fields})

    start_save = ckpt.async_save_sharded

    def logged_start(model, optimizer, location, state, group=None, stager=None):
        log.append({"what": "start", "location": location, "step": state["step"]})
        return start_save(model, optimizer, location, state, group, stager)

    ray.train.report, run_events.emit, ckpt.async_save_sharded = report, emit, logged_start
    trainer = stub_trainer(storage_uri, rank, world)
    model, optimizer = trainer.model, trainer.optimizer
    checks: dict = {}
    snapshots: dict[int, list[torch.Tensor]] = {}

    def save(step: int, synchronous: bool = False) -> str:
        snapshots[step] = full_state(model, optimizer)
        metrics = {"epoch": 1, "step": step, "loss": 10.0 - step}
        extra = {"epoch_step": step, "epoch_steps": 100, "epoch_loss_sum": 2.5 * step, "epoch_label_tokens": step,
                 "training_s": 1.0, "stale_evals": 0}
        return trainer.checkpoint(f"step_{step:07d}", metrics, extra, synchronous=synchronous)

    # 1. A save at step 1, kept in flight (the gate shut) while training takes steps 2-4.
    train_step(model, optimizer, 1)
    first = save(1)
    for step in (2, 3, 4):
        train_step(model, optimizer, step)
        trainer.settle_checkpoint(wait=False)
    checks["in_flight_after_3_steps"] = trainer.pending is not None
    checks["reports_while_in_flight"] = sum(e["what"] == "report" for e in log)
    checks["complete_while_in_flight"] = ckpt.is_complete(first)
    # 2. The gate opens; the next steps' agreement finds it complete and reports it.
    gate.set()
    steps = 4
    while trainer.pending is not None and steps < 200:
        steps += 1
        train_step(model, optimizer, steps)
        trainer.settle_checkpoint(wait=False)
    checks["reported_by_step"] = steps
    # 3. The next save waits for the previous one: the gate shut again, a save started, and a
    # third asked for at once; the gate opens a second later, on a timer.
    gate.clear()
    train_step(model, optimizer, 1000)
    second = save(steps + 1)
    train_step(model, optimizer, 1001)
    opener = threading.Timer(1.0, gate.set)
    opener.start()
    asked = time.perf_counter()
    third = save(steps + 3)
    checks["third_waited_s"] = time.perf_counter() - asked
    # 4. The last, synchronous (as on notice), after the third completes.
    train_step(model, optimizer, 1002)
    fourth = save(steps + 10, synchronous=True)
    checks["pending_after_synchronous"] = trainer.pending is not None
    later = full_state(model, optimizer)
    # 5. Every checkpoint reloads to exactly the state of its own step (not a later one).
    reloads = {}
    for location, step in ((first, 1), (second, steps + 1), (third, steps + 3), (fourth, steps + 10)):
        other, other_optimizer = model_and_optimizer(world, 7)
        train_step(other, other_optimizer, 0)  # AdamW's state exists to load into
        state = ckpt.load_sharded(other, other_optimizer, location, trainer.cpu_group)
        loaded = full_state(other, other_optimizer)
        reloads[location] = {"equal_to_its_step": same(loaded, snapshots[step]),
                             "equal_to_the_end": same(loaded, later), "state": state}
    fs, root = storage.filesystem(storage_uri)
    result = {"log": log, "checks": checks, "reloads": reloads, "written": written, "root": root.rstrip("/"),
              "history": trainer.history, "locations": [first, second, third, fourth]}
    with open(f"{out_prefix}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    storage_, prefix_, port_, rank_, world_ = sys.argv[1:]
    main(storage_, prefix_, int(port_), int(rank_), int(world_))
