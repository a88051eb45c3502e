"""One rank of a real gloo group that runs the collectives check with its per-link
measurements, as a Ray actor of `tpufinetune-train collectives` would.

Run as a process by tests/trainer/test_trainer_collectives_links.py, once per rank:
`python collectives_links_worker.py OUT_DIR PORT RANK WORLD SLICES SLICE MIB`. SLICE is this
rank's slice, given as the operator gives it to a pod (TPUFT_SLICE_INDEX). Each rank writes
its place (`where`) and its check's result to OUT_DIR/rank<RANK>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.collectives import RankWorker
from tpufinetune_trainer.slices import SLICE_INDEX_ENV

HIDDEN_DIM, BATCH = 32, 8


def main(out: str, port: int, rank: int, world: int, slices: int, slice_: int, mib: float) -> None:
    os.environ[SLICE_INDEX_ENV] = str(slice_)
    # RankWorker.__init__ asks Ray where the actor runs; here this process is the rank.
    worker = RankWorker.__new__(RankWorker)
    worker.backend, worker.node_ip, worker.accelerator_id = BACKENDS["cpu"], "127.0.0.1", 0
    worker.setup(rank, 0, rank, world, 1, "127.0.0.1", port)
    result = worker.check(HIDDEN_DIM, BATCH, corrupt=False, bandwidth_mib=mib, num_slices=slices)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"where": worker.where(), "result": result}))


if __name__ == "__main__":
    out_dir, port_, rank_, world_, slices_, slice_index_, mib_ = sys.argv[1:]
    main(out_dir, int(port_), int(rank_), int(world_), int(slices_), int(slice_index_), float(mib_))
