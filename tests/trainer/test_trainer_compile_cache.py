"""--compile-cache-dir: compiled programs are kept on a volume that outlives the pod, so a
restarted worker loads them instead of compiling again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tpufinetune_trainer.backends import BACKENDS, compile_cache_env
from tpufinetune_trainer.cli import build_parser
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.errors import ConfigError

# One worker start: the flag's directory set as the trainer sets it, then one compiled function.
WORKER = """
import json, sys, torch
from torch._dynamo.utils import counters
from tpufinetune_trainer.backends import BACKENDS, use_compile_cache
use_compile_cache(sys.argv[1], BACKENDS["cpu"])
f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
f(torch.randn(8, 8))
print(json.dumps(dict(counters["inductor"])))
"""


def start_worker(cache_dir) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path), OMP_NUM_THREADS="1")
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", WORKER, str(cache_dir)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_restarted_worker_loads_what_the_first_compiled_from_the_cache_directory(tmp_path):
    cache = tmp_path / "volume" / "compile-cache"
    first = start_worker(cache)
    assert first.get("fxgraph_cache_miss", 0) >= 1 and not first.get("fxgraph_cache_hit")
    assert any((cache / "inductor").rglob("*")), "nothing was written to the cache directory"
    second = start_worker(cache)  # a new process: only the directory survives
    assert second.get("fxgraph_cache_hit", 0) >= 1 and not second.get("fxgraph_cache_miss"), second


def test_the_cache_variables_per_backend():
    assert compile_cache_env("", BACKENDS["tpu"]) == {}
    assert compile_cache_env("/var/cache/tpuft/", BACKENDS["cpu"]) == {
        "TORCHINDUCTOR_CACHE_DIR": "/var/cache/tpuft/inductor"}
    assert compile_cache_env("/var/cache/tpuft", BACKENDS["tpu"]) == {
        "TORCHINDUCTOR_CACHE_DIR": "/var/cache/tpuft/inductor",
        "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "/var/cache/tpuft/torch_tpu"}


def test_the_flag_defaults_to_the_environment_and_must_be_absolute(monkeypatch):
    monkeypatch.setenv("TPUFT_COMPILE_CACHE_DIR", "/mnt/compile-cache")
    args = build_parser().parse_args(["finetune"])
    assert args.compile_cache_dir == "/mnt/compile-cache"
    with pytest.raises(ConfigError, match="--compile-cache-dir 'cache' must be an absolute path"):
        FinetuneConfig(storage_path="/tmp/unused", compile_cache_dir="cache").validate()
