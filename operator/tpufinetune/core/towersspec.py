"""spec.training.towers: a multimodal run's settings (the models layer of the API, beside
specmodels.py). The rules across fields are validation._check_towers and its CEL twins
(celrules.towers_spec_rules, training_rules); the plan's vision tower is memplan_media.py."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .apimodels import _Model

# spec.training.towers: what becomes of each tower in front of the language model (the
# trainer's --vision-tower choices), and how many images an example may hold.
TOWER_MODES = ("frozen", "trained")
# With LoRA, `vision: trained` puts adapters on these of training.lora.targetModules: the vision
# tower's attention and MLP projections (the trainer's lora.TOWER_TARGET_MODULES).
TOWER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_IMAGES_PER_EXAMPLE = 64


class Towers(_Model):
    """A multimodal run: the model's own processor renders each example's images into its
    prompt, and the vision tower computes their features on the device each micro-batch."""

    vision: Literal[TOWER_MODES] = Field(  # type: ignore[valid-type]
        "frozen", description="frozen: the vision tower is held in bfloat16 and not trained (no gradients, no "
                              "optimizer state); the projector into the language model trains (with LoRA, in full "
                              "beside the adapters). trained: the tower trains too: with method full its weights "
                              "(fp32 master weights, gradients and AdamW state); with LoRA adapters on its "
                              "attention and MLP projections named in lora.targetModules (q_proj, k_proj, "
                              "v_proj, o_proj, gate_proj, up_proj, down_proj), its base frozen in bfloat16 and "
                              "merged into by the export.")
    # No schema default: unset is the only value this version accepts (audio is not built yet).
    audio: Literal[TOWER_MODES] | None = Field(  # type: ignore[valid-type]
        None, description="Reserved for the audio tower: refused while audio fine-tuning is not built.")
    max_images_per_example: int = Field(
        1, ge=1, le=MAX_IMAGES_PER_EXAMPLE,
        description="Images an example may hold at most (an example with more is refused, naming its row). "
                    "Their media tokens (Gemma 4: 282 an image, 280 soft tokens between a begin and an end "
                    "token) must fit training.maxSeqLen.")
