"""Hook implementations of the Inkling plugin (no heavy imports: specs only)."""

from __future__ import annotations

from ferrule import hookimpl
from ferrule.specs import FamilyStatus, ModelFamilySpec


@hookimpl
def register_model_families():
    return [
        ModelFamilySpec(
            name="inkling",
            model_types=("inkling_mm_model", "inkling_text"),
            status=FamilyStatus.STRUCTURAL,
            reason=(
                "registered for discovery only: the Megatron provider (ShortConv, local/global relative "
                "attention, shared-expert-sink router), mapping table, update groups, LoRA appliers, TMLv0 "
                "template and vision/audio towers are not implemented yet"
            ),
            hf_model_class="transformers:InklingForConditionalGeneration",  # text-only: InklingForCausalLM
            features=("lora", "chat_template", "towers"),
            description="Inkling multimodal MoE (text, vision and audio towers)",
        ),
    ]
