"""Multimodal data (--vision-tower): conversations whose content is a list of parts, rendered
with the model's own processor, and the images' pixels computed per micro-batch.

A row's `messages` content is a string or a list of parts: `{"type": "text", "text": …}`,
`{"type": "image", "image": "<path relative to the data file, absolute path, or gs:// URI>"}`.
The model's chat template renders a conversation (an image part becomes the image token)
and each image token is expanded as Gemma4Processor expands it: <|image> + one soft token
per pooled patch of the image as the image processor resizes it + <image|>. The number of
soft tokens depends only on the image's size, read here from its header (the image is
checked to be whole); pixels are decoded and resized only where a micro-batch is built, on
the workers (`Pixels`). The examples hold token ids, labels (responses only: an image's
tokens are never labelled) and each example's image references, never pixels.

Audio parts are part of the format but not trained yet: a row with one is refused."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import storage
from .data import IGNORE_INDEX, Examples, Packed, bin_pack, fill_blocks
from .errors import DataError

PART_TYPES = ("text", "image", "audio")
AUDIO_NOT_BUILT = "audio fine-tuning is not built yet"
TOWER_SETTINGS = ("frozen", "trained")


# --------------------------------------------------------------------------- processor


@dataclass
class MediaProcessor:
    """What rendering needs of the model's processor: its tokenizer (with the chat
    template), its image processor and the image tokens' names."""

    tokenizer: object
    image_processor: object
    image_token: str
    boi_token: str
    eoi_token: str

    @property
    def chat_template(self):
        return self.tokenizer.chat_template

    def ids(self, token: str) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(token))

    def soft_tokens(self, height: int, width: int) -> int:
        """An image's soft tokens, as Gemma4Processor counts them for its size."""
        from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

        ip = self.image_processor
        target_h, target_w = get_aspect_ratio_preserving_size(
            height=height, width=width, patch_size=ip.patch_size,
            max_patches=ip.max_soft_tokens * ip.pooling_kernel_size ** 2, pooling_kernel_size=ip.pooling_kernel_size)
        return (target_h // ip.patch_size) * (target_w // ip.patch_size) // ip.pooling_kernel_size ** 2


def load_media_processor(source: str) -> MediaProcessor:
    """The model directory's processor (AutoProcessor); where it cannot be built whole (its
    video processor needs torchvision), its tokenizer and image processor, read from the
    same files."""
    from transformers import AutoImageProcessor, AutoTokenizer

    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(source)
        tokenizer, image_processor = processor.tokenizer, processor.image_processor
        if getattr(processor, "chat_template", None) and not tokenizer.chat_template:
            tokenizer.chat_template = processor.chat_template
    except Exception:
        tokenizer = AutoTokenizer.from_pretrained(source)
        image_processor = AutoImageProcessor.from_pretrained(source)
    template = Path(source) / "chat_template.jinja"
    if not getattr(tokenizer, "chat_template", None) and template.is_file():
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    names = {name: getattr(tokenizer, name, None) for name in ("image_token", "boi_token", "eoi_token")}
    if not all(names.values()) or not getattr(tokenizer, "chat_template", None):
        raise DataError(f"--model-id {source}: its processor has no image tokens or chat template, so it cannot "
                        "render image parts; --vision-tower needs a multimodal model such as google/gemma-4-E2B-it")
    return MediaProcessor(tokenizer, image_processor, **names)


# --------------------------------------------------------------------------- images


def image_location(ref: str, dataset: str) -> str:
    """Where an image part's path points: a URI or absolute path as it is, a relative path
    beside the data file (in storage when the data file is)."""
    if storage.is_uri(ref) or ref.startswith("/"):
        return ref
    base = dataset.rstrip("/")
    parent = base.rsplit("/", 1)[0] if "/" in base else "."
    return f"{parent}/{ref}"


def read_image_bytes(location: str) -> bytes:
    fs, path = storage.filesystem(location)
    with fs.open_input_file(path) as f:
        return f.read()


def image_size(location: str, row: int) -> tuple[int, int]:
    """(height, width) of the image at `location`, checked whole (its header and checksums,
    not its pixels); a missing or undecodable image is refused naming the row."""
    from PIL import Image, UnidentifiedImageError

    try:
        data = read_image_bytes(location)
    except (FileNotFoundError, OSError) as exc:
        raise DataError(f"row {row}: image {location} cannot be read ({type(exc).__name__}: {exc}); "
                        "fix the path (relative to the data file, absolute, or a gs:// URI) or remove the part") from exc
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"row {row}: image {location} is not a readable image ({type(exc).__name__}: {exc}); "
                        "replace it with a PNG/JPEG file or remove the part") from exc
    return height, width


def decode_image(location: str):
    from PIL import Image

    return Image.open(io.BytesIO(read_image_bytes(location))).convert("RGB")


# Images read at once (reads from a bucket wait on the network; PIL's decoding releases the GIL).
READ_THREADS = 16


def read_in_parallel(read, items: list):
    """`read` of each item, in order, on up to READ_THREADS threads; the first failure (in
    order) is raised."""
    if len(items) <= 1:
        return [read(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(READ_THREADS, len(items))) as pool:
        return list(pool.map(read, items))


class Pixels:
    """A micro-batch's images as the model takes them (decoded, resized and patched by the
    model's image processor): `pixel_values` and `image_position_ids`, in the order of
    their tokens in the batch. Runs where the batch is built, on each worker."""

    def __init__(self, image_processor):
        self.image_processor = image_processor

    def __call__(self, locations: list[str], device) -> dict:
        if not locations:
            return {}
        return self.of(list(read_in_parallel(decode_image, locations)), device)

    def of(self, images: list, device) -> dict:
        """Decoded images (PIL) as the model takes them."""
        out = self.image_processor(images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"].to(device),
                "image_position_ids": out["image_position_ids"].to(device)}


# --------------------------------------------------------------------------- rows


def parse_turns(turns, row: int, max_images: int, dataset: str) -> tuple[list[dict], list[str]]:
    """A row's turns with list contents checked, and its images' locations in order."""
    if not isinstance(turns, list) or not all(isinstance(t, dict) and "role" in t and "content" in t for t in turns):
        raise DataError(f"row {row}: 'messages' must be a list of {{role, content}} objects")
    out, images = [], []
    for turn in turns:
        content = turn["content"]
        if content is None or isinstance(content, str):
            out.append({"role": str(turn["role"]), "content": content or ""})
            continue
        if not isinstance(content, list):
            raise DataError(f"row {row}: a turn's content must be a string or a list of parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "audio":
                raise DataError(f"row {row}: an audio part: {AUDIO_NOT_BUILT}; remove the audio parts")
            if kind not in PART_TYPES:
                raise DataError(f"row {row}: unknown part type {kind!r}; a part is "
                                "{'type': 'text', 'text': ...} or {'type': 'image', 'image': <path or gs:// URI>}")
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text") or "")})
                continue
            ref = part.get("image")
            if not isinstance(ref, str) or not ref:
                raise DataError(f"row {row}: an image part needs 'image': a path relative to the data file, "
                                "an absolute path or a gs:// URI")
            images.append(image_location(ref, dataset))
            parts.append({"type": "image"})
        out.append({"role": str(turn["role"]), "content": parts})
    if len(images) > max_images:
        raise DataError(f"row {row}: {len(images)} images, more than --max-images-per-example {max_images}; "
                        "raise it or split the row")
    return out, images


@dataclass
class MediaExamples(Examples):
    """Examples with each one's image locations (in the order of its image tokens)."""

    media: list = field(default_factory=list)


@dataclass
class MediaPacked(Packed):
    """Packed blocks with each block's image locations (an object array of tuples)."""

    media: np.ndarray = None


def fill_media_blocks(examples: MediaExamples, blocks: list[list[int]], max_seq_len: int, pad_id: int) -> MediaPacked:
    """data.fill_blocks, and each block's images: its examples' in index order (fill_blocks'
    order), so the batch's images come in the order of their tokens."""
    packed = fill_blocks(examples.input_ids, examples.labels, blocks, max_seq_len, pad_id)
    media = np.empty(len(blocks), dtype=object)
    for b, members in enumerate(blocks):
        media[b] = tuple(loc for i in sorted(members) for loc in examples.media[i])
    return MediaPacked(**vars(packed), media=media)


def pack_media(examples: MediaExamples, max_seq_len: int, pad_id: int) -> MediaPacked:
    return fill_media_blocks(examples, bin_pack(examples.lengths, max_seq_len), max_seq_len, pad_id)


def expand(processor: MediaProcessor, text: str, sizes) -> tuple[list[int], list[bool]]:
    """`text`'s token ids with each image token expanded as Gemma4Processor expands it
    (<|image> + the image's soft tokens + <|image|>), `sizes` the images' (height, width) in
    order; and which ids are an image's."""
    tok = processor.tokenizer
    image, boi, eoi = processor.ids(processor.image_token), processor.ids(processor.boi_token), \
        processor.ids(processor.eoi_token)
    ids, is_media = [], []
    pieces = text.split(processor.image_token)
    for k, piece in enumerate(pieces):
        words = tok(piece, add_special_tokens=False)["input_ids"] if piece else []
        ids += words
        is_media += [False] * len(words)
        if k < len(pieces) - 1:
            media = [boi] + [image] * processor.soft_tokens(*next(sizes)) + [eoi]
            ids += media
            is_media += [True] * len(media)
    return ids, is_media


def render(processor: MediaProcessor, turns: list[dict], sizes: list[tuple[int, int]]) -> tuple[list, list]:
    """Token ids and labels of one conversation: the chat template's pieces (data.chat_pieces:
    assistant turns labelled), each image token expanded (`expand`); an image's tokens are
    never labelled."""
    from .data import chat_pieces

    sizes = iter(sizes)
    tokens, labels = [], []
    for text, is_label in chat_pieces(processor.tokenizer, turns):
        ids, is_media = expand(processor, text, sizes)
        tokens += ids
        labels += [t if is_label and not m else IGNORE_INDEX for t, m in zip(ids, is_media)]
    return tokens, labels


def prompt_ids(processor: MediaProcessor, turns: list[dict], sizes: list[tuple[int, int]]) -> list[int]:
    """The token ids of a prompt (`turns`, the model's turn to answer), as inference renders it."""
    text = processor.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return expand(processor, text, iter(sizes))[0]


@dataclass
class MediaEncoded:
    examples: MediaExamples
    skipped_long_prompts: list[int]
    truncated: int


def encode_media_rows(rows, processor: MediaProcessor, max_seq_len: int, dataset: str,
                      max_images: int = 1) -> MediaEncoded:
    """Every row rendered; a prompt longer than max_seq_len is skipped (data's rule), an
    example whose media tokens alone exceed it refused naming the row; a response cut at
    max_seq_len keeps every image of its prompt."""
    if "messages" not in rows.column_names:
        raise DataError(f"--dataset {dataset}: --vision-tower takes 'messages' rows (content a string or a list "
                        f"of text and image parts); found columns {rows.column_names}")
    image = processor.ids(processor.image_token)
    parsed = [parse_turns(raw, row, max_images, dataset) for row, raw in enumerate(rows["messages"])]
    # Every image's size (a read of its object each) at once; the first bad one in row order is refused.
    wanted = [(loc, row) for row, (_, images) in enumerate(parsed) for loc in images]
    sizes = iter(read_in_parallel(lambda item: image_size(*item), wanted))
    ids, labels, media, skipped, truncated = [], [], [], [], 0
    for row, (turns, images) in enumerate(parsed):
        tokens, labs = render(processor, turns, [next(sizes) for _ in images])
        soft = sum(1 for t in tokens if t == image)
        if soft + 2 * len(images) > max_seq_len:
            raise DataError(f"row {row}: its images take {soft + 2 * len(images)} tokens, more than "
                            f"--max-seq-len {max_seq_len}; raise --max-seq-len or use smaller images")
        first_label = next((k for k, x in enumerate(labs) if x != IGNORE_INDEX), len(labs))
        if first_label >= max_seq_len:
            skipped.append(row)
            continue
        if len(tokens) > max_seq_len:
            tokens, labs, truncated = tokens[:max_seq_len], labs[:max_seq_len], truncated + 1
            if tokens.count(image) != soft:  # an image cut in its middle: refused, not half-fed
                raise DataError(f"row {row}: --max-seq-len {max_seq_len} cuts through an image of a later turn; "
                                "raise --max-seq-len")
        ids.append(tokens)
        labels.append(labs)
        media.append(tuple(images))
    return MediaEncoded(MediaExamples(ids, labels, media=media), skipped, truncated)


def subset(examples: MediaExamples, index: list[int]) -> MediaExamples:
    return MediaExamples([examples.input_ids[i] for i in index], [examples.labels[i] for i in index],
                         media=[examples.media[i] for i in index])


def media_digest(examples: MediaExamples) -> str:
    """data.hash_examples' digest, with the examples' image locations."""
    from .data import hash_examples

    digest = hashlib.blake2b(hash_examples(examples).encode(), digest_size=8)
    for locations in examples.media:
        digest.update(("\x00".join(locations) + "\x01").encode())
    return f"{len(examples)} examples with images, digest {digest.hexdigest()}"


def prepare_media(dataset: str, split: str, processor: MediaProcessor, max_seq_len: int, eval_fraction: float,
                  seed: int, long_prompts: str = "skip", max_images: int = 1):
    """The training examples (with image locations, held in memory) and the held-out ones
    packed: data.prepare's result for a multimodal run."""
    from .data import PreparedData, check_long_prompts, load_rows, pad_id_of, split_eval

    rows = load_rows(dataset, split)
    encoded = encode_media_rows(rows, processor, max_seq_len, dataset, max_images)
    skipped = encoded.skipped_long_prompts
    check_long_prompts(len(skipped), len(rows), skipped[0] if skipped else None, len(encoded.examples),
                       max_seq_len, long_prompts)
    train_idx, eval_idx = split_eval(len(encoded.examples), eval_fraction, seed)
    train = subset(encoded.examples, train_idx)
    train.digest = media_digest(train)
    held = pack_media(subset(encoded.examples, eval_idx), max_seq_len, pad_id_of(processor.tokenizer)) \
        if eval_idx else None
    return PreparedData(train=train, eval=held, examples=len(train_idx), eval_examples=len(eval_idx),
                        skipped_long_prompts=len(skipped), truncated=encoded.truncated,
                        dataset_format="messages", prompt_format="chat")


def segment_images(packed: MediaPacked, block: int, boi: int) -> dict[int, list[str]]:
    """Each example (segment) of a packed block with its images, in the block's order: the
    block's images, as many to an example as its <|image> tokens."""
    real = int(packed.real_tokens[block])
    segments, taken, found = packed.segment_ids[block][:real], 0, {}
    for segment in dict.fromkeys(segments.tolist()):
        images = int((packed.input_ids[block][:real][segments == segment] == boi).sum())
        found[segment] = list(packed.media[block][taken:taken + images])
        taken += images
    return found


def boi_id(tokenizer) -> int:
    return int(tokenizer.convert_tokens_to_ids(tokenizer.boi_token))


def proof_images(eval_data, examples, count: int, tokenizer) -> list[list[str]]:
    """The images of export.proof_prompts' prompts, in its order: each held-out example's
    (`segment_images`), else each training example's."""
    found: list[list[str]] = []
    if eval_data is not None:
        for block in range(len(eval_data)):
            for images in segment_images(eval_data, block, boi_id(tokenizer)).values():
                found.append(images)
                if len(found) == count:
                    return found
    return found + [list(examples.media[i]) for i in range(count - len(found))]


def with_images(items: list, packed: MediaPacked, boi: int) -> list:
    """generation.held_out's items, each with its example's images (`segment_images`): a
    multimodal run's held-out prompts are answered with their images."""
    blocks: dict[int, dict] = {}
    for item in items:
        if item.block not in blocks:
            blocks[item.block] = segment_images(packed, item.block, boi)
        item.images = blocks[item.block][item.segment]
    return items


def image_groups(input_ids, image_token_id: int):
    """Each run of image soft tokens numbered (0, 1, … along a row), -1 elsewhere: what
    transformers' vision masks (get_block_sequence_ids_for_mask) take as an image's tokens,
    built on the device."""
    import torch

    is_image = input_ids == image_token_id
    before = torch.nn.functional.pad(is_image[:, :-1], (1, 0), value=False)
    return torch.where(is_image, torch.cumsum((is_image & ~before).long(), dim=1) - 1, -1)


def sees_images_whole(config) -> bool:
    """Whether the model attends bidirectionally within each image (Gemma 4's
    use_bidirectional_attention "vision"), as its own masks do at inference."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "use_bidirectional_attention", None) == "vision"


# --------------------------------------------------------------------------- towers


def towers(model) -> dict:
    """The model's towers and projectors by name (absent ones left out)."""
    inner = getattr(model, "model", model)
    found = {name: getattr(inner, name, None) for name in ("vision_tower", "embed_vision", "audio_tower", "embed_audio")}
    return {name: module for name, module in found.items() if module is not None}


def freeze_towers(model, vision: str) -> list:
    """--vision-tower frozen: the vision tower takes no gradient (its projector trains with
    the language model); the audio tower is never trained (not built yet). Returns the
    frozen parameters."""
    parts = towers(model)
    frozen = [parts.get("audio_tower"), parts.get("embed_audio")]
    if vision == "frozen":
        frozen.append(parts.get("vision_tower"))
    params = []
    for module in frozen:
        if module is not None:
            module.requires_grad_(False)
            params += list(module.parameters())
    return params
