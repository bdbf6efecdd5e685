"""Update-group tables applied to mcore parameter names: which parameters travel together.

A family's update-group table (:class:`ferrule.contract.specs.UpdateGroupTable`, declared by its plugin)
lists :class:`ferrule.contract.specs.UpdateGroup`\\ s. This module turns the parameter names a rank holds
into *units*: the parameters that must reach the rollout engine in one bucket (a converter or
an engine may need every piece of a fused tensor at once; a split write would leave half of it
stale). The rules (miles ``AtomicUpdateGroup`` semantics, reference/miles_study.md §2.1):

- a parameter belongs to the group with a suffix it ends with, matched on whole dotted
  components (``"linear_fc1.weight"`` matches ``"mlp.linear_fc1.weight"`` but not
  ``"mlp.xlinear_fc1.weight"``); if several suffixes match, the longest wins;
- parameters of one group with the same prefix (the name minus the suffix, e.g.
  ``"decoder.layers.3."``) form one unit, and a unit holds every suffix of its group exactly
  once (a missing piece means names were not normalised and half a fused tensor would go
  stale: miles pitfall 13);
- every parameter is in exactly one unit: a parameter no group claims is an error (never a
  silent singleton);
- a non-optional group that matches no parameter is an error (it catches mistyped suffixes);
  an ``optional`` group may be absent (a pipeline stage without embedding or MoE layers);
- a unit never mixes routed-expert and other parameters (they are gathered on different
  process groups), see :func:`is_routed_expert_param`.

Names are *global* mcore names (layer index over the whole model, global expert index), as
produced by :func:`ferrule.megatron.param_gather.global_param_names`. Importing this module
imports no torch.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ferrule.contract.specs import UpdateGroup, UpdateGroupTable

__all__ = [
    "UpdateGroupError",
    "UpdateUnit",
    "as_group_table",
    "build_update_units",
    "is_routed_expert_param",
    "match_group",
]


class UpdateGroupError(ValueError):
    """Parameter names do not fit an update-group table (the message lists every offender)."""


def is_routed_expert_param(name: str) -> bool:
    """True if the mcore parameter ``name`` belongs to a routed (token-dispatched) expert.

    Routed experts live under a module component named ``experts`` (``SequentialMLP``:
    ``mlp.experts.local_experts.3.linear_fc1.weight``; ``TEGroupedMLP`` / ``GroupedMLP``:
    ``mlp.experts.linear_fc1.weight0``, ``mlp.experts.weight1``). Shared experts are dense,
    regular-TP and replicated over EP, even when they nest their own ``experts.N`` list under a
    ``shared_experts`` module (Inkling: ``mlp.shared_experts.experts.0.linear_fc1.weight``), so
    any name with a ``shared_experts`` component is *not* routed. Components are compared
    whole, so ``my_experts`` or ``experts_bias`` do not count.

    This is the single classifier for the gather group (expert-TP vs TP), the EP collection and
    the size accounting of weight sync (miles pitfall 1: a bare ``".experts." in name`` test
    classified shared experts as routed).
    """
    parts = name.split(".")
    return "experts" in parts and "shared_experts" not in parts


def as_group_table(groups: UpdateGroupTable | Sequence[UpdateGroup], family: str = "unnamed") -> UpdateGroupTable:
    """An :class:`UpdateGroupTable` from a table or a plain sequence of groups (validated).

    Raises:
        ferrule.contract.specs.SpecError: repeated keys or a suffix claimed by two groups.
        TypeError: ``groups`` is neither.
    """
    if isinstance(groups, UpdateGroupTable):
        return groups
    if isinstance(groups, (list, tuple)) and all(isinstance(g, UpdateGroup) for g in groups):
        return UpdateGroupTable(family=family, groups=tuple(groups))
    raise TypeError(f"expected an UpdateGroupTable or a sequence of UpdateGroup, got {type(groups).__name__}.")


def _ends_with_component(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def match_group(name: str, table: UpdateGroupTable) -> tuple[UpdateGroup, str] | None:
    """``(group, suffix)`` claiming ``name`` (longest matching suffix wins), or None."""
    best: tuple[UpdateGroup, str] | None = None
    for g in table.groups:
        for s in g.suffixes:
            if _ends_with_component(name, s) and (best is None or len(s) > len(best[1])):
                best = (g, s)
    return best


@dataclass(frozen=True)
class UpdateUnit:
    """Parameters that travel to the rollout engine together (never split across buckets).

    Attributes:
        group: the :attr:`UpdateGroup.key` of the group.
        prefix: the shared name prefix (``"decoder.layers.3."``; ``""`` for top-level params).
        names: the global mcore names of the unit, in the order the rank holds them.
        routed: True if the unit holds routed-expert parameters (then all of them are).
    """

    group: str
    prefix: str
    names: tuple[str, ...]
    routed: bool


def _listing(title: str, items: Sequence[str], fix: str) -> str:
    lines = "\n".join(f"  - {x}" for x in items)
    return f"{title} ({len(items)}):\n{lines}\n{fix}"


def build_update_units(param_names: Iterable[str], groups: UpdateGroupTable | Sequence[UpdateGroup]) -> list[UpdateUnit]:
    """Split the parameter names one rank holds into update units.

    Args:
        param_names: global mcore parameter names of this rank (all its model chunks), in
            model order; duplicates are an error.
        groups: the family's update-group table (or its groups).

    Returns:
        The units, ordered by the position of their first member in ``param_names``; every
        name is in exactly one unit.

    Raises:
        UpdateGroupError: listing, together, every parameter no group claims, every
            non-optional group that matched nothing, every incomplete unit (with its missing
            suffixes), every unit mixing routed-expert and other parameters, and duplicates.
    """
    table = as_group_table(groups)
    names = list(param_names)
    errors: list[str] = []
    dupes = sorted(n for n, c in collections.Counter(names).items() if c > 1)
    if dupes:
        errors.append(_listing("parameter names given more than once", dupes,
                               "Pass each parameter once (global names: layer and expert indices made global)."))
    unmatched: list[str] = []
    members: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (group key, prefix) -> [(name, suffix)]
    matched_groups: set[str] = set()
    for name in dict.fromkeys(names):
        hit = match_group(name, table)
        if hit is None:
            unmatched.append(name)
            continue
        g, s = hit
        matched_groups.add(g.key)
        members.setdefault((g.key, name[: len(name) - len(s)]), []).append((name, s))
    if unmatched:
        from ferrule.mapping.vocabulary import sited

        errors.append(_listing(f"UpdateGroupTable({table.family}): parameters no update group claims",
                               [sited(n) for n in unmatched],
                               "Add their suffixes to a group of the family's update-group table "
                               "(every parameter must travel in exactly one unit)."))
    required_missing = [f"{g.key} (suffixes {list(g.suffixes)})" for g in table.groups
                        if not g.optional and g.key not in matched_groups]
    if required_missing:
        errors.append(_listing(f"UpdateGroupTable({table.family}): non-optional groups that match no parameter",
                               required_missing,
                               "Fix the suffix (typo?) or mark the group optional=True if a rank may "
                               "legitimately hold none of it (e.g. a pipeline stage without it)."))
    by_key = {g.key: g for g in table.groups}
    incomplete, mixed = [], []
    units: list[UpdateUnit] = []
    for (key, prefix), items in members.items():
        got = [s for _, s in items]
        missing = [s for s in by_key[key].suffixes if s not in got]
        repeated = sorted({s for s in got if got.count(s) > 1})
        if missing or repeated:
            incomplete.append(f"group {key!r} prefix {prefix!r}: has {[n for n, _ in items]}"
                              + (f", missing suffixes {missing}" if missing else "")
                              + (f", repeated suffixes {repeated}" if repeated else ""))
        routed = [is_routed_expert_param(n) for n, _ in items]
        if any(routed) and not all(routed):
            mixed.append(f"group {key!r} prefix {prefix!r}: routed {[n for (n, _), r in zip(items, routed) if r]}, "
                         f"other {[n for (n, _), r in zip(items, routed) if not r]}")
        units.append(UpdateUnit(group=key, prefix=prefix, names=tuple(n for n, _ in items), routed=all(routed)))
    if incomplete:
        errors.append(_listing(f"UpdateGroupTable({table.family}): incomplete update units", incomplete,
                               "Every unit must hold each suffix of its group once; check that parameter names "
                               "are normalised (no wrapper components) and share the group's prefix."))
    if mixed:
        errors.append(_listing(f"UpdateGroupTable({table.family}): units mixing routed-expert and other parameters",
                               mixed, "Put routed-expert suffixes in a group of their own (they are gathered on "
                                      "the expert process groups)."))
    if errors:
        raise UpdateGroupError("\n".join(errors))
    return units  # dict order = first-member order
