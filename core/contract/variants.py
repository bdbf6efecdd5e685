"""A family plugin's variants as data: the one shape of ``register_providers``,
``register_converters`` and ``register_update_groups``.

Every family plugin registers, per variant (one HF ``model_type`` family), a provider, a converter
and an update-group table whose objects live in one *variant module* (``qwen2.py``,
``inkling_text.py``, ``llama.py``): ``CONFIG_TRANSLATION``, ``MAPPING``, ``UPDATE_GROUPS`` and,
for a family whose model is not Llama-shaped, a provider builder. :class:`Variants` declares
``{family: variant module}`` once (as Megatron-Bridge's bridges declare the variants they cover),
and the three hooks become one line each::

    VARIANTS = Variants({"qwen2": "ferrule.plugins.qwen.qwen2", "qwen3": "ferrule.plugins.qwen.qwen3"})

    @hookimpl
    def register_providers():
        return VARIANTS.providers()

Every reference stays a lazy ``"module:attr"`` string (no variant module is imported by the
hooks; the registry and the conformance kit resolve them), so update-group tables load one way
in every family. Importing this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ferrule.contract.specs import ConverterSpec, ProviderSpec, SpecError, UpdateGroupTable

__all__ = ["Variants"]


@dataclass(frozen=True)
class Variants:
    """The variants of one family plugin and the module holding each one's tables.

    Attributes:
        modules: ``{family: importable variant module}``, in registration order (kept as a
            tuple of pairs: specs and tables are frozen). Each module defines
            ``CONFIG_TRANSLATION`` (a :class:`~ferrule.config_translation.ConfigTranslation`),
            ``MAPPING`` (a :class:`~ferrule.mapping.MappingTable`) and ``UPDATE_GROUPS`` (a tuple
            of :class:`~ferrule.contract.specs.UpdateGroup`).
        build: the name of the provider builder in each variant module
            (``build(hf_config, layout, **options) -> list[MegatronModule]``), or None for the
            default build driven by ``CONFIG_TRANSLATION`` (Llama-shaped models).

    Raises:
        SpecError: no variant, or a module that is not a dotted module name.
    """

    modules: tuple[tuple[str, str], ...]
    build: str | None = None

    def __init__(self, modules: Mapping[str, str], build: str | None = None) -> None:
        pairs = tuple(modules.items())
        if not pairs:
            raise SpecError("Variants needs at least one {family: variant module} entry.")
        for family, module in pairs:
            if not module or ":" in module or not all(part.isidentifier() for part in module.split(".")):
                raise SpecError(f"Variants: family {family!r} has module {module!r}; expected a dotted module "
                                f"name such as 'my_plugin.my_variant' (no ':attr').")
        object.__setattr__(self, "modules", pairs)
        object.__setattr__(self, "build", build)

    def __iter__(self) -> Iterator[str]:
        """The family names, in declaration order."""
        return (family for family, _ in self.modules)

    def items(self) -> Iterator[tuple[str, str]]:
        """``(family, variant module)`` pairs, in declaration order."""
        return iter(self.modules)

    def providers(self) -> list[ProviderSpec]:
        """``register_providers``' answer: one :class:`ProviderSpec` per variant."""
        return [ProviderSpec(family=f, build=f"{m}:{self.build}" if self.build else None) for f, m in self.modules]

    def converters(self) -> list[ConverterSpec]:
        """``register_converters``' answer: each variant's ``MAPPING`` and ``CONFIG_TRANSLATION``."""
        return [ConverterSpec(family=f, mapping=f"{m}:MAPPING", config_translation=f"{m}:CONFIG_TRANSLATION")
                for f, m in self.modules]

    def update_groups(self) -> list[UpdateGroupTable]:
        """``register_update_groups``' answer: each variant's ``UPDATE_GROUPS`` (a lazy reference)."""
        return [UpdateGroupTable(family=f, groups=f"{m}:UPDATE_GROUPS") for f, m in self.modules]
