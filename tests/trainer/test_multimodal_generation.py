"""Each epoch's generation metrics of a multimodal run (--vision-tower with --generate-examples):
the held-out prompts are answered with their images, made on the worker by the run's image
processor, and each answer names the images it was asked with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpufinetune_trainer import media, vision_assets
from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.data import pad_id_of
from tpufinetune_trainer.events import parse_text

BLOCK = 192  # an example is 89 tokens (64 of them its image's)
HELD_OUT = 8  # answers each epoch


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    info = vision_assets.write_vision_assets(tmp_path_factory.mktemp("vision"), rows=160, seed=5)
    return Path(info["model"]), Path(info["data"])


@pytest.mark.timeout(120)
def test_each_epoch_answers_held_out_images_with_their_images_and_names_them(vision, process_group, no_ray_report,
                                                                            tmp_path, capsys):
    from tpufinetune_trainer.train import Trainer

    model, data_file = vision
    processor = media.load_media_processor(str(model))
    data = media.prepare_media(str(data_file), "train", processor, BLOCK, 0.2, 42)
    cfg = FinetuneConfig(model_id=str(model), storage_path=str(tmp_path), num_workers=1, device="cpu",
                         max_seq_len=BLOCK, learning_rate=3e-3, batch_size_per_device=8, num_epochs=3,
                         lr_schedule="constant", warmup_ratio=0.0, vision_tower="frozen", run_name="vision",
                         eval_fraction=0.2, seed=42, generate_examples=HELD_OUT, generate_max_new_tokens=8,
                         generate_metrics="exactMatch,rougeL").validate()
    trainer = Trainer(cfg, BACKENDS["cpu"], {"train": data.train, "eval": data.eval,
                                             "pad_id": pad_id_of(processor.tokenizer)}, rank=0, world=1, local_rank=0)
    trainer.run()

    rows = [json.loads(line) for line in data_file.read_text().splitlines()]
    colour_of = {str(data_file.parent / row["messages"][0]["content"][0]["image"]): row["colour"] for row in rows}
    epochs = [e for e in parse_text(capsys.readouterr().out) if e.kind == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    for event in epochs:
        samples = event["eval_samples"]
        assert event["eval_generated"] == HELD_OUT and len(samples) == HELD_OUT
        assert {"eval_exact_match", "eval_rouge_l"} <= set(event)
        # Each answer names the one held-out image it was asked with.
        assert all(len(s["images"]) == 1 and s["images"][0] in colour_of for s in samples), samples
        assert all(s["reference"] == vision_assets.answer(colour_of[s["images"][0]]) for s in samples), samples
        stored = [json.loads(line) for line in Path(event["eval_samples_uri"]).read_text().splitlines()]
        assert [s["images"] for s in stored] == [s["images"] for s in samples]
    last = epochs[-1]["eval_samples"]
    right = sum(s["output"] == vision_assets.answer(colour_of[s["images"][0]]) for s in last)
    print(f"the last epoch answers {right} of {len(last)} held-out images right: "
          f"{[(colour_of[s['images'][0]], s['output']) for s in last]}")
    assert right >= 0.75 * len(last)
    assert epochs[-1]["eval_exact_match"] == right / len(last)
