"""Recording the experts an HF MoE model's routers pick while the embedded engine decodes (R3).

Routing replay (R3, "rollout routing replay", Ma et al. 2025, arXiv 2510.11370): the rollout records,
per token and MoE layer, the top-k experts its router chose; the train forward then routes every
token to those experts (gating weights recomputed from the train router's logits over them,
:mod:`ferrule.megatron.routing_replay`), so the policy that is trained is the one that sampled.

The HF routers of the MoE families (``Qwen3MoeTopKRouter``, ``InklingTopkRouter``,
``Inkling2TopKRouter`` in transformers 5.2x) are the modules named ``*.mlp.gate`` with a ``top_k``
attribute; their ``forward`` returns ``(logits, weights, indices, ...)`` with ``indices``
``[tokens, top_k]`` int64 for the flattened ``[batch, seq]`` tokens (batch-major). A forward hook
keeps ``indices`` of every call: the prompt forward, then one call per decode step.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["RouteRecorder", "hf_routers"]


def hf_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the HF model's MoE routers in model (layer) order: modules named
    ``*.mlp.gate`` that have a ``top_k`` attribute (a dense MLP's ``gate_proj`` does not match)."""
    return [(n, m) for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]


class RouteRecorder:
    """Context manager: forward hooks on every HF router of ``model`` that keep its top-k indices.

    After the block, :meth:`rows` cuts the calls into per-row routes. Calls are the prompt forward
    ``[batch * P, top_k]`` followed by one ``[batch, top_k]`` call per decode step.

    Raises:
        ValueError: at entry, ``model`` has no MoE router (routing replay needs an MoE model); in
            :meth:`rows`, a router ran a different number of times than the others (a looped layer,
            e.g. Inkling-2-Loop, routes one token several times per forward: not supported).
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = hf_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay: {type(model).__name__} has no MoE router (no '*.mlp.gate' module "
                             "with top_k); turn algorithm.routing_replay off for a dense model.")
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles: list = []

    def __enter__(self) -> "RouteRecorder":
        for k, (_, module) in enumerate(self.routers):
            self._handles.append(module.register_forward_hook(self._hook(k)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, k: int):
        def keep(module, args, output):
            self.calls[k].append(output[2].detach().to(torch.int16))
        return keep

    def rows(self, prompt_lengths: Sequence[int], prompt_width: int, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Per real row ``r``: ``[prompt_lengths[r] + lengths[r] - 1, layers, top_k]`` int16 CPU.

        Args:
            prompt_lengths: each real row's prompt tokens (right-aligned in a prompt forward of
                ``prompt_width`` columns: left padding, or none when all are equal).
            prompt_width: ``P``, the prompt forward's sequence length.
            lengths: each real row's generated tokens ``R`` (its first ``R - 1`` were fed back).
        """
        counts = {len(c) for c in self.calls}
        if len(counts) != 1:
            per = {name: len(c) for (name, _), c in zip(self.routers, self.calls)}
            raise ValueError(f"routing replay: the MoE routers ran unequal numbers of times {per}; a layer that "
                             "runs several times per forward (a looped model) is not supported.")
        stacked = [torch.stack(calls_at, dim=1).cpu() for calls_at in zip(*self.calls)]  # per call [tokens, L, k]
        prefill, steps = stacked[0], stacked[1:]
        batch = prefill.shape[0] // prompt_width
        prefill = prefill.view(batch, prompt_width, *prefill.shape[1:])
        out = []
        for r, (p, n) in enumerate(zip(prompt_lengths, lengths)):
            parts = [prefill[r, prompt_width - p:]] + [steps[t].view(batch, *steps[t].shape[1:])[r:r + 1]
                                                       for t in range(max(n - 1, 0))]
            out.append(torch.cat(parts).contiguous())
        return out
