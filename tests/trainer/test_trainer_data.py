"""Offline assets, dolly formatting, packing into static shapes, per-document attention."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tpufinetune_trainer import assets
from tpufinetune_trainer.data import (
    IGNORE_INDEX,
    encode_rows,
    eval_order,
    format_prompt,
    load_rows,
    pack,
    prepare,
    shard_order,
)
from tpufinetune_trainer.errors import DataError
from tpufinetune_trainer.model import load_causal_lm, load_tokenizer

from trainer_helpers import write_jsonl


@pytest.fixture(scope="module")
def tokenizer(trainer_assets):
    return load_tokenizer(str(trainer_assets.model))


@pytest.fixture(scope="module")
def rows(trainer_assets):
    return load_rows(str(trainer_assets.data), "train")


def test_dataset_is_deterministic_dolly_format():
    a, b = assets.generate_dataset(300, seed=7), assets.generate_dataset(300, seed=7)
    assert a == b and a != assets.generate_dataset(300, seed=8)
    assert all(set(r) == {"instruction", "context", "response", "category"} for r in a)
    categories = {r["category"] for r in a}
    assert {"open_qa", "closed_qa", "summarization", "creative_writing", "classification"} <= categories
    assert any(r["context"] for r in a) and any(not r["context"] for r in a)


def test_dataset_has_a_dolly_like_spread_of_lengths(rows, tokenizer):
    enc = encode_rows(rows, tokenizer, max_seq_len=4096)
    lengths = np.array([len(x) for x in enc.input_ids])
    # Many short answers, a long tail: median well under a quarter of 512, tail past 512.
    assert np.median(lengths) < 100
    assert np.percentile(lengths, 99) > 350 and lengths.max() > 512
    assert 60 < lengths.mean() < 160


def test_tiny_gemma4_loads_offline_and_is_small(trainer_assets):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(trainer_assets.model)
    text = config.get_text_config()
    assert config.model_type == "gemma4" and text.model_type == "gemma4_text"
    tok = AutoTokenizer.from_pretrained(trainer_assets.model)
    # The two defaults that would make it huge are set down to the tokenizer's size.
    assert text.vocab_size == text.vocab_size_per_layer_input == len(tok)
    assert all(text.per_layer_config[i].head_dim <= 64 for i in range(text.num_hidden_layers))
    model = AutoModelForCausalLM.from_pretrained(trainer_assets.model)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert model.model.vision_tower is not None  # the text-only load below must drop it
    text_only = load_causal_lm(str(trainer_assets.model), torch.float32, "sdpa")
    assert text_only.model.vision_tower is None and text_only.model.audio_tower is None
    assert tok.bos_token_id == 2 and tok.eos_token_id == 1 and tok.pad_token_id == 0


def test_prompt_format_is_the_tutorials():
    assert format_prompt("Say hi", "") == "Instruction: Say hi\nResponse:"
    assert format_prompt("Sum it up", "Long text.") == "Instruction: Sum it up\nContext: Long text.\nResponse:"


def test_labels_mask_the_prompt(rows, tokenizer):
    enc = encode_rows(rows.select(range(50)), tokenizer, max_seq_len=512)
    for ids, labels in zip(enc.input_ids, enc.labels):
        prompt_len = labels.index(next(x for x in labels if x != IGNORE_INDEX))
        assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids[1:prompt_len]).startswith("Instruction:")
        assert tokenizer.decode(ids[1:prompt_len]).endswith("Response:")
        assert labels[prompt_len:] == ids[prompt_len:]


def test_packing_gives_full_fixed_blocks_and_keeps_every_token(rows, tokenizer):
    enc = encode_rows(rows, tokenizer, max_seq_len=512)
    packed = pack(enc.input_ids, enc.labels, 512, tokenizer.pad_token_id)
    assert packed.input_ids.shape == packed.labels.shape == packed.position_ids.shape == (len(packed), 512)
    assert packed.real_tokens.sum() == sum(len(x) for x in enc.input_ids)
    assert packed.real_tokens.mean() > 0.9 * 512  # dense: the point of packing
    # Every example appears once: documents start where position ids restart at 0.
    starts = (packed.position_ids == 0) & (packed.input_ids == tokenizer.bos_token_id)
    assert starts.sum() == len(enc.input_ids)
    # Padding carries no labels.
    pads = np.arange(512)[None, :] >= packed.real_tokens[:, None]
    assert (packed.labels[pads] == IGNORE_INDEX).all() and (packed.input_ids[pads] == tokenizer.pad_token_id).all()


def test_every_batch_has_one_shape_across_epochs_and_ranks():
    blocks, world, batch = 53, 2, 4
    seen = []
    for epoch in range(1, 4):
        per_rank = [shard_order(blocks, world, batch, epoch, 42, r) for r in range(world)]
        assert {len(p) for p in per_rank} == {len(per_rank[0])} and len(per_rank[0]) % batch == 0
        assert not set(per_rank[0]) & set(per_rank[1])  # ranks see disjoint blocks
        seen.append(np.concatenate(per_rank))
    assert not np.array_equal(seen[0], seen[1])  # reshuffled every epoch
    covered = np.concatenate([eval_order(blocks, world, batch, r) for r in range(world)])
    assert len(covered) % (world * batch) == 0
    assert sorted(covered[covered >= 0].tolist()) == list(range(blocks))


def test_each_packed_example_only_attends_to_itself(trainer_assets, rows, tokenizer):
    """Logits of an example inside a packed block equal its logits alone."""
    model = load_causal_lm(str(trainer_assets.model), torch.float32, "sdpa").eval()
    enc = encode_rows(rows.select(range(12)), tokenizer, max_seq_len=256)
    packed = pack(enc.input_ids, enc.labels, 256, tokenizer.pad_token_id)
    block = 0
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(packed.input_ids[block:block + 1]),
                       position_ids=torch.from_numpy(packed.position_ids[block:block + 1])).logits[0]
        starts = np.flatnonzero(packed.position_ids[block] == 0)
        checked = 0
        for start, end in zip(starts, list(starts[1:]) + [int(packed.real_tokens[block])]):
            if end <= start:
                continue
            ids = torch.from_numpy(packed.input_ids[block, start:end][None])
            alone = model(input_ids=ids).logits[0]
            torch.testing.assert_close(logits[start:end], alone, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 2, "the block should hold several examples"


def test_local_files_and_directories_load(tmp_path, rows):
    rows.select(range(20)).to_parquet(str(tmp_path / "part.parquet"))
    assert len(load_rows(str(tmp_path / "part.parquet"), "train")) == 20
    assert len(load_rows(str(tmp_path), "train[:5]")) == 5
    with pytest.raises(DataError, match="no such file"):
        load_rows(str(tmp_path / "absent.jsonl"), "train")


def test_long_prompts_are_skipped_or_fail(tmp_path, tokenizer):
    normal = [{"instruction": "What is two plus two?", "context": "", "response": "Four."}] * 40
    long = [{"instruction": "word " * 400, "context": "", "response": "x"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", normal + long)
    data = prepare(str(path), "train", tokenizer, 128, 0.1, 0)
    assert data.skipped_long_prompts == 1 and data.examples + data.eval_examples == 40
    with pytest.raises(DataError, match="longer than --max-seq-len=128"):
        prepare(str(path), "train", tokenizer, 128, 0.1, 0, long_prompts="fail")


def test_assets_cli_writes_model_and_data(tmp_path):
    info = assets.write_assets(tmp_path, "tiny", rows=50)
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert (tmp_path / "model" / "tokenizer.json").is_file()
    lines = (tmp_path / "data" / "train.jsonl").read_text().splitlines()
    assert len(lines) == 50 and json.loads(lines[0])["instruction"]
    assert info["parameters"] < 2_000_000
