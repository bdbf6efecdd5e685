"""Weights in and out of the embedded rollout engine under HF *checkpoint* names
(:meth:`EmbeddedWeightUpdates.update_weights`, :meth:`~EmbeddedWeightUpdates.get_hf_state_dict`),
translated to transformers' in-memory layout by :mod:`ferrule.rollout._checkpoint_names`.

A mixin of :class:`ferrule.rollout.embedded.EmbeddedEngine`: it reads the engine's ``model``,
``device``, ``weights_version``, its ``_ck_tensors`` cache and, while asleep, the live tensor of a
stashed one (the engine's part ``_sleep``, :class:`ferrule.rollout._sleep.WeightSleep`).
"""

from __future__ import annotations

import difflib
from typing import Iterable

import torch

from ferrule.rollout._checkpoint_names import CheckpointTensor, checkpoint_tensors

__all__ = ["EmbeddedWeightUpdates"]


class EmbeddedWeightUpdates:
    """``update_weights`` / ``get_hf_state_dict`` of the embedded engine (in-place copies, so
    captured CUDA graphs stay valid)."""

    #: count of writes to the weights or the served adapter through the engine's API (weight and
    #: adapter updates, direct writes (set_weights_version), wake); a merged adapter copy (:mod:`ferrule.rollout._lora_merge`) is
    #: merged again when it changed
    _weights_serial = 0

    def _checkpoint_tensors(self) -> dict[str, CheckpointTensor]:
        # Built once: the views alias the parameters, which update_weights only writes in place.
        if self._ck_tensors is None:
            self._ck_tensors = checkpoint_tensors(self.model)
        return self._ck_tensors

    def _load_checkpoint_named(self, state_dict: dict[str, torch.Tensor]) -> None:
        targets = self._checkpoint_tensors()
        given = {targets[k].alias_key() for k in state_dict if k in targets}
        missing = sorted(k for k, e in targets.items() if e.alias_key() not in given)
        if missing:
            raise KeyError(f"EmbeddedEngine(state_dict=...): {len(missing)} tensor(s) missing, e.g. {missing[:5]}; "
                           "pass the full model.state_dict() or every HF checkpoint tensor.")
        self.update_weights(state_dict.items(), version=0)

    @torch.inference_mode()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy checkpoint-named tensors into the model in place and set ``weights_version = version``.

        Names are the HF *checkpoint* names, what ``save_pretrained`` writes and what the family's
        mapping table, weight sync and SGLang use (for Qwen3-MoE one tensor per expert,
        ``model.layers.L.mlp.experts.E.gate_proj.weight`` ``[moe_intermediate, hidden]``), even where
        transformers keeps another layout in memory (stacked ``mlp.experts.gate_up_proj``); the
        translation is transformers' own reverse conversion (:mod:`ferrule.rollout._checkpoint_names`).

        All tensors of one call are validated before any is written, so a bad call changes
        nothing. Tied parameters (``lm_head.weight`` aliasing ``model.embed_tokens.weight``) can
        be sent under either name; sending both with different values is an error.

        Args:
            named_tensors: ``(hf_name, tensor)`` pairs, e.g. one update-group bucket. Floating
                tensors are cast to the parameter dtype; other dtypes must match.
            version: the trainer's weight version; must not be lower than ``weights_version``.

        Raises:
            KeyError: unknown names (each is listed with the closest known names).
            ValueError: shape / dtype mismatch, duplicate names, conflicting tied values,
                or a version going backwards.
        """
        if version < self.weights_version:
            raise ValueError(f"update_weights(version={version}) is older than the loaded weights_version="
                             f"{self.weights_version}; versions must not go backwards.")
        targets = self._checkpoint_tensors()
        items = list(named_tensors)
        unknown = [n for n, _ in items if n not in targets]
        if unknown:
            hints = {n: difflib.get_close_matches(n, list(targets), n=2) for n in unknown[:10]}
            raise KeyError(f"update_weights: {len(unknown)} unknown HF checkpoint parameter name(s): {hints} "
                           f"(name -> closest known). The model has {len(targets)} checkpoint-named tensors; "
                           "convert names with the family's mapping table before sending.")
        seen: dict[tuple, tuple[str, torch.Tensor]] = {}
        errors = []
        for name, tensor in items:
            dst = targets[name]
            if tuple(tensor.shape) != dst.shape:
                errors.append(f"{name}: shape {tuple(tensor.shape)} != expected {dst.shape}")
            elif dst.param.is_floating_point() != tensor.is_floating_point() or (
                    not dst.param.is_floating_point() and dst.param.dtype != tensor.dtype):
                errors.append(f"{name}: dtype {tensor.dtype} cannot be loaded into {dst.param.dtype}")
            key = dst.alias_key()
            if key in seen:
                other_name, other = seen[key]
                if other_name == name:
                    errors.append(f"{name}: sent twice in one call")
                elif not torch.equal(other.to(tensor.device, tensor.dtype), tensor):
                    errors.append(f"{name} and {other_name} are tied in this model but were sent with different values")
            seen[key] = (name, tensor)
        if errors:
            raise ValueError("update_weights rejected the whole call (nothing was written):\n  " + "\n  ".join(errors))
        # Only host-to-device copies may be asynchronous: a non_blocking device-to-host copy into
        # pageable memory returns before the data has landed, and the source bucket can be freed
        # and reused by the caching allocator meanwhile (seen on an H200: a CPU rollout engine fed
        # from a CUDA train engine received garbage weights).
        async_ok = self.device.type == "cuda" and self._sleep.stash is None
        for name, tensor in items:
            dst = self._sleep.live(targets[name])
            if self._sleep.stash is not None and dst.view is not None:
                dst.write_(tensor)  # asleep: one (blocking) copy straight into the page-locked host copy
            else:
                dst.write_(tensor.to(dst.param.device, dst.param.dtype,
                                     non_blocking=async_ok and tensor.device.type == "cpu"))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._weights_serial += 1
        self.weights_version = version

    def direct_weight_targets(self) -> dict[str, CheckpointTensor] | None:
        """Where each HF checkpoint tensor lives in the served weights, for a writer in this process
        (:mod:`ferrule.sync.direct`), or None while asleep (the weights are on the host: use
        :meth:`update_weights`).

        The entries alias the served weights (for the fast decode path, the fused q/k/v and gate/up
        buffers); writing them in place is what :meth:`update_weights` does, without its validation,
        casts and stream synchronisation. The dict is replaced (a new object) whenever the weights
        move (re-fusing), so a writer that caches views compares it by identity. The writer must
        call :meth:`set_weights_version` after its copies.
        """
        if self.asleep or self._closed:
            return None
        return self._checkpoint_tensors()

    def set_weights_version(self, version: int) -> None:
        """Record ``version`` after a direct write (:meth:`direct_weight_targets`).

        Raises:
            ValueError: ``version`` lower than ``weights_version``.
        """
        if version < self.weights_version:
            raise ValueError(f"set_weights_version({version}) is older than the loaded weights_version="
                             f"{self.weights_version}; versions must not go backwards.")
        self._weights_serial += 1  # the weights were written (a merged adapter copy is merged again)
        self.weights_version = version

    def get_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's tensors under HF checkpoint names (what ``save_pretrained`` writes, tied names
        included), in checkpoint layout, detached. They alias the weights (in-place edits reach the
        model) except for a layout that is no strided view of a parameter (none among the ferrule
        families), which comes back as a copy.
        """
        return {k: self._sleep.live(e).read() for k, e in self._checkpoint_tensors().items()}
