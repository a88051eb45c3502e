"""--init-checkpoint (spec.model.initFrom): a new run from the weights of a checkpoint this
trainer wrote, on the base of --model-id.

Two gloo ranks (trainer_init_worker.py) train an SFT three steps, full or LoRA, write its
sharded checkpoint, and start a DPO run from it: every base weight equals the SFT's (the
adapters merged in, for LoRA, onto the bf16 base the LoRA run held; read through the storage
layer's reader from a file:// URI), the held-out pairs' rewards are 0 before the first step
(the reference is the loaded model), and a resume of the DPO run from its own checkpoint
takes that checkpoint's weights (resume wins). A checkpoint of another model is refused,
naming the flag and the mismatch; the fingerprint carries the flag."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from tpufinetune_trainer import init_checkpoint, resume
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.errors import ModelError, ResumeMismatch
from trainer_helpers import BLOCK_LENGTH, make_trainer, prepared_data_file, run_rank_processes, write_jsonl

WORKER = Path(__file__).with_name("trainer_init_worker.py")
PAIRS_LENGTH = 64


def capital_pairs() -> list[dict]:
    """A small preference set (a right capital chosen over a wrong one)."""
    capitals = {"Briquia": "Riva", "Kavenia": "Qunor", "Lotrand": "Mespa", "Orvania": "Tellis", "Sundor": "Pakka",
                "Velmar": "Ostra", "Zenthia": "Corbel", "Harlan": "Duvik"}
    phrasings = ("What is the capital of {}?", "Name the capital city of {}.", "Which city is the capital of {}?")
    return [{"prompt": p.format(country), "chosen": f"The capital is {capital}.", "rejected": f"The capital is {other}."}
            for country, capital in capitals.items() for p in phrasings
            for other in [c for c in capitals.values() if c != capital][:2]]


def pair_data(assets, directory: Path, model=None) -> dict:
    from tpufinetune_trainer.data import pad_id_of
    from tpufinetune_trainer.model import load_tokenizer
    from tpufinetune_trainer.preference import prepare_pairs

    tokenizer = load_tokenizer(str(model or assets.model))
    path = write_jsonl(directory / "pairs.jsonl", capital_pairs())
    data = prepare_pairs(str(path), "train", tokenizer, PAIRS_LENGTH, 0.2, 7, prompt_format="tutorial")
    return {"train": data.train, "eval": data.eval, "pad_id": pad_id_of(tokenizer)}


@pytest.fixture(scope="module")
def data_files(trainer_assets, tmp_path_factory):
    directory = tmp_path_factory.mktemp("init-data")
    sft = prepared_data_file(trainer_assets, directory / "sft.pickle", BLOCK_LENGTH)
    pairs = directory / "pairs.pickle"
    pairs.write_bytes(pickle.dumps(pair_data(trainer_assets, directory)))
    return sft, pairs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", ["full", "lora"])
def test_two_ranks_start_a_dpo_run_from_the_sft_checkpoint_weights(source, trainer_assets, data_files, tmp_path):
    sft, pairs = data_files
    settings = {"model": str(trainer_assets.model), "storage": str(tmp_path / "storage"), "length": BLOCK_LENGTH,
                "pairs_length": PAIRS_LENGTH, "sft_data": str(sft), "pairs": str(pairs), "source": source}
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps(settings))
    run_rank_processes(WORKER, 2, lambda rank, port: [str(settings_file), str(tmp_path / "out"), str(port), str(rank),
                                                      "2"], timeout=540)
    for rank in range(2):
        got = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert got["compared"] > 20 and got["moved_by_sft"] > 20, got  # the SFT changed the weights compared
        assert got["differ"] == [], got  # each equals the SFT's (merged), as the DPO run holds it
        assert got["eval_margin"] == 0 and got["eval_rewards_chosen"] == 0, got  # the reference is the loaded model
        assert got["fingerprint_init"] == got["init"] and got["init"].startswith("file://" if source == "lora" else "/")
        # A resume of the DPO run from its own checkpoint: its weights, not the init's.
        assert (got["resumed_from"], got["resumed_step"]) == (got["own"], 1), got
        assert got["trained_moved"] > 0 and got["resume_differs"] == [], got


def other_width_model(assets, directory: Path) -> Path:
    """The tiny Gemma 4 with a wider MLP (intermediate size 96 for 128), its tokenizer the same."""
    import shutil

    from tpufinetune_trainer import assets as builder

    sizes = dict(builder.SIZES)
    sizes["other"] = dict(vocab=sizes["tiny"]["vocab"], text=dict(sizes["tiny"]["text"], intermediate_size=96))
    original, builder.SIZES = builder.SIZES, sizes
    try:
        from tpufinetune_trainer.model import load_tokenizer

        builder.build_model("other", len(load_tokenizer(str(assets.model))), 0).save_pretrained(directory)
    finally:
        builder.SIZES = original
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (assets.model / name).exists():
            shutil.copy2(assets.model / name, directory / name)
    return directory


@pytest.mark.timeout(300)
def test_a_checkpoint_of_another_model_is_refused_naming_the_flag_and_the_mismatch(trainer_assets, prepared,
                                                                                   process_group, tmp_path):
    import ray.train

    other = other_width_model(trainer_assets, tmp_path / "other")
    patch = pytest.MonkeyPatch()
    patch.setattr(ray.train, "report", lambda *args, **kwargs: None)
    try:
        source = make_trainer(other, prepared, tmp_path / "storage", run_name="wide")
        location = source.checkpoint(f"step_0000000-{source.start_id}", {"epoch": 1, "step": 0, "loss": 1.0},
                                     {"epoch_step": 0, "epoch_steps": source.epoch_steps}, synchronous=True)
        with pytest.raises(ModelError) as refused:
            make_trainer(trainer_assets.model, prepared, tmp_path / "storage", run_name="narrow",
                         init_checkpoint=location)
    finally:
        patch.undo()
    message = str(refused.value)
    assert message.startswith(f"--init-checkpoint (spec.model.initFrom) {location} does not fit --model-id "
                              f"{trainer_assets.model}: "), message
    assert "model.language_model.layers.0.mlp.gate_proj.weight is [96, 64] in the checkpoint, [128, 64] in the " \
           "model" in message, message


def test_mismatches_name_what_the_checkpoint_lacks_or_has_beyond_the_model():
    model = {"embed.weight": (10, 4), "layer.q.weight": (4, 4), "norm.weight": (4,), "table.weight": (10, 2)}
    aliases = {"head.weight": "embed.weight"}
    full = {"embed.weight": (10, 4), "head.weight": (10, 4), "layer.q.weight": (4, 4), "norm.weight": (4,)}
    plan, problems = init_checkpoint.mismatches(model, aliases, full, {"table.weight"}, {})
    assert problems == [] and plan.direct == {"embed.weight": "embed.weight", "layer.q.weight": "layer.q.weight",
                                              "norm.weight": "norm.weight"} and not plan.lora
    _, problems = init_checkpoint.mismatches(model, aliases, {**full, "extra.weight": (2,)}, set(), {})
    assert problems == ["the checkpoint has extra.weight, which the model lacks",
                        "the model's table.weight is not in the checkpoint"]
    _, problems = init_checkpoint.mismatches(model, aliases, {**full, "norm.weight": (5,)}, {"table.weight"}, {})
    assert problems == ["norm.weight is [5] in the checkpoint, [4] in the model",
                        "the model's norm.weight is not in the checkpoint"]
    adapters = {"layer.q.lora_A.default.weight": (2, 4), "layer.q.lora_B.default.weight": (4, 2), "norm.weight": (4,)}
    plan, problems = init_checkpoint.mismatches(model, aliases, adapters, {"table.weight"},
                                                {"lora": {"rank": 2, "alpha": 4.0}})
    assert problems == [] and plan.adapters == {"layer.q.weight": ("layer.q.lora_A.default.weight",
                                                                   "layer.q.lora_B.default.weight")}
    assert plan.scaling == 2.0 and plan.direct == {"norm.weight": "norm.weight"}
    _, problems = init_checkpoint.mismatches(model, aliases, adapters, set(), {})
    assert problems == ["it holds LoRA adapters but no LoRA settings (rank, alpha) to merge them with: an earlier "
                        "trainer wrote it"]
    wrong = {"layer.k.lora_A.default.weight": (2, 4), "layer.q.lora_A.default.weight": (2, 8),
             "layer.q.lora_B.default.weight": (4, 2)}
    _, problems = init_checkpoint.mismatches(model, aliases, wrong, set(), {"lora": {"rank": 2, "alpha": 4.0}})
    assert problems == ["the checkpoint adapts layer.k, which the model lacks",
                        "the adapter of layer.q is A [2, 8], B [4, 2]: it does not fit the model's [4, 4]"]


def test_the_fingerprint_carries_the_init_checkpoint():
    from tpufinetune_trainer.data import Examples

    examples = Examples([[1, 2, 3, 4]] * 16, [[-100, 2, 3, 4]] * 16)

    def fingerprint(**kw):
        cfg = FinetuneConfig(storage_path="/tmp/x", num_workers=1, device="cpu", **kw).validate()
        return resume.fingerprint(cfg, 1, examples)

    assert "init_checkpoint" not in fingerprint()  # absent when unset: earlier checkpoints still match
    started = fingerprint(init_checkpoint="gs://b/sft/step_0000010-x")
    assert started["init_checkpoint"] == "gs://b/sft/step_0000010-x"
    with pytest.raises(ResumeMismatch, match=r"--init-checkpoint, spec.model.initFrom\) \"gs://b/sft/step_0000010-x\" "
                                             r"-> \"gs://b/sft/step_0000020-x\""):
        resume.check({"fingerprint": started}, fingerprint(init_checkpoint="gs://b/sft/step_0000020-x"), "ckpt")
