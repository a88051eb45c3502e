"""Benchmark: rank 0's peak host memory and time of the Hugging Face export, the previous
export (the whole model gathered on rank 0 in fp32, cast, written to a local directory by
save_pretrained, then uploaded) against the streamed one (checkpoint.export_hf: one tensor
gathered at a time, cast to the base's dtype, written straight to the destination), on
CPU. Not a test.

    .venv/bin/python benchmarks/bench_export.py [--layers 4] [--world 2] [--work DIR]

Writes a random Gemma 4 text model (benchmarks/bench_trainer_load.py's shape: hidden 2048,
a 32768-token vocabulary; bf16, as Gemma 4 ships) to DIR, then, for each variant, starts
`--world` ranks as processes in one gloo group; each loads it sharded (load_sharded, fp32
master weights, as a worker holds them) and exports it to DIR as a `file://` URI (pyarrow's
output streams, the trainer's path for gs://). Memory is rank 0's kernel high-water mark
over the export (VmHWM, reset through /proc/self/clear_refs just before it) minus its
resident size then.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

VARIANTS = ("gathered", "streamed")


def gathered_export(model, destination: str, base_dir: Path, group) -> None:
    """The previous export: get_model_state_dict(full_state_dict, cpu_offload) on rank 0,
    cast, save_pretrained into a temporary directory, then upload_dir."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tpufinetune_trainer import checkpoint as ckpt
    from tpufinetune_trainer import storage
    from tpufinetune_trainer.model import export_dtype

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for target in ckpt.tied_weight_copies(model):
        full.pop(target, None)
    if dist.get_rank() == 0:
        dtype = export_dtype(json.loads((base_dir / "config.json").read_text()))
        for key, value in full.items():
            if value.is_floating_point():
                full[key] = value.to(dtype)
        with tempfile.TemporaryDirectory(prefix="tpuft-export-") as tmp:
            model.save_pretrained(tmp, state_dict=full)
            storage.upload_dir(tmp, destination)
    del full
    dist.barrier(group=group)


def rank_main(model_dir: str, variant: str, destination: str, out: str, port: int, rank: int, world: int) -> None:
    import ctypes

    import torch
    import torch.distributed as dist

    from bench_trainer_load import status_kib
    from tpufinetune_trainer import checkpoint as ckpt
    from tpufinetune_trainer.parallelize import build_mesh
    from tpufinetune_trainer.sharded_load import load_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from transformers.utils import logging

    logging.disable_progress_bar()
    model, _ = load_sharded(model_dir, "sdpa", build_mesh("cpu", world), torch.float32)
    group = dist.new_group(backend="gloo")
    dist.barrier()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
    before = status_kib("VmRSS")
    start = time.perf_counter()
    if variant == "gathered":
        gathered_export(model, destination, Path(model_dir), group)
    else:
        ckpt.export_hf(model, None, destination, group, Path(model_dir))
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
    Path(f"{out}.{rank}.json").write_text(json.dumps({"before_mib": before / 1024, "peak_mib": peak / 1024,
                                                      "seconds": seconds, "held_mib": held / 2**20}))
    dist.destroy_process_group()


def run_variant(model_dir: Path, variant: str, world: int, work: Path) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from harness.ports import free_port

    port = free_port()
    out = work / f"result-{variant}"
    destination = work / f"export-{variant}"
    shutil.rmtree(destination, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "trainer"), str(REPO / "tests"), str(REPO / "benchmarks"),
                                           os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", str(model_dir), variant,
                               f"file://{destination}", str(out), str(port), str(rank), str(world)], env=env)
             for rank in range(world)]
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise SystemExit(f"{variant}: ranks exited with {codes}")
    result = json.loads(Path(f"{out}.0.json").read_text())
    result["written_mib"] = sum(f.stat().st_size for f in destination.glob("*.safetensors")) / 2**20
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--world", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--work", help="directory for the model and the exports (default: a temporary one)")
    args = parser.parse_args()
    from bench_trainer_load import write_model

    with tempfile.TemporaryDirectory(prefix="tpuft-bench-export-") as tmp:
        work = Path(args.work or tmp)
        model_dir = work / "model"
        params = write_model(model_dir, args.layers)
        results = {variant: run_variant(model_dir, variant, args.world, work) for variant in VARIANTS}
    fp32_mib = params * 4 / 2**20
    print(f"\nCPU, {args.world} ranks (gloo), a {params / 1e9:.2f}B-parameter Gemma 4 ({fp32_mib:.0f} MiB in fp32), "
          f"exported in bf16 to a file:// URI; rank 0")
    rows = [("metric", "gathered (before)", "streamed (after)")]
    growth = {v: r["peak_mib"] - r["before_mib"] for v, r in results.items()}
    rows += [("RSS before the export MiB", *(f"{results[v]['before_mib']:.0f}" for v in VARIANTS)),
             ("peak growth over the export MiB", *(f"{growth[v]:.0f}" for v in VARIANTS)),
             ("peak growth / fp32 model", *(f"{growth[v] / fp32_mib:.2f}x" for v in VARIANTS)),
             ("export seconds", *(f"{results[v]['seconds']:.1f}" for v in VARIANTS)),
             ("safetensors written MiB", *(f"{results[v]['written_mib']:.0f}" for v in VARIANTS))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-of":
        model_dir_, variant_, destination_, out_, port_, rank_, world_ = sys.argv[2:]
        rank_main(model_dir_, variant_, destination_, out_, int(port_), int(rank_), int(world_))
    else:
        main()
