"""Offline assets, dolly formatting, packing into static shapes, per-document attention."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tpufinetune_trainer import assets
from tpufinetune_trainer.data import (
    IGNORE_INDEX,
    BatchPlan,
    Examples,
    Packed,
    Ragged,
    encode_rows,
    epoch_steps,
    eval_order,
    format_prompt,
    load_rows,
    pack,
    plan_epoch,
    plan_run,
    prepare,
    rank_blocks,
    rank_eval_share,
    steps_per_epoch,
)
from tpufinetune_trainer.errors import DataError
from tpufinetune_trainer.model import load_causal_lm

from trainer_helpers import write_jsonl


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


def tutorial_steps_per_epoch(examples: int, world: int, batch: int) -> int:
    """The tutorial's loop: a shuffled DataLoader with drop_last, sharded by Ray Train's
    prepare_data_loader (a DistributedSampler over the devices)."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(range(examples), num_replicas=world, rank=0, shuffle=True)
    return len(DataLoader(range(examples), batch_size=batch, sampler=sampler, drop_last=True))


@pytest.mark.parametrize("examples,world,batch,accum", [(1024, 16, 4, 1), (512, 2, 4, 1), (96, 2, 2, 3),
                                                        (973, 16, 4, 1), (37, 2, 4, 1)])
def test_an_epoch_takes_the_tutorials_steps_and_every_example_once(examples, world, batch, accum):
    plan = BatchPlan(world, batch, accum)
    lengths = np.random.default_rng(0).integers(8, 300, examples)
    steps = steps_per_epoch(examples, plan)
    if examples % plan.global_examples == 0 and accum == 1:
        assert steps == tutorial_steps_per_epoch(examples, world, batch)
    elif accum == 1:
        # The tutorial drops a partial last batch; here it is one more, smaller step.
        assert steps - 1 <= tutorial_steps_per_epoch(examples, world, batch) <= steps
    orders = []
    for epoch in (1, 2, 3):
        grouped = epoch_steps(lengths, plan, epoch, 42)
        assert len(grouped) == steps
        sizes = sorted(len(g) for g in grouped)
        assert sizes[1:] == [plan.global_examples] * (steps - 1)  # only one step may be smaller
        everything = np.concatenate(grouped)
        assert sorted(everything.tolist()) == list(range(examples))  # each example exactly once
        orders.append(everything)
        assert all(np.array_equal(a, b) for a, b in zip(grouped, epoch_steps(lengths, plan, epoch, 42)))
    assert not np.array_equal(orders[0], orders[1])  # reshuffled every epoch


def test_a_steps_examples_do_not_depend_on_how_the_batch_is_split():
    lengths = np.random.default_rng(1).integers(8, 300, 200)
    one = epoch_steps(lengths, BatchPlan(1, 8, 1), 3, 42)
    four = epoch_steps(lengths, BatchPlan(4, 1, 2), 3, 42)
    assert all(np.array_equal(a, b) for a, b in zip(one, four))


def test_steps_even_out_their_tokens():
    """Grouping in windows (longest first, to the step with the fewest tokens) keeps the
    fullest step, which sets the blocks of every step, near the mean."""
    lengths = np.minimum(np.random.default_rng(2).lognormal(4.3, 0.7, 1024).astype(int) + 8, 512)  # dolly-like
    plan = BatchPlan(2, 4, 1)
    totals = np.array([lengths[g].sum() for g in epoch_steps(lengths, plan, 1, 42)])
    assert totals.max() < 1.2 * totals.mean()
    cut = np.array([lengths[np.random.default_rng(43).permutation(1024)[s * 8:(s + 1) * 8]].sum()
                    for s in range(128)])
    assert cut.max() > 1.5 * cut.mean()  # a plain cut of the shuffle would not


def synthetic_examples(count: int, seed: int) -> Examples:
    """Examples of varied length: a prompt (no labels), then a labelled response."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for _ in range(count):
        prompt, response = int(rng.integers(3, 60)), int(rng.integers(1, 200))
        tokens = rng.integers(3, 1000, prompt + response).tolist()
        ids.append(tokens)
        labels.append([IGNORE_INDEX] * prompt + tokens[prompt:])
    return Examples(ids, labels)


def test_examples_are_flat_int32_rows_that_say_what_the_lists_said():
    """Examples hold their rows as one int32 array and offsets: the lengths, the scored
    tokens, each row and the resume digest are what the lists gave, and the rows pickle
    as out-of-band buffers (what Ray's object store shares among a host's workers)."""
    import pickle

    from tpufinetune_trainer.resume import examples_digest

    listed = synthetic_examples(300, seed=5)
    ids = [row.tolist() for row in listed.input_ids]
    labels = [row.tolist() for row in listed.labels]
    assert isinstance(listed.input_ids, Ragged) and listed.input_ids.values.dtype == np.int32
    assert listed.lengths.tolist() == [len(row) for row in ids]
    assert listed.label_tokens.tolist() == [sum(1 for t in row[1:] if t != IGNORE_INDEX) for row in labels]
    assert [listed.labels[i].tolist() for i in (0, 7, -1)] == [labels[0], labels[7], labels[-1]]
    assert examples_digest(listed) == examples_digest(Examples(ids, labels))
    tokens = int(listed.lengths.sum())
    assert listed.input_ids.values.nbytes == listed.labels.values.nbytes == 4 * tokens
    # Pickled as Ray pickles (protocol 5): the token arrays travel out of band, as buffers
    # the object store maps into each worker of a host instead of objects rebuilt per worker.
    buffers = []
    inline = pickle.dumps(listed, protocol=5, buffer_callback=buffers.append)
    assert sum(buffer.raw().nbytes for buffer in buffers) >= 2 * 4 * tokens and len(inline) < 1000
    assert examples_digest(pickle.loads(inline, buffers=buffers)) == examples_digest(listed)
    with pytest.raises(IndexError):
        listed.input_ids[len(listed)]


@pytest.mark.parametrize("world,batch,accum", [(2, 4, 1), (1, 2, 2), (4, 3, 1)])
def test_every_step_has_the_same_blocks_and_padding_carries_no_labels(world, batch, accum):
    length, epochs = 256, 3
    examples = synthetic_examples(101, world)
    lengths, labels = examples.lengths, examples.label_tokens
    base = BatchPlan(world, batch, accum)
    plan = plan_run(lengths, labels, base, epochs, 7, length).plan
    for epoch in range(1, epochs + 1):
        planned = plan_epoch(lengths, labels, plan, epoch, 7, length)
        grouped = epoch_steps(lengths, plan, epoch, 7)
        steps = len(planned)
        assert planned.slots.shape == (steps, accum, world, plan.blocks)  # fixed for the run
        per_rank = [rank_blocks(examples, planned, rank, length, 0) for rank in range(world)]
        for rank, blocks in enumerate(per_rank):
            assert blocks.input_ids.shape == (steps * accum * plan.blocks, length)
            pads = np.arange(length)[None, :] >= blocks.real_tokens[:, None]
            assert (blocks.labels[pads] == IGNORE_INDEX).all()
            assert (blocks.input_ids[pads] == 0).all()
            empty = planned.slots[:, :, rank, :].reshape(-1) < 0
            assert (blocks.real_tokens[empty] == 0).all() and (blocks.label_tokens[empty] == 0).all()
        for step in range(steps):
            members = [e for b in planned.slots[step].reshape(-1) if b >= 0 for e in planned.blocks[b]]
            assert sorted(members) == sorted(grouped[step].tolist())  # the step's examples, each once
            cut = slice(step * accum * plan.blocks, (step + 1) * accum * plan.blocks)
            assert sum(int(b.label_tokens[cut].sum()) for b in per_rank) == planned.label_tokens[step] \
                == int(labels[grouped[step]].sum())
            assert sum(int(b.real_tokens[cut].sum()) for b in per_rank) == planned.real_tokens[step]
    # The fullest step needed every block: none fewer would do.
    fullest = max(int((plan_epoch(lengths, labels, plan, e, 7, length).slots >= 0)
                      .sum(axis=(1, 2, 3)).max()) for e in range(1, epochs + 1))
    assert -(-fullest // (world * accum)) == plan.blocks


def test_evaluation_covers_every_block_once_in_one_shape():
    blocks, world, batch = 53, 2, 4
    covered = np.concatenate([eval_order(blocks, world, batch, r) for r in range(world)])
    assert len(covered) % (world * batch) == 0
    assert sorted(covered[covered >= 0].tolist()) == list(range(blocks))


def test_each_rank_holds_only_its_share_of_the_held_out_blocks():
    blocks, world, batch, length = 11, 4, 2, 8
    rng = np.random.default_rng(0)
    packed = Packed(*(rng.integers(0, 100, (blocks, length)) for _ in range(4)),
                    real_tokens=rng.integers(1, length, blocks), label_tokens=rng.integers(0, length, blocks))
    held = []
    for rank in range(world):
        share, local = rank_eval_share(packed, world, batch, rank)
        order = eval_order(blocks, world, batch, rank)
        # The same batches in the same shape as before, each index now into the share.
        assert len(local) == len(order) and ((local < 0) == (order < 0)).all()
        assert len(share) == int((order >= 0).sum()) <= -(-blocks // world)
        for mine, whole in zip(local[local >= 0], order[order >= 0]):
            assert (share.input_ids[mine] == packed.input_ids[whole]).all()
            assert share.label_tokens[mine] == packed.label_tokens[whole]
        held += order[order >= 0].tolist()
    assert sorted(held) == list(range(blocks))  # every block on exactly one rank


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
