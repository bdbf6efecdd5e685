"""ferrule's conformance kit on the ``llama`` family: discovery, spec hygiene, completeness,
lazy references, and the numeric cases (HF -> torch_dist -> HF bit-exact, mapping coverage,
Megatron vs HF logits on the tiny random Llama from ``ferrule_llama.llama.TINY_HF_CONFIG``)."""

from ferrule.conformance.kit import FamilyConformance


class TestLlamaConformance(FamilyConformance):
    families = ("llama",)
