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


#: TMLv0 model turns end with <|content_model_end_sampling|> (tml-renderers' ``v0.Renderer.stop()`` is [200006]).
_TMLV0_STOP_TOKENS = ("<|content_model_end_sampling|>",)


@hookimpl
def register_chat_templates():
    from ferrule.specs import ChatTemplateSpec

    return [
        ChatTemplateSpec(
            name="tmlv0",
            family="inkling",
            template="ferrule.plugins.inkling:templates/tmlv0.jinja",
            stop_tokens=_TMLV0_STOP_TOKENS,
            tokenizer="ferrule.plugins.inkling.tokenizer:load_tmlv0_tokenizer",
            description="TMLv0 (tml-renderers v0): effort line, thinking, tool calls, image/audio placeholders",
        ),
    ]
