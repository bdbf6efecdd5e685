"""Strict value typing for :mod:`ferrule.rl.config` (file values and ``key=value`` overrides).

Supported field types: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]`` of strings,
``list[str]``, ``list[float]``, ``list[int]``, ``dict[str, Any]``, ``Any``, and unions of these
(``bool | Literal["auto"]``: the first member that takes the value wins).
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Callable, Literal

import yaml

#: the choices of ``algorithm.loss`` (:mod:`ferrule.losses` names)
LOSS_NAMES = ("ppo", "cispo", "importance_sampling", "dro", "gspo")
#: the built-in choices of ``reward.fn``
BUILTIN_REWARDS = ("task", "exact_match")

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


class ConfigError(ValueError):
    """One or more config problems; ``problems`` lists each as ``"section.key: what; fix"``."""

    def __init__(self, problems: list[str], origin: str | None = None):
        self.problems = list(problems)
        self.origin = origin
        where = f" in {origin}" if origin else ""
        head = f"{len(self.problems)} config error{'s' if len(self.problems) != 1 else ''}{where}:"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


def type_name(tp: Any) -> str:
    """Human-readable name of a field type (``int``, ``one of 'a', 'b'``, ``list[str]``)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _coerce_float(value: Any, key: str, bad: Callable[[], ConfigError]) -> float:
    """A config float: an int widens, a string that parses (PyYAML reads ``1e-6`` without a dot as a
    string) converts, a bool or anything else is ``bad()``; non-finite values are refused."""
    if isinstance(value, bool):
        raise bad()
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise bad() from None
    if not isinstance(value, float):
        raise bad()
    if not math.isfinite(value):  # .inf, 1e400 (YAML and float() read it as inf), .nan
        raise ConfigError([f"{key}: expected a finite float, got {value!r}; write a finite number"])
    return value


def coerce_value(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` (already parsed from YAML/TOML) against ``tp``; return the typed value.

    Raises:
        ConfigError: naming ``key``, the expected type and the value received.
    """
    def bad(expected: str | None = None) -> ConfigError:
        return ConfigError([f"{key}: expected {expected or type_name(tp)}, got "
                            f"{type(value).__name__} {value!r}"])

    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        for member in typing.get_args(tp):
            try:
                return coerce_value(value, member, key)
            except ConfigError:
                continue
        raise bad()
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError([f"{key}: {value!r} is not allowed; expected {type_name(tp)}"])
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        return _coerce_float(value, key, bad)
    if tp is str:
        if not isinstance(value, str):
            raise bad("str (quote it)")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise bad()
        (item_tp,) = typing.get_args(tp)
        return [coerce_value(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        for k in value:
            if not isinstance(k, str):
                raise ConfigError([f"{key}: mapping keys must be strings, got {k!r}"])
        return dict(value)
    raise TypeError(f"{key}: unsupported config field type {tp!r}")  # a bug in the schema


def parse_override_value(text: str, tp: Any, key: str) -> Any:
    """Parse the string of a ``key=value`` override into ``tp`` (see :func:`coerce_value`).

    ``str`` keys take the text verbatim (no YAML interpretation); ``bool`` keys accept
    true/false/yes/no/on/off/1/0; ``int``/``float`` keys use Python's parsers; list, dict and
    ``Any`` keys use YAML (``[0.9, 0.98]``, ``{k: v}``, ``2``, ``null``).
    """
    origin = typing.get_origin(tp)
    if tp is str or (origin is Literal and all(isinstance(a, str) for a in typing.get_args(tp))):
        return coerce_value(text, tp, key)
    stripped = text.strip()
    if tp is bool:
        low = stripped.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError([f"{key}: expected a bool (true/false/yes/no/on/off/1/0), got {text!r}"])
    if tp is int:
        try:
            return int(stripped)
        except ValueError:
            raise ConfigError([f"{key}: expected int, got {text!r}"]) from None
    if tp is float:
        try:
            value = float(stripped)
        except ValueError:
            raise ConfigError([f"{key}: expected float, got {text!r}"]) from None
        return coerce_value(value, tp, key)
    try:
        parsed = yaml.safe_load(stripped) if stripped else ""
    except yaml.YAMLError as exc:
        raise ConfigError([f"{key}: cannot parse {text!r} as YAML ({exc.__class__.__name__})"]) from None
    return coerce_value(parsed, tp, key)
