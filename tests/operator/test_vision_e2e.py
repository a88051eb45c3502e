"""A multimodal run on the test ground (spec.training.towers): the tiny Gemma 4 with its towers
and processor files and the colour task (the trainer's vision asset builder), model and data
in the bucket with every image an object there (each row names its image relative to the data
file, so it resolves beside it in the bucket; the local copy is deleted before the run), the
vision tower frozen, on a cpu pool to Succeeded. The job's argv carries --vision-tower, the
plan is made again from the model's config.json, the export in the bucket holds the processor's
files, and the proof loaded that export whole with its processor and answered a held-out
image prompt naming the image's colour (status.export.sample, which names the image)."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import PurePosixPath

import pytest

from tpufinetune_trainer.vision_assets import COLOURS, QUESTION, write_vision_assets

from harness.ground_fixtures import StoredAssets
from ground_runs import resource, start_run

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

NAME = "vision-frozen"
PROCESSOR_FILES = {"processor_config.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"}


def colour_named(text: str) -> str | None:
    """The one colour of the task a completion names, if exactly one."""
    named = {c for c in COLOURS if re.search(rf"\b{c}\b", text)}
    return named.pop() if len(named) == 1 else None


def test_a_vision_run_from_the_bucket_succeeds_and_its_export_answers_an_image_prompt(
        operator, ground, kube, storage, tmp_path):
    started = time.monotonic()
    local = tmp_path / "vision"
    write_vision_assets(local, rows=240, seed=7)
    rows = [json.loads(line) for line in (local / "data" / "train.jsonl").read_text().splitlines()]
    colour_of = {PurePosixPath(row["messages"][0]["content"][0]["image"]).name: row["colour"] for row in rows}
    root = ground.gcs.upload(local, ground.gcs.unique_uri("assets", "vision"))
    shutil.rmtree(local)  # the pods read the bucket's objects: nothing of this machine's is left to read
    images = [name for name in ground.gcs.list(f"{root}/data") if name.startswith("images/")]
    assert len(images) == len(rows), "every image is an object in the bucket"
    assets = StoredAssets(root=root, model=f"{root}/model", data=f"{root}/data/train.jsonl")
    # About 54 steps of 8 examples (2 workers x 4) at a constant 3e-3: the frozen tower's
    # features are enough for the projector and the language model to name the colour.
    manifest = resource(NAME, assets, storage, epochs=2, training={
        "batchSizePerDevice": 4, "maxSeqLen": 192, "learningRate": 3e-3, "lrSchedule": "constant",
        "warmupRatio": 0.0, "towers": {"vision": "frozen"}})
    uid, cluster = start_run(kube, manifest)

    def entrypoint():  # read while the run lasts: its RayCluster goes when it ends
        try:
            return kube.head_job_client(cluster).get_job_info(f"tft-{uid}-1").entrypoint
        except Exception:  # the head not up yet, or the job not submitted yet
            return None
    argv = kube.wait_for(entrypoint, "the job's entrypoint", timeout=300, interval=2)
    assert "--vision-tower=frozen" in argv and "--max-images-per-example=1" in argv, argv

    final = kube.wait_for(lambda: (s := kube.status(NAME)).get("phase") in ("Succeeded", "Failed") and s,
                          "the run to end", timeout=600, interval=2)
    assert final["phase"] == "Succeeded", (final.get("message"), final.get("trainerFailure"))
    plan = final["plan"]
    # Planned again from the bucket model's own config.json (the trainer's `model` event): the
    # text widths, and the vision tower from its vision_config and the processor's tokens per
    # image (the table does not know this model).
    assert plan["basis"] == "config" and plan["modelConfig"]["modelType"] == "gemma4_text", plan
    towers = plan["towers"]
    assert towers["vision"] == "frozen" and towers["visionParameters"] > 0, towers
    assert "config.json" in towers["widthsFrom"] and towers["tokensPerImage"] < 282, towers
    print(f"status.plan: fits {plan.get('fits')}, host {plan.get('hostBytes')} of {plan.get('hostLimitBytes')}; "
          f"towers {towers}")

    export = final["exportedModelURI"]
    exported = set(ground.gcs.list(export))
    assert PROCESSOR_FILES <= exported, f"the export lacks {PROCESSOR_FILES - exported}: {sorted(exported)}"
    assert "config.json" in exported and any(name.endswith(".safetensors") for name in exported), sorted(exported)

    # The proof loaded that export whole with its own processor and answered each held-out
    # prompt with its image: the sample names the image (an object in the bucket) and the answer.
    sample = final["export"]["sample"]
    assert sample and all(QUESTION in entry["prompt"] and len(entry.get("images", [])) == 1 for entry in sample), sample
    assert all(entry["images"][0].startswith(f"{root}/data/images/") for entry in sample), sample
    answered = [(colour_of[PurePosixPath(entry["images"][0]).name], colour_named(entry["completion"]))
                for entry in sample]
    assert all(named == asked for asked, named in answered), f"(the image's colour, the answer's): {answered}"
    print(f"vision e2e: {time.monotonic() - started:.0f} s; {len(final['history'])} epochs; "
          f"proof {[(e['images'][0].rsplit('/', 1)[-1], e['completion']) for e in sample]}")
