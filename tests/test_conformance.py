"""Run ferrule's own conformance kit over every registered family (the in-tree qwen2, qwen3,
qwen3_moe, inkling, and the example llama plugin when installed)."""

from ferrule.testing import FamilyConformance


class TestFamilyConformance(FamilyConformance):
    families = None
