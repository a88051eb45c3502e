"""Benchmark: training time blocked by one checkpoint save, and the extra host memory it
takes, the trainer's save (checkpoint.async_save_sharded, and the synchronous save_sharded)
against the tutorial's synchronous `dcp.save` (a plain FileSystemWriter: one thread, an
fsync per file), on CPU. Not a test.

    .venv/bin/python benchmarks/bench_checkpoint.py [--layers 4] [--world 2] [--saves 2] [--dir DIR] [--small]

Each of `--world` ranks is a process in one gloo group holding its FSDP2 shards of a random
Gemma 4 text model (benchmarks/bench_trainer_load.py's shape: hidden 2048, a 32768-token
vocabulary; 4 layers are ~0.31B trainable parameters) in fp32 and AdamW's two moments after
one step, as a worker holds them between steps. Every variant saves the same state `--saves`
times into DIR (a local disk; each save removed, and the page cache written back with
sync(), outside the timed part). Ours write to DIR as a `file://` URI: the trainer's writer
for a storage URI (checkpoint.ArrowWriter, pyarrow's file system), as for gs://.

- tutorial: `dcp.save(state, storage_writer=FileSystemWriter(dir))`, DCP's defaults;
- ours, sync, 1 thread: save_sharded with checkpoint.WRITE_THREADS set to 1 (no fsync, plan caching);
- ours, sync: save_sharded (WRITE_THREADS files per rank), as the trainer saves on notice;
- ours, async: async_save_sharded as the trainer checkpoints (a host copy of the shards,
  into buffers kept from one save to the next, then DCP's writer thread on a gloo group of
  its own): blocked is until it returns, "save done" until its future is (trainer_state.json
  written). Its first save allocates the buffers (the table's extra peak, a max over the
  saves); the later ones copy into them (the blocked median, of 3 saves or more).

Blocked seconds are each save's slowest rank (the next step's collectives wait for it), the
median over the saves. Extra peak memory is each rank's kernel high-water mark over the save
(VmHWM, reset through /proc/self/clear_refs just before it) minus its resident size then;
the table shows the larger rank and the larger save.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("tutorial", "ours, sync, 1 thread", "ours, sync", "ours, async")
STAGER = None


def status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def sharded_state(layers: int, world: int, small: bool):
    """A random Gemma 4 text model sharded over the group (each rank allocates only its
    shards) and AdamW after one step, as a training worker holds them. `small`: hidden 256,
    a few MiB, to check the script itself."""
    import torch
    from transformers import Gemma4ForCausalLM

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_trainer_load import gemma4_config
    from tpufinetune_trainer.parallelize import apply_fsdp, build_mesh

    config = gemma4_config(layers).text_config
    if small:
        config.hidden_size, config.intermediate_size, config.head_dim, config.global_head_dim = 256, 1024, 64, 64
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    apply_fsdp(model, build_mesh("cpu", world), torch.float32)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0, 0.02, generator=generator)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, sum(p.numel() for p in params)


def save(variant: str, model, optimizer, directory: str, group):
    """One save by `variant`; returns the pending save (None for the synchronous ones)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tpufinetune_trainer import checkpoint as ckpt

    state = {"epoch": 1, "step": 100}
    if variant == "tutorial":
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(directory),
                 process_group=group)
        return None
    uri = f"file://{directory}"
    if variant == "ours, async":
        global STAGER
        STAGER = STAGER or ckpt.HostStager()  # one for the run, as the trainer's
        return ckpt.async_save_sharded(model, optimizer, uri, state, group, STAGER)
    threads = ckpt.WRITE_THREADS
    ckpt.WRITE_THREADS = 1 if variant.endswith("1 thread") else threads
    try:
        ckpt.save_sharded(model, optimizer, uri, state, group)
    finally:
        ckpt.WRITE_THREADS = threads
    return None


def rank_main(layers: int, small: bool, out: str, base: str, saves: int, port: int, rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")  # the trainer's save group (nothing else on it)
    model, optimizer, params = sharded_state(layers, world, small)
    libc = ctypes.CDLL("libc.so.6")
    results = {"params": params, "variants": {}}
    for variant in VARIANTS:
        rows = []
        for n in range(saves):
            directory = f"{base}/{variant.replace(', ', '-').replace(' ', '-')}-{n}"
            dist.barrier(group=group)
            libc.malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
            before = status_kib("VmRSS")
            dist.barrier(group=group)
            start = time.perf_counter()
            future = save(variant, model, optimizer, directory, group)
            blocked = time.perf_counter() - start
            if future is not None:
                future.wait()
            total = time.perf_counter() - start
            peak = status_kib("VmHWM")
            dist.barrier(group=group)
            if rank == 0:
                shutil.rmtree(directory)
                os.sync()  # every save starts with no dirty pages of the one before
            rows.append({"blocked_s": blocked, "total_s": total, "extra_mib": (peak - before) / 1024})
        results["variants"][variant] = rows
    Path(f"{out}.{rank}.json").write_text(json.dumps(results))
    dist.barrier(group=group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (4: ~0.31B trainable parameters)")
    parser.add_argument("--world", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--saves", type=int, default=2, help="saves per variant (median of them)")
    parser.add_argument("--dir", help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--small", action="store_true", help="hidden 256 (a few MiB): checks the script only")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "trainer"), str(REPO / "tests")]  # this checkout's trainer, not an installed one
    from harness.ports import free_port

    from tpufinetune_trainer.checkpoint import WRITE_THREADS

    with tempfile.TemporaryDirectory(prefix="tpuft-bench-ckpt-", dir=args.dir) as work:
        out, port = f"{work}/result", free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join([str(REPO / "trainer"), str(REPO / "tests"),
                                               os.environ.get("PYTHONPATH", "")]))
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", str(args.layers), str(int(args.small)), out, work,
                                   str(args.saves), str(port), str(rank), str(args.world)], env=env)
                 for rank in range(args.world)]
        codes = [proc.wait() for proc in procs]
        if any(codes):
            raise SystemExit(f"ranks exited with {codes}")
        ranks = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(args.world)]

    def figure(variant: str, key: str, over_saves) -> float:
        per_save = [max(r["variants"][variant][n][key] for r in ranks) for n in range(args.saves)]
        return over_saves(per_save)

    blocked = {v: figure(v, "blocked_s", statistics.median) for v in VARIANTS}
    total = {v: figure(v, "total_s", statistics.median) for v in VARIANTS}
    extra = {v: figure(v, "extra_mib", max) for v in VARIANTS}
    params = ranks[0]["params"]
    print(f"\nCPU, {args.world} ranks (gloo, one process each), Gemma 4 text model of {params / 1e9:.2f}B trainable "
          f"parameters, fp32 weights + AdamW moments ({params * 12 / 2**30:.1f} GiB a checkpoint), local disk; "
          f"median of {args.saves} saves, the slowest rank; ours writes {WRITE_THREADS} files per rank, to a "
          f"file:// URI")
    rows = [("variant", "blocked s", "vs tutorial", "save done s", "extra peak MiB", "vs tutorial")]
    for v in VARIANTS:
        rows.append((v, f"{blocked[v]:.2f}", f"{blocked[v] / blocked['tutorial']:.2f}x", f"{total[v]:.2f}",
                     f"{extra[v]:.0f}", f"{extra[v] / max(extra['tutorial'], 1):.2f}x"))
    rows.append(("target", "", "<= 0.3x", "", "", "<= 0.6x"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    ours, tutorial = "ours, async", "tutorial"
    per_rank_mib = params * 12 / args.world / 2**20
    print(f"\ntraining time blocked by one checkpoint, ours (async) vs the tutorial's dcp.save: "
          f"{blocked[ours] / blocked[tutorial]:.2f}x (target <= 0.3x); its first save, which allocates the host copy: "
          f"{figure(ours, 'blocked_s', lambda saves: saves[0]):.2f} s")
    print(f"extra peak memory, ours (async) vs the tutorial's dcp.save: {extra[ours] / max(extra[tutorial], 1):.2f}x "
          f"({extra[ours]:.0f} MiB against {extra[tutorial]:.0f}; one rank's checkpoint is {per_rank_mib:.0f} MiB) "
          f"(target <= 0.6x)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-of":
        layers_, small_, out_, base_, saves_, port_, rank_, world_ = sys.argv[2:]
        rank_main(int(layers_), small_ == "1", out_, base_, int(saves_), int(port_), int(rank_), int(world_))
    else:
        main()
