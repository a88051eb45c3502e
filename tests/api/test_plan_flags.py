"""benchmarks/plan_flags.py: the benchmarks run what the operator's plan would choose for
their model, as the trainer flags the operator passes. Pure: a config.json's widths in,
the slice, the choice and the flags out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_flags  # noqa: E402

from tpufinetune.core.jobspec import memory_flags  # noqa: E402


def text_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict:
    """A Gemma 4 config.json as transformers writes it: the text model's widths under text_config."""
    return {"model_type": "gemma4", "text_config": {
        "model_type": "gemma4_text", "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "vocab_size": vocab, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)}}


TINY = text_config(64, 128, 4, 2, 1, 8192)  # the benchmarks' tiny model's widths
LARGE = text_config(5376, 21504, 62, 32, 16, 262144)  # a 31B-wide model: no device holds its state


def test_two_workers_are_two_one_chip_slices_and_four_are_one_slice():
    # No TPU slice has exactly two devices: two one-chip slices (Multislice) hold them.
    assert plan_flags.slice_for(2) == ("v6e", "1x1", 2)
    assert plan_flags.slice_for(4) == ("v6e", "2x2", 1)
    assert plan_flags.slice_for(1) == ("v6e", "1x1", 1)


def test_a_model_one_device_holds_is_replicated_with_every_block_kept_gathered():
    planned = plan_flags.plan(TINY, "/models/tiny", workers=2, batch_per_device=4, max_seq_len=512)
    assert planned.devices == 2 and planned.slices == 2
    assert (planned.choices.sharding, planned.choices.shard_group, planned.choices.checkpointing) == \
        ("replicate", 1, "none")
    assert planned.plan.keep_gathered
    assert planned.flags == ("--shard-group=1", "--reshard-after-forward=false")
    assert "sharding replicate" in planned.words() and "--shard-group=1" in planned.words()
    # The flags the trainer reads: its own parser's translation, nothing else moved.
    assert plan_flags.trainer_settings(planned.flags) == {"shard_group": 1, "reshard_after_forward": False}


def test_a_model_no_device_holds_gets_the_operators_flags_for_its_choice():
    planned = plan_flags.plan(LARGE, "/models/large", workers=2, batch_per_device=4, max_seq_len=512)
    assert planned.choices.sharding != "replicate" and planned.choices.checkpointing != "none"
    assert not planned.plan.keep_gathered
    # What jobspec passes for the same choice, and no reshard flag (the trainer's default).
    spec_training = plan_flags.parse_spec({
        "tpu": {"generation": planned.generation, "topology": planned.topology, "slices": planned.slices},
        "image": plan_flags.IMAGE, "checkpoint": {"storagePath": plan_flags.STORAGE},
        "model": {"id": "/models/large"}, "training": {"batchSizePerDevice": 4, "maxSeqLen": 512}}).training
    assert list(planned.flags) == memory_flags(spec_training, planned.choices)
    assert not any(flag.startswith("--reshard-after-forward") for flag in planned.flags)
