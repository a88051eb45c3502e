"""parse_spec: defaults, accepted names, and one-line refusals naming the field."""
from __future__ import annotations

import pytest
from api_spec_cases import INVALID, base_spec, spec_with

from tpufinetune.core import api
from tpufinetune.core.api import TPUFineTuneSpec, parse_spec, parse_stored_spec
from tpufinetune.core.errors import SpecError
from tpufinetune.core.generations import ALL_GENERATION_NAMES
from tpufinetune.core.status import TPUFineTuneStatus


def test_api_identity_constants():
    assert (api.GROUP, api.VERSION, api.KIND, api.PLURAL) == (
        "tpufinetune.dev", "v1alpha1", "TPUFineTune", "tpufinetunes")
    assert api.API_VERSION == "tpufinetune.dev/v1alpha1"


def test_minimal_spec_gets_the_defaults():
    spec = parse_spec(base_spec())
    assert spec.mode == "finetune"
    assert spec.tpu.slices == 1 and spec.tpu.chips_per_host is None
    assert spec.tpu.spot is False and spec.tpu.reservation is None
    assert spec.model.id == "google/gemma-4-E2B-it" and spec.model.token_secret is None
    assert (spec.dataset.id, spec.dataset.split) == ("databricks/databricks-dolly-15k",
                                                     "train[:1024]")
    training = spec.training
    # The tutorial's 4 examples per device per step (packed into blocks by the trainer).
    assert (training.epochs, training.batch_size_per_device, training.max_seq_len) == (3, 4, 512)
    assert (training.global_batch_blocks, training.lr_schedule, training.warmup_ratio) == (0, "cosine", 0.05)
    assert (training.max_grad_norm, training.max_steps, training.prompt_format) == (1.0, 0, "auto")
    assert (training.learning_rate, training.weight_decay, training.seed) == (2e-5, 0.01, 42)
    assert training.eval_fraction == 0.05
    checkpoint = spec.checkpoint
    assert (checkpoint.keep, checkpoint.score_attribute, checkpoint.score_order) == (
        1, "auto", "min")
    assert spec.ray_version == "2.60.0"
    assert spec.max_retries == 0 and spec.suspend is False
    assert spec.active_deadline_seconds is None and spec.ttl_seconds_after_finished == 0
    assert spec.no_progress_timeout_seconds == 3600


@pytest.mark.parametrize("name", ALL_GENERATION_NAMES)
def test_every_generation_name_users_type_is_accepted_and_kept_as_written(name):
    topology = {"v5e": "2x2", "v5litepod": "2x2", "v6e": "2x2", "trillium": "2x2",
                "cpu": "2"}.get(name, "2x2x1")
    spec = parse_spec(spec_with(tpu__generation=name, tpu__topology=topology))
    # The operator never rewrites spec (GitOps drift): the alias survives parsing.
    assert spec.tpu.generation == name


def test_snake_case_field_names_are_accepted_too():
    spec = parse_spec({"tpu": {"generation": "v6e", "topology": "4x4", "chips_per_host": 4},
                       "image": "img", "checkpoint": {"storage_path": "gs://b/shared"}})
    assert spec.tpu.chips_per_host == 4 and spec.checkpoint.storage_path == "gs://b/shared"


def test_collectives_needs_no_storage_path_and_may_span_slices():
    spec = parse_spec(spec_with(mode="collectives", checkpoint=None, tpu__slices=4))
    assert spec.tpu.slices == 4 and spec.checkpoint.storage_path is None


def test_yaml_numbers_are_accepted_as_quantities():
    spec = parse_spec(spec_with(workers={"resources": {"requests": {"cpu": 32},
                                                       "limits": {"cpu": "32"}}}))
    assert spec.workers.resources.requests == {"cpu": "32"}


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_invalid_spec_is_refused_with_the_field_named(case):
    with pytest.raises(SpecError) as caught:
        parse_spec(case.spec)
    error = caught.value
    assert error.field == case.field
    if case.python_exact:
        assert error.message == case.message
    else:
        assert case.message in error.message
    assert str(error) == f"{error.field}: {error.message}" and "\n" not in str(error)


def test_request_above_the_default_limit_is_refused():
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with(workers={"resources": {"requests": {"cpu": 100}}}))
    assert str(caught.value) == "spec.workers.resources.requests.cpu: 100 exceeds the limit 64"


def test_memory_limit_that_cannot_hold_dev_shm_is_refused():
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with(workers={"resources": {"requests": {"memory": "64Gi"},
                                                    "limits": {"memory": "64Gi"}}}))
    assert caught.value.field == "spec.workers.resources.limits.memory"
    assert "100Gi /dev/shm" in caught.value.message


def test_spec_must_be_a_mapping():
    with pytest.raises(SpecError, match="^spec: must be a mapping$"):
        parse_spec(["not", "a", "mapping"])


def test_direct_construction_runs_the_same_cross_field_rules():
    with pytest.raises(ValueError, match="spec.tpu.slices"):
        TPUFineTuneSpec.model_validate(spec_with(tpu={"generation": "cpu", "topology": "40", "slices": 2}))


def test_finetune_spans_slices_up_to_the_generation_ceiling():
    assert parse_spec(spec_with(tpu__slices=2)).tpu.slices == 2
    assert parse_spec(spec_with(tpu={"generation": "v5p", "topology": "16x16x24", "slices": 3})).tpu.slices == 3
    assert parse_spec(spec_with(tpu={"generation": "cpu", "topology": "2", "slices": 32})).tpu.slices == 32
    # The global batch counts every slice's devices: 2 slices x 16 devices x 4.
    assert parse_spec(spec_with(tpu__slices=2, training={"globalBatchBlocks": 256})).training.global_batch_blocks == 256


def test_status_dumps_with_the_crd_field_names():
    status = TPUFineTuneStatus(phase="Running", epoch=2, epochs=3, epoch_progress="2/3",
                               checkpoint_uri="gs://b/c", dashboard_url="http://h:8265",
                               history=[{"epoch": 1, "loss": 3.14, "checkpointURI": "gs://b/1"}])
    dumped = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert dumped == {
        "phase": "Running", "epoch": 2, "epochs": 3, "epochProgress": "2/3",
        "checkpointURI": "gs://b/c", "dashboardURL": "http://h:8265",
        "history": [{"epoch": 1, "loss": 3.14, "checkpointURI": "gs://b/1"}],
    }


def test_status_read_back_ignores_fields_it_does_not_know():
    status = TPUFineTuneStatus.model_validate({"phase": "Pending", "kopf": {"progress": {}}})
    assert status.phase == "Pending"


def test_a_local_checkpoint_path_needs_no_shared_volume_on_one_machine():
    """A local Ray head (`tpufinetune run --local`): every Ray process shares one
    filesystem, so the shared-storage rule (test_crd_admission) does not apply there."""
    spec = spec_with(tpu={"generation": "cpu", "topology": "2"}, checkpoint={"storagePath": "/tmp/ckpt"})
    with pytest.raises(SpecError, match="spec.checkpoint.storagePath: is a local path"):
        parse_spec(spec)
    assert parse_spec(spec, one_machine=True).checkpoint.storage_path == "/tmp/ckpt"
    assert parse_stored_spec(spec, one_machine=True)[0].checkpoint.storage_path == "/tmp/ckpt"


def test_lora_defaults_adapt_the_language_models_attention_and_mlp_projections():
    # Unset means full, and stays unset: a schema default would be stored in every object,
    # which an operator older than the field refuses after a rollback.
    assert parse_spec(base_spec()).training.method is None
    assert parse_spec(base_spec()).training.lora_settings() is None
    assert parse_spec(spec_with(training={"method": "full"})).training.lora_settings() is None
    lora = parse_spec(spec_with(training={"method": "lora"})).training.lora_settings()
    assert (lora.rank, lora.alpha, lora.export_merged) == (16, 32.0, True)
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    given = parse_spec(spec_with(training={"method": "lora", "lora": {"rank": 4, "targetModules": ["q_proj"]}}))
    assert (given.training.lora.rank, given.training.lora.target_modules) == (4, ["q_proj"])


def test_every_known_lora_module_name_is_some_familys():
    names = {name for family in api.LORA_TARGET_MODULES.values() for name in family}
    assert set(api.LORA_MODULE_NAMES) == names and set(api.DEFAULT_LORA_TARGET_MODULES) <= names


def test_the_trainers_result_puts_the_exported_adapter_in_status():
    from tpufinetune.core.runevents import apply_event

    status: dict = {}
    apply_event(status, {"event": "result", "best_checkpoint_uri": "gs://b/run/epoch_0001-x", "best_step": 9,
                         "exported_model_uri": "gs://b/run/export",
                         "exported_adapter_uri": "gs://b/run/export-adapter"})
    parsed = TPUFineTuneStatus.model_validate(status)
    assert (parsed.exported_model_uri, parsed.exported_adapter_uri) == ("gs://b/run/export",
                                                                      "gs://b/run/export-adapter")
    assert parsed.model_dump(by_alias=True, exclude_none=True)["exportedAdapterURI"] == "gs://b/run/export-adapter"


@pytest.mark.parametrize("model_id", ["google/gemma-4-26B-A4B-it", "Google/Gemma-4-26B-A4B"])
def test_a_mixture_of_experts_model_is_refused_by_name_with_the_dense_ones_to_use(model_id):
    with pytest.raises(SpecError) as refused:
        parse_spec(spec_with(model__id=model_id))
    assert refused.value.field == "spec.model.id"
    message = str(refused.value)
    assert model_id in message and "mixture-of-experts" in message and "128 experts" in message
    assert "google/gemma-4-31B-it" in message and "26B" not in message.split("instead")[1]


@pytest.mark.parametrize("model_id", ["google/gemma-4-31B-it", "google/gemma-4-E2B", "someone/own-moe-model",
                                      "gs://bucket/models/gemma-4-26B-A4B-it"])
def test_dense_and_unknown_models_are_not_refused_here(model_id):
    # Only the planner's table is known here; the trainer refuses a MoE config it reads.
    assert parse_spec(spec_with(model__id=model_id)).model.id == model_id
