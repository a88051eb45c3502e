"""Multimodal fine-tuning (--vision-tower): a tiny Gemma 4 with its towers and processor files
(vision_assets.py) learns a task whose answer depends only on the image, on one gloo rank
with the trainer's own loop; packed images stay in their example; bad rows are refused
naming the row."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tpufinetune_trainer import media, vision_assets
from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.data import IGNORE_INDEX, load_rows, pad_id_of, prepare, split_eval
from tpufinetune_trainer.errors import ConfigError, DataError

BLOCK = 192  # an example is 89 tokens (64 of them its image's): two fit a block


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision")
    info = vision_assets.write_vision_assets(out, rows=240, seed=5)
    return out, Path(info["model"]), Path(info["data"])


@pytest.fixture(scope="module")
def processor(vision):
    return media.load_media_processor(str(vision[1]))


def trainer_of(model: Path, data, storage: Path, processor, **overrides):
    from tpufinetune_trainer.train import Trainer

    settings = dict(model_id=str(model), storage_path=str(storage), num_workers=1, device="cpu", max_seq_len=BLOCK,
                    learning_rate=3e-3, batch_size_per_device=8, num_epochs=3, lr_schedule="constant",
                    warmup_ratio=0.0, vision_tower="frozen", run_name="vision", eval_fraction=0.2, seed=42)
    cfg = FinetuneConfig(**{**settings, **overrides}).validate()
    return Trainer(cfg, BACKENDS["cpu"], {"train": data.train, "eval": data.eval,
                                          "pad_id": pad_id_of(processor.tokenizer)}, rank=0, world=1, local_rank=0)


def without_images(data_file: Path, out: Path) -> Path:
    """The same rows with their image parts removed (the question alone)."""
    rows = [json.loads(line) for line in data_file.read_text().splitlines()]
    for row in rows:
        for turn in row["messages"]:
            if isinstance(turn["content"], list):
                turn["content"] = [p for p in turn["content"] if p["type"] != "image"]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@torch.no_grad()
def greedy(model, processor, row: dict, data_file: Path, max_new: int = 8) -> str:
    """`model`'s greedy answer to a row's question and image, its pixels by `processor`."""
    turns, images = media.parse_turns(row["messages"][:1], 0, 1, str(data_file))
    ids = media.prompt_ids(processor, turns, [media.image_size(loc, 0) for loc in images])
    pixels = media.Pixels(processor.image_processor)(images, "cpu")
    end = processor.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    out = []
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ids + out]), use_cache=False, **pixels).logits
        token = int(logits[0, -1].argmax())
        if token == end:
            break
        out.append(token)
    return processor.tokenizer.decode(out)


@pytest.mark.timeout(240)
def test_a_frozen_vision_tower_run_learns_what_only_the_image_tells(vision, processor, process_group,
                                                                   no_ray_report, tmp_path, capsys):
    """3 CPU epochs with the vision tower frozen (the trainer's run: epochs, checkpoints, the
    export and its proof): the held-out response NLL at least 30% below the same run's with
    the images removed, and the export, loaded whole with its own processor files as a user
    loads it, answers at least 80% of the held-out images right, greedily."""
    out, model, data_file = vision
    with_images = media.prepare_media(str(data_file), "train", processor, BLOCK, 0.2, 42)
    seen = trainer_of(model, with_images, tmp_path / "a", processor)
    assert not any(p.requires_grad for p in media.towers(seen.model)["vision_tower"].parameters())
    assert all(p.requires_grad for p in media.towers(seen.model)["embed_vision"].parameters())
    seen.run()
    nll_seen = seen.evaluate()
    # The run's own export proof loaded the export whole and answered each prompt with its image.
    assert len(check_export_proof(capsys.readouterr().out, data_file)) == 3

    blind_data = media.prepare_media(str(without_images(data_file, out / "blind.jsonl")), "train", processor,
                                     BLOCK, 0.2, 42)
    assert blind_data.eval_examples == with_images.eval_examples
    blind = trainer_of(model, blind_data, tmp_path / "b", processor)
    for _ in range(3):
        blind.train_epoch()
        blind.epoch, blind.epoch_step = blind.epoch + 1, 0
    nll_blind = blind.evaluate()
    print(f"held-out response NLL: {nll_seen:.4f} with the images, {nll_blind:.4f} without "
          f"({nll_seen / nll_blind:.2%})")
    assert nll_seen <= 0.7 * nll_blind

    export = tmp_path / "a" / "vision" / "export"
    assert {"processor_config.json", "chat_template.jinja", "tokenizer.json"} <= {p.name for p in export.iterdir()}
    right, held = export_answers(export, data_file)
    print(f"the export answers {right} of {held} held-out images right")
    assert right >= 0.8 * held


def check_export_proof(output: str, data_file: Path) -> list[dict]:
    """The run's export_proof event (from its output): generated, each sample's answer naming
    its image's colour. Its samples."""
    from tpufinetune_trainer.events import parse_text

    rows = [json.loads(line) for line in data_file.read_text().splitlines()]
    colour_of = {str(data_file.parent / row["messages"][0]["content"][0]["image"]): row["colour"] for row in rows}
    proof = next(e for e in parse_text(output) if e.kind == "export_proof")
    assert proof["mode"] == "generated"
    for sample in proof["sample"]:
        assert sample["completion"].startswith(vision_assets.answer(colour_of[sample["images"][0]])), sample
    return proof["sample"]


def export_answers(export: Path, data_file: Path) -> tuple[int, int]:
    """The export, loaded whole with its own processor files as a user loads it: how many of
    the held-out images it answers right, greedily, of how many."""
    from transformers import AutoModelForImageTextToText

    rows = [json.loads(line) for line in data_file.read_text().splitlines()]
    exported = AutoModelForImageTextToText.from_pretrained(export, attn_implementation=model_attention()).eval()
    assert exported.model.vision_tower is not None and exported.model.audio_tower is not None
    export_processor = media.load_media_processor(str(export))
    _, held = split_eval(len(rows), 0.2, 42)
    right = sum(greedy(exported, export_processor, rows[i], data_file).strip() == vision_assets.answer(rows[i]["colour"])
                for i in held)
    return right, len(held)


def model_attention() -> dict:
    return {"": "sdpa", "text_config": "sdpa", "vision_config": "sdpa", "audio_config": "eager"}


def segment_losses(trainer, packed) -> list[float]:
    """Each example's summed response loss, block by block, segment by segment."""
    from tpufinetune_trainer.device_blocks import DeviceBlocks

    blocks = DeviceBlocks(packed, trainer.device, trainer.pad_id)
    batch = blocks.gather(torch.arange(len(packed)))
    pixels = trainer.method.pixels(batch["media"], trainer.device)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                               attention_mask=trainer.method.masks(trainer, batch), use_cache=False, **pixels).logits
    token = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten().long(),
                            ignore_index=IGNORE_INDEX, reduction="none").view(logits.shape[:2])
    found = []
    for b in range(len(packed)):
        for segment in range(1, int(packed.segment_ids[b].max()) + 1):
            if (packed.segment_ids[b] == segment).any() and (packed.labels[b][packed.segment_ids[b] == segment]
                                                             != IGNORE_INDEX).any():
                found.append(float(token[b][torch.from_numpy(packed.segment_ids[b] == segment)].sum()))
    return found


@pytest.mark.timeout(120)
def test_two_examples_with_images_packed_in_one_block_lose_what_each_loses_alone(vision, processor,
                                                                                 process_group, tmp_path):
    _, model, data_file = vision
    data = media.prepare_media(str(data_file), "train[:12]", processor, BLOCK, 0.0, 42)
    trainer = trainer_of(model, data, tmp_path, processor, eval_fraction=0.0, num_epochs=1,
                         checkpoint_score_attribute="loss")
    first, second = 0, next(i for i in range(1, 12) if data.train.media[i] != data.train.media[0])
    alone = segment_losses(trainer, trainer.method.fill(data.train, [[first], [second]], BLOCK, trainer.pad_id))
    packed = trainer.method.fill(data.train, [[first, second]], BLOCK, trainer.pad_id)
    assert len(packed.media[0]) == 2
    together = segment_losses(trainer, packed)
    assert len(alone) == len(together) == 2
    np.testing.assert_allclose(together, alone, rtol=0, atol=1e-5)


def test_a_model_that_sees_each_image_whole_is_trained_with_the_masks_it_infers_with(vision, processor, tmp_path):
    """Gemma 4 with use_bidirectional_attention "vision" (each image's soft tokens attend to
    each other): an example alone in a block, with the trainer's masks, gets the logits the
    model's own forward gives it with the processor's token types."""
    from transformers import AutoModelForImageTextToText

    from tpufinetune_trainer.masks import MaskBuilder
    from tpufinetune_trainer.methods.media_sft import MediaSFT

    _, model_dir, data_file = vision
    model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation=model_attention()).eval()
    model.config.text_config.use_bidirectional_attention = "vision"
    examples = media.encode_media_rows(load_rows(str(data_file), "train[:1]"), processor, BLOCK,
                                       str(data_file)).examples
    packed = media.fill_media_blocks(examples, [[0]], BLOCK, pad_id_of(processor.tokenizer))
    pixels = media.Pixels(processor.image_processor)(list(packed.media[0]), "cpu")
    n = int(packed.real_tokens[0])
    ids = torch.from_numpy(packed.input_ids)
    batch = {"input_ids": ids, "segment_ids": torch.from_numpy(packed.segment_ids)}
    trainer = type("T", (), {"model": model, "masks": MaskBuilder(model.config, BLOCK, "cpu", torch.float32, "sdpa")})
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=torch.from_numpy(packed.position_ids), use_cache=False,
                     attention_mask=MediaSFT.masks(trainer, batch), **pixels).logits[0, :n]
        theirs = model(input_ids=ids[:, :n], mm_token_type_ids=(ids[:, :n] == model.config.image_token_id).long(),
                       use_cache=False, **pixels).logits[0]
        causal = model(input_ids=ids[:, :n], use_cache=False, **pixels).logits[0]
    assert not torch.allclose(causal, theirs, atol=1e-4)  # the image's tokens do see each other whole
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_image_tokens_are_placed_as_the_processor_places_them(vision, processor):
    """An image's soft tokens as Gemma4's image processor counts them for that image, between
    its begin and end tokens, where the chat template put the image part; none labelled."""
    _, _, data_file = vision
    encoded = media.encode_media_rows(load_rows(str(data_file), "train[:2]"), processor, BLOCK, str(data_file))
    ids, labels = np.asarray(encoded.examples.input_ids[0]), np.asarray(encoded.examples.labels[0])
    counted = processor.image_processor([media.decode_image(encoded.examples.media[0][0])],
                                        return_tensors="pt")["num_soft_tokens_per_image"]
    image = processor.ids(processor.image_token)
    assert int((ids == image).sum()) == int(counted[0]) == 64
    start = int(np.flatnonzero(ids == processor.ids(processor.boi_token))[0])
    assert ids[start + 65] == processor.ids(processor.eoi_token)
    assert (labels[start:start + 66] == IGNORE_INDEX).all()
    assert processor.tokenizer.decode(labels[labels != IGNORE_INDEX]).startswith("The picture is ")


# --------------------------------------------------------------------------- bad input


def bad_rows(tmp_path: Path, parts: list) -> str:
    """A data file whose row 1 has `parts` as its user content (row 0 is good)."""
    good = tmp_path / "good.png"
    vision_assets.colour_image(random.Random(0), "red").save(good)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "good.png"},
                                                       {"type": "text", "text": "What colour?"}]},
                          {"role": "assistant", "content": "red"}]},
            {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "red"}]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("case, parts, words", [
    ("missing", [{"type": "image", "image": "nowhere.png"}], "cannot be read"),
    ("corrupt", [{"type": "image", "image": "corrupt.png"}], "not a readable image"),
    ("unknown", [{"type": "video", "video": "clip.mp4"}], "unknown part type 'video'"),
    ("audio", [{"type": "audio", "audio": "a.wav"}], "audio fine-tuning is not built yet"),
    ("too many", [{"type": "image", "image": "good.png"}] * 2, "more than --max-images-per-example 1"),
])
def test_bad_rows_are_refused_naming_the_row(vision, processor, tmp_path, case, parts, words):
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image at all")
    dataset = bad_rows(tmp_path, parts)
    with pytest.raises(DataError) as refused:
        media.prepare_media(dataset, "train", processor, BLOCK, 0.0, 42)
    assert str(refused.value).startswith("row 1:") and words in str(refused.value), str(refused.value)


def test_a_truncated_image_is_refused_naming_the_row(vision, processor, tmp_path):
    whole = tmp_path / "whole.png"
    vision_assets.colour_image(random.Random(1), "blue").save(whole)
    (tmp_path / "corrupt.png").write_bytes(whole.read_bytes()[:-40])
    with pytest.raises(DataError, match=r"^row 1: image .*corrupt.png is not a readable image"):
        media.prepare_media(bad_rows(tmp_path, [{"type": "image", "image": "corrupt.png"}]), "train", processor,
                            BLOCK, 0.0, 42)


def test_images_longer_than_the_block_are_refused_naming_the_row(vision, processor, tmp_path):
    dataset = bad_rows(tmp_path, [{"type": "image", "image": "good.png"}])
    with pytest.raises(DataError, match=r"^row 0: its images take 66 tokens, more than --max-seq-len 60"):
        media.prepare_media(dataset, "train", processor, 60, 0.0, 42)


def test_a_text_run_refuses_image_parts_naming_the_row(vision, tmp_path):
    from tpufinetune_trainer.model import load_tokenizer

    dataset = bad_rows(tmp_path, [{"type": "text", "text": "hello"}])
    tokenizer = load_tokenizer(str(vision[1]))
    with pytest.raises(DataError, match=r"row 0: an image part, but the run has no vision tower: pass --vision-tower"):
        prepare(dataset, "train", tokenizer, BLOCK, 0.0, 42, stream=False)


def test_audio_towers_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError, match="audio fine-tuning is not built yet"):
        FinetuneConfig(model_id="m", storage_path=str(tmp_path), audio_tower="frozen").validate()
    for flags, words in ((dict(prompt_format="tutorial"), "--prompt-format tutorial"),
                         (dict(dataset_format="dolly"), "--dataset-format dolly"),
                         (dict(method="dpo"), "--method dpo")):
        with pytest.raises(ConfigError, match=words):
            FinetuneConfig(model_id="m", storage_path=str(tmp_path), vision_tower="frozen", **flags).validate()
    with pytest.raises(ConfigError, match="--max-images-per-example 0"):
        FinetuneConfig(model_id="m", storage_path=str(tmp_path), vision_tower="frozen",
                       max_images_per_example=0).validate()


@pytest.mark.timeout(120)
def test_a_lora_run_trains_adapters_and_the_projector_and_leaves_the_towers(vision, processor, process_group,
                                                                            tmp_path):
    """--method lora with --vision-tower frozen: the language model's adapters and the vision
    projector (in full, fp32) train; the vision and audio towers and the base do not."""
    from torch.distributed.tensor import DTensor

    from tpufinetune_trainer import lora

    _, model, data_file = vision
    data = media.prepare_media(str(data_file), "train[:32]", processor, BLOCK, 0.0, 42)
    trainer = trainer_of(model, data, tmp_path, processor, method="lora", eval_fraction=0.0, num_epochs=1,
                         checkpoint_score_attribute="loss", learning_rate=1e-2)

    def full(param):
        return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()

    parts = media.towers(trainer.model)
    before = {name: full(p) for name, p in trainer.model.named_parameters()}
    trained = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(lora.is_adapter(n) or ".embed_vision." in n for n in trained), sorted(trained)
    assert any(".embed_vision." in n for n in trained) and any(lora.is_adapter(n) for n in trained)
    assert all(p.dtype == torch.bfloat16 for p in parts["vision_tower"].parameters())
    trainer.train_epoch()
    after = {name: full(p) for name, p in trainer.model.named_parameters()}
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert any(".embed_vision." in n for n in changed) and any(lora.is_adapter(n) and "lora_B" in n for n in changed)
    assert changed <= trained, sorted(changed - trained)


@pytest.mark.parametrize("flags, parts, kind, text", [
    (["--vision-tower", "frozen"], [{"type": "image", "image": "nowhere.png"}], "DataError",
     "row 1: image "),
    (["--vision-tower", "frozen", "--audio-tower", "frozen"], [{"type": "text", "text": "hi"}], "ConfigError",
     "--audio-tower frozen (spec.training.towers.audio): audio fine-tuning is not built yet"),
    ([], [{"type": "image", "image": "good.png"}], "DataError",
     "row 0: an image part, but the run has no vision tower: pass --vision-tower frozen"),
])
def test_the_command_refuses_bad_multimodal_input_before_any_worker(vision, tmp_path, capsys, monkeypatch, flags,
                                                                    parts, kind, text):
    """`tpufinetune-train finetune` with the flags the operator passes: one failure event
    naming the problem, in the driver, before Ray."""
    from tpufinetune_trainer import cli
    from trainer_helpers import events_of

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    dataset = bad_rows(tmp_path, parts)
    rc = cli.main(["finetune", "--model-id", str(vision[1]), "--dataset", dataset, "--num-workers", "1",
                   "--device", "cpu", "--storage-path", str(tmp_path / "storage"), "--max-seq-len", str(BLOCK), *flags])
    events = events_of(capsys.readouterr().out)
    failure = events[-1]
    assert rc != 0 and failure.kind == "failure" and failure["type"] == kind and text in failure["message"], failure
    assert not [e for e in events if e.kind == "start"]


def test_an_image_path_is_read_beside_the_data_file_in_a_bucket_or_on_disk():
    assert media.image_location("images/1.png", "gs://b/data/train.jsonl") == "gs://b/data/images/1.png"
    assert media.image_location("images/1.png", "/d/train.jsonl") == "/d/images/1.png"
    assert media.image_location("1.png", "train.jsonl") == "./1.png"
    assert media.image_location("gs://o/x.png", "gs://b/train.jsonl") == "gs://o/x.png"
    assert media.image_location("/abs/x.png", "gs://b/train.jsonl") == "/abs/x.png"


@pytest.mark.timeout(120)
def test_a_trained_vision_tower_trains_and_the_audio_tower_never_does(vision, processor, process_group, tmp_path):
    from torch.distributed.tensor import DTensor

    _, model, data_file = vision
    data = media.prepare_media(str(data_file), "train[:16]", processor, BLOCK, 0.0, 42)
    trainer = trainer_of(model, data, tmp_path, processor, vision_tower="trained", eval_fraction=0.0, num_epochs=1,
                         checkpoint_score_attribute="loss")

    def snapshot(module):
        return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in module.parameters()]

    parts = media.towers(trainer.model)
    assert all(p.requires_grad for p in parts["vision_tower"].parameters())
    assert not any(p.requires_grad for p in parts["audio_tower"].parameters())
    before = {name: snapshot(module) for name, module in parts.items()}
    trainer.train_epoch()
    after = {name: snapshot(module) for name, module in parts.items()}
    moved = {name for name in parts if any(not torch.equal(a, b) for a, b in zip(before[name], after[name]))}
    assert moved == {"vision_tower", "embed_vision"}, moved


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_the_command_runs_a_vision_fine_tune_through_ray_train_to_its_proven_export(vision, ray_head, tmp_path):
    """`tpufinetune-train finetune --vision-tower frozen` as the job entrypoint runs it: the
    driver renders the rows, two Ray Train workers train (each its share of the blocks, its
    images made where its micro-batches are), and the export's proof answers with images.
    These 64 rows give a rank a micro-batch without images (an all-padding slot), which
    must still run the towers (media_sft.towers_run_idle; the run failed without it)."""
    from trainer_helpers import offline_env, run_trainer

    _, model, data_file = vision
    run = run_trainer(["finetune", "--model-id", str(model), "--dataset", str(data_file), "--dataset-split",
                       "train[:64]", "--num-workers", "2", "--device", "cpu", "--max-seq-len", str(BLOCK),
                       "--num-epochs", "1", "--batch-size-per-device", "4", "--learning-rate", "3e-3",
                       "--eval-fraction", "0.1", "--storage-path", str(tmp_path / "storage"), "--run-name", "vision",
                       "--vision-tower", "frozen"], offline_env(ray_head.env()), timeout=400)
    assert run.rc == 0, run.tail()
    proof = run.one("export_proof")
    assert proof["mode"] == "generated" and all(len(sample["images"]) == 1 for sample in proof["sample"]), proof
    assert run.one("result")["exported_model_uri"].endswith("/vision/export")


def test_a_resume_must_keep_what_of_the_model_trains(vision, processor, tmp_path):
    """The resume fingerprint names --vision-tower (frozen and trained keep other optimizer
    state); a text run's has no such field, so its older checkpoints still match."""
    from tpufinetune_trainer import resume

    data = media.prepare_media(str(vision[2]), "train[:16]", processor, BLOCK, 0.0, 42)

    def fingerprint(**flags):
        cfg = FinetuneConfig(model_id="m", storage_path=str(tmp_path), num_workers=1, device="cpu",
                             eval_fraction=0.0, checkpoint_score_attribute="loss", **flags).validate()
        return resume.fingerprint(cfg, 1, data.train)

    frozen, trained = fingerprint(vision_tower="frozen"), fingerprint(vision_tower="trained")
    assert resume.differences(frozen, trained) == ['--vision-tower "frozen" -> "trained"']
    assert "vision_tower" not in fingerprint()
