"""A retry starts warm: the prepared data and the compiled programs of an earlier attempt
are kept in the run's storage, so a later attempt tokenizes and compiles nothing again,
even on a host whose disk has neither (a new head pod, a new TPU host)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tpufinetune_trainer import compile_cache, data, data_stream, finetune
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.startup import Startup

from trainer_helpers import offline_env, run_trainer, write_jsonl

MAX_SEQ_LEN = 128


def rows_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "rows.jsonl", [{"instruction": f"Say {i}.", "context": "", "response": f"{i} " * 5}
                                                for i in range(40)])


def test_a_later_attempts_driver_maps_the_published_entry_and_tokenizes_nothing(
        tokenizer, tmp_path, monkeypatch):
    path, published = rows_file(tmp_path), f"file://{tmp_path / 'storage' / 'run-1' / 'data'}"
    encoded = []
    encode = data.encode_rows
    monkeypatch.setattr(data, "encode_rows", lambda rows, *a, **k: encoded.append(len(rows)) or encode(rows, *a, **k))

    def prepare(home: str) -> data.PreparedData:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / home))  # this host's disk
        return data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, published=published)

    first = prepare("attempt-1")
    assert (first.source, first.tokenized_examples, sum(encoded)) == ("tokenized", 40, 40)
    cfg = FinetuneConfig(model_id="m", storage_path=f"file://{tmp_path / 'storage'}", run_name="run-1")
    finetune.shipped_examples(first.train, cfg, alive_nodes=1)  # published once, on one node too
    encoded.clear()
    second = prepare("attempt-2")  # a new host: nothing on its disk
    assert (second.source, second.tokenized_examples, encoded) == ("published", 0, [])
    assert second.train.input_ids.values.tolist() == first.train.input_ids.values.tolist()
    assert second.train.digest == first.train.digest and second.eval_examples == first.eval_examples
    third = prepare("attempt-1")  # the first host again
    assert (third.source, third.tokenized_examples, encoded) == ("local_cache", 0, [])


def test_the_startup_facts_travel_to_the_workers_and_into_the_event():
    driver = Startup(origin=1000.0, stages={"data_ready": 2.0})
    driver.note(data_source="published", tokenized_examples=0)
    worker = Startup.of(driver.handover())
    worker.note(compile_cache_hits=3, compile_cache_misses=0)
    fields = worker.fields()
    assert (fields["data_source"], fields["tokenized_examples"], fields["compile_cache_hits"]) == ("published", 0, 3)
    with pytest.raises(ValueError, match="data_source"):
        worker.note(data_source="somewhere")


# One worker's start on a host of its own (its own XDG cache): the run's cache seeded into
# it, a compiled function, the new files uploaded.
WORKER = """
import json, sys, torch
from torch._dynamo.utils import counters
from tpufinetune_trainer import compile_cache
from tpufinetune_trainer.backends import BACKENDS, use_compile_cache
local, fetched = compile_cache.seed(sys.argv[1])
use_compile_cache(str(local), BACKENDS["cpu"])
f = torch.compile(lambda x: torch.cos(x) * 3 - 1)
f(torch.randn(8, 8))
print(json.dumps({**compile_cache.counters(), "fetched": fetched, "uploaded": compile_cache.upload(local, sys.argv[1])}))
"""


def start_worker(remote: str, home: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1",
               XDG_CACHE_HOME=str(home))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", WORKER, remote], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_worker_on_a_new_host_loads_what_an_earlier_attempt_compiled_from_the_runs_storage(tmp_path):
    remote = f"file://{tmp_path / 'storage' / 'run-1' / compile_cache.REMOTE}"
    first = start_worker(remote, tmp_path / "host-a")
    assert first["compile_cache_misses"] >= 1 and not first["compile_cache_hits"] and first["uploaded"] >= 1
    second = start_worker(remote, tmp_path / "host-b")  # another host: only the storage has the cache
    assert second["fetched"] >= 1 and second["compile_cache_hits"] >= 1 and not second["compile_cache_misses"]
    assert second["uploaded"] == 0  # nothing new


# --------------------------------------------------------------------------- two starts for real

LOCAL_COMPILE_CACHE = re.compile(r"Compile cache: (\S+) from ")


def finetune_args(assets, storage: Path) -> list[str]:
    return ["finetune", "--model-id", str(assets.model), "--dataset", str(assets.data),
            "--dataset-split", "train[:48]", "--num-workers", "1", "--max-seq-len", "256", "--eval-fraction", "0",
            "--device", "cpu", "--compile", "on", "--storage-path", str(storage), "--run-name", "warm",
            "--checkpoint-every-steps", "2", "--max-steps", "4", "--progress-interval", "60"]


@pytest.mark.ray
@pytest.mark.slow
def test_a_retry_of_the_run_tokenizes_and_compiles_nothing_again(ray_head, trainer_assets, tmp_path):
    storage = tmp_path / "storage"
    args = finetune_args(trainer_assets, storage)
    first = run_trainer([*args, "--fail-at-step", "3", "--max-failures", "0"],
                        offline_env(ray_head.env(dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "head-1")))),
                        timeout=480)
    assert first.rc != 0 and "injected failure" in first.output, first.tail()
    # The retry's hosts are new: the driver's disk is empty, and the worker's copy of the
    # compile cache is removed (the Ray workers keep the head's cache home).
    for local in set(LOCAL_COMPILE_CACHE.findall(first.output)):
        shutil.rmtree(local)
    second = run_trainer(args, offline_env(ray_head.env(dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "head-2")))),
                         timeout=480)
    assert second.rc == 0, second.tail()
    cold, warm = first.one("startup"), second.one("startup")
    assert (cold["data_source"], warm["data_source"]) == ("tokenized", "published")
    assert cold["tokenized_examples"] == 48 and warm["tokenized_examples"] == 0
    assert cold["compile_cache_misses"] >= 1 and not cold["compile_cache_hits"]
    assert warm["compile_cache_hits"] >= 1 and not warm["compile_cache_misses"], warm
    compiled = {name: e["first_step_compiled_s"] - e["model_loaded_s"] for name, e in (("cold", cold), ("warm", warm))}
    assert compiled["warm"] < compiled["cold"], compiled
    print(f"\ncold: {dict(cold)}\nwarm: {dict(warm)}")
    print(f"first step at {cold['first_step_s']} s (cold) and {warm['first_step_s']} s (warm): "
          f"{warm['first_step_s'] / cold['first_step_s']:.2f}x; first step's compile "
          f"{compiled['cold']:.1f} s -> {compiled['warm']:.1f} s")
