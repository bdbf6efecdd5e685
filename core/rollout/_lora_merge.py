"""A served LoRA adapter merged into a copy of the targeted weights, for the embedded engine's
fast CUDA decode path (:mod:`ferrule.rollout._fast_decode`).

PEFT's unmerged ``lora.Linear`` forward (``base(x) + lora_B(lora_A(x)) * scaling``; PEFT
``peft/tuners/lora/layer.py``) adds two small matmuls and a handful of eager kernels and Python per
targeted linear. When one adapter serves every row (the embedded engine serves one adapter,
applied to every request), the same function is ``x @ (W + scaling * B @ A)^T``: the merged
weight, rounded once to the weight dtype. :class:`MergedLora` keeps that merged weight in its own
buffers (the base weights stay untouched and bit-identical, so unloading the adapter or serving
it unmerged elsewhere is exact) and

- gives the fast decode step a :class:`~ferrule.rollout._fast_decode.FusedLayout` over them;
- runs the prefill on them too (:meth:`MergedLora.merged_modules`: each targeted PEFT wrapper is
  swapped, for the prefill only, for a plain ``nn.Linear`` over its block of the merged buffer,
  so the prefill is the base model's own forward);
- re-merges only when the weights or the adapter changed (:meth:`MergedLora.refresh` with a
  :meth:`MergedLora.version`), not on every ``generate`` (168 ``addmm`` for an all-linear adapter
  on a 24-layer model).

Every merged buffer is allocated once, when the adapter is first served on the fast path, and
written in place afterwards, so captured CUDA graphs stay valid and device memory stays flat
across adapter syncs. Its cost is one copy of the targeted weights (for an all-linear adapter,
every layer's projection weights).

``RolloutEngineSettings.lora_merged``: true (default, :data:`LORA_MERGED`) as above; false:
the behaviour before (merge on every call, prefill through PEFT's unmerged layers). H200, Qwen2-0.5B
shape, r16 all-linear, greedy 64 x 128 (docs/benchmarks.md "LoRA"): 1.017x the base decode time
with true, 1.129x with false; mean |logprob error| against fp32 HF + PEFT 0.0075 (base bf16 path
against fp32 HF: 0.0067).

The plain path (CPU, continuous batching, stop strings, truncated sampling, ...) keeps PEFT's
unmerged forward (:mod:`ferrule.rollout._lora`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Iterator

import torch
from ferrule.rollout._lora import ADAPTER_NAME

if TYPE_CHECKING:
    from ferrule.rollout._fast_decode import FusedLayout

__all__ = ["LORA_MERGED", "MergedLora"]

#: default of ``RolloutEngineSettings.lora_merged`` (see the module docstring)
LORA_MERGED = True  # verified on an H200, 2026-12-02 (docs/benchmarks.md "LoRA")
#: the projections a decoder layer of the fast path has (``FusedLayout.block`` places each)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _stand_in(base: torch.nn.Linear, weight: torch.Tensor) -> torch.nn.Linear:
    """An ``nn.Linear`` computing ``x @ weight^T + base.bias`` (``weight`` aliased, not copied)."""
    lin = torch.nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
    lin.weight = torch.nn.Parameter(weight, requires_grad=False)
    lin.bias = base.bias
    return lin


class MergedLora:
    """Decode weights with the served LoRA adapter merged into a copy: ``W + scaling * B @ A``
    (PEFT's ``lora.Linear`` forward with the product taken first), rounded once to the weight
    dtype (``torch.addmm``: fp32 accumulation on CUDA). Only the targeted fused buffers of the
    layout are copied; rows of a copied buffer that no adapter targets (``k_proj`` when only
    ``q_proj`` / ``v_proj`` are adapted) are copied from the base at every refresh.

    Args:
        layout: the base :class:`~ferrule.rollout._fast_decode.FusedLayout`.
        adapter: the served :class:`ferrule.rollout._lora.ServedLoraAdapter`.
        model: the engine's model (carrying the adapter's PEFT wrappers).

    Attributes:
        layout: the layout over the merged buffers (decode with it).
        nbytes: device bytes of the merged buffers.
        refreshes: how many times :meth:`refresh` merged (for tests and benchmarks).

    Raises:
        ValueError: a wrapped module that is not one of a decoder layer's projections
            (:data:`PROJECTIONS`; the caller then keeps the plain, unmerged path).
    """

    def __init__(self, layout: "FusedLayout", adapter: Any, model: torch.nn.Module):
        # the merged buffers are tensors of the base buffers' kind (ordinary ones, also when built inside
        # generate's inference mode): an inference tensor has another dispatch key set, which fails the
        # compiled step's guards (one more compile of the whole decode step, seen on CPU with
        # backend="eager"; tests/test_rollout_fast_decode.py)
        with torch.inference_mode(False), torch.no_grad():
            self._build(layout, adapter, model)

    def _build(self, layout: "FusedLayout", adapter: Any, model: torch.nn.Module) -> None:
        weights = list(layout.weights)
        copies: dict[int, torch.Tensor] = {}
        spans: dict[int, list[tuple[int, int]]] = {}
        self.plan: list[tuple] = []  # (merged block, base block, lora_A [r, in], lora_B [out, r], scaling)
        self._swaps: list[tuple] = []  # (parent's module dict, child name, PEFT wrapper, stand-in nn.Linear)
        for name, m in adapter._wrapped.items():
            parts = name.split(".")
            if (len(parts) != 5 or parts[:2] != ["model", "layers"] or parts[4] not in PROJECTIONS
                    or ADAPTER_NAME not in getattr(m, "lora_A", {})):
                raise ValueError(f"MergedLora: cannot merge the adapter on {name!r}")
            k, r0 = layout.block(int(parts[2]), parts[4])
            if k not in copies:
                with torch.inference_mode(layout.weights[k].is_inference()):  # the base buffer's kind of tensor
                    copies[k] = weights[k] = torch.empty_like(layout.weights[k])
            a, b = m.lora_A[ADAPTER_NAME].weight, m.lora_B[ADAPTER_NAME].weight
            r1 = r0 + b.shape[0]
            self.plan.append((copies[k][r0:r1], layout.weights[k][r0:r1], a, b, float(m.scaling[ADAPTER_NAME])))
            spans.setdefault(k, []).append((r0, r1))
            parent = model.get_submodule(".".join(parts[:4]))
            self._swaps.append((parent._modules, parts[4], m, _stand_in(m.get_base_layer(), copies[k][r0:r1])))
        self._fill: list[tuple[torch.Tensor, torch.Tensor]] = []  # (merged rows, base rows) no adapter targets
        for k, kspans in spans.items():
            at = 0
            for r0, r1 in sorted(kspans) + [(layout.weights[k].shape[0],) * 2]:
                if r0 > at:
                    self._fill.append((copies[k][at:r0], layout.weights[k][at:r0]))
                at = max(at, r1)
        self.adapter = adapter
        self.nbytes = sum(c.numel() * c.element_size() for c in copies.values())
        self.base_key = layout.key()
        self.layout = dataclasses.replace(layout, weights=weights)
        self.refreshes = 0
        self._merged_version: tuple | None = None
        # every parameter of the model (base and adapter) in named_parameters order, so that the
        # per-call checks read addresses and version counters without walking the module tree
        named = list(model.named_parameters())
        self._base_params = [p for n, p in named if "lora_" not in n]
        self._watched = [p for _, p in named if not p.is_inference()]  # inference tensors keep no version

    def base_ptrs(self) -> tuple[int, ...]:
        """:func:`ferrule.rollout._fast_decode.base_ptrs` of the model, from the parameters cached
        at construction (the module tree is fixed while this adapter is served)."""
        return tuple(p.data_ptr() for p in self._base_params)

    def version(self, serial: int) -> tuple[int, int]:
        """What the merge depends on: the engine's count of weight / adapter writes through its
        API (``serial``) and the sum of the parameters' in-place version counters (which also
        counts writes through the aliases ``get_hf_state_dict`` / ``get_lora_state_dict`` return;
        not writes through ``param.data``, which has a counter of its own)."""
        return serial, sum(p._version for p in self._watched)

    @torch.no_grad()
    def refresh(self, version: tuple | None = None) -> bool:
        """Merged block = base block + scaling * B @ A for every targeted projection, in place;
        skipped (returns False) when ``version`` equals the last merged one (None: always merge)."""
        if version is not None and version == self._merged_version:
            return False
        if self._fill:
            torch._foreach_copy_([d for d, _ in self._fill], [s for _, s in self._fill])
        for dst, base, a, b, scaling in self.plan:
            torch.addmm(base, b, a, alpha=scaling, out=dst)
        self._merged_version = version
        self.refreshes += 1
        return True

    @contextlib.contextmanager
    def merged_modules(self) -> Iterator[None]:
        """Within the block, each targeted PEFT wrapper is replaced in its parent by a plain
        ``nn.Linear`` over its block of the merged weights (the base model's forward on merged
        weights); the wrappers are back in place afterwards, also when the block raises."""
        for mods, child, _, lin in self._swaps:
            mods[child] = lin
        try:
            yield
        finally:
            for mods, child, wrapper, _ in self._swaps:
                mods[child] = wrapper
