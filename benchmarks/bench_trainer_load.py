"""Benchmark: peak host memory per rank of loading the base model, the full load against
the sharded one (trainer/tpufinetune_trainer/sharded_load.py), on CPU. Not a test.

    .venv/bin/python benchmarks/bench_trainer_load.py [--layers 14] [--world 2] [--work DIR]

Writes a random Gemma 4 text model of ~1.04B parameters (14 layers of hidden 2048, a
32768-token vocabulary, the per-layer embedding table of 32768 x 3584) to DIR as one
safetensors file in bf16, as Gemma 4 ships, one tensor at a time (the writer never holds
the model). Then, for each load path, starts `--world` ranks as separate processes in one
gloo group, each doing what a training worker does before its optimizer: the full path is
load_causal_lm (fp32) then apply_fsdp; the sharded path is load_sharded. Both shard over
all ranks with fp32 compute (CPU), so the frozen per-layer table is fp32 in both.

Memory is each rank's kernel high-water mark (VmHWM: anonymous and file-backed pages it
had mapped, so a memory-mapped checkpoint counts) over the load, reset through
/proc/self/clear_refs after the imports and the process group are up; "before" is the
resident size at that reset. The table shows the larger rank of each path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PATHS = ("full", "sharded")


def gemma4_config(layers: int):
    from transformers import Gemma4Config

    text = dict(vocab_size=32768, vocab_size_per_layer_input=32768, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                global_head_dim=256, hidden_size_per_layer_input=256, max_position_embeddings=4096,
                sliding_window=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                layer_types=["full_attention" if i % 5 == 4 or i == layers - 1 else "sliding_attention"
                             for i in range(layers)])
    return Gemma4Config(text_config=text, vision_config=None, audio_config=None, dtype="bfloat16")


def write_model(directory: Path, layers: int) -> int:
    """A random Gemma 4 as save_pretrained lays it out (the same keys, the tied head left
    out), written tensor by tensor. Returns its parameter count."""
    import struct

    import torch
    from transformers import Gemma4ForConditionalGeneration

    config = gemma4_config(layers)
    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(config)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    tensors = [(name, t) for name, t in model.state_dict(keep_vars=True).items() if name not in tied]
    header, offset = {}, 0
    for name, t in tensors:
        size = t.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    generator = torch.Generator().manual_seed(0)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, t in tensors:
            if name.endswith("layer_scalar"):
                value = torch.ones(t.shape, dtype=torch.bfloat16)
            else:
                value = (torch.randn(t.shape, generator=generator) * 0.02).to(torch.bfloat16)
            f.write(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    config.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def rank_main(model_dir: str, path: str, out: str, port: int, rank: int, world: int) -> None:
    """One rank: load by `path`, write {before_mib, peak_mib, seconds} to out.<rank>.json."""
    import ctypes

    import torch
    import torch.distributed as dist

    from tpufinetune_trainer.model import load_causal_lm
    from tpufinetune_trainer.parallelize import apply_fsdp, build_mesh
    from tpufinetune_trainer.sharded_load import load_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = build_mesh("cpu", world)
    import transformers.models.gemma4.modeling_gemma4  # noqa: F401  (imported by both paths: not their cost)
    from transformers.utils import logging

    logging.disable_progress_bar()

    dist.barrier()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
    before = status_kib("VmRSS")
    start = time.perf_counter()
    if path == "full":
        model = apply_fsdp(load_causal_lm(model_dir, torch.float32, "sdpa"), mesh, torch.float32)
        how = "every rank loaded the whole model"
    else:
        model, how = load_sharded(model_dir, "sdpa", mesh, torch.float32)
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    after = status_kib("VmRSS")
    shard = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                for p in model.parameters())
    dist.barrier()
    Path(f"{out}.{rank}.json").write_text(json.dumps({
        "before_mib": before / 1024, "peak_mib": peak / 1024, "after_mib": after / 1024, "seconds": seconds,
        "held_mib": shard / 2**20, "how": how}))
    dist.destroy_process_group()


def run_path(model_dir: Path, path: str, world: int, work: Path) -> list[dict]:
    sys.path.insert(0, str(REPO / "tests"))
    from harness.ports import free_port

    port = free_port()
    out = work / f"result-{path}"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "trainer"), str(REPO / "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", str(model_dir), path, str(out), str(port),
                               str(rank), str(world)], env=env) for rank in range(world)]
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise SystemExit(f"{path}: ranks exited with {codes}")
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=14, help="decoder layers (14: ~1.04B parameters)")
    parser.add_argument("--world", type=int, default=2, help="ranks (processes) per load")
    parser.add_argument("--work", help="directory for the model (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tpuft-bench-load-") as tmp:
        work = Path(args.work or tmp)
        model_dir = work / "model"
        start = time.perf_counter()
        params = write_model(model_dir, args.layers)
        size_mib = (model_dir / "model.safetensors").stat().st_size / 2**20
        print(f"wrote a random Gemma 4 of {params / 1e9:.2f}B parameters ({size_mib:.0f} MiB bf16 safetensors) "
              f"in {time.perf_counter() - start:.0f} s", flush=True)
        results = {path: run_path(model_dir, path, args.world, work) for path in PATHS}
    print(f"\nCPU, {args.world} ranks (gloo, one process each), {params / 1e9:.2f}B-parameter Gemma 4, bf16 file, "
          f"fp32 weights; per rank, the larger of the {args.world}")
    rows = [("metric", "full load (before)", "sharded load (after)", "ratio", "target")]

    def worst(path, key):
        return max(r[key] for r in results[path])

    peak = (worst("full", "peak_mib"), worst("sharded", "peak_mib"))
    growth = (worst("full", "peak_mib") - worst("full", "before_mib"),
              worst("sharded", "peak_mib") - worst("sharded", "before_mib"))
    rows += [
        ("RSS before the load MiB", f"{worst('full', 'before_mib'):.0f}", f"{worst('sharded', 'before_mib'):.0f}", "", ""),
        ("peak RSS (VmHWM) during the load MiB", f"{peak[0]:.0f}", f"{peak[1]:.0f}", f"{peak[1] / peak[0]:.2f}x",
         "<= 0.6x"),
        ("peak growth over the load MiB", f"{growth[0]:.0f}", f"{growth[1]:.0f}", f"{growth[1] / growth[0]:.2f}x", ""),
        ("RSS after the load MiB", f"{worst('full', 'after_mib'):.0f}", f"{worst('sharded', 'after_mib'):.0f}", "", ""),
        ("parameters held per rank MiB", f"{worst('full', 'held_mib'):.0f}", f"{worst('sharded', 'held_mib'):.0f}",
         "", ""),
        ("load seconds", f"{worst('full', 'seconds'):.1f}", f"{worst('sharded', 'seconds'):.1f}",
         f"{worst('sharded', 'seconds') / worst('full', 'seconds'):.2f}x", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    print(f"\nsharded path: {results['sharded'][0]['how']}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-of":
        model_dir_, path_, out_, port_, rank_, world_ = sys.argv[2:]
        rank_main(model_dir_, path_, out_, int(port_), int(rank_), int(world_))
    else:
        main()
