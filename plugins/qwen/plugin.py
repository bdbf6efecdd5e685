"""Hook implementations of the Qwen plugin (no heavy imports: specs only)."""

from __future__ import annotations

from ferrule import hookimpl
from ferrule.contract.specs import ChatTemplateSpec, FamilyStatus, ModelFamilySpec, ToolParserSpec
from ferrule.contract.variants import Variants

# VALIDATED: HF -> torch_dist -> HF bit-exact and Megatron-vs-HF logits <= 1e-5 (fp32; TP=1, TP=2, EP=2)
# in tests/test_convert.py and plugins/qwen/tests/test_qwen_parity.py.

#: family -> variant module holding CONFIG_TRANSLATION, MAPPING, UPDATE_GROUPS (the provider is the
#: default build, driven by CONFIG_TRANSLATION).
VARIANTS = Variants({"qwen2": "ferrule.plugins.qwen.qwen2", "qwen3": "ferrule.plugins.qwen.qwen3",
                     "qwen3_moe": "ferrule.plugins.qwen.qwen3_moe"})


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
            name="qwen2",
            model_types=("qwen2",),
            status=FamilyStatus.VALIDATED,
            hf_model_class="transformers:Qwen2ForCausalLM",
            description="Qwen2 / Qwen2.5 dense (QKV bias)",
        ),
        ModelFamilySpec(
            name="qwen3",
            model_types=("qwen3",),
            status=FamilyStatus.VALIDATED,
            hf_model_class="transformers:Qwen3ForCausalLM",
            description="Qwen3 dense (q/k norm, no QKV bias)",
        ),
        ModelFamilySpec(
            name="qwen3_moe",
            model_types=("qwen3_moe",),
            status=FamilyStatus.VALIDATED,
            hf_model_class="transformers:Qwen3MoeForCausalLM",
            description="Qwen3-MoE (routed experts, top-k, norm_topk_prob)",
        ),
    ]


#: Qwen chat turns end with <|im_end|>; base models may emit <|endoftext|> (HF generation_config eos ids).
_QWEN_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


@hookimpl
def register_chat_templates():
    qwen3 = "ferrule.plugins.qwen:templates/qwen3.jinja"
    return [
        ChatTemplateSpec(
            name="qwen2_5",
            family="qwen2",
            template="ferrule.plugins.qwen:templates/qwen2_5.jinja",
            stop_tokens=_QWEN_STOP_TOKENS,
            tokenizer="ferrule.plugins.qwen.tokenizer:load_qwen2_tokenizer",
            description="Qwen2 / Qwen2.5 ChatML with tools (default system prompt)",
        ),
        ChatTemplateSpec(name="qwen3", family="qwen3", template=qwen3, stop_tokens=_QWEN_STOP_TOKENS,
                         tokenizer="ferrule.plugins.qwen.tokenizer:load_qwen3_tokenizer",
                         description="Qwen3 ChatML with <think> blocks and tools"),
        ChatTemplateSpec(name="qwen3_moe", family="qwen3_moe", template=qwen3, stop_tokens=_QWEN_STOP_TOKENS,
                         tokenizer="ferrule.plugins.qwen.tokenizer:load_qwen3_tokenizer",
                         description="Qwen3 ChatML with <think> blocks and tools (MoE checkpoints)"),
    ]


@hookimpl
def register_tool_parsers():
    # Qwen 2.5 / 3 declare Hermes function calling in their templates: <tool_call>{json}</tool_call>
    return [ToolParserSpec(family=f, parse="ferrule.chat.tool_calls:parse_hermes") for f in ("qwen2", "qwen3", "qwen3_moe")]
