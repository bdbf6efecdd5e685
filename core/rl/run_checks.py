"""Checks of a ``ferrule train`` config that need no model: run by :class:`ferrule.rl.loop.GRPOTrainer`
before anything is loaded, so these errors come in a second rather than after model loading.

- :func:`check_supported`: settings the loop does not implement (yet);
- :func:`preflight`: the run folder, the model family, the chat template;
- :func:`lora_settings`: the ``lora`` section as :class:`ferrule.lora.LoraSettings` (or None).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ferrule.rl.config import ConfigError, RLConfig

__all__ = ["check_supported", "lora_settings", "preflight"]


def lora_settings(cfg: RLConfig) -> Any:
    """The ``lora`` section as :class:`ferrule.lora.LoraSettings` (``init_seed = train.seed``), or None
    when ``lora.rank == 0`` (full-parameter training).

    Raises:
        ConfigError: LoRA requested but :mod:`ferrule.lora` (the LoRA train side) is not installed, or
            the settings are refused by ``LoraSettings`` (the message names the key).
    """
    lo = cfg.lora
    if lo.rank == 0:
        return None
    try:
        from ferrule.lora import LoraSettings
    except ImportError:
        raise ConfigError([f"lora.rank: {lo.rank} asks for LoRA training, but this ferrule has no ferrule.lora "
                           "(the LoRA train engine); update ferrule or set lora.rank=0"]) from None
    targets = lo.target_modules if isinstance(lo.target_modules, str) else tuple(lo.target_modules)
    try:
        return LoraSettings(rank=lo.rank, alpha=float(lo.alpha), dropout=float(lo.dropout), target_modules=targets,
                            target_parameters=tuple(lo.target_parameters),
                            use_rslora=lo.use_rslora, init_seed=cfg.train.seed)
    except ValueError as exc:
        raise ConfigError([f"lora: {exc}"]) from None


def preflight(cfg: RLConfig) -> None:
    """The checks that need no model, run before any is loaded (seconds earlier than setup).

    Raises:
        ConfigError: every problem at once: a fresh run into a run folder that already holds
            metrics (the message names ``--resume``), an unknown ``model.family``, a checkpoint
            whose ``model_type`` no plugin supports, an unknown ``data.chat_template``.
    """
    from ferrule import registry
    from ferrule.rl.metrics import METRICS_FILE, read_metrics

    problems = []
    run_dir = Path(cfg.logging.run_dir)
    if not cfg.checkpoint.resume:
        done = read_metrics(run_dir / METRICS_FILE)
        if done:
            problems.append(f"logging.run_dir: {run_dir} already holds a run ({len(done)} logged steps, last "
                            f"step {done[-1].get('step')}); continue it with --resume (`ferrule train --resume "
                            f"--run-dir {run_dir}`), or start a new run with another --run-dir")
    if cfg.model.family:
        try:
            registry.get_family(cfg.model.family)
        except registry.UnknownModelError as exc:
            problems.append(f"model.family: {exc.args[0] if exc.args else exc}")
    else:
        hf_config = json.loads((Path(cfg.model.hf_dir) / "config.json").read_text())
        try:
            registry.family_for_hf_config(hf_config)
        except registry.UnknownModelError as exc:
            problems.append(f"model.hf_dir: {exc.args[0] if exc.args else exc}")
    if cfg.data.chat_template:
        try:
            registry.get_chat_template(cfg.data.chat_template)
        except registry.UnknownModelError as exc:
            problems.append(f"data.chat_template: {exc.args[0] if exc.args else exc}")
    if problems:
        raise ConfigError(problems)


def check_supported(cfg: RLConfig) -> None:
    """Raise :class:`ConfigError` for settings the loop does not implement (yet)."""
    p = []
    a = cfg.algorithm
    if a.kl_coef > 0 and a.kl_estimator != "k3":
        p.append(f"algorithm.kl_estimator: {a.kl_estimator!r} is not implemented as a loss term "
                 "(ferrule.losses uses k3); set algorithm.kl_estimator=k3")
    if a.entropy_coef > 0:
        p.append("algorithm.entropy_coef: an entropy bonus is not implemented by the train engine; set it to 0 "
                 "(entropy is still reported)")
    if cfg.lora.rank > 0:
        try:
            lora_settings(cfg)
        except ConfigError as exc:
            p.extend(exc.problems)
    # parallel.*: checked against the world size and the model by ferrule.rl.distributed.check_layout
    if p:
        raise ConfigError(p)
