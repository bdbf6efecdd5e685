"""A family's Megatron model builder: the registry's provider, with the family's towers attached.

The registry only looks things up (:func:`ferrule.contract.registry.provider_build` gives the provider
alone); this module composes the provider with the towers (:func:`ferrule.megatron.towers.attach_towers`),
so the train engine, the converters and the conformance kit build the same model.
"""

from __future__ import annotations

import functools
from typing import Any
from .parallel import ParallelLayoutError
from ferrule.contract import registry

__all__ = ["provider_build"]


def provider_build(family: str) -> Any:
    """The callable that builds the family's Megatron model: ``build(hf_config, layout, **options)``
    returning its chunks, with the family's towers (``register_towers``) attached to the first
    stage's chunk. A text-only family gets :func:`ferrule.contract.registry.provider_build` unchanged, or, when
    its spec declares ``layouts`` (:class:`ferrule.contract.specs.LayoutSupport`), wrapped to refuse other layouts.

    Raises:
        ferrule.contract.registry.IncompleteFamilyError: a tower's ``update_group`` is not in the family's
            update-group table (a weight sync would leave the tower behind), or the family lacks
            a provider (or, for the default build, a converter).
        ferrule.contract.registry.UnknownModelError: no such family.
        ferrule.megatron.parallel.ParallelLayoutError: (from the returned callable) a layout outside the
            family's ``layouts``.
    """
    build = registry.provider_build(family)
    support = registry.get_family(family).layouts
    if support is not None:  # a layout the family does not support: one line, before megatron asserts in the build
        build = functools.partial(_build_in_supported_layout, family, support, build)
    towers = registry.get_towers(family)
    if not towers:
        return build
    groups = {g.key for g in registry.get_update_groups(family).groups}
    lost = [f"{t.name} -> {t.update_group!r}" for t in towers if t.update_group not in groups]
    if lost:
        raise registry.IncompleteFamilyError(
            f"family {family!r}: tower update group(s) {lost} missing from its update-group table "
            f"{sorted(groups)}; add them so that every weight sync carries the towers.")
    return functools.partial(_build_with_towers, build, tuple(towers))


def _build_with_towers(build: Any, towers: tuple, hf_config: Any, layout: Any, **options: Any) -> Any:
    """The family's provider, then its towers attached (:func:`ferrule.megatron.towers.attach_towers`)."""
    import torch

    from .towers import attach_towers

    chunks = build(hf_config, layout, **options)
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    return attach_towers(chunks, towers, hf_config, options.get("params_dtype") or torch.float32)


def _build_in_supported_layout(family: str, support: Any, build: Any, hf_config: Any, layout: Any,
                               **options: Any) -> Any:
    refusal = support.refusal(family, layout)
    if refusal:
        raise ParallelLayoutError(refusal)
    return build(hf_config, layout, **options)
