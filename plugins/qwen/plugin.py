"""Hook implementations of the Qwen plugin (no heavy imports: specs only)."""

from __future__ import annotations

from ferrule import hookimpl
from ferrule.specs import FamilyStatus, ModelFamilySpec

_PENDING = "provider, converter and update groups are not implemented yet"


@hookimpl
def register_model_families():
    return [
        ModelFamilySpec(
            name="qwen2",
            model_types=("qwen2",),
            status=FamilyStatus.STRUCTURAL,
            reason=_PENDING,
            hf_model_class="transformers:Qwen2ForCausalLM",
            description="Qwen2 / Qwen2.5 dense (QKV bias)",
        ),
        ModelFamilySpec(
            name="qwen3",
            model_types=("qwen3",),
            status=FamilyStatus.STRUCTURAL,
            reason=_PENDING,
            hf_model_class="transformers:Qwen3ForCausalLM",
            description="Qwen3 dense (q/k norm, no QKV bias)",
        ),
        ModelFamilySpec(
            name="qwen3_moe",
            model_types=("qwen3_moe",),
            status=FamilyStatus.STRUCTURAL,
            reason=_PENDING,
            hf_model_class="transformers:Qwen3MoeForCausalLM",
            description="Qwen3-MoE (routed experts, top-k, norm_topk_prob)",
        ),
    ]
