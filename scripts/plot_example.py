"""The `tpufinetune plot` picture in docs/trainer.md, made from a real run:

    .venv/bin/python scripts/plot_example.py [-o docs/images/plot-example.png]

`tpufinetune-train finetune` trains the tiny Gemma 4 (tpufinetune_trainer.assets) on CPU
under Ray Train (a private local head, 2 workers, gloo) with a held-out slice; its log's
events are folded into a status by the operator's own fold (core/runevents.py), and the
status is drawn by the function behind `tpufinetune plot`. Nothing is drawn by hand: what
the picture shows is what `tpufinetune plot` shows for the same run. About 2 minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
# The Ray head, and so its workers, run this checkout's code.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer"),
                                            os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

from harness.ray_fixtures import build_assets  # noqa: E402
from harness.rayhead import VENV_BIN, RayHead  # noqa: E402
from tpufinetune.core.runevents import apply_event  # noqa: E402
from tpufinetune.plot import figure, save  # noqa: E402
from tpufinetune_trainer.events import parse_text  # noqa: E402

OUT = REPO / "docs" / "images" / "plot-example.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tpuft-plot-") as work:
        assets = build_assets(Path(work) / "assets")
        head = RayHead.start(num_cpus=4)
        try:
            cmd = [str(VENV_BIN / "tpufinetune-train"), "finetune", "--model-id", str(assets.model),
                   "--dataset", str(assets.data), "--dataset-split", "train[:480]", "--num-workers", "2",
                   "--max-seq-len", "512", "--learning-rate", "3e-3", "--eval-fraction", "0.1",
                   "--device", "cpu", "--storage-path", str(Path(work) / "storage"), "--run-name", "demo",
                   "--progress-interval", "0.2", "--num-epochs", "3"]
            env = dict(head.env(), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=900)
        finally:
            head.stop()
    if proc.returncode != 0:
        raise SystemExit(f"the run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    status: dict = {"phase": "Succeeded"}
    for event in parse_text(proc.stdout):
        apply_event(status, event)
    save(figure(status, title="demo/tiny-gemma"), args.output)
    print(f"{args.output}: {len(status.get('curve') or [])} curve points, "
          f"{sum(1 for e in status.get('history') or [] if 'evalLoss' in e)} eval points")


if __name__ == "__main__":
    main()
