"""Hook implementations of the Inkling-2 plugin (no heavy imports: specs only)."""

from __future__ import annotations

from ferrule import hookimpl
from ferrule.contract.specs import (ChatTemplateSpec, FamilyStatus, LoRAApplierSpec, ModelFamilySpec, ToolParserSpec,
                           TowerSpec)
from ferrule.contract.variants import Variants

# inkling2_text is VALIDATED: the conformance kit passes (HF -> torch_dist -> HF bit-exact, mapping, update groups,
# logits == Inkling2ForCausalLM at TP=1 and TP=2); plugins/inkling2/tests/test_inkling2.py: gradients within 1e-5 at TP=1 and EP=2,
# embedded-rollout logprobs and weight sync; the released MXFP8 experts convert (tests/test_convert_mxfp8.py).
# LoRA == HF PEFT (tests/test_lora_inkling2.py). The TMLv0 chat template is Inkling's (register_chat_templates
# below says why it applies).
# inkling2_loop is VALIDATED on the same grounds: the conformance kit passes (round trip, mapping, update groups,
# logits == Inkling2LoopForCausalLM at TP=1 and TP=2); plugins/inkling2/tests/test_inkling2.py: gradients at TP=1 and EP=2,
# embedded-rollout logprobs, weight sync; LoRA (the loop gates' included) == HF PEFT (tests/test_lora_inkling2.py);
# the released Inkling-2-Mini NVFP4 experts (w13/w2 _weight_scale, _weight_amax, _weight_outer_scale_denominator)
# convert bit-equal to Inkling2LoopForCausalLM.from_pretrained and ferrule check passes on such a folder at TP=1
# and TP=2 (tests/test_convert_nvfp4.py).

# inkling2 (multimodal) is VALIDATED: the conformance kit passes with the vision tower (round trip, mapping, update
# groups, text and image-prompt logits == Inkling2ForConditionalGeneration at TP=1 and TP=2); plugins/inkling2/tests/test_inkling2_mm.py
# adds the word-embedding gradient on an image prompt, EP=2 with images, embedded-rollout logprobs with images and the
# tower's weight sync; LoRA == HF PEFT with an image prompt, gradients included (tests/test_lora_inkling2.py); ferrule
# check passes at TP=1 and TP=2 (text logits); multimodal GRPO on the shipped example with a bit-identical resume
# (plugins/inkling2/tests/test_inkling2_mm_rl.py); images through ferrule serve (tests/test_serve_inkling2.py).

#: family -> variant module holding CONFIG_TRANSLATION, build_provider, MAPPING, UPDATE_GROUPS.
VARIANTS = Variants({"inkling2_text": "ferrule.plugins.inkling2.inkling2_text",
                     "inkling2_loop": "ferrule.plugins.inkling2.inkling2_loop",
                     "inkling2": "ferrule.plugins.inkling2.inkling2"}, build="build_provider")


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
            name="inkling2_text",
            model_types=("inkling2_text",),
            status=FamilyStatus.VALIDATED,
            hf_model_class="transformers:Inkling2ForCausalLM",
            attn_implementation="eager",
            features=("lora", "chat_template"),
            description="Inkling-2 text MoE (dynamic ShortConvs, gated attention output, block attention residuals, "
                        "sigmoid top-k router, soft-capped experts and logits)",
        ),
        ModelFamilySpec(
            name="inkling2_loop",
            model_types=("inkling2_loop_text",),
            status=FamilyStatus.VALIDATED,
            hf_model_class="transformers:Inkling2LoopForCausalLM",
            attn_implementation="eager",
            features=("lora", "chat_template"),
            description="Inkling-2-Loop text MoE (Inkling-2 with a range of layers run several times, low-rank loop gate)",
        ),
        ModelFamilySpec(
            name="inkling2",
            model_types=("inkling2",),
            status=FamilyStatus.VALIDATED,
            hf_model_class="transformers:Inkling2ForConditionalGeneration",
            attn_implementation="eager",
            features=("lora", "towers", "chat_template"),
            description="Inkling-2 multimodal (the inkling2_text model + a ViT vision tower with axial RoPE and merger)",
        ),
    ]


# tml-renderers 0.2.1 ships one TML renderer, v0.Renderer (TMLv0), documented for Inkling / Inkling-Small; it
# names no Inkling-2 renderer, and no Inkling-2 tokenizer file is available offline. What ties Inkling-2 to
# TMLv0 is transformers' Inkling2Config: eos_token_id 200006 == v0.Renderer.stop() (<|content_model_end_sampling|>),
# unpadded_vocab_size 200058 == the TMLv0 vocabulary (o200k_base's 199,998 ranks + 60 specials), image_token_id
# 200054 == TMLv0's <|unused_200054|> (also Inkling2Processor's default image_token); Inkling2LoopTextConfig has the
# same eos_token_id and unpadded_vocab_size. plugins/inkling2/tests/test_inkling2_chat_template.py
# checks these facts and renders conversations against tml-renderers under the inkling2 names.

#: TMLv0 model turns end with <|content_model_end_sampling|> (tml-renderers' ``v0.Renderer.stop()`` is [200006]).
_TMLV0_STOP_TOKENS = ("<|content_model_end_sampling|>",)


@hookimpl
def register_chat_templates():
    return [ChatTemplateSpec(name=name, family=family, template="ferrule.tmlv0:templates/tmlv0.jinja",
                             stop_tokens=_TMLV0_STOP_TOKENS,
                             tokenizer="ferrule.tmlv0.tokenizer:load_tmlv0_tokenizer", description=desc)
            for name, family, desc in (
                ("tmlv0_inkling2", "inkling2_text", "TMLv0 (tml-renderers v0), as Inkling's: Inkling-2 text prompts"),
                ("tmlv0_inkling2_loop", "inkling2_loop", "TMLv0 (tml-renderers v0), as Inkling's: Inkling-2-Loop "
                                                         "(Inkling-2-Mini) text prompts"),
                ("tmlv0_inkling2_mm", "inkling2", "TMLv0 (tml-renderers v0), as Inkling's: Inkling-2 text prompts "
                                                  "(image parts write one placeholder each, as for Inkling)"))]


@hookimpl
def register_tool_parsers():
    # the TMLv0 format, as Inkling's (the same template): <|content_invoke_tool_json|> tool invocations
    return [ToolParserSpec(family=f, parse="ferrule.tmlv0.tool_calls:parse_tmlv0")
            for f in ("inkling2_text", "inkling2_loop", "inkling2")]


@hookimpl
def register_lora_appliers():
    # no dense MLP and no shared experts: attention (Inkling-2's linears), the core's routed experts, lm_head
    # refused; the loop family adds its message gates. The multimodal family adapts its language model with the
    # same appliers (the vision tower stays frozen); PEFT names come from each variant's PEFT_MAPPING.
    peft, ink2 = "ferrule.lora.peft_format", "ferrule.plugins.inkling2.lora"
    experts = "ferrule.lora.peft_experts"
    specs = []
    for family in VARIANTS:
        specs += [
            LoRAApplierSpec(kind="attention", family=family, apply=f"{ink2}:apply_attention",
                            export=f"{peft}:export_linear", load=f"{peft}:load_linear"),
            LoRAApplierSpec(kind="routed_experts", family=family, apply="ferrule.lora.appliers:apply_routed_experts",
                            export=f"{experts}:export_routed", load=f"{experts}:load_routed"),
            LoRAApplierSpec(kind="lm_head", family=family, apply=f"{ink2}:apply_lm_head",
                            export=f"{peft}:export_linear", load=f"{peft}:load_linear"),
        ]
    specs.append(LoRAApplierSpec(kind="loop_gate", family="inkling2_loop", apply=f"{ink2}:apply_loop_gate",
                                 export=f"{peft}:export_linear", load=f"{peft}:load_linear"))
    return specs


@hookimpl
def register_towers():
    # frozen by default, as for Inkling; items are token grids [rows, cols, S, S, 3] (item_token_dims=2): the tower
    # attends within each image and resamples its position grid to the image's shape
    v = "ferrule.plugins.inkling2.towers"
    return [TowerSpec(family="inkling2", modality="vision", build=f"{v}:build_vision_tower",
                      placeholder_config_key="image_token_id", hf_prefix="model.visual.", update_group="vision_tower",
                      hf_input="pixel_values", hf_inputs=f"{v}:hf_vision_inputs", item_token_dims=2,
                      preprocess=f"{v}:preprocess_image")]
