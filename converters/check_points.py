"""Capture points of ``ferrule check``'s divergence report: which module outputs are compared, on both sides.

Per decoder layer ``i`` the points are, in forward order (megatron side: ``decoder.layers[i]``):

============== ================================================ ====================================
op             megatron module                                  HF module (default choice)
============== ================================================ ====================================
``input_norm`` ``input_layernorm`` (absent when ``IdentityOp``)  ``input_layernorm``
``attention``  ``self_attention``: what the attention block      ``post_attention_layernorm`` when
               adds to the residual stream (post-norm and        the layer has
               ``linear_proj``'s bias included)                  ``post_feedforward_layernorm``
                                                                 (Gemma-2/3, OLMo-2), else
                                                                 ``self_attn``
``pre_mlp_norm`` ``pre_mlp_layernorm`` (absent when ``IdentityOp``) ``pre_feedforward_layernorm``;
                                                                 else ``post_attention_layernorm``
                                                                 for a pre-norm layer (Llama names
                                                                 its pre-MLP norm so)
``mlp``        ``mlp``: what the MLP block adds (post-norm       ``post_feedforward_layernorm`` if
               and ``linear_fc2``'s bias included)               present, else ``mlp``
``output``     the layer                                         the layer
============== ================================================ ====================================

plus ``embedding`` (``embedding`` / ``model.embed_tokens``, after any embedding multiplier on
the megatron side and HF's scaled embedding) first and ``final_norm`` (``decoder.final_layernorm``
/ ``model.norm``) last. A family whose HF layers name these modules otherwise declares
``CHECK_HF_CAPTURE = {op: "attribute.path" | None}`` in its provider module (None: no such
point). A point both sides lack is left out; a point one side lacks is reported as not compared (``diff`` None) and is never a
departure; a non-finite megatron value where HF is finite counts as an infinite difference (a
departure), so no difference is ever NaN.

Megatron captures are ``[seq, batch, hidden]`` (transposed here); at TP > 1 every point is a
full (all-reduced) tensor, so rank 0 compares them with HF's ``[batch, seq, hidden]``.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["POINT_OPS", "hf_layer_points", "mcore_layer_points", "capture", "compare", "first_departure"]

#: Per-layer ops in forward order.
POINT_OPS = ("input_norm", "attention", "pre_mlp_norm", "mlp", "output")


def _module(root: Any, path: str | None):
    import torch

    obj = root
    for part in (path or "").split(".") if path else ():
        obj = getattr(obj, part, None)
    return obj if path and isinstance(obj, torch.nn.Module) else None


def hf_layer_points(layer: Any, overrides: dict[str, str | None] | None = None) -> dict[str, Any]:
    """``{op: HF module}`` of one HF decoder layer (module docs); ops without a module are left out."""
    def has(name: str) -> bool:
        return _module(layer, name) is not None

    post_ffn = has("post_feedforward_layernorm")
    names: dict[str, str | None] = {
        "input_norm": "input_layernorm",
        "attention": "post_attention_layernorm" if post_ffn else "self_attn",
        "pre_mlp_norm": "pre_feedforward_layernorm" if has("pre_feedforward_layernorm") else
        (None if post_ffn else "post_attention_layernorm"),
        "mlp": "post_feedforward_layernorm" if post_ffn else "mlp",
    }
    names.update(overrides or {})
    points = {op: _module(layer, name) for op, name in names.items() if op != "output"}
    points["output"] = layer
    return {op: m for op, m in points.items() if m is not None}


def mcore_layer_points(layer: Any) -> dict[str, Any]:
    """``{op: megatron module}`` of one ``TransformerLayer``; ``IdentityOp`` norms are left out."""
    from megatron.core.transformer.identity_op import IdentityOp

    points = {"input_norm": getattr(layer, "input_layernorm", None), "attention": getattr(layer, "self_attention", None),
              "pre_mlp_norm": getattr(layer, "pre_mlp_layernorm", None), "mlp": getattr(layer, "mlp", None),
              "output": layer}
    return {op: m for op, m in points.items() if m is not None and not isinstance(m, IdentityOp)}


def _with_bias(output: Any) -> Any:
    """A module's output as the residual stream receives it: megatron's attention and MLP return
    ``(output, bias)`` with ``linear_proj`` / ``linear_fc2``'s bias left out (``skip_bias_add``; the layer's
    bias-dropout-add adds it), while HF's ``o_proj`` / ``down_proj`` add theirs, so the bias is added here
    (a point that left it out differed by the bias in every layer of a family with an ``o_proj`` bias, and
    every later mistake was blamed on "layer 0 attention")."""
    if not isinstance(output, (tuple, list)):
        return output
    out = output[0]
    bias = output[1] if len(output) > 1 else None
    import torch

    if isinstance(out, torch.Tensor) and isinstance(bias, torch.Tensor) and bias.shape == out.shape[-1:]:
        return out + bias
    return out


def capture(points: dict[tuple, Any], store: dict, *, layout: str) -> list:
    """Forward hooks storing each module's first output tensor under its key, as fp64 ``[b, s, h]``; a
    ``(output, bias)`` pair of a megatron attention / MLP (``layout="sbh"``) is stored as ``output + bias``."""
    handles = []
    for key, module in points.items():
        def hook(_m, _inputs, output, key=key):
            if layout == "sbh":
                out = _with_bias(output)
            else:
                out = output[0] if isinstance(output, (tuple, list)) else output
            out = out.detach().double()
            store[key] = out.transpose(0, 1) if layout == "sbh" else out

        handles.append(module.register_forward_hook(hook))
    return handles


def _max_diff(a, b) -> float:
    import torch

    d = (a - b).abs()
    d = torch.where((a == b) | (a.isnan() & b.isnan()), torch.zeros_like(d), d)
    return float(torch.nan_to_num(d, nan=math.inf, posinf=math.inf).max().item())


def compare(order: list[tuple], hf_store: dict, mc_store: dict) -> list[tuple[Any, str, float | None, str]]:
    """``(layer, op, max abs diff or None, note)`` for every key of ``order`` (module docs)."""
    rows = []
    for key in order:
        layer, op = key
        a, b = hf_store.get(key), mc_store.get(key)
        if a is None and b is None:
            continue  # neither side has this point (e.g. no pre-norms in a post-norm family)
        if a is None or b is None:
            side = "HF" if a is None else "megatron"
            rows.append((layer, op, None, f"not compared: no {side} module"))
        elif a.shape != b.shape:
            rows.append((layer, op, None, f"not compared: HF {tuple(a.shape)} vs megatron {tuple(b.shape)}"))
        else:
            rows.append((layer, op, _max_diff(a.cpu(), b.cpu()), ""))
    return rows


def first_departure(rows: list[tuple], atol: float) -> tuple | None:
    """The first compared row whose difference exceeds ``atol`` (None: no compared point departs)."""
    return next((r for r in rows if r[2] is not None and r[2] > atol), None)
