"""Serving one HF PEFT LoRA adapter on the embedded engine's transformers model (unmerged).

The adapter arrives as PEFT's *saved* tensors and config (what ``PeftModel.save_pretrained``
writes to ``adapter_model.safetensors`` / ``adapter_config.json``, and what
``ferrule.lora.hf_adapter_state_dict`` / ``ferrule.lora.peft_config`` produce):

- names ``base_model.model.<module path>.lora_A.weight`` ``[r, in_features]`` and
  ``base_model.model.<module path>.lora_B.weight`` ``[out_features, r]``, where ``<module path>``
  is the ``nn.Linear``'s name in the ``...ForCausalLM`` (``model.layers.0.self_attn.q_proj``);
- a ``peft.LoraConfig(...).to_dict()``-compatible dict (``r``, ``lora_alpha``,
  ``target_modules``, ``use_rslora``, ...).

The LoRA forward is PEFT's own (``peft.inject_adapter_in_model`` wraps each targeted
``nn.Linear`` in ``peft.tuners.lora.Linear``: ``y = base(x) + lora_B(lora_A(dropout(x))) *
scaling`` with ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA, PEFT
``LoraLayer.update_layer``). The base weights are never touched (no merge), so the adapter is
applied exactly once and the base stays bit-identical across updates. Dropout is inactive: the
engine's model is in eval mode.

Adapter parameters are kept in the base layer's dtype and device (as SGLang does); later
updates copy into them in place, so CUDA graphs captured with the adapter stay valid.

:class:`ServedLoraAdapter` is the part of :class:`ferrule.rollout.embedded.EmbeddedEngine` (``engine._lora``)
that owns the served adapter's tensors and config; the engine's ``update_lora_adapter``,
``unload_lora_adapter``, ``load_lora_adapter`` and ``get_lora_state_dict`` drive it.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping

import torch

__all__ = ["ADAPTER_NAME", "PEFT_PREFIX", "is_unset", "ServedLoraAdapter", "lora_config_from_dict",
           "structural_settings"]

#: PEFT's adapter name for the single adapter the engine serves.
ADAPTER_NAME = "default"
#: Prefix of every key in a saved PEFT adapter of a causal LM (``PeftModel`` -> ``LoraModel`` -> the HF model).
PEFT_PREFIX = "base_model.model."

#: Config keys that change which tensors exist or how they are applied; they must not change between
#: two updates of a served adapter (unload it first).
STRUCTURAL_KEYS = ("r", "lora_alpha", "target_modules", "target_parameters", "use_rslora", "rank_pattern",
                   "alpha_pattern", "layers_to_transform", "layers_pattern", "exclude_modules", "fan_in_fan_out")

#: PEFT features that add tensors other than lora_A / lora_B (or change the forward); refused.
_UNSUPPORTED = {"use_dora": False, "modules_to_save": None, "bias": "none", "lora_bias": False,
                "layer_replication": None, "trainable_token_indices": None, "use_qalora": False}


def is_unset(value: Any) -> bool:
    """None or an empty container (PEFT writes ``target_parameters: set()`` for some models)."""
    return value is None or (isinstance(value, (list, tuple, set, frozenset, dict)) and not value)


def _normalise(key: str, value: Any) -> Any:
    if key in ("target_modules", "target_parameters") and isinstance(value, (list, tuple, set, frozenset)):
        return sorted(value)
    if is_unset(value):
        return None
    return value


def structural_settings(peft_config: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`STRUCTURAL_KEYS` of a PEFT config dict, normalised for comparison (lists sorted)."""
    return {k: _normalise(k, peft_config.get(k)) for k in STRUCTURAL_KEYS}


def lora_config_from_dict(peft_config: Mapping[str, Any]) -> Any:
    """A ``peft.LoraConfig`` from a ``LoraConfig.to_dict()`` / ``adapter_config.json`` dict.

    Keys ``LoraConfig`` does not take as arguments (``peft_type``, ``auto_mapping``,
    ``peft_version``, ...) are dropped after checking ``peft_type``.

    Raises:
        ValueError: not a LoRA config (``peft_type`` other than ``LORA``), ``r`` / ``lora_alpha``
            missing, or a PEFT feature this engine does not serve (DoRA, bias, modules_to_save,
            target_parameters, ...), naming the key and the value it needs.
    """
    from peft import LoraConfig

    if not isinstance(peft_config, Mapping):
        raise ValueError(f"peft_config must be a dict (LoraConfig.to_dict() / adapter_config.json), "
                         f"got {type(peft_config).__name__}.")
    peft_type = str(peft_config.get("peft_type", "LORA")).rsplit(".", 1)[-1]
    if peft_type != "LORA":
        raise ValueError(f"peft_config['peft_type']={peft_config.get('peft_type')!r}; only LoRA adapters (LORA) "
                         "are served.")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if peft_config.get(k) is None]
    if missing:
        raise ValueError(f"peft_config lacks {missing}; pass LoraConfig(...).to_dict() or the adapter_config.json "
                         "that PeftModel.save_pretrained writes.")
    bad = {k: peft_config[k] for k, ok in _UNSUPPORTED.items()
           if not is_unset(peft_config.get(k)) and peft_config.get(k) != ok}
    if bad:
        raise ValueError(f"peft_config uses PEFT features the embedded engine does not serve: {bad}; expected "
                         f"{ {k: _UNSUPPORTED[k] for k in bad} } (plain LoRA: lora_A / lora_B only).")
    fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    kwargs = {k: v for k, v in peft_config.items() if k in fields and k not in ("peft_type", "task_type")}
    kwargs["inference_mode"] = True
    return LoraConfig(**kwargs)


class ServedLoraAdapter:
    """One PEFT LoRA adapter injected into a transformers model; see the module docstring.

    Build it with :meth:`inject` (validates the first tensors before anything stays changed);
    update it with :meth:`load_`; take it out with :meth:`remove`.

    Attributes:
        config: the adapter's config dict as given. structural: :func:`structural_settings` of it.
        targets: PEFT saved name -> the adapter parameter it fills (``lora_A`` ``[r, in]``,
            ``lora_B`` ``[out, r]``).
    """

    def __init__(self, model: torch.nn.Module, config: dict[str, Any], targets: dict[str, torch.nn.Parameter],
                 wrapped: dict[str, torch.nn.Module]):
        self.model = model
        self.config = config
        self.structural = structural_settings(config)
        self.targets = targets
        self._wrapped = wrapped  # module path -> peft LoRA layer (holds .base_layer)

    # ------------------------------------------------------------------ build / remove
    @classmethod
    def inject(cls, model: torch.nn.Module, peft_config: Mapping[str, Any],
               tensors: Mapping[str, torch.Tensor]) -> "ServedLoraAdapter":
        """Wrap the targeted linears of ``model`` with PEFT LoRA layers and load ``tensors``.

        torch's global RNG is left as it was (PEFT's init draws from it; the values are then
        overwritten). If the tensors do not fit, the model is restored before raising.

        Raises:
            ValueError: bad config (:func:`lora_config_from_dict`), targets matching no module,
                a targeted module that is not an ``nn.Linear``, or tensors that do not fit
                (see :meth:`load_`).
            KeyError: tensor names the adapter does not have.
        """
        from peft import inject_adapter_in_model
        from peft.tuners.lora import LoraLayer

        lora_config = lora_config_from_dict(peft_config)
        before = {name for name, m in model.named_modules() if isinstance(m, LoraLayer)}
        if before:
            raise ValueError(f"the model already carries PEFT LoRA layers ({sorted(before)[:3]}...); the embedded "
                             "engine serves one adapter it injected itself.")
        devices = [model.device] if getattr(model, "device", torch.device("cpu")).type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            try:
                inject_adapter_in_model(lora_config, model, adapter_name=ADAPTER_NAME)
            except ValueError as exc:
                raise ValueError(f"peft_config target_modules={peft_config.get('target_modules')!r} do not fit this "
                                 f"{type(model).__name__}: {exc}") from exc
        wrapped = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
        adapter = cls(model, dict(peft_config), {}, wrapped)
        try:
            not_linear = [n for n, m in wrapped.items() if ADAPTER_NAME not in m.lora_A]
            if not_linear:
                raise ValueError(f"peft_config targets modules that are not nn.Linear ({not_linear[:5]}); the embedded "
                                 "engine serves LoRA on linear layers only (no embedding / conv adapters).")
            for name, m in wrapped.items():
                base = next(m.get_base_layer().parameters())  # nn.Linear weight, or a fused expert tensor
                for part in ("lora_A", "lora_B"):
                    lin = getattr(m, part)[ADAPTER_NAME]
                    lin.to(device=base.device, dtype=base.dtype)
                    lin.weight.requires_grad_(False)
                    adapter.targets[f"{PEFT_PREFIX}{name}.{part}.weight"] = lin.weight
            adapter.load_(tensors)
        except Exception:
            adapter.remove()
            raise
        return adapter

    def remove(self) -> None:
        """Put every original ``nn.Linear`` (the very same module and parameters) back in place."""
        for name, m in self._wrapped.items():
            if any(name.startswith(other + ".") for other in self._wrapped):
                continue  # nested wrapper (PEFT stacks one ParamWrapper per target parameter): the outer one goes
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, child, m.get_base_layer())
        self._wrapped, self.targets = {}, {}
        for attr in ("peft_config", "_hf_peft_config_loaded"):  # set by inject_adapter_in_model
            if attr in vars(self.model):
                delattr(self.model, attr)

    # ------------------------------------------------------------------ values
    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Validate a full adapter: exactly the adapter's names, matching shapes, floating dtypes.

        Raises:
            KeyError: names the adapter does not have (each with the closest known names).
            ValueError: adapter tensors not given (listed), shape mismatches, non-floating tensors.
        """
        unknown = [n for n in tensors if n not in self.targets]
        if unknown:
            hints = {n: difflib.get_close_matches(n, list(self.targets), n=2) for n in unknown[:10]}
            raise KeyError(f"update_lora_adapter: {len(unknown)} tensor name(s) not in the adapter that peft_config "
                           f"describes (target_modules={self.config.get('target_modules')!r}): {hints} (name -> "
                           "closest known). Send PEFT saved names (base_model.model.<module>.lora_A.weight).")
        errors = [f"{n}: not sent" for n in self.targets if n not in tensors]
        for n, t in tensors.items():
            want = tuple(self.targets[n].shape)
            if tuple(t.shape) != want:
                errors.append(f"{n}: shape {tuple(t.shape)} != expected {want} (lora_A [r, in], lora_B [out, r], "
                              f"r={self.config.get('r')})")
            elif not t.is_floating_point():
                errors.append(f"{n}: dtype {t.dtype} is not floating point")
        if errors:
            raise ValueError(f"update_lora_adapter rejected the whole adapter (nothing was written; every one of the "
                             f"{len(self.targets)} adapter tensors must be sent):\n  " + "\n  ".join(errors[:20])
                             + (f"\n  ... {len(errors) - 20} more" if len(errors) > 20 else ""))

    @torch.no_grad()
    def load_(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """:meth:`check`, then copy every tensor into its adapter parameter in place (cast to its dtype)."""
        self.check(tensors)
        dsts = [self.targets[n] for n in tensors]
        srcs = [t.to(device=d.device, dtype=d.dtype, non_blocking=d.device.type == "cuda" and t.device.type == "cpu")
                for t, d in zip(tensors.values(), dsts)]
        torch._foreach_copy_(dsts, srcs)  # one multi-tensor launch per device/dtype group instead of one per tensor

    def state_dict(self) -> dict[str, torch.Tensor]:
        """PEFT saved name -> the served adapter tensor (detached aliases)."""
        return {n: p.detach() for n, p in self.targets.items()}

    def nbytes(self) -> int:
        """Bytes of the adapter parameters (``numel * element_size``)."""
        return sum(p.numel() * p.element_size() for p in self.targets.values())
