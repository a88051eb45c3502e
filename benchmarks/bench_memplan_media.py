"""The memory planner against measured peaks for multimodal runs (--vision-tower): random
Gemma 4 models (a small language model and a vision tower of the row's width and depth,
its image processor's patch size, pooling and soft-token budget) trained a few steps on
CPU, one process (world size 1, gloo), with the trainer's own multimodal path: the whole
model built with both towers' attention as model.tower_attention picks it, media.freeze_towers
(--vision-tower frozen or trained), LoRA's adapters and the vision projector in full as
lora.inject puts them, FSDP2 with the towers in the root unit (parallelize.apply_fsdp,
model.decoder_blocks), examples of --max-images-per-example images packed into blocks
(media.fill_media_blocks, device_blocks.DeviceBlocks), each micro-batch's images decoded and
patched by the image processor from PNG files (media.Pixels) and methods/media_sft.py's loss
over transformers' full logits, AdamW as train.py builds it.

Every block holds as many images as its tokens do (maxSeqLen // the tokens of one image),
which is what the planner assumes of a block; each image is sized so the processor gives
it its whole soft-token budget. Rows with 1 image a block and with several, from examples
of one image each or of several.

The measurement is bench_memplan.py's (a fresh process per row; VmHWM over the steps minus
what was resident before the model existed, after one step of the smallest model of the
same code path), against the planner's per-device bytes for the row: core/memplan.py's
device_bytes for the language model (--loss-head full, as a multimodal step runs) plus
core/memplan_media.py's plan of the row's own vision config (towers_from_config: the path
the table's entries take), as memplan.estimate adds them. Every row is held out: no constant
was fitted to a multimodal row (the text block's constants, which the tower's encoder is
counted with, were fitted to bench_memplan.py's FITTED rows only).

    .venv/bin/python benchmarks/bench_memplan_media.py              # every row
    .venv/bin/python benchmarks/bench_memplan_media.py --only v1    # one
    .venv/bin/python benchmarks/bench_memplan_media.py --recorded   # the planner against MEASURED (docs)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_memplan import MIB, TOLERANCE, WARM_UP, _text, case, in_child, peak_over_steps  # noqa: E402

# The media tokens' ids in the random vocabulary (Gemma 4's are past its text tokens; any
# ids the random text never draws do).
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = 3, 4, 5
FIRST_TEXT_TOKEN = 8
PROMPT_TEXT = 6  # text tokens before each example's images (unlabelled)


def _vision(hidden: int, layers: int, heads: int, head_dim: int, kv_heads: int | None = None,
            intermediate: int | None = None, patch: int = 4, pooling: int = 2, positions: int = 64) -> dict:
    """A Gemma4VisionConfig as a dict (what a model's config.json holds under vision_config)."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, head_dim=head_dim,
                num_key_value_heads=kv_heads or heads, intermediate_size=intermediate or 4 * hidden,
                patch_size=patch, pooling_kernel_size=pooling, position_embedding_size=positions)


def media_case(text: dict, vision: dict, length: int, blocks: int, tower: str, soft_tokens: int = 70,
               images_per_example: int = 1, bidirectional: bool = False, **kw) -> dict:
    """`tower`: frozen or trained (--vision-tower); `soft_tokens` the image processor's
    max_soft_tokens (70 the fewest it takes); `bidirectional`: each image's soft tokens see
    each other (the published Gemma 4's use_bidirectional_attention "vision"; transformers'
    default config leaves it unset)."""
    return dict(case(text, length, blocks, **kw), vision=vision, tower=tower, soft_tokens=soft_tokens,
                images_per_example=images_per_example, bidirectional=bidirectional)


T1 = _text(256, 6, 4, 64, 8192, kv_heads=2)
T2 = _text(192, 4, 3, 64, 6000, kv_heads=1, global_head_dim=128, ple=8)
V1 = _vision(128, 4, 4, 32)  # patch 4, pooling 2: 280 patches an image, 70 soft tokens
V2 = _vision(256, 6, 4, 64, kv_heads=2, pooling=3, positions=96)  # pooling 3: 630 patches an image
V3 = _vision(384, 3, 6, 64, intermediate=1024, patch=8, pooling=2)
# Never fitted to: frozen and trained towers, full and LoRA, fp32 and bf16, sdpa and eager,
# 1 image a block (128 tokens: 72 an image) and several (up to 14), one image an example
# and several.
HELD_OUT = {
    "v1": media_case(T1, V1, 128, 2, "frozen"),
    "v2": media_case(T1, V1, 128, 2, "trained"),
    "v3": media_case(T1, V1, 512, 1, "frozen", attention="eager", images_per_example=7),
    "v4": media_case(T1, V1, 512, 1, "trained", dtype="bf16"),
    "v5": media_case(T1, V1, 512, 1, "frozen", method="lora"),
    "v6": media_case(T2, V2, 256, 2, "trained", attention="eager", images_per_example=3),
    "v7": media_case(T2, V2, 256, 2, "frozen", dtype="bf16", method="lora", dropout=0.05),
    "v8": media_case(T2, V3, 1024, 1, "trained", images_per_example=2),
    "v9": media_case(T2, V3, 1024, 1, "frozen", attention="eager", dtype="bf16", method="lora",
                     images_per_example=14),
    "v10": media_case(T1, V2, 512, 1, "trained", attention="eager", dtype="bf16", images_per_example=7),
    # Bidirectional within each image, as the published models attend (media_sft's masks).
    "v11": media_case(T1, V1, 512, 1, "frozen", images_per_example=2, bidirectional=True),
    "v12": media_case(T2, V3, 1024, 1, "trained", attention="eager", dtype="bf16", method="full",
                      images_per_example=1, bidirectional=True),
    "v13": media_case(T2, V2, 512, 2, "frozen", attention="eager", method="lora", dropout=0.05,
                      images_per_example=7, bidirectional=True),
}
CONFIGS = HELD_OUT
# Measured peaks (MiB), each row once in its own process (one run of every row) on the
# project's shared 2-core machine. `--recorded` prints the current planner against them. A row not here
# has not been run. tests/api/test_memplan_media.py holds the planner to them.
MEASURED: dict[str, float] = {
    "v1": 286.2, "v2": 320.2, "v3": 382.1, "v4": 451.2, "v5": 317.3, "v6": 1439.8, "v7": 203.5, "v8": 1011.4,
    "v9": 417.3, "v10": 1672.0, "v11": 364.1, "v12": 1140.2, "v13": 527.0,
}
# The warm-up's tower (bench_memplan's WARM_UP is the text model): one image of 70 soft tokens.
WARM_VISION = _vision(16, 1, 2, 8, intermediate=32)


def image_processor_settings(config: dict) -> dict:
    vision = config["vision"]
    return dict(patch_size=vision["patch_size"], pooling_kernel_size=vision["pooling_kernel_size"],
                max_soft_tokens=config["soft_tokens"])


def image_side(settings: dict) -> tuple[int, int]:
    """(height, width) in pixels of an image the processor gives its whole soft-token budget
    (its largest: the planner's bound): a rectangle of whole pooled patches whose count is
    the budget, the squarest there is."""
    from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

    budget, pool, patch = settings["max_soft_tokens"], settings["pooling_kernel_size"], settings["patch_size"]
    rows = max(r for r in range(1, int(budget ** 0.5) + 1) if budget % r == 0)
    height, width = rows * pool * patch, budget // rows * pool * patch
    got = get_aspect_ratio_preserving_size(height, width, patch, budget * pool ** 2, pool)
    assert got == (height, width), f"the processor resizes {height}x{width} to {got}"
    return height, width


def images_per_block(config: dict) -> int:
    return max(1, config["length"] // (config["soft_tokens"] + 2))


def _examples(config: dict, directory: str):
    """Examples of `images_per_example` images each (their PNG files written to `directory`),
    packed so that every block holds images_per_block images; the rest of a block a labelled
    response. Returns the packed blocks (media.MediaPacked)."""
    import numpy as np
    from PIL import Image

    from tpufinetune_trainer.data import IGNORE_INDEX
    from tpufinetune_trainer.media import MediaExamples, fill_media_blocks

    height, width = image_side(image_processor_settings(config))
    length, vocab, soft = config["length"], config["text"]["vocab_size"], config["soft_tokens"]
    per_block, per_example = images_per_block(config), config["images_per_example"]
    rng = np.random.default_rng(0)
    ids, labels, media, layout = [], [], [], []
    for block in range(config["blocks"]):
        whole, rest = divmod(per_block, per_example)
        counts = [per_example] * whole + ([rest] if rest else [])
        share = (length - per_block * (soft + 2)) // len(counts)
        members = []
        for images in counts:
            locations = []
            for _ in range(images):
                location = os.path.join(directory, f"{len(os.listdir(directory)):05d}.png")
                Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(location)
                locations.append(location)
            prompt = list(rng.integers(FIRST_TEXT_TOKEN, vocab, min(PROMPT_TEXT, share // 2)))
            media_ids = [BOI_TOKEN, *[IMAGE_TOKEN] * soft, EOI_TOKEN] * images
            response = list(rng.integers(FIRST_TEXT_TOKEN, vocab, share - len(prompt)))
            ids.append(np.array(prompt + media_ids + response))
            labels.append(np.array([IGNORE_INDEX] * (len(prompt) + len(media_ids)) + response))
            media.append(tuple(locations))
            members.append(len(ids) - 1)
        layout.append(members)
    return fill_media_blocks(MediaExamples(ids, labels, media=media), layout, length, 0)


def _build(config: dict):
    """The whole model built and sharded as the trainer has it (towers frozen or trained,
    LoRA's adapters), AdamW, MediaSFT's loss and one micro-batch of image blocks. Returns
    one training step."""
    import tempfile
    from types import SimpleNamespace

    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from tpufinetune_trainer import lora
    from tpufinetune_trainer.device_blocks import DeviceBlocks
    from tpufinetune_trainer.masks import MaskBuilder
    from tpufinetune_trainer.media import Pixels, freeze_towers
    from tpufinetune_trainer.methods.media_sft import MediaSFT
    from tpufinetune_trainer.model import tower_attention
    from tpufinetune_trainer.parallelize import apply_fsdp, build_mesh
    from tpufinetune_trainer.train import param_groups

    if config["text"] is WARM_UP:  # bench_memplan's warm-up: its text model, a tower to match
        config = dict(config, vision=WARM_VISION, length=80, images_per_example=1)
    text, length, blocks = config["text"], config["length"], config["blocks"]
    dtype = torch.bfloat16 if config["dtype"] == "bf16" else torch.float32
    gemma = Gemma4Config(text_config=dict(text, vocab_size_per_layer_input=text["vocab_size"],
                                          max_position_embeddings=16384, sliding_window=256, pad_token_id=0,
                                          eos_token_id=1, bos_token_id=2,
                                          use_bidirectional_attention="vision" if config["bidirectional"] else None),
                         vision_config=config["vision"], audio_config=None, image_token_id=IMAGE_TOKEN,
                         boi_token_id=BOI_TOKEN, eoi_token_id=EOI_TOKEN)
    model = Gemma4ForConditionalGeneration._from_config(
        gemma, attn_implementation=tower_attention(gemma, config["attention"]))
    model.config.get_text_config().use_cache = False
    uses_lora = config["method"] == "lora"
    cfg = SimpleNamespace(lora_rank=16, lora_alpha=32.0, lora_dropout=config["dropout"],
                          lora_target_modules=config["targets"], model_id="random", lora_train_embeddings=False,
                          uses_lora=uses_lora, multimodal=True, vision_tower=config["tower"])
    if uses_lora:
        lora.inject(model, cfg)
    freeze_towers(model, config["tower"])  # the trainer's order: after the load (and LoRA), before the optimizer
    model = apply_fsdp(model, build_mesh("cpu", 1), dtype, device=torch.device("cpu"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(params, 0.01), lr=torch.tensor(1e-4), fused=True)
    method = MediaSFT(cfg)
    method.pixels = Pixels(Gemma4ImageProcessorPil(**image_processor_settings(config)))
    trainer = SimpleNamespace(model=model, masks=MaskBuilder(model.config, length, torch.device("cpu"), dtype,
                                                             config["attention"]))
    directory = tempfile.mkdtemp(prefix="bench_memplan_media_")
    packed = _examples(config, directory)
    batch = DeviceBlocks(packed, torch.device("cpu"), 0).gather(torch.arange(blocks))
    assert len(batch["media"]) == images_per_block(config) * blocks, "the blocks do not hold the planned images"
    labels = int(packed.label_tokens.sum())

    def step() -> None:
        summed = method.loss_sum(trainer, batch, None)
        (summed / max(labels, 1)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(name: str) -> dict:
    """Run in a fresh process: build, shard, train `steps` steps; bytes of peak over baseline."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration  # noqa: F401
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil  # noqa: F401

    import peft  # noqa: F401
    import PIL.Image  # noqa: F401
    import tpufinetune_trainer.lora, tpufinetune_trainer.masks, tpufinetune_trainer.train  # noqa: E401,F401
    import tpufinetune_trainer.methods.media_sft, tpufinetune_trainer.device_blocks  # noqa: E401,F401

    return peak_over_steps(name, CONFIGS[name], _build)


def planned(name: str):
    """The planner's bytes for row `name` on one CPU device: the language model's step
    (device_bytes, the full-logits head) and the towers' share (memplan_media.plan of the
    row's own vision config). Returns (total, the towers' MediaPlan)."""
    from tpufinetune.core import memplan_media
    from tpufinetune.core.memplan import device_bytes, shape_from_config

    config = CONFIGS[name]
    text = dict(config["text"], vocab_size_per_layer_input=config["text"]["vocab_size"])
    shape = shape_from_config({"text_config": text}, name)
    compute, eager = 2 if config["dtype"] == "bf16" else 4, config["attention"] == "eager"
    part = device_bytes(shape, config["method"], 1, config["length"], config["blocks"], compute_bytes=compute,
                        eager_attention=eager, lora_rank=16, lora_targets=tuple(config["targets"].split(",")),
                        lora_dropout=config["dropout"], loss_head="full")
    towers = memplan_media.towers_from_config(config["vision"], {"max_soft_tokens": config["soft_tokens"]})
    media = memplan_media.plan(towers, config["tower"], shape.hidden, config["method"], 1, config["length"],
                               config["blocks"], compute, eager, text_step_bytes=part.activations + part.loss_head)
    return part.total + media.bytes, media


def describe(name: str) -> str:
    config, vision = CONFIGS[name], CONFIGS[name]["vision"]
    method = config["method"] + (f" d{config['dropout']:g}" if config["method"] == "lora" else "")
    tower = (f"{vision['hidden_size']}x{vision['num_hidden_layers']} "
             f"p{vision['patch_size']}k{vision['pooling_kernel_size']}")
    images = f"{images_per_block(config)}/{config['images_per_example']}{'b' if config['bidirectional'] else ''}"
    return (f"{config['text']['hidden_size']:>4}x{config['text']['num_hidden_layers']:<2} {tower:>13} "
            f"{config['length']:>5}x{config['blocks']} {images:>5} {config['tower']:>7} {config['dtype']:>4} "
            f"{config['attention']:>5} {method:>9}")


HEADER = (f"{'name':4} {'text':>7} {'tower':>13} {'L x b':>7} {'img/ex':>6} {'vision':>7} {'dtype':>4} {'attn':>5} "
          f"{'method':>9} {'towers':>7} {'plan MiB':>8} {'measured':>8} {'ratio':>6} {'within':>6}")


def row(name: str, measured_mib: float | None) -> str:
    total, media = planned(name)
    estimate = total / MIB
    ratio = estimate / measured_mib if measured_mib else None
    within = ("yes" if abs(ratio - 1) <= TOLERANCE else "NO") if ratio else ""
    return (f"{name:4} {describe(name)} {media.bytes / MIB:7.1f} {estimate:8.1f} "
            f"{(f'{measured_mib:8.1f}' if measured_mib else 'not run'):>8} "
            f"{(f'{ratio:6.2f}' if ratio else ''):>6} {within:>6}").rstrip()


def recorded() -> str:
    """The current planner against MEASURED: the table the docs show."""
    lines = ["multimodal, held-out (no constant fitted to these):", HEADER]
    within = []
    for name in CONFIGS:
        measured = MEASURED.get(name)
        lines.append(row(name, measured))
        if measured:
            within.append(abs(planned(name)[0] / MIB / measured - 1) <= TOLERANCE)
    lines.append(f"within {TOLERANCE:.0%} of the measured peak: {sum(within)} of {len(within)} measured "
                 f"({len(CONFIGS) - len(within)} not run)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append")
    parser.add_argument("--recorded", action="store_true",
                        help="print the planner against the recorded measurements (MEASURED), and exit")
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.recorded:
        print(recorded())
        return 0
    if args.child:
        print(json.dumps(measure(args.child)))
        return 0
    print("columns: text and tower width x depth (p patch, k pooling), images a block / an example (b: "
          "bidirectional within each image), "
          "towers = the planner's tower share", flush=True)
    print(HEADER + f" {'s':>6}", flush=True)
    within = []
    for name in [n for n in CONFIGS if not args.only or n in args.only]:
        result, failure = in_child(__file__, name)
        if result is None:
            print(f"{name:4} failed: {failure}", flush=True)
            within.append(False)
            continue
        measured = result["measured"] / MIB
        within.append(abs(planned(name)[0] / MIB / measured - 1) <= TOLERANCE)
        print(f"{row(name, measured)} {result['seconds']:6.1f}", flush=True)
    print(f"within {TOLERANCE:.0%} of the measured peak: {sum(within)} of {len(within)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
