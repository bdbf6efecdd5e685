"""The vocabulary of a config translation: the entry kinds (:class:`Field`, :class:`Constant`,
:class:`Derived`, :class:`Require`, :class:`Harmless`), :class:`ConfigTranslation` (``to_mcore`` /
``to_hf``) and :func:`parse_hf_config`. See :mod:`ferrule.config_translation` for the whole story.

Importing this module imports neither torch nor megatron (transformers is imported by
``to_mcore`` only).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping

__all__ = ["ConfigTranslationError", "Field", "Constant", "Derived", "Require", "Harmless", "ConfigTranslation",
           "parse_hf_config", "MISSING", "ENTRY_KINDS", "ROPE_FIELD_READERS"]

Target = Literal["config", "option"]


class ConfigTranslationError(ValueError):
    """An HF config cannot be translated (unsupported value, missing key, inconsistent values)."""


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


#: Sentinel: "no default" (the HF key is required).
MISSING: Any = _Missing()


def _lookup(hf: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    """First key of ``keys`` present in ``hf`` (and its value), or ``(None, MISSING)``."""
    for key in keys:
        if key in hf and hf[key] is not None:
            return key, hf[key]
    return None, MISSING


#: The ``rope_parameters`` sub-fields a translation row reads by the megatron value it produces
#: (:meth:`ConfigTranslation.unread_rope_fields`); ``"*"``: every field.
ROPE_FIELD_READERS: dict[str, set[str]] = {
    "rotary_base": {"rope_theta"},
    "rope_scaling": {"rope_type", "type", "factor", "original_max_position_embeddings", "attention_factor",
                     "beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim", "low_freq_factor",
                     "high_freq_factor"},
    "rotary_percent": {"partial_rotary_factor"},
    "layer_rope": {"*"},
}


@dataclass(frozen=True)
class Field:
    """Copy one value between an HF key and an mcore kwarg/option.

    Attributes:
        hf: the HF key written by :meth:`ConfigTranslation.to_hf`.
        mcore: the ``TransformerConfig`` kwarg (``target='config'``) or model option
            (``target='option'``) name.
        target: where the value goes on the mcore side.
        aliases: older HF spellings also accepted on input (checked after ``hf``), e.g.
            ``num_experts`` for ``num_local_experts``.
        default: value used when the HF config lacks every spelling; ``MISSING`` makes the key
            required.
        cast: Python type the value is coerced to (``int``, ``float``, ``bool``) or None.
    """

    hf: str
    mcore: str
    target: Target = "config"
    aliases: tuple[str, ...] = ()
    default: Any = MISSING
    cast: type | None = None


@dataclass(frozen=True)
class Constant:
    """An mcore kwarg/option the family always sets; it has no HF key."""

    mcore: str
    value: Any
    target: Target = "config"


@dataclass(frozen=True)
class Derived:
    """A value computed from the whole HF config by a named function.

    Attributes:
        mcore: kwarg/option name.
        to_mcore: ``f(hf_config) -> value``; may raise :class:`ConfigTranslationError`.
        to_hf: ``g(value, transformer_config_kwargs, model_options) -> dict`` of the HF keys it
            owns (an empty dict writes nothing).
        hf_keys: the HF keys this entry reads; ``to_hf`` removes those of them that ``to_hf``
            does not write (legacy spellings such as top-level ``rope_theta``).
        target: where the value goes on the mcore side.
        reads: further HF keys ``to_mcore`` reads but ``to_hf`` neither writes nor removes
            (they stay in ``base``); they count as translated for the unknown-key check.
    """

    mcore: str
    to_mcore: Callable[[Mapping[str, Any]], Any]
    to_hf: Callable[[Any, Mapping[str, Any], Mapping[str, Any]], dict]
    hf_keys: tuple[str, ...]
    target: Target = "config"
    reads: tuple[str, ...] = ()


@dataclass(frozen=True)
class Harmless:
    """An HF key the family reads on purpose *not at all*, because it cannot change the numbers.

    Attributes:
        hf: the HF key (kept unchanged in ``config.json`` by :meth:`ConfigTranslation.to_hf`).
        reason: why ignoring it is safe, for reviewers and ``ferrule check`` output. Required.
    """

    hf: str
    reason: str

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError(f"Harmless({self.hf!r}) needs a reason: say why ignoring the key cannot change the model.")


@dataclass(frozen=True)
class Require:
    """An HF key whose value must be one of ``allowed``.

    Attributes:
        hf: the HF key.
        allowed: supported values; the first is written back by ``to_hf``.
        default: value assumed when the key is absent (``MISSING``: the key is required).
        reason: what ferrule does not support, for the error message.
        write_back: whether ``to_hf`` writes ``allowed[0]`` (False for keys transformers
            itself does not serialize for the family).
    """

    hf: str
    allowed: tuple[Any, ...]
    default: Any = MISSING
    reason: str = ""
    write_back: bool = True


Entry = Field | Constant | Derived | Require | Harmless


class SharedRowOverlapWarning(FutureWarning):
    """A family row and a shared row (:data:`DECODER_ENTRIES` and friends) set the same mcore value.

    The family's row wins (the plugin keeps working as written); the shared row is dropped from
    that table. Shown by default (a ``FutureWarning``): remove the family's row once its package
    needs a ferrule whose shared rows translate the key (docs/plugins.md, "What changed for
    plugin authors").
    """


def describe_entry(e: Any) -> str:
    """A row named by its keys, e.g. ``Derived('window_size' <- reads 'sliding_window', 'layer_types')``."""
    if isinstance(e, Field):
        return f"Field({e.hf!r} -> {e.target} {e.mcore!r})"
    if isinstance(e, Constant):
        return f"Constant({e.target} {e.mcore!r} = {e.value!r})"
    if isinstance(e, Derived):
        keys = ", ".join(repr(k) for k in (*e.hf_keys, *e.reads)) or "no HF key"
        return f"Derived({e.target} {e.mcore!r} <- {keys}; {getattr(e.to_mcore, '__name__', e.to_mcore)})"
    return repr(e)


#: id() of every row of the shared tuples -> the tuple's name (filled at the end of this module).
_SHARED_ROWS: dict[int, str] = {}


def register_shared_rows(name: str, rows: tuple) -> None:
    """Mark ``rows`` as ferrule's shared rows (named ``name`` in overlap warnings); for modules that
    define shared rows beside this one (:mod:`ferrule.config_translation.layer_types`)."""
    for row in rows:
        _SHARED_ROWS.setdefault(id(row), name)


def _resolve_overlap(name: str, key: tuple[str, str], first: Any, second: Any) -> Any:
    """The row of two that set the same mcore value which stays (the shared-rows contract).

    Raises:
        ValueError: both rows are the family's own, or both shared (naming both by their keys).
    """
    import warnings

    shared = [_SHARED_ROWS.get(id(e)) for e in (first, second)]
    if (shared[0] is None) == (shared[1] is None):
        raise ValueError(
            f"ConfigTranslation({name}): {key[0]} {key[1]!r} is set by two rows, {describe_entry(first)} and "
            f"{describe_entry(second)}; each mcore value must have exactly one row: remove one of them.")
    family_row, shared_row, group = (second, first, shared[0]) if shared[0] else (first, second, shared[1])
    warnings.warn(
        f"ConfigTranslation({name}): the family's row {describe_entry(family_row)} and the shared row "
        f"{describe_entry(shared_row)} (from {group}) both set {key[0]} {key[1]!r}; the family's row wins and the "
        f"shared one is dropped from this table. The shared rows translate this key now: remove the family's row "
        f"when the package requires this ferrule (docs/plugins.md, 'What changed for plugin authors').",
        SharedRowOverlapWarning, stacklevel=4)
    return family_row


@dataclass(frozen=True)
class ConfigTranslation:
    """An immutable HF <-> mcore config table for one model variant.

    Attributes:
        name: variant name for error messages (e.g. ``"qwen3"``).
        entries: the table, applied in order.
    """

    name: str
    entries: tuple[Entry, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.entries, tuple):
            raise TypeError(f"ConfigTranslation({self.name}).entries must be a tuple (tables are immutable).")
        seen: dict[tuple[str, str], int] = {}
        dropped: set[int] = set()
        for i, e in enumerate(self.entries):
            if isinstance(e, (Require, Harmless)):
                continue
            if not isinstance(e, (Field, Constant, Derived)):
                raise TypeError(f"ConfigTranslation({self.name}).entries[{i}]={e!r} is not a "
                                f"Field/Constant/Derived/Require/Harmless.")
            key = (e.target, e.mcore)
            if key in seen:
                j = seen[key]
                keep = _resolve_overlap(self.name, key, self.entries[j], e)
                dropped.add(i if keep is self.entries[j] else j)
                seen[key] = j if keep is self.entries[j] else i
                continue
            seen[key] = i
        if dropped:
            object.__setattr__(self, "entries", tuple(e for k, e in enumerate(self.entries) if k not in dropped))

    # -- queries --------------------------------------------------------------------------
    def hf_keys(self) -> tuple[str, ...]:
        """Every HF key the table reads (canonical names, aliases and derived inputs)."""
        keys: list[str] = []
        for e in self.entries:
            if isinstance(e, Field):
                keys += [e.hf, *e.aliases]
            elif isinstance(e, Derived):
                keys += [*e.hf_keys, *e.reads]
            elif isinstance(e, Require):
                keys.append(e.hf)
        return tuple(dict.fromkeys(keys))

    def harmless_keys(self) -> dict[str, str]:
        """HF keys listed as :class:`Harmless` -> their reason."""
        return {e.hf: e.reason for e in self.entries if isinstance(e, Harmless)}

    def unknown_keys(self, keys) -> list[str]:
        """The keys of ``keys`` that no entry translates and no :class:`Harmless` entry lists."""
        known = set(self.hf_keys()) | set(self.harmless_keys())
        return sorted(k for k in keys if k not in known)

    def unread_rope_fields(self, values: Mapping[str, Any]) -> list[str]:
        """The sub-fields of a flat ``rope_parameters`` (``rope_parameters.factor``, ...) that no entry reads,
        checked like top-level keys: an entry reads ``rope_parameters.X`` when it names it in ``hf_keys`` /
        ``reads``, or when it produces the megatron value X feeds (:data:`ROPE_FIELD_READERS`: ``rotary_base``
        reads ``rope_theta``; ``rope_scaling`` the scaling fields; ``rotary_percent`` ``partial_rotary_factor``;
        ``layer_rope`` all of them). Neutral values (``rope_type: default``, ``partial_rotary_factor: 1``, None)
        need no reader. Without this, a family whose own RoPE row reads only ``rope_theta`` built plain RoPE for
        a YaRN checkpoint silently (the logits caught it, by 1.7e-3)."""
        params = values.get("rope_parameters")
        if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
            return []  # absent, or one RoPE per layer type (LAYER_TYPE_ROPE_ENTRIES read every field)
        read: set[str] = set()
        for e in self.entries:
            names = [*e.hf_keys, *e.reads] if isinstance(e, Derived) else []
            read |= {n.split(".", 1)[1] for n in names if n.startswith("rope_parameters.")}
            if isinstance(e, (Field, Derived)):  # a Constant reads nothing
                read |= ROPE_FIELD_READERS.get(e.mcore, set())
        neutral = {"rope_type": ("default",), "type": ("default",), "partial_rotary_factor": (1, 1.0)}
        return sorted(f"rope_parameters.{k}" for k, v in params.items()
                      if v is not None and v not in neutral.get(k, ()) and k not in read and "*" not in read)

    # -- HF -> mcore ----------------------------------------------------------------------
    def to_mcore(self, hf_config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Translate an HF config as transformers parses it.

        Args:
            hf_config: a ``transformers.PretrainedConfig``, or a dict (``config.json`` contents or
                ``PretrainedConfig.to_dict()``) which is parsed by the class registered for its
                ``model_type`` first (see :func:`parse_hf_config`).

        Returns:
            ``(transformer_config_kwargs, model_options)``, two new dicts of plain values.

        Raises:
            ConfigTranslationError: transformers refuses the config; a key is neither translated
                nor :class:`Harmless` for this family; a required key is missing, a value is
                unsupported, or a value has the wrong type. The message names the key and the fix.
        """
        values, keys = parse_hf_config(hf_config, self.name)
        self._translate(values, requires_only=True)  # a wrong model_type / feature is the clearer error
        unknown = self.unknown_keys(keys)
        if unknown:
            raise ConfigTranslationError(
                f"{self.name}: HF config key(s) {unknown} are neither translated nor listed as harmless for this "
                f"family, so ferrule would silently build a different model than transformers. Fix: translate "
                f"each in the family's CONFIG_TRANSLATION (Field / Derived / Require), or, if it cannot change "
                f"the model's numbers, add Harmless(key, reason=...) (docs/plugins.md)."
            )
        translated = self._translate(values)  # an unsupported rope_type is named before its unread fields
        unread = self.unread_rope_fields(values)
        if unread:
            raise ConfigTranslationError(
                f"{self.name}: HF config sub-key(s) {unread} are read by no row of the family's translation, so "
                f"ferrule would silently build a different RoPE than transformers. Fix: keep the shared "
                f"ROPE_SCALING_ENTRIES (in DECODER_ENTRIES: rope_type linear / llama3 / yarn and their fields, "
                f"partial_rotary_factor), or declare what your Derived row reads, reads=('rope_parameters.factor', "
                f"...), and translate it (docs/plugins.md)."
            )
        return translated

    def _translate(self, hf_config: Mapping[str, Any],
                   requires_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {"config": {}, "option": {}}
        for e in self.entries:
            if isinstance(e, Harmless) or (requires_only and not isinstance(e, Require)):
                continue
            if isinstance(e, Require):
                _, value = _lookup(hf_config, (e.hf,))
                if value is MISSING:
                    if e.default is MISSING:
                        raise ConfigTranslationError(
                            f"{self.name}: HF config lacks required key {e.hf!r} (supported: {list(e.allowed)})."
                        )
                    value = e.default
                if value not in e.allowed:
                    raise ConfigTranslationError(
                        f"{self.name}: HF config has {e.hf}={value!r}, which ferrule does not support"
                        f"{' (' + e.reason + ')' if e.reason else ''}; supported: {list(e.allowed)}."
                    )
            elif isinstance(e, Field):
                key, value = _lookup(hf_config, (e.hf, *e.aliases))
                if value is MISSING:
                    if e.default is MISSING:
                        spell = " or ".join(repr(k) for k in (e.hf, *e.aliases))
                        raise ConfigTranslationError(
                            f"{self.name}: HF config lacks required key {spell} (maps to {e.target} {e.mcore!r})."
                        )
                    value = e.default
                out[e.target][e.mcore] = _cast(self.name, key or e.hf, value, e.cast)
            elif isinstance(e, Constant):
                out[e.target][e.mcore] = e.value
            else:  # Derived
                out[e.target][e.mcore] = e.to_mcore(hf_config)
        return out["config"], out["option"]

    # -- mcore -> HF ----------------------------------------------------------------------
    def to_hf(
        self,
        transformer_config_kwargs: Mapping[str, Any],
        model_options: Mapping[str, Any],
        base: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Translate back to an HF config dict.

        Args:
            transformer_config_kwargs / model_options: as returned by :meth:`to_mcore` (extra
                keys are ignored).
            base: an HF config dict whose other keys (token ids, architectures, ...) are kept;
                translated keys overwrite it. Legacy spellings replaced by a canonical key
                (e.g. top-level ``rope_theta``) are removed. ``base`` is not modified.

        Raises:
            ConfigTranslationError: a value the table needs is missing, or a constant differs
                from the family's value (the model is not of this variant).
        """
        hf: dict[str, Any] = dict(base or {})
        src = {"config": transformer_config_kwargs, "option": model_options}
        for e in self.entries:
            if isinstance(e, Harmless):
                continue
            if isinstance(e, Require):
                if e.write_back:
                    hf[e.hf] = e.allowed[0]
                continue
            if isinstance(e, Constant):
                if e.mcore in src[e.target] and src[e.target][e.mcore] != e.value:
                    raise ConfigTranslationError(
                        f"{self.name}: {e.target} {e.mcore}={src[e.target][e.mcore]!r} but this "
                        f"variant always uses {e.value!r}; use the translation of the matching variant."
                    )
                continue
            if e.mcore not in src[e.target]:
                raise ConfigTranslationError(
                    f"{self.name}: cannot write the HF config: {e.target} {e.mcore!r} is missing."
                )
            value = src[e.target][e.mcore]
            if isinstance(e, Field):
                for alias in e.aliases:
                    hf.pop(alias, None)
                hf[e.hf] = value
            else:
                written = e.to_hf(value, transformer_config_kwargs, model_options)
                for key in e.hf_keys:  # drop legacy spellings the derivation replaced
                    if key not in written:
                        hf.pop(key, None)
                hf.update(written)
        return hf


def _cast(name: str, key: str, value: Any, cast: type | None) -> Any:
    if cast is None:
        return value
    if cast is bool:
        if not isinstance(value, bool):
            raise ConfigTranslationError(f"{name}: HF key {key!r}={value!r} must be true or false.")
        return value
    if cast is int and (isinstance(value, bool) or not isinstance(value, int)):
        if not (isinstance(value, float) and value.is_integer()):
            raise ConfigTranslationError(f"{name}: HF key {key!r}={value!r} must be an integer.")
    if cast is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigTranslationError(f"{name}: HF key {key!r}={value!r} must be a number.")
    return cast(value)


#: ``PretrainedConfig`` attributes every config has (their defaults cannot change a decoder's
#: numbers); keys of a raw dict equal to these defaults are not checked as unknown.
def _base_defaults() -> dict[str, Any]:
    from transformers import PretrainedConfig

    return PretrainedConfig().to_dict()


def parse_hf_config(hf_config: Any, name: str = "hf config") -> tuple[dict[str, Any], frozenset[str]]:
    """The config as transformers parses it, and the keys it sets.

    A dict is parsed by ``CONFIG_MAPPING[model_type].from_dict`` (what ``AutoConfig`` and
    ``from_pretrained`` do), so transformers' defaults, legacy spellings and normalisation apply:
    e.g. a legacy ``rope_scaling: {type: linear, factor: 4}`` beside ``rope_parameters`` becomes
    ``rope_parameters = {rope_type: linear, factor: 4, rope_theta: 10000}`` in transformers 5.24,
    which is what HF's model then uses.

    Returns:
        ``(values, keys)``: ``values`` is ``parsed.to_dict()`` plus the dict's keys transformers
        dropped (legacy aliases such as ``num_experts``, kept so consistency checks can see
        them); ``keys`` is every key the config sets: ``parsed.to_diff_dict()`` (the keys
        ``save_pretrained`` writes) plus the dict's own keys, minus generic ``PretrainedConfig``
        keys left at their defaults.

    Raises:
        ConfigTranslationError: not a dict / ``PretrainedConfig``, a ``model_type`` transformers
            does not know, or a value transformers' config class refuses.
    """
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(hf_config, PretrainedConfig):
        parsed, raw = hf_config, {}
    elif isinstance(hf_config, Mapping):
        raw = dict(hf_config)
        model_type = raw.get("model_type")
        if model_type not in CONFIG_MAPPING:
            raise ConfigTranslationError(
                f"{name}: HF config has model_type={model_type!r}, which transformers does not know; ferrule "
                f"translates the config as transformers parses it. Install a transformers version with this "
                f"model, or register its config class with transformers.AutoConfig.register."
            )
        try:
            parsed = CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(raw))
        except Exception as exc:  # noqa: BLE001 - transformers raises several types; re-raised with context
            raise ConfigTranslationError(f"{name}: transformers refuses this config: {exc}") from exc
    else:
        raise ConfigTranslationError(
            f"{name}: expected the HF config as a dict (config.json) or a transformers PretrainedConfig, "
            f"got {type(hf_config).__name__}."
        )
    values = parsed.to_dict()
    for key, value in raw.items():
        values.setdefault(key, value)
    base = _base_defaults()
    keys = set(parsed.to_diff_dict()) | {k for k, v in raw.items() if k not in base or v != base[k]}
    return values, frozenset(keys)


# Read-only view used by families composing tables (documentation aid).
ENTRY_KINDS = MappingProxyType({"Field": Field, "Constant": Constant, "Derived": Derived, "Require": Require})
