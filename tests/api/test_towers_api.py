"""spec.training.towers (a multimodal run) in the API, pure: its defaults, the CEL twins in the
generated CRD (api_spec_cases.TOWERS_INVALID and TOWERS_ACCEPTED run against the real apiserver in
test_crd_admission.py, and through parse_spec in test_api_models.py), the trainer argv, the memory
plan's vision tower and its figures against transformers' own Gemma 4 classes, and what an operator
older than the field does with a multimodal run (a rollback)."""
from __future__ import annotations

import dataclasses

import pytest

import older_operator
from api_spec_cases import TOWERS_ACCEPTED, TOWERS_INVALID, base_spec, spec_with
from tpufinetune import crdgen
from tpufinetune.core import memplan, memplan_media, memplan_spec, validation
from tpufinetune.core.api import parse_spec
from tpufinetune.core.jobspec import trainer_argv
from tpufinetune.core.status import checked_status

# The last operator without spec.training.towers.
PRE_TOWERS_COMMIT = "9a1dfbb4806ed677b6cb157de1ef901a8e474931"
MESSAGES = {validation.TOWERS_AUDIO_MESSAGE, validation.TOWERS_MODE_MESSAGE, validation.MEDIA_TOKENS_MESSAGE,
            validation.TOWERS_WITH_MESSAGE, validation.TOWERS_TRAINED_MESSAGE, validation.TOWERS_EXPORT_MESSAGE}


def test_unset_is_a_text_run_and_the_defaults_are_a_frozen_tower_and_one_image():
    assert parse_spec(base_spec()).training.towers is None
    towers = parse_spec(spec_with(training={"towers": {}})).training.towers
    assert (towers.vision, towers.audio, towers.max_images_per_example) == ("frozen", None, 1)


def test_every_towers_message_has_its_cel_twin_and_towers_stores_no_default():
    spec = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = spec["x-kubernetes-validations"] + spec["properties"]["training"]["x-kubernetes-validations"]
    assert MESSAGES <= {rule.get("message") for rule in rules}
    towers = spec["properties"]["training"]["properties"]["towers"]
    assert "default" not in towers and "default" not in towers["properties"]["audio"]


@pytest.mark.parametrize("case", TOWERS_INVALID, ids=lambda c: c.id)
def test_parse_spec_refuses_each_towers_case_naming_its_field(case):
    with pytest.raises(validation.SpecError) as caught:
        parse_spec(case.spec)
    assert caught.value.field == case.field
    if case.python_exact:
        assert str(caught.value) == f"{case.field}: {case.message}"


@pytest.mark.parametrize("spec", TOWERS_ACCEPTED, ids=str)
def test_parse_spec_accepts_each_towers_spec(spec):
    parse_spec(spec)


def test_the_media_rule_knows_every_gemma_4_id_of_the_table_and_nothing_else():
    known = memplan_media.known_tokens_per_image()
    assert set(known) == set(memplan.KNOWN_MODELS) and set(known.values()) == {282}
    assert memplan_media.tokens_per_image(" google/GEMMA-4-31b-it ") == 282
    assert memplan_media.tokens_per_image("gs://bucket/my-gemma") is None


# ---- the trainer argv ---------------------------------------------------------------------------

def test_a_multimodal_run_passes_its_towers_and_a_text_runs_argv_is_unchanged():
    text = trainer_argv(parse_spec(base_spec()), run_name="r")
    assert not [arg for arg in text if arg.startswith(("--vision-tower", "--max-images"))]
    # A model the planner does not know, so that the plan's choices (--shard-group, ...) are the same.
    training = {"method": "full", "maxSeqLen": 2048}
    spec = spec_with(model={"id": "gs://b/m"}, training={**training, "towers": {"vision": "trained",
                                                                                "maxImagesPerExample": 7}})
    multimodal = trainer_argv(parse_spec(spec), run_name="r")
    assert multimodal[-3:-1] == ["--vision-tower=trained", "--max-images-per-example=7"]
    text_of_it = trainer_argv(parse_spec(spec_with(model={"id": "gs://b/m"}, training=training)), run_name="r")
    assert multimodal[:-3] + multimodal[-1:] == text_of_it


def _trainer_config(argv: list[str]):
    """What the trainer makes of `argv`: its parser, its config, its checks."""
    from tpufinetune_trainer import cli as trainer_cli

    return trainer_cli._config(trainer_cli.build_parser().parse_args(argv[1:])).validate()


@pytest.mark.parametrize("spec", TOWERS_ACCEPTED, ids=str)
def test_the_trainer_takes_the_argv_of_every_towers_spec_the_api_accepts(spec):
    config = _trainer_config(trainer_argv(parse_spec(spec), run_name="r"))
    towers = parse_spec(spec).training.towers
    assert (config.vision_tower, config.max_images_per_example) == (towers.vision, towers.max_images_per_example)


TRAINER_REFUSED = (validation.TOWERS_WITH_MESSAGE, validation.TOWERS_TRAINED_MESSAGE,
                   validation.TOWERS_EXPORT_MESSAGE)


@pytest.mark.parametrize("case", [c for c in TOWERS_INVALID if c.message in TRAINER_REFUSED], ids=lambda c: c.id)
def test_what_the_trainer_refuses_of_a_multimodal_run_the_api_refuses(case):
    """Each setting the trainer's multimodal path refuses, given beside --vision-tower."""
    from tpufinetune_trainer.errors import TrainerError

    training = case.spec["training"]
    without = {**case.spec, "training": {k: v for k, v in training.items() if k != "towers"}}
    argv = trainer_argv(parse_spec(without), run_name="r")
    argv.append(f"--vision-tower={training['towers'].get('vision', 'frozen')}")
    with pytest.raises(TrainerError, match="--vision-tower"):
        _trainer_config(argv)


# ---- the memory plan ----------------------------------------------------------------------------

def _vision_model(**config):
    import torch  # the trainer's stack, a dev dependency (missing, the test fails, never skips)
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel

    with torch.device("meta"):
        return Gemma4VisionModel(Gemma4VisionConfig(**config))


def _config_of(shape: memplan_media.VisionShape) -> dict:
    return dict(num_hidden_layers=shape.layers, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                num_attention_heads=shape.heads, head_dim=shape.head_dim, num_key_value_heads=shape.kv_heads,
                patch_size=shape.patch_size, pooling_kernel_size=shape.pooling_kernel,
                position_embedding_size=shape.position_embeddings)


@pytest.mark.parametrize("name", ["gemma-4-E2B", "gemma-4-31B"])
def test_the_towers_parameters_are_what_transformers_builds(name):
    shape = memplan_media.VISION_TOWERS[name]
    model = _vision_model(**_config_of(shape))
    assert shape.parameters == sum(p.numel() for p in model.parameters())


def test_e2b_s_tower_is_transformers_default_and_its_tokens_the_processors():
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil as Gemma4ImageProcessor

    shape, default = memplan_media.VISION_TOWERS["gemma-4-E2B"], Gemma4VisionConfig()
    assert _config_of(shape) == {key: getattr(default, key) for key in _config_of(shape)}
    assert (shape.patch_size, shape.pooling_kernel, shape.soft_tokens) == (
        Gemma4ImageProcessor.patch_size, Gemma4ImageProcessor.pooling_kernel_size, Gemma4ImageProcessor.max_soft_tokens)
    assert memplan_media.VISION_TOWERS["gemma-4-E4B"] == shape


def _request(vision: str = "", method: str = "full", **changes) -> memplan.Request:
    return memplan.Request(**{"model_id": "google/gemma-4-E2B-it", "method": method, "generation": "v6e",
                              "topology": "4x4", "max_seq_len": 512, "batch_per_device": 2, "vision_tower": vision,
                              **changes})


def test_e2b_s_audio_tower_is_transformers_default_and_loaded_frozen():
    import torch
    from transformers.models.gemma4.configuration_gemma4 import Gemma4AudioConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel

    with torch.device("meta"):
        audio = Gemma4AudioModel(Gemma4AudioConfig())
    towers = memplan_media.MODEL_TOWERS["gemma-4-E2B"]
    assert towers.audio_parameters == sum(p.numel() for p in audio.parameters())
    assert towers.audio_width == Gemma4AudioConfig().output_proj_dims
    assert memplan_media.MODEL_TOWERS["gemma-4-31B"].audio_parameters == 0


TOWER, AUDIO = 167_364_608, 304_824_608
PROJECTORS = 768 * 1536 + 1536 * 1536  # embed_vision, embed_audio into E2B's 1536 wide model


def test_every_tower_is_in_the_root_unit_sharded_and_gathered_and_only_the_vision_projector_trains():
    """Frozen (the default): the towers' fp32 masters sharded over the 16 devices and their bf16
    copy whole (FSDP2's root unit stays gathered through the step); embed_vision alone trains: its
    gradient sharded and unsharded, and AdamW's two moments. With LoRA the same, the frozen rest
    in bf16 (lora.inject) and embed_vision in fp32 beside the adapters."""
    loaded, projector = TOWER + AUDIO + PROJECTORS, 768 * 1536
    trains = -(-4 * projector // 16) + -(-8 * projector // 16) + 6 * projector
    full = memplan.estimate(_request("frozen")).media
    assert (full.tower_parameters, full.audio_parameters, full.projector_parameters) == (TOWER, AUDIO, PROJECTORS)
    assert (full.weight_bytes, full.trained_bytes) == (-(-4 * loaded // 16) + 2 * loaded, trains)
    lora = memplan.estimate(_request("frozen", method="lora")).media
    assert lora.weight_bytes == -(-(2 * (loaded - projector) + 4 * projector) // 16) + 2 * loaded
    assert lora.trained_bytes == trains


def test_a_trained_tower_holds_its_sharded_state_and_every_layers_activations():
    frozen, trained = (memplan.estimate(_request(mode)).media for mode in ("frozen", "trained"))
    assert trained.weight_bytes == frozen.weight_bytes
    projector = 768 * 1536

    def state(trained_parameters: int) -> int:  # gradient and AdamW sharded, the gradient unsharded
        return -(-4 * trained_parameters // 16) + -(-8 * trained_parameters // 16) + 6 * trained_parameters

    assert (frozen.trained_bytes, trained.trained_bytes) == (state(projector), state(projector + TOWER))
    assert trained.activation_bytes > 10 * frozen.activation_bytes  # 16 layers kept, not one at a time


def test_a_multimodal_step_is_planned_over_the_full_logits():
    """The trainer's multimodal loss runs over transformers' full logits (methods/media_sft.py)."""
    text = memplan_spec.request_of(parse_spec(base_spec()))
    multimodal = memplan_spec.request_of(parse_spec(spec_with(training={"towers": {}})))
    assert (text.loss_head, multimodal.loss_head) == ("labels", "full")


def test_the_towers_add_to_the_step_and_the_text_plan_is_as_before():
    text, multimodal = memplan.estimate(_request()), memplan.estimate(_request("frozen"))  # the same loss head
    assert text.media is None and text.breakdown.towers == 0
    assert multimodal.breakdown.towers == multimodal.media.bytes > 0
    assert multimodal.per_chip_bytes - text.per_chip_bytes == multimodal.media.bytes
    assert dataclasses.replace(multimodal.breakdown, towers=0) == text.breakdown
    assert multimodal.host_bytes > text.host_bytes  # the export proof loads the towers too


def test_a_block_holds_as_many_images_as_its_tokens():
    plan = memplan.estimate(_request("frozen", max_seq_len=2048)).media
    assert (plan.tokens_per_image, plan.images_per_block, plan.media_tokens_per_block) == (282, 7, 1974)
    assert plan.images_per_micro_batch == 14  # two blocks a device


def test_status_plan_shows_the_towers_and_a_text_runs_plan_has_no_such_key():
    text = memplan_spec.status_of(memplan_spec.plan_spec(parse_spec(base_spec())))
    assert "towers" not in text
    status = memplan_spec.status_of(memplan_spec.plan_spec(parse_spec(spec_with(training={"towers": {}}))))
    towers = status["towers"]
    assert towers["vision"] == "frozen" and towers["visionParameters"] == 167_364_608
    assert (towers["tokensPerImage"], towers["imagesPerBlock"], towers["mediaTokensPerBlock"]) == (282, 1, 282)
    assert "Gemma4VisionConfig" in towers["widthsFrom"] and "vision tower frozen" in status["message"]
    assert set(text) <= set(status)
    checked_status({"phase": "Pending", "plan": status})  # every key declared (it refuses any other)


def test_the_plan_from_the_models_config_json_keeps_the_tower():
    """The trainer's `model` event (its text config) plans the run again: the tower stays counted."""
    request = memplan_spec.request_of(parse_spec(spec_with(training={"towers": {"vision": "trained"}})))
    config = {"num_hidden_layers": 35, "hidden_size": 1536, "intermediate_size": 8192, "num_attention_heads": 8,
              "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "model_type": "gemma4_text"}
    replanned = memplan_spec.with_model_config(request, config)
    assert replanned.basis == "config" and replanned.media.vision == "trained"
    assert memplan_spec.status_of(replanned)["towers"] == memplan_spec.status_of(memplan.estimate(request))["towers"]


def test_what_fits_instead_of_a_trained_tower_may_be_lora_on_its_projections():
    """With LoRA a trained vision tower takes adapters on its projections (accepted at apply), so
    the plan may offer method lora as the lighter method, and the offer fits; or nothing (a
    trained tower keeps every layer's eager attention over 2,520 patches an image: seven images a
    block of 2048 tokens fit no v6e slice, LoRA's adapters or not)."""
    fewer = memplan.estimate(_request("trained", batch_per_device=4))
    assert fewer.fits is False
    assert fewer.smallest_fit == "method lora (rank 16), batchSizePerDevice 2, activationCheckpointing block, " \
                                 "topology 8x8 (64 chips)"
    offered = memplan.estimate(_request("trained", method="lora", batch_per_device=2,
                                        activation_checkpointing="block", topology="8x8"))
    assert offered.fits is True and offered.media.vision == "trained"
    none = memplan.estimate(_request("trained", batch_per_device=4, max_seq_len=2048))
    assert none.fits is False and none.smallest_fit == ""
    assert none.refusal().endswith("nothing on v6e fits, even method lora at batchSizePerDevice 1")


def test_a_model_the_table_does_not_know_plans_no_tower():
    spec = parse_spec(spec_with(model={"id": "gs://b/m", "parameters": 2_000_000_000}, training={"towers": {}}))
    assert memplan_spec.plan_spec(spec).media is None


# ---- version skew -------------------------------------------------------------------------------

def test_an_operator_older_than_towers_names_them_ignored_and_passes_no_tower_flag(tmp_path):
    """A rollback: the older operator drops spec.training.towers as an unknown field and names it
    (condition SpecFieldsIgnored, a Warning Event), and its job is a text run: no tower flag."""
    operator = older_operator.extract(PRE_TOWERS_COMMIT, tmp_path, "pre-towers")
    spec = spec_with(training={"towers": {"vision": "trained"}})
    answer = older_operator.reads(operator, spec)
    assert answer["ignored"] == ["spec.training.towers"]
    assert answer["says"].startswith("this operator version does not know spec.training.towers")
    assert not [arg for arg in answer["argv"] if arg.startswith(("--vision-tower", "--max-images"))]
