"""The API and the trainer agree: every flag the operator passes has the trainer's own
default when the spec leaves it unset, and every value the trainer refuses is refused by
`parse_spec` too (the same cases run against the real apiserver in
test_crd_admission.py, through api_spec_cases.INVALID)."""
from __future__ import annotations

import argparse

import pytest
from api_spec_cases import INVALID, MEMORY_INVALID, base_spec, spec_with

from tpufinetune.core import api
from tpufinetune.core.api import SCORE_ATTRIBUTES, Checkpoint, parse_spec
from tpufinetune.core.apimodels import MemorySettings
from tpufinetune.core.errors import SpecError
from tpufinetune.core.jobspec import trainer_argv
from tpufinetune_trainer import cli as trainer_cli
from tpufinetune_trainer import config as trainer_config
from tpufinetune_trainer import lora as trainer_lora
from tpufinetune_trainer.errors import TrainerError

# Flags whose value comes from the slice, the storage or the run's identity rather than a
# spec default (so there is no default to agree on).
DERIVED_FLAGS = {"--topology", "--accelerator-type", "--num-workers", "--device",
                 "--storage-path", "--run-name"}
# Trainer flags the operator does not pass, each with its reason.
NOT_PASSED = {
    "--resume-from": "passed only on retries and resumes, from status.checkpointURI",
    "--init-checkpoint": "passed only when spec.model.initFrom's artifact is checkpoint, with status.initFrom's URI "
                         "(tests/operator/test_init_from.py)",
    "--long-prompts": "the trainer's default (skip, counted in the start event) applies",
    "--compute-dtype": "the backend decides (bfloat16 on TPU and GPU, float32 on the cpu stand-in)",
    "--loss-head": "the trainer's default (labels) applies; full is the reference and a fallback for a run started by hand",
    "--model-load": "the trainer's default (sharded) applies; full is a fallback for a run started by hand",
    "--progress-interval": "the trainer's default (30 s) applies",
    **{flag: "passed only when training.method is dpo, with training.dpo's values or its defaults (--dpo-lora: "
             "true exactly when training.lora is given)"
       for flag in ("--dpo-beta", "--dpo-loss", "--dpo-label-smoothing", "--dpo-reference-free", "--dpo-lora")},
    "--fail-at-step": "fault injection for the trainer's own tests",
    **{flag: "passed only when training.evaluation.generate is set, with its values or its defaults (the trainer's "
             "0 examples is off; an older trainer image knows no such flag)"
       for flag in ("--generate-examples", "--generate-max-new-tokens", "--generate-metrics")},
    "--keep-best-by": "passed only when training.evaluation.keepBestBy names a generated metric (evalLoss is the "
                      "trainer's default)",
    "--global-batch-examples": "the operator passes the same flag by its other name, --global-batch-blocks",
    "--loss-on": "passed only when training.lossOn is set (unset: the trainer's responses)",
    "--target-eval-loss": "passed only when training.targetEvalLoss is set (the trainer's 0 is off)",
    "--tokens-per-step": "passed only when training.tokensPerStep is set (the trainer's 0 is a step of examples; "
                         "an older trainer image knows no such flag)",
    "--early-stopping-patience": "passed only when training.earlyStoppingPatience is set (0 is off)",
    "--method": "passed only when training.method is lora or dpo (full is the trainer's default, and an older "
                "trainer image knows no --method)",
    **{flag: "passed only when training.method is lora (training.lora's values or its defaults) or dpo with "
             "training.lora given"
       for flag in ("--lora-rank", "--lora-alpha", "--lora-dropout", "--lora-target-modules",
                    "--lora-export-merged")},
    "--activation-checkpointing": "passed only when the plan's activation checkpointing (training."
                                  "activationCheckpointing, or the plan's choice when auto) is block or "
                                  "selective (none is the trainer's default)",
    "--shard-group": "passed only when the plan's sharding (training.sharding, or the plan's choice when auto) "
                     "is hybrid or replicate (full, the whole slice, is the trainer's default; an older trainer "
                     "image knows no such flag)",
    "--attention": "passed only when training.attention is set (unset: the device's kernel, the trainer's auto)",
    "--freeze-embeddings": "passed only when training.freezeEmbeddings is true",
    "--lora-train-embeddings": "passed only when training.lora.trainEmbeddings is true (an older trainer image "
                               "knows no such flag)",
    **{flag: "passed only when training.towers is set (a multimodal run), with its values or its defaults (a text "
             "run's argv is as before; an older trainer image knows no such flag)"
       for flag in ("--vision-tower", "--max-images-per-example")},
    "--audio-tower": "never passed: spec.training.towers.audio is refused at apply (audio fine-tuning is not built "
                     "yet)",
    "--num-slices": "passed only when tpu.slices is more than 1 (1 is the trainer's default; an older trainer "
                    "image knows no such flag)",
    "--reshard-after-forward": "passed as false only where the memory plan holds every block's gathered copy "
                               "within its margin (memplan.keeps_gathered); true is the trainer's default",
    "--compile-cache-dir": "its default is the head's TPUFT_COMPILE_CACHE_DIR, set in spec.head.env beside the "
                           "volume the user mounts (docs/gke.md, the compile cache across restarts)",
}


def _finetune_parser() -> argparse.ArgumentParser:
    parser = trainer_cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["finetune"]


def _flag_dests() -> dict[str, str]:
    return {option: action.dest for action in _finetune_parser()._actions
            for option in action.option_strings if option.startswith("--")
            and option != "--help"}


def _passed_flags(argv: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in argv[2:])


def _trainer_config(argv: list[str]):
    """What the trainer makes of `argv`: its parser, its config, its checks."""
    return trainer_cli._config(trainer_cli.build_parser().parse_args(argv[1:])).validate()


def test_every_trainer_flag_is_passed_or_left_out_for_a_stated_reason():
    passed = set(_passed_flags(trainer_argv(parse_spec(base_spec()), run_name="r")))
    assert passed <= set(_flag_dests()), passed - set(_flag_dests())
    unaccounted = set(_flag_dests()) - passed - set(NOT_PASSED)
    assert not unaccounted, (f"trainer flags {sorted(unaccounted)} are neither passed by "
                             "jobspec.trainer_argv nor listed in NOT_PASSED with a reason")


def test_unset_spec_fields_pass_the_trainers_own_defaults():
    argv = trainer_argv(parse_spec(base_spec()), run_name="r")
    given = vars(trainer_cli.build_parser().parse_args(argv[1:]))
    defaults = vars(trainer_cli.build_parser().parse_args(["finetune"]))
    dests = _flag_dests()
    compared = 0
    for flag in _passed_flags(argv):
        if flag in DERIVED_FLAGS:
            continue
        dest = dests[flag]
        assert given[dest] == defaults[dest], (
            f"{flag}: the API's default gives {given[dest]!r}, the trainer's default is "
            f"{defaults[dest]!r}")
        compared += 1
    assert compared >= 13  # model, data, training and checkpoint flags


def test_closed_sets_are_the_trainers():
    choices = {action.dest: tuple(action.choices) for action in _finetune_parser()._actions
               if action.choices}
    assert SCORE_ATTRIBUTES == choices["checkpoint_score_attribute"]
    assert Checkpoint.model_fields["score_order"].annotation.__args__ == choices[
        "checkpoint_score_order"]


def test_the_operators_argv_for_the_default_spec_passes_the_trainers_checks():
    config = _trainer_config(trainer_argv(parse_spec(base_spec()), run_name="r"))
    assert config.num_workers == 16 and config.storage_path.startswith("gs://")


# (spec change, trainer flag and value): values at and past each bound the trainer checks.
TRAINER_REFUSALS = [
    ({"training": {"epochs": 0}}, ["--num-epochs=0"]),
    ({"training": {"batchSizePerDevice": 0}}, ["--batch-size-per-device=0"]),
    ({"training": {"maxSeqLen": 7}}, ["--max-seq-len=7"]),
    ({"training": {"learningRate": 0}}, ["--learning-rate=0.0"]),
    ({"training": {"learningRate": -1e-5}}, ["--learning-rate=-1e-05"]),
    ({"training": {"weightDecay": -0.1}}, ["--weight-decay=-0.1"]),
    ({"training": {"evalFraction": -0.1}}, ["--eval-fraction=-0.1"]),
    ({"training": {"evalFraction": 1}}, ["--eval-fraction=1.0"]),
    ({"checkpoint": {"storagePath": "gs://b/p", "keep": 0}}, ["--keep-checkpoints=0"]),
    ({"checkpoint": {"storagePath": "gs://b/p", "scoreAttribute": "accuracy"}},
     ["--checkpoint-score-attribute=accuracy"]),
    ({"checkpoint": {"storagePath": "gs://b/p", "scoreOrder": "lowest"}},
     ["--checkpoint-score-order=lowest"]),
    ({"checkpoint": {"storagePath": "gs://b/p", "scoreAttribute": "eval_loss"},
      "training": {"evalFraction": 0}},
     ["--checkpoint-score-attribute=eval_loss", "--eval-fraction=0.0"]),
    ({"training": {"targetEvalLoss": 1.5, "evalFraction": 0}},
     ["--target-eval-loss=1.5", "--eval-fraction=0.0"]),
    ({"training": {"earlyStoppingPatience": 3, "evalFraction": 0}},
     ["--early-stopping-patience=3", "--eval-fraction=0.0"]),
    ({"training": {"targetEvalLoss": -1.0}}, ["--target-eval-loss=-1.0"]),
    ({"training": {"lossOn": "prompts"}}, ["--loss-on=prompts"]),
    ({"training": {"method": "lora", "lora": {"rank": 0}}}, ["--lora-rank=0", "--method=lora"]),
    ({"training": {"method": "lora", "lora": {"targetModules": ["q_proj", "attn"]}}},
     ["--lora-target-modules=q_proj,attn", "--method=lora"]),
    ({"training": {"lora": {"rank": 8}}}, ["--lora-rank=8"]),  # LoRA's settings with method full
    ({"training": {"method": "qlora"}}, ["--method=qlora"]),
    # DPO's settings: without method dpo, and each combination its check_dpo refuses.
    ({"training": {"dpo": {"beta": 0.2}}}, ["--dpo-beta=0.2"]),
    ({"training": {"method": "dpo", "dpo": {"loss": "ipo", "labelSmoothing": 0.1}}},
     ["--dpo-label-smoothing=0.1", "--dpo-loss=ipo", "--method=dpo"]),
    ({"training": {"method": "dpo", "dpo": {"beta": 0}}}, ["--dpo-beta=0", "--method=dpo"]),
    ({"training": {"method": "dpo", "dpo": {"labelSmoothing": 0.5}}}, ["--dpo-label-smoothing=0.5", "--method=dpo"]),
    ({"training": {"method": "dpo", "dpo": {"labelSmoothing": -0.1}}},
     ["--dpo-label-smoothing=-0.1", "--method=dpo"]),
    ({"training": {"method": "dpo", "dpo": {"loss": "hinge"}}}, ["--dpo-loss=hinge", "--method=dpo"]),
    ({"training": {"method": "dpo", "lossOn": "all"}}, ["--loss-on=all", "--method=dpo"]),
    ({"training": {"method": "dpo", "tokensPerStep": 65536}}, ["--tokens-per-step=65536", "--method=dpo"]),
    ({"training": {"method": "lora", "lora": {"trainEmbeddings": True}, "freezeEmbeddings": True}},
     ["--lora-train-embeddings=true", "--freeze-embeddings=true", "--method=lora"]),
]
# training.evaluation: each of what the trainer's check_generation refuses.
GENERATE = ["--generate-examples=64", "--generate-max-new-tokens=64"]
TRAINER_REFUSALS += [
    ({"training": {"evaluation": {"generate": {"metrics": ["rougeL", "chrF"]}}}},
     ["--generate-metrics=rougeL,chrF", *GENERATE]),
    ({"training": {"evaluation": {"generate": {"metrics": ["bleu", "bleu"]}}}}, ["--generate-metrics=bleu,bleu", *GENERATE]),
    ({"training": {"evaluation": {"generate": {"metrics": []}}}}, ["--generate-metrics=", *GENERATE]),
    ({"training": {"evaluation": {"generate": {"examples": 5000}}}}, ["--generate-examples=5000"]),
    ({"training": {"evaluation": {"generate": {"maxNewTokens": 4096}}}}, ["--generate-max-new-tokens=4096", *GENERATE[:1]]),
    ({"training": {"evaluation": {"generate": {}, "keepBestBy": "accuracy"}}}, ["--keep-best-by=accuracy", *GENERATE]),
    ({"training": {"evaluation": {"generate": {"metrics": ["exactMatch"]}, "keepBestBy": "rougeL"}}},
     ["--keep-best-by=rougeL", *GENERATE, "--generate-metrics=exactMatch"]),
    ({"training": {"evaluation": {"keepBestBy": "bleu"}}}, ["--keep-best-by=bleu"]),
    ({"checkpoint": {"storagePath": "gs://b/p", "scoreAttribute": "loss"},
      "training": {"evaluation": {"generate": {"metrics": ["rougeL"]}, "keepBestBy": "rougeL"}}},
     ["--keep-best-by=rougeL", *GENERATE, "--generate-metrics=rougeL", "--checkpoint-score-attribute=loss"]),
    ({"training": {"evalFraction": 0, "evaluation": {"generate": {}}}}, [*GENERATE, "--eval-fraction=0.0"]),
    ({"training": {"method": "dpo", "evaluation": {"generate": {}}}}, [*GENERATE, "--method=dpo"]),
    ({"training": {"lossOn": "all", "evaluation": {"generate": {}}}}, [*GENERATE, "--loss-on=all"]),
]
TRAINER_REFUSALS += [
    ({"training": {"activationCheckpointing": "full"}}, ["--activation-checkpointing=full"]),
    ({"training": {"attention": "flash"}}, ["--attention=flash"]),
    ({"training": {"tokensPerStep": 40000}}, ["--tokens-per-step=40000"]),
    ({"training": {"tokensPerStep": 32768, "globalBatchBlocks": 64}},
     ["--tokens-per-step=32768", "--global-batch-blocks=64"]),
]


def _with_flags(argv: list[str], flags: list[str]) -> list[str]:
    replaced = {flag.split("=", 1)[0]: flag for flag in flags}
    present = {arg.split("=", 1)[0] for arg in argv}
    return [replaced.get(arg.split("=", 1)[0], arg) for arg in argv] + [
        flag for name, flag in replaced.items() if name not in present]


@pytest.mark.parametrize("changes,flags", TRAINER_REFUSALS, ids=lambda v: str(v))
def test_what_the_trainer_refuses_the_api_refuses(changes, flags):
    argv = _with_flags(trainer_argv(parse_spec(base_spec()), run_name="r"), flags)
    with pytest.raises(TrainerError, match=flags[0].split("=", 1)[0]):  # the trainer names its flag
        _trainer_config(argv)
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with(**changes))
    changed = {f"spec.{section}.{key}" for section, values in changes.items() for key in values}
    # A nested block's refusal names the field inside it (spec.training.lora.rank).
    assert any(caught.value.field == field or caught.value.field.startswith((field + ".", field + "["))
               for field in changed), (caught.value.field, changed)


def test_every_trainer_refusal_is_an_admission_case():
    """The same values reach the real apiserver through INVALID (test_crd_admission)."""
    admission_specs = [case.spec for case in INVALID]
    for changes, _ in TRAINER_REFUSALS:
        assert spec_with(**changes) in admission_specs, changes


@pytest.mark.parametrize("changes", [
    {"training": {"evalFraction": 0}},
    {"checkpoint": {"storagePath": "gs://b/p", "scoreAttribute": "eval_loss"}},
    {"checkpoint": {"storagePath": "gs://b/p", "scoreAttribute": "tokens_per_s",
                    "scoreOrder": "max"}},
    {"training": {"maxSeqLen": 8, "evalFraction": 0.5}},
    {"training": {"targetEvalLoss": 1.5, "earlyStoppingPatience": 2}},
    {"training": {"tokensPerStep": 65536}},
    {"training": {"evaluation": {"generate": {}}}},
    {"training": {"evaluation": {"generate": {"examples": 8, "maxNewTokens": 2048, "metrics": ["rougeL", "bleu"]},
                                 "keepBestBy": "bleu"}}},
    {"training": {"evaluation": {"keepBestBy": "evalLoss"}}},
    {"tpu": {"generation": "v6e", "topology": "4x4", "slices": 2},
     "training": {"tokensPerStep": 65536, "maxSeqLen": 1024, "batchSizePerDevice": 2}},
], ids=str)
def test_what_the_api_accepts_the_trainer_accepts(changes):
    spec = parse_spec(spec_with(**changes))
    _trainer_config(trainer_argv(spec, run_name="r"))


def test_tokens_per_step_reaches_the_trainer_only_when_set():
    assert not any(arg.startswith("--tokens-per-step") for arg in trainer_argv(parse_spec(base_spec()), run_name="r"))
    argv = trainer_argv(parse_spec(spec_with(training={"tokensPerStep": 65536})), run_name="r")
    plan = _trainer_config(argv).batch_plan()
    assert "--tokens-per-step=65536" in argv
    assert (plan.tokens_per_step, plan.world, plan.blocks, plan.accum) == (65536, 16, 4, 2)


def test_a_collectives_run_ignores_the_checkpoint_ranking():
    spec = parse_spec(spec_with(mode="collectives",
                                checkpoint={"scoreAttribute": "eval_loss"},
                                training={"evalFraction": 0}))
    assert trainer_argv(spec)[1] == "collectives"


def test_loras_closed_sets_and_module_table_are_the_trainers():
    choices = {action.dest: tuple(action.choices) for action in _finetune_parser()._actions
               if action.choices}
    assert api.TRAINING_METHODS == choices["method"] == trainer_lora.METHODS
    assert api.DPO_LOSSES == choices["dpo_loss"] and api.DATASET_FORMATS == choices["dataset_format"]
    assert api.LORA_TARGET_MODULES == trainer_lora.TARGET_MODULES
    assert api.DEFAULT_LORA_TARGET_MODULES == trainer_lora.DEFAULT_TARGET_MODULES


def test_method_lora_without_settings_passes_the_trainers_lora_defaults():
    argv = trainer_argv(parse_spec(spec_with(training={"method": "lora"})), run_name="r")
    given = vars(trainer_cli.build_parser().parse_args(argv[1:]))
    defaults = vars(trainer_cli.build_parser().parse_args(["finetune"]))
    flags = _passed_flags(argv)
    lora_flags = [flag for flag in flags if flag.startswith("--lora-")]
    assert len(lora_flags) == 5 and flags["--method"] == "lora"
    dests = _flag_dests()
    for flag in lora_flags:
        assert given[dests[flag]] == defaults[dests[flag]], flag
    config = _trainer_config(argv)
    assert (config.method, config.lora_rank, config.lora_alpha) == ("lora", 16, 32.0)


def test_the_lora_settings_of_a_spec_reach_the_trainer():
    spec = spec_with(training={"method": "lora", "lora": {"rank": 8, "alpha": 8, "dropout": 0,
                                                          "targetModules": ["q_proj", "v_proj"],
                                                          "exportMerged": False}})
    config = _trainer_config(trainer_argv(parse_spec(spec), run_name="r"))
    assert (config.lora_rank, config.lora_alpha, config.lora_dropout) == (8, 8.0, 0.0)
    assert (config.lora_target_modules, config.lora_export_merged) == ("q_proj,v_proj", False)
    assert not config.lora_train_embeddings


def test_lora_train_embeddings_reaches_the_trainer_only_when_true():
    def flags(lora: dict) -> dict:
        return _passed_flags(trainer_argv(parse_spec(spec_with(training={"method": "lora", "lora": lora})),
                                          run_name="r"))

    on = spec_with(training={"method": "lora", "lora": {"trainEmbeddings": True}})
    assert _trainer_config(trainer_argv(parse_spec(on), run_name="r")).lora_train_embeddings
    assert flags({"trainEmbeddings": True})["--lora-train-embeddings"] == "true"
    for lora in ({}, {"trainEmbeddings": False}):
        assert "--lora-train-embeddings" not in flags(lora), lora


def test_the_memory_fields_closed_sets_are_the_trainers():
    choices = {action.dest: tuple(action.choices) for action in _finetune_parser()._actions
               if action.choices}
    fields = MemorySettings.model_fields
    # auto is the operator's: the memory plan passes what it chose (memplan_sharding).
    assert fields["activation_checkpointing"].annotation.__args__[0].__args__ == ("auto", *choices[
        "activation_checkpointing"]) == ("auto", *trainer_config.ACTIVATION_CHECKPOINTING)
    # The API leaves auto out: unset is the device's kernel.
    assert ("auto", *fields["attention"].annotation.__args__[0].__args__) == choices["attention"]
    assert {case.field.rsplit(".", 1)[1] for case in MEMORY_INVALID} == {
        "activationCheckpointing", "attention", "freezeEmbeddings", "sharding"}


def test_the_memory_settings_of_a_spec_reach_the_trainer():
    spec = spec_with(training={"activationCheckpointing": "selective", "attention": "sdpa",
                               "freezeEmbeddings": True})
    argv = trainer_argv(parse_spec(spec), run_name="r")
    config = _trainer_config(argv)
    assert (config.activation_checkpointing, config.attention, config.freeze_embeddings) == ("selective", "sdpa",
                                                                                           True)
    # Unset or at the trainer's default: no flag at all, so an older trainer image runs the spec.
    for training in ({}, {"activationCheckpointing": "none", "freezeEmbeddings": False}):
        passed = _passed_flags(trainer_argv(parse_spec(spec_with(training=training)), run_name="r"))
        assert not {"--activation-checkpointing", "--attention", "--freeze-embeddings"} & set(passed), training


def test_the_trainer_keeps_blocks_gathered_where_the_plan_says_so():
    on_v7x = spec_with(model={"id": "google/gemma-4-E2B-it"}, tpu={"generation": "v7x", "topology": "2x2x2"})
    assert _trainer_config(trainer_argv(parse_spec(on_v7x), run_name="r")).reshard_after_forward is False
    # Elsewhere no flag at all: the trainer's memory-safe default, and an older trainer image runs the spec.
    on_v6e = spec_with(model={"id": "google/gemma-4-E2B-it"})
    for spec in (on_v6e, base_spec()):
        argv = trainer_argv(parse_spec(spec), run_name="r")
        assert "--reshard-after-forward" not in _passed_flags(argv) and _trainer_config(argv).reshard_after_forward


def test_method_dpo_without_settings_passes_the_trainers_dpo_defaults():
    argv = trainer_argv(parse_spec(spec_with(training={"method": "dpo"})), run_name="r")
    given = vars(trainer_cli.build_parser().parse_args(argv[1:]))
    defaults = vars(trainer_cli.build_parser().parse_args(["finetune"]))
    flags = _passed_flags(argv)
    dpo_flags = [flag for flag in flags if flag.startswith("--dpo-")]
    assert len(dpo_flags) == 5 and flags["--method"] == "dpo"
    assert not [flag for flag in flags if flag.startswith("--lora-")]  # every weight trains
    dests = _flag_dests()
    for flag in dpo_flags:
        assert given[dests[flag]] == defaults[dests[flag]], flag
    config = _trainer_config(argv)
    assert (config.method, config.uses_lora, config.dpo_beta, config.dpo_loss) == ("dpo", False, 0.1, "sigmoid")


def test_the_dpo_settings_of_a_spec_reach_the_trainer_and_lora_trains_adapters():
    spec = spec_with(training={"method": "dpo", "lora": {"rank": 8, "targetModules": ["q_proj", "v_proj"]},
                               "dpo": {"beta": 0.25, "loss": "sigmoid", "labelSmoothing": 0.1,
                                       "referenceFree": True}})
    config = _trainer_config(trainer_argv(parse_spec(spec), run_name="r"))
    assert (config.method, config.dpo_lora, config.uses_lora) == ("dpo", True, True)
    assert (config.dpo_beta, config.dpo_loss, config.dpo_label_smoothing, config.dpo_reference_free) == (
        0.25, "sigmoid", 0.1, True)
    assert (config.lora_rank, config.lora_target_modules) == (8, "q_proj,v_proj")
    # lora: {} is LoRA at its defaults; IPO without smoothing is sound.
    ipo = spec_with(training={"method": "dpo", "lora": {}, "dpo": {"loss": "ipo"}, "datasetFormat": "preference"})
    config = _trainer_config(trainer_argv(parse_spec(ipo), run_name="r"))
    assert (config.dpo_lora, config.lora_rank, config.dpo_loss, config.dataset_format) == (True, 16, "ipo",
                                                                                          "preference")


def test_the_generation_closed_sets_and_defaults_are_the_trainers():
    from tpufinetune.core import specmodels
    from tpufinetune_trainer import generation as trainer_generation

    choices = {action.dest: tuple(action.choices) for action in _finetune_parser()._actions if action.choices}
    assert specmodels.KEEP_BEST_BY == choices["keep_best_by"] == trainer_generation.KEEP_BEST_BY
    assert specmodels.GENERATION_METRICS == trainer_generation.GENERATION_METRICS
    assert (specmodels.MAX_NEW_TOKENS, specmodels.MAX_GENERATE_EXAMPLES) == (
        trainer_generation.MAX_NEW_TOKENS, trainer_generation.MAX_EXAMPLES)


def test_generate_without_settings_passes_the_trainers_defaults_and_turns_it_on():
    argv = trainer_argv(parse_spec(spec_with(training={"evaluation": {"generate": {}}})), run_name="r")
    flags = _passed_flags(argv)
    assert flags["--generate-examples"] == "64" and "--keep-best-by" not in flags
    given = vars(trainer_cli.build_parser().parse_args(argv[1:]))
    defaults = vars(trainer_cli.build_parser().parse_args(["finetune"]))
    for dest in ("generate_max_new_tokens", "generate_metrics"):
        assert given[dest] == defaults[dest], dest
    config = _trainer_config(argv)
    assert (config.generate_examples, config.checkpoint_score_attribute) == (64, "eval_loss")


def test_keep_best_by_a_metric_reaches_the_trainer_which_ranks_checkpoints_by_it():
    spec = spec_with(training={"evaluation": {"generate": {"examples": 8, "maxNewTokens": 32,
                                                           "metrics": ["rougeL", "bleu"]}, "keepBestBy": "bleu"}})
    argv = trainer_argv(parse_spec(spec), run_name="r")
    assert [a for a in argv if a.startswith(("--generate-", "--keep-best-by"))] == [
        "--generate-examples=8", "--generate-max-new-tokens=32", "--generate-metrics=rougeL,bleu",
        "--keep-best-by=bleu"]
    config = _trainer_config(argv)
    assert (config.checkpoint_score_attribute, config.checkpoint_score_order) == ("eval_bleu", "max")


def test_no_evaluation_passes_no_evaluation_flag():
    argv = trainer_argv(parse_spec(base_spec()), run_name="r")
    assert not [a for a in argv if a.startswith(("--generate-", "--keep-best-by"))]
