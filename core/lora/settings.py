"""``LoraSettings``: what to adapt and how (rank, alpha, dropout, targets, rsLoRA, init seed).

Importing this module imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["LoraSettings", "ALL_TARGETS", "MAX_LORA_RANK", "checkpoint_settings"]

#: The ``target_modules`` sentinel: every linear module a registered applier handles, except the
#: output layer (PEFT's ``"all-linear"`` also leaves ``lm_head`` out); name ``output_layer`` /
#: ``lm_head`` explicitly to adapt it.
ALL_TARGETS = "all"

#: The largest LoRA rank ferrule accepts up front: ``ferrule train``'s ``lora.rank`` (config
#: validation, :mod:`ferrule.rl.config_checks`) and the default of ``ferrule serve --max-lora-rank``
#: (:class:`ferrule.serve.limits.ServeLimits`). Past it a typo (``lora.rank=100000``) would
#: otherwise allocate ``[rank, in]`` + ``[out, rank]`` per adapted linear before anything failed.
MAX_LORA_RANK = 128


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters (Hu et al. 2021, "LoRA"; rsLoRA: Kalajdzievski 2023).

    The adapted layer computes ``y = W x + scaling * B (A dropout(x))`` with ``A`` ``[rank, in]``
    and ``B`` ``[out, rank]`` (HF PEFT's ``lora_A`` / ``lora_B`` layout, ``peft/tuners/lora/layer.py``).

    Attributes:
        rank: ``r`` > 0.
        alpha: ``lora_alpha`` > 0; ``scaling = alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA
            (PEFT's definition).
        dropout: dropout probability on the adapter's input, in [0, 1); active in training mode only
            (it draws random numbers, so with dropout > 0 results depend on the micro-batch split).
        target_modules: ``"all"`` (:data:`ALL_TARGETS`), or module names: Megatron leaves
            (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, ``output_layer``) select
            every module with that leaf, experts included; HF names (``q_proj``, ``mlp.down_proj``,
            ..., ``lm_head``) select transformers *modules* by PEFT's rule (the module path equals the
            name or ends with ``"." + name``), so ``down_proj`` is the dense MLP's ``nn.Linear`` and not
            the experts' 3-D parameter of the same leaf. May be empty when ``target_parameters`` is not.
            An HF name that is part of a fused Megatron module (``q_proj`` of ``linear_qkv``,
            ``gate_proj`` of ``linear_fc1``) must come with its siblings.
        target_parameters: HF parameter paths, PEFT's ``target_parameters`` (matched the same way on
            ``<module path>.<parameter>``): the 3-D expert parameters transformers keeps instead of
            linears, i.e. the routed experts of every MoE family (``mlp.experts.gate_up_proj``,
            ``mlp.experts.down_proj``) and Inkling's shared experts (``mlp.shared_experts.gate_proj``
            + ``mlp.shared_experts.up_proj``, ``mlp.shared_experts.down_proj``). Empty with ``"all"``
            (which includes them).
        use_rslora: rank-stabilized scaling.
        init_seed: seed of the ``A`` initialisation (PEFT's: kaiming-uniform with ``a = sqrt(5)``,
            i.e. ``U(-1/sqrt(in), 1/sqrt(in))``; ``B`` starts at zero so the adapted model equals
            the base model). Each module draws from its own generator seeded by ``init_seed`` and its
            global name, so the values do not depend on the parallel layout.

    Raises:
        ValueError: a field out of range (the message names it).
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ALL_TARGETS
    use_rslora: bool = False
    init_seed: int = 0
    target_parameters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoraSettings.rank={self.rank!r}; expected a positive integer (e.g. 8).")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoraSettings.alpha={self.alpha!r}; expected a positive number (e.g. 16).")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings.dropout={self.dropout!r}; expected 0 <= dropout < 1.")
        targets = self.target_modules
        if isinstance(targets, str):
            if targets != ALL_TARGETS:
                raise ValueError(f"LoraSettings.target_modules={targets!r}; expected {ALL_TARGETS!r} or a tuple of "
                                 f"module names such as ('linear_qkv', 'linear_proj').")
        params = self.target_parameters
        if isinstance(params, str) or not all(isinstance(t, str) and t for t in params):
            raise ValueError(f"LoraSettings.target_parameters={params!r}; expected a tuple of HF parameter paths "
                             f"such as ('mlp.experts.gate_up_proj', 'mlp.experts.down_proj').")
        object.__setattr__(self, "target_parameters", tuple(dict.fromkeys(params)))
        if isinstance(targets, str):
            if self.target_parameters:
                raise ValueError(f"LoraSettings.target_parameters={self.target_parameters!r} with target_modules="
                                 f"{ALL_TARGETS!r}: 'all' already adapts every expert parameter; drop "
                                 f"target_parameters or list target_modules.")
        else:
            targets = tuple(targets)
            if not all(isinstance(t, str) and t for t in targets) or not (targets or self.target_parameters):
                raise ValueError(f"LoraSettings.target_modules={self.target_modules!r}; expected {ALL_TARGETS!r} or a "
                                 f"tuple of module names (empty only with target_parameters).")
            object.__setattr__(self, "target_modules", tuple(dict.fromkeys(targets)))
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"LoraSettings.use_rslora={self.use_rslora!r}; expected True or False.")
        if isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int):
            raise ValueError(f"LoraSettings.init_seed={self.init_seed!r}; expected an integer.")

    @property
    def scaling(self) -> float:
        """``alpha / rank`` (``alpha / sqrt(rank)`` with rsLoRA), PEFT ``LoraLayer.update_layer``."""
        return float(self.alpha) / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "LoraSettings":
        """From a config mapping (``ferrule train``'s ``lora:`` section, ``engine_state.json``'s ``lora``);
        ``target_modules`` / ``target_parameters`` may be lists.

        Raises:
            ValueError: unknown keys (listed) or bad values.
        """
        known = {"rank", "alpha", "dropout", "target_modules", "target_parameters", "use_rslora", "init_seed"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown LoRA settings {unknown}; known: {sorted(known)}.")
        kw = dict(raw)
        for key in ("target_modules", "target_parameters"):
            if isinstance(kw.get(key), list):
                kw[key] = tuple(kw[key])
        return cls(**kw)

    # -- what the train engine calls: it receives the adapters through these settings and imports no
    # ferrule.lora itself (docs/architecture.md: the engine layer sits below lora)

    def apply_to(self, chunks: Any, *, family: str, table: Any, hf_config: Mapping[str, Any]) -> list[str]:
        """Attach these adapters to unwrapped model ``chunks`` and freeze the base
        (:func:`ferrule.lora.model.apply_lora`); returns the adapted modules' global names."""
        from .model import apply_lora

        return apply_lora(chunks, self, family=family, table=table, hf_config=hf_config)

    def save_payload(self, engine: Any) -> tuple[dict, dict[str, bytes]]:
        """The adapter part of ``engine.save`` (:func:`ferrule.lora.checkpoint.lora_save_payload`)."""
        from .checkpoint import lora_save_payload

        return lora_save_payload(engine)

    def load_payload(self, engine: Any, ckpt: Any, with_optimizer: bool) -> dict | None:
        """The adapter part of ``engine.load`` (:func:`ferrule.lora.checkpoint.lora_load_payload`)."""
        from .checkpoint import lora_load_payload

        return lora_load_payload(engine, ckpt, with_optimizer)


def checkpoint_settings(path: Any) -> LoraSettings:
    """The :class:`~ferrule.lora.LoraSettings` a LoRA checkpoint (a ``TrainEngine.save`` folder, e.g.
    ``ferrule lora import``'s ``OUT``) was saved with, from its ``engine_state.json``; pass them as
    ``TrainEngine.from_torch_dist(path, lora=...)`` to resume it (same targets, ``target_parameters``
    included, and the same ``init_seed``).

    Raises:
        FileNotFoundError: no ``engine_state.json``, or it records no LoRA (a full-parameter checkpoint).
    """
    import json
    from pathlib import Path

    from ferrule.megatron.checkpoint import ENGINE_STATE_FILE

    state = Path(path) / ENGINE_STATE_FILE
    if not state.is_file():
        raise FileNotFoundError(f"{state} is missing; {path} is not a TrainEngine.save folder.")
    saved = json.loads(state.read_text()).get("lora")
    if not saved:
        raise FileNotFoundError(f"{path} is a full-parameter checkpoint ({ENGINE_STATE_FILE} records no LoRA).")
    return LoraSettings.from_dict(saved)
