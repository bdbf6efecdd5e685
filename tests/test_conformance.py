"""Run ferrule's own conformance kit over the in-tree families (qwen2, qwen3, qwen3_moe, inkling)."""

from ferrule.testing import FamilyConformance as TestFamilyConformance  # noqa: F401
