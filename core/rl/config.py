"""Typed configuration of ``ferrule train`` (GRPO-style RL).

A config is a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file with the sections below, plus
command-line overrides ``section.key=value`` (``data.task_kwargs.max_terms=2`` reaches into a
dict-valued key). Every key has a default, a unit and a description in its field metadata;
``docs/train.md`` carries the generated reference (:func:`config_reference_markdown`).

Loading (:func:`load_config`) reports *every* problem at once in one :class:`ConfigError`:
unknown keys (with the closest valid key from :mod:`difflib`), wrong types, and contradictory
settings (:func:`validate_config`). Types are strict: an ``int`` key refuses ``1.5`` and
``true``; a ``float`` key accepts ints and strings such as ``"1e-6"`` (PyYAML reads ``1e-6``
without a dot as a string, a YAML 1.1 quirk); a ``bool`` override accepts
true/false/yes/no/on/off/1/0; list and dict overrides are YAML flow syntax (``[a, b]``,
``{k: v}``).

Example::

    cfg = load_config("examples/configs/tiny_ci.yaml", ["train.steps=5", "rollout.temperature=0.8"])
    cfg.dump(cfg.logging.run_dir)   # writes RUN_DIR/config.yaml (resolved, reloadable)
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import typing
from pathlib import Path
from typing import Any

import yaml

from ferrule.fs.run_layout import CONFIG_FILE_NAME
from ferrule.rl.config_schema import (  # noqa: F401  (re-exported: the config's public names live here)
    SECTIONS, AgentConfig, AlgorithmConfig, CheckpointConfig, DataConfig, EvalConfig, LoggingConfig, LoraConfig, ModelConfig,
    OptimizerConfig, ParallelConfig, RewardConfig, RLConfig, RolloutConfig, TrainConfig)
from ferrule.rl.config_types import (BUILTIN_REWARDS, LOSS_NAMES, ConfigError, coerce_value,  # noqa: F401
                                     parse_override_value, type_name)


def _section_fields(section_cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(section_cls)}


def all_keys() -> list[str]:
    """Every valid ``section.key``, in declaration order."""
    return [f"{s}.{k}" for s, cls in SECTIONS.items() for k in _section_fields(cls)]


def _suggest(bad: str) -> str:
    keys = all_keys()
    hit = difflib.get_close_matches(bad, keys if "." in bad else list(SECTIONS), n=1, cutoff=0.6)
    if not hit:  # match on the last component: "temperature" -> rollout.temperature, eval.temperature
        leaf = bad.rsplit(".", 1)[-1]
        near = difflib.get_close_matches(leaf, sorted({k.rsplit(".", 1)[1] for k in keys}), n=1, cutoff=0.75)
        hit = [k for k in keys if near and k.rsplit(".", 1)[1] == near[0]]
    if not hit:
        return f"; valid sections: {', '.join(SECTIONS)}"
    return "; did you mean " + " or ".join(repr(h) for h in hit) + "?"


def _apply_mapping(raw: Any, values: dict[str, dict[str, Any]], errors: list[str], origin: str) -> None:
    if raw is None:
        return
    if not isinstance(raw, dict):
        errors.append(f"{origin}: the top level must be a mapping of sections, got {type(raw).__name__}")
        return
    for section, body in raw.items():
        if section not in SECTIONS:
            errors.append(f"{section}: unknown section{_suggest(str(section))}")
            continue
        if body is None:
            continue
        if not isinstance(body, dict):
            errors.append(f"{section}: expected a mapping of keys, got {type(body).__name__} {body!r}")
            continue
        fields_ = _section_fields(SECTIONS[section])
        for key, value in body.items():
            dotted = f"{section}.{key}"
            if key not in fields_:
                errors.append(f"{dotted}: unknown key{_suggest(dotted)}")
                continue
            try:
                values[section][key] = coerce_value(value, fields_[key][0], dotted)
            except ConfigError as exc:
                errors.extend(exc.problems)


def _apply_override(item: str, values: dict[str, dict[str, Any]], errors: list[str]) -> None:
    path, eq, text = item.partition("=")
    path = path.strip()
    if not eq or not path:
        errors.append(f"override {item!r}: expected section.key=value")
        return
    parts = path.split(".")
    if len(parts) < 2 or parts[0] not in SECTIONS:
        errors.append(f"override {path}: unknown key{_suggest(path)}")
        return
    section, key, rest = parts[0], parts[1], parts[2:]
    fields_ = _section_fields(SECTIONS[section])
    if key not in fields_:
        errors.append(f"override {section}.{key}: unknown key{_suggest(section + '.' + key)}")
        return
    tp = fields_[key][0]
    try:
        if rest:  # reach into a dict-valued key: data.task_kwargs.max_terms=2
            if typing.get_origin(tp) is not dict:
                errors.append(f"override {path}: {section}.{key} is a {type_name(tp)}, not a mapping")
                return
            current = dict(values[section].get(key, fields_[key][1].default_factory()))  # type: ignore[misc]
            node = current
            for part in rest[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError([f"override {path}: {part!r} is not a mapping"])
            node[rest[-1]] = parse_override_value(text, Any, path)
            values[section][key] = current
        else:
            values[section][key] = parse_override_value(text, tp, f"{section}.{key}")
    except ConfigError as exc:
        errors.extend(exc.problems)


def config_from_dict(raw: dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = (),
                     *, origin: str = "<dict>", validate: bool = True) -> RLConfig:
    """Build an :class:`RLConfig` from a nested dict plus ``section.key=value`` overrides.

    Raises:
        ConfigError: every unknown key, type error and (when ``validate``) contradiction at once.
    """
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    errors: list[str] = []
    _apply_mapping(raw, values, errors, origin)
    for item in overrides:
        _apply_override(item, values, errors)
    if errors:
        raise ConfigError(errors, origin=origin)
    cfg = RLConfig(**{s: SECTIONS[s](**values[s]) for s in SECTIONS})
    if validate:
        problems = validate_config(cfg)
        if problems:
            raise ConfigError(problems, origin=origin)
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives one key twice (PyYAML keeps the last)."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hashable = hash(key) is not None
        except TypeError:
            hashable = False
        if hashable and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key]}); keep one of them",
                key_node.start_mark)
        if hashable:
            seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML or TOML config file into a dict (no validation).

    Raises:
        ConfigError: missing file, unknown suffix, bytes that are not UTF-8 (the line named), a key
            given twice in one YAML mapping, or a syntax error (with the parser's position).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file {str(path)!r} does not exist"])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ConfigError([f"line {line}: byte {exc.object[exc.start:exc.start + 1]!r} is not UTF-8; save the file "
                           "as UTF-8"], origin=str(path)) from None
    try:
        if path.suffix in (".yaml", ".yml"):
            return yaml.load(text, Loader=_UniqueKeyLoader) or {}
        if path.suffix == ".toml":
            return tomllib.loads(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError([f"cannot parse: {exc}"], origin=str(path)) from exc
    raise ConfigError([f"config file {str(path)!r}: unknown suffix {path.suffix!r}; use .yaml, .yml or .toml"])


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] | tuple[str, ...] = (),
                *, validate: bool = True) -> RLConfig:
    """Load ``path`` (YAML/TOML; None: defaults only), apply overrides, validate.

    Raises:
        ConfigError: see :func:`config_from_dict` and :func:`read_config_file`.
    """
    raw = read_config_file(path) if path is not None else {}
    return config_from_dict(raw, overrides, origin=str(path) if path else "<defaults>", validate=validate)


from ferrule.rl.config_checks import config_reference_markdown, validate_config  # noqa: E402

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig", "LoggingConfig", "LoraConfig",
    "ModelConfig", "OptimizerConfig", "ParallelConfig", "RLConfig", "RewardConfig", "RolloutConfig",
    "TrainConfig", "all_keys", "config_from_dict", "config_reference_markdown", "load_config",
    "read_config_file", "validate_config", "LOSS_NAMES", "BUILTIN_REWARDS", "CONFIG_FILE_NAME",
]
