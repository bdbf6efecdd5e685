"""Hook implementations of the Inkling-2 plugin (no heavy imports: specs only)."""

from __future__ import annotations

from ferrule import hookimpl
from ferrule.specs import FamilyStatus, ModelFamilySpec

_TEXT_REASON = ("skeleton: no provider, config translation, mapping table or update groups yet (issue 27); "
                "nothing converts, trains or is checked against Inkling2ForCausalLM")
_LOOP_REASON = ("skeleton: no provider, config translation, mapping table or update groups yet (issue 27); "
                "nothing converts, trains or is checked against Inkling2LoopForCausalLM")


@hookimpl
def register_model_families():
    return [
        ModelFamilySpec(
            name="inkling2_text",
            model_types=("inkling2_text",),
            status=FamilyStatus.STRUCTURAL,
            reason=_TEXT_REASON,
            hf_model_class="transformers:Inkling2ForCausalLM",
            description="Inkling-2 text MoE (dynamic ShortConvs, gated attention output, block attention residuals, "
                        "sigmoid top-k router, soft-capped experts and logits)",
        ),
        ModelFamilySpec(
            name="inkling2_loop",
            model_types=("inkling2_loop_text",),
            status=FamilyStatus.STRUCTURAL,
            reason=_LOOP_REASON,
            hf_model_class="transformers:Inkling2LoopForCausalLM",
            description="Inkling-2-Loop text MoE (Inkling-2 with a range of layers run several times, low-rank loop gate)",
        ),
    ]
