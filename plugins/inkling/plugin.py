"""Hook implementations of the Inkling plugin (no heavy imports: specs only)."""

from __future__ import annotations

from ferrule import hookimpl
from ferrule.contract.specs import (ChatTemplateSpec, FamilyStatus, LoRAApplierSpec, ModelFamilySpec, ToolParserSpec,
                           TowerSpec)
from ferrule.contract.variants import Variants

# inkling_text is VALIDATED: logits == InklingForCausalLM within 1e-5 (fp32; TP=1, TP=2, EP=2) and gradients within
# 1e-5 relative (plugins/inkling/tests/test_inkling_parity.py), bit-exact conversion loading cleanly in transformers
# (plugins/inkling/tests/test_inkling_convert.py, conformance kit), exact embedded rollout (plugins/inkling/tests/test_inkling_rollout.py), update
# groups + checked weight sync and GRPO on the shipped example with bit-identical resume (plugins/inkling/tests/test_inkling_rl.py).
# inkling (multimodal) is VALIDATED: the conformance kit (tests/test_conformance.py, inkling.TINY_HF_CONFIG +
# tiny_media) checks the bit-exact round trip, text logits and logits of an image+audio prompt through both towers ==
# InklingForConditionalGeneration within 1e-5 at TP=1 and TP=2 (each tower changes the logits); gradients on a
# multimodal batch, towers on every weight sync and embedded rollout with media (plugins/inkling/tests/test_inkling_towers.py), LoRA ==
# HF PEFT with and without media (tests/test_lora_inkling_mm.py), multimodal GRPO with bit-identical resume
# (plugins/inkling/tests/test_inkling_mm_rl.py) and media through the service (tests/test_serve_media.py).

#: family -> variant module holding CONFIG_TRANSLATION, build_provider, MAPPING, UPDATE_GROUPS.
VARIANTS = Variants({"inkling_text": "ferrule.plugins.inkling.inkling_text", "inkling": "ferrule.plugins.inkling.inkling"},
                    build="build_provider")


@hookimpl
def register_providers():
    return VARIANTS.providers()


@hookimpl
def register_converters():
    return VARIANTS.converters()


@hookimpl
def register_update_groups():
    return VARIANTS.update_groups()


@hookimpl
def register_model_families():
    return [
        ModelFamilySpec(
            name="inkling",
            model_types=("inkling_mm_model",),
            status=FamilyStatus.VALIDATED,
            hf_model_class="transformers:InklingForConditionalGeneration",
            features=("lora", "chat_template", "towers"),
            description="Inkling multimodal MoE (text, vision and audio towers)",
        ),
        ModelFamilySpec(
            name="inkling_text",
            model_types=("inkling_text",),
            status=FamilyStatus.VALIDATED,
            hf_model_class="transformers:InklingForCausalLM",
            description="Inkling text MoE (ShortConv, local/global relative attention, shared-expert-sink router)",
        ),
    ]


#: TMLv0 model turns end with <|content_model_end_sampling|> (tml-renderers' ``v0.Renderer.stop()`` is [200006]).
_TMLV0_STOP_TOKENS = ("<|content_model_end_sampling|>",)


@hookimpl
def register_chat_templates():
    return [
        ChatTemplateSpec(
            name="tmlv0",
            family="inkling",
            template="ferrule.tmlv0:templates/tmlv0.jinja",
            stop_tokens=_TMLV0_STOP_TOKENS,
            tokenizer="ferrule.tmlv0.tokenizer:load_tmlv0_tokenizer",
            description="TMLv0 (tml-renderers v0): effort line, thinking, tool calls, image/audio placeholders",
        ),
    ]


@hookimpl
def register_tool_parsers():
    return [ToolParserSpec(family="inkling", parse="ferrule.tmlv0.tool_calls:parse_tmlv0")]


@hookimpl
def register_lora_appliers():
    # the multimodal family adapts its language model with the same appliers (towers stay frozen); its PEFT
    # names come from inkling.PEFT_MAPPING (MAPPING.peft_table): model.language_model.layers.L...
    peft, ink = "ferrule.lora.peft_format", "ferrule.plugins.inkling.lora"
    return [spec for family in VARIANTS for spec in (
        LoRAApplierSpec(kind="attention", family=family, apply=f"{ink}:apply_attention",
                        export=f"{peft}:export_linear", load=f"{peft}:load_linear"),
        LoRAApplierSpec(kind="shared_experts", family=family, apply=f"{ink}:apply_shared_experts",
                        export=f"{ink}:export_shared_experts", load=f"{ink}:load_shared_experts"))]


@hookimpl
def register_towers():
    # frozen by default, as miles trains Inkling (reference/miles_study.md 1.6); placeholder ids come from the
    # InklingConfig (image_token_id 200054 / audio_token_id 200053 in the released checkpoints)
    return [
        TowerSpec(family="inkling", modality="vision", build="ferrule.plugins.inkling.towers:build_vision_tower",
                  placeholder_config_key="image_token_id", hf_prefix="model.visual.", update_group="vision_tower", hf_input="pixel_values",
                  preprocess="ferrule.plugins.inkling.towers:preprocess_image"),
        TowerSpec(family="inkling", modality="audio", build="ferrule.plugins.inkling.towers:build_audio_tower",
                  placeholder_config_key="audio_token_id", hf_prefix="model.audio.", update_group="audio_tower", hf_input="audio_input_ids",
                  preprocess="ferrule.plugins.inkling.towers:preprocess_audio"),
    ]
