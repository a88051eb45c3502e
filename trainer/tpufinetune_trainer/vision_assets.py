"""Offline multimodal assets: a tiny random Gemma 4 with its towers and processor files, and
an image task whose answer depends only on the image.

    python -m tpufinetune_trainer.assets --out DIR --kind vision

writes ``DIR/model`` (the whole model, its tokenizer with Gemma 4's media tokens, a chat
template that places an image part's token where the processor expands it, and the
processor's configuration) and ``DIR/data/train.jsonl`` with its images as PNG files in
``DIR/data/images`` (the rows name them relative to the data file). The task: a square of
one colour (each image a new shade, with noise), the question always the same, the answer
naming the colour; without the image the best a model can do is guess.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .assets import SIZES, SPECIAL_TOKENS, TINY_AUDIO, TINY_VISION, build_tokenizer

# Gemma 4's media tokens, as the tokenizer names them (Gemma4Processor reads these names).
MEDIA_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
VIDEO_TOKEN = "<|video|>"  # Gemma4Processor adds it to the tokenizer; here it is in the vocabulary already
# A Gemma-style template whose message content is a string or a list of parts: an image part
# becomes the image token, which the processor expands to <|image> + soft tokens + <image|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'audio' %}<|audio|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# A small image processor: 48x48 images, 2-pixel patches pooled 3x3, so an image is 64 soft
# tokens (70 is the fewest Gemma4ImageProcessor takes as its budget).
IMAGE_PROCESSOR = dict(patch_size=2, max_soft_tokens=70, pooling_kernel_size=3)
VISION = dict(TINY_VISION, patch_size=IMAGE_PROCESSOR["patch_size"],
              pooling_kernel_size=IMAGE_PROCESSOR["pooling_kernel_size"])
IMAGE_SIDE = 48
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 220, 40),
           "purple": (140, 40, 170), "white": (240, 240, 240)}
QUESTION = "What colour is this picture?"


def answer(colour: str) -> str:
    return f"The picture is {colour}."


def colour_image(rng: random.Random, colour: str):
    """A 48x48 PNG-ready image of `colour`: the shade moved a little, and per-pixel noise."""
    import numpy as np
    from PIL import Image

    base = np.array(COLOURS[colour], dtype=np.int64) + np.array([rng.randint(-25, 25) for _ in range(3)])
    noise = np.random.default_rng(rng.randrange(1 << 30)).integers(-12, 13, size=(IMAGE_SIDE, IMAGE_SIDE, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def colour_rows(directory: Path, n: int, seed: int) -> list[dict]:
    """`n` rows of the colour task, their images written to `directory / images`."""
    rng = random.Random(seed)
    images = directory / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(n):
        colour = rng.choice(sorted(COLOURS))
        name = f"images/{index:05d}.png"
        colour_image(rng, colour).save(directory / name)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": answer(colour)}], "colour": colour})
    return rows


def build_media_tokenizer():
    """The BPE of assets.build_tokenizer over this task's words, with Gemma 4's media tokens."""
    texts = [QUESTION, *(answer(c) for c in COLOURS), "user model"] * 50
    tokenizer = build_tokenizer(texts, 512, extra_special=[*MEDIA_TOKENS.values(), VIDEO_TOKEN])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_vision_model(tokenizer, seed: int = 0):
    """A randomly initialised Gemma 4 (assets' tiny text model, a tiny vision tower matching
    IMAGE_PROCESSOR, the tiny audio tower) whose media token ids are the tokenizer's."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vocab = len(tokenizer)
    text = dict(SIZES["tiny"]["text"], vocab_size=vocab, vocab_size_per_layer_input=vocab,
                max_position_embeddings=4096, sliding_window=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in MEDIA_TOKENS.items()}
    config = Gemma4Config(text_config=text, vision_config=VISION, audio_config=TINY_AUDIO,
                          image_token_id=ids["image_token"], boi_token_id=ids["boi_token"],
                          eoi_token_id=ids["eoi_token"], audio_token_id=ids["audio_token"],
                          boa_token_id=ids["boa_token"], eoa_token_index=ids["eoa_token"],
                          video_token_id=tokenizer.convert_tokens_to_ids(VIDEO_TOKEN))
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config)
    # A pretrained tower's patch embedding carries an image's colours through its layers; a
    # random one at the usual 0.02 scale is swamped by its own layers' normalised outputs
    # (every colour a few percent apart). At unit scale the frozen tower tells colours apart.
    with torch.no_grad():
        model.model.vision_tower.patch_embedder.input_proj.weight.normal_(0.0, 1.0)
    return model


def processor_config() -> dict:
    """What Gemma4Processor.save_pretrained writes as processor_config.json: the processor's
    own settings and each sub-processor's (AutoProcessor, AutoImageProcessor read it)."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    image = Gemma4ImageProcessorPil(**IMAGE_PROCESSOR).to_dict()
    image["resample"] = int(image["resample"])
    audio = Gemma4AudioFeatureExtractor().to_dict()
    video = dict(IMAGE_PROCESSOR, video_processor_type="Gemma4VideoProcessor", do_rescale=True,
                 rescale_factor=1 / 255, do_normalize=False, do_convert_rgb=True, do_resize=True)
    return {"processor_class": "Gemma4Processor", "image_seq_length": IMAGE_PROCESSOR["max_soft_tokens"],
            "audio_seq_length": 750, "audio_ms_per_token": 40, "image_processor": image,
            "feature_extractor": json.loads(json.dumps(audio, default=float)), "video_processor": video}


def write_vision_assets(out: Path, rows: int = 240, seed: int = 1234) -> dict:
    out = Path(out)
    data_dir, model_dir = out / "data", out / "model"
    data_dir.mkdir(parents=True, exist_ok=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    dataset = colour_rows(data_dir, rows, seed)
    with open(data_dir / "train.jsonl", "w", encoding="utf-8") as f:
        for row in dataset:
            f.write(json.dumps(row) + "\n")
    tokenizer = build_media_tokenizer()
    model = build_vision_model(tokenizer, seed)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (model_dir / "processor_config.json").write_text(json.dumps(processor_config(), indent=2))
    return {"model": str(model_dir), "data": str(data_dir / "train.jsonl"), "rows": len(dataset),
            "vocab": len(tokenizer), "parameters": sum(p.numel() for p in model.parameters())}
