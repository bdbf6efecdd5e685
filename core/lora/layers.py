"""Trainable low-rank factors attached to Megatron's tensor-parallel linear layers.

An adapter is a child module ``lora`` (:class:`LoraAdapter`) of the base
``ColumnParallelLinear`` / ``RowParallelLinear`` plus a forward hook on the base that adds
``scaling * B (A dropout(x))`` to the base output, so the base module, its parameter names and
its checkpoint keys stay exactly as they were (the adapter is kept out of the base module's
``state_dict``; :mod:`ferrule.lora.checkpoint` saves it per rank).

Tensor parallelism (megatron ``tensor_parallel/layers.py``; same split as the base weight):

- column-parallel ``Y_r = X W_r^T`` (``W`` split on the output dim): ``B`` is split on its
  output dim like ``W`` (``[out/tp, r]``, megatron ``partition_dim=0``), ``A`` ``[r, in]`` is
  replicated. ``h = A x`` is identical on every rank; it passes through
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) so that
  ``dL/dh = sum_r B_r^T dL/dY_r`` and every rank gets the full, identical gradient of ``A``.
- row-parallel ``Y = sum_r X_r W_r^T`` (``W`` split on the input dim): ``A`` is split on its
  input dim (``[r, in/tp]``, ``partition_dim=1``), ``B`` ``[out, r]`` is replicated.
  ``h = sum_r A_r x_r`` via ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
  identity backward); ``Y`` and ``dL/dY`` are replicated, so ``B``'s gradient is identical on
  every rank and ``A_r``'s is its own slice.

Replicated factors carry no ``tensor_model_parallel`` attribute, so megatron's grad-norm counts
them once (``param_is_not_tensor_parallel_duplicate``).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

__all__ = ["LoraAdapter", "LORA_PARAM_ATTR", "attach_adapter", "adapters_of", "is_adapter_param", "is_adapter_module"]

#: attribute set (True) on every adapter parameter; :func:`ferrule.megatron.param_gather.bind_params` skips them
LORA_PARAM_ATTR = "is_lora_adapter"


def is_adapter_param(param: Any) -> bool:
    """True for a LoRA factor made by :func:`attach_adapter`."""
    return bool(getattr(param, LORA_PARAM_ATTR, False))


class LoraAdapter(torch.nn.Module):
    """``lora_A`` ``[rank, in_local]`` and ``lora_B`` ``[out_local, rank]`` of one linear layer.

    Attributes:
        parallel: ``"column"`` or ``"row"`` (the base module's TP style).
        kind: the applier kind (``attention``, ``dense_mlp``, ...) that attached it.
        scaling: ``alpha / rank`` (rsLoRA: ``alpha / sqrt(rank)``).
        tp_size: the base module's TP size.
    """

    def __init__(self, *, in_local: int, out_local: int, rank: int, scaling: float, dropout: float,
                 parallel: str, kind: str, tp_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel={parallel!r}; expected 'column' or 'row'.")
        self.parallel, self.kind, self.scaling, self.tp_size = parallel, kind, float(scaling), int(tp_size)
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, in_local, dtype=dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        self.dropout_p = float(dropout)
        for p in (self.lora_A, self.lora_B):
            setattr(p, LORA_PARAM_ATTR, True)
        split = self.lora_B if parallel == "column" else self.lora_A
        if tp_size > 1:
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            set_tensor_model_parallel_attributes(split, True, 0 if parallel == "column" else 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B (A dropout(x))`` for the base module's input ``x`` ``[s, b, in_local]``
        -> ``[s, b, out_local]`` (column) / ``[s, b, out]`` (row). Dropout acts only in training
        mode with grad enabled (``forward_backward``), never in ``forward_logprobs``."""
        from megatron.core.tensor_parallel import mappings

        if self.dropout_p > 0 and self.training and torch.is_grad_enabled():  # not in forward_logprobs (no_grad)
            x = torch.nn.functional.dropout(x, self.dropout_p, training=True)
        h = torch.nn.functional.linear(x.to(self.lora_A.dtype), self.lora_A)
        if self.tp_size > 1:
            if self.parallel == "column":
                h = mappings.copy_to_tensor_model_parallel_region(h)
            else:
                h = mappings.reduce_from_tensor_model_parallel_region(h)
        return torch.nn.functional.linear(h, self.lora_B) * self.scaling


def _forward_hook(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    x = args[0] if args else kwargs.get("input_")
    if kwargs.get("weight") is not None:
        raise RuntimeError("a LoRA-adapted output layer was called with an external weight (tied embeddings); "
                           "LoRA on a tied output layer is refused at apply time.")
    out, bias = output
    return out + module.lora(x).to(out.dtype), bias


def _drop_adapter_keys(module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "lora.")]:
        del state_dict[key]


def _ignore_missing_adapter_keys(module: Any, incompatible: Any) -> None:
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if ".lora.lora_" not in k]


def attach_adapter(module: Any, *, global_name: str, kind: str, settings: Any, tp_rank: int, tp_size: int,
                   shared_a: Any = None, expert: bool = False) -> LoraAdapter:
    """Attach a :class:`LoraAdapter` to one megatron linear module and hook its forward.

    Args:
        module: a ``ColumnParallelLinear`` (``gather_output=False``) or ``RowParallelLinear``
            (``input_is_parallel=True``), without sequence parallelism.
        global_name: the module's global mcore name (layer offset included): it seeds ``A``.
        kind: the applier kind recorded on the adapter.
        settings: :class:`~ferrule.lora.LoraSettings`.
        tp_rank / tp_size: this rank's position in the module's TP group.
        shared_a: an ``A`` parameter to share instead of a new one (routed experts: one ``A`` per
            layer and linear, shared by every expert; ``global_name`` then only names the module).
        expert: give ``B`` the base expert weight's ``allreduce`` (megatron's: ``False``, an
            expert-parallel parameter reduced over the expert-data-parallel group and put in the
            optimizer's expert param group, when ``ep > 1``; ``True``, dense, at ``ep == 1``); a shared
            ``A`` stays a dense parameter, so its gradient is summed over the whole data-parallel
            group, EP ranks included.

    ``A`` is drawn full (``[rank, in]``, kaiming-uniform ``a=sqrt(5)``, generator seeded by
    ``settings.init_seed`` and ``global_name``) and sliced for this rank, so TP does not change
    the values; ``B`` is zero.

    Raises:
        ValueError: the module is not a supported megatron linear, is already adapted, or uses
            sequence parallelism / a gathered output.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if hasattr(module, "lora"):
        raise ValueError(f"{global_name} already has a LoRA adapter; apply LoRA once per model.")
    if isinstance(module, ColumnParallelLinear):
        parallel = "column"
        if module.gather_output:
            raise ValueError(f"{global_name}: LoRA needs gather_output=False on a ColumnParallelLinear.")
    elif isinstance(module, RowParallelLinear):
        parallel = "row"
        if not module.input_is_parallel:
            raise ValueError(f"{global_name}: LoRA needs input_is_parallel=True on a RowParallelLinear.")
    else:
        raise ValueError(f"{global_name} is a {type(module).__name__}; the core LoRA appliers adapt megatron's "
                         f"ColumnParallelLinear / RowParallelLinear only (a family with other modules registers its "
                         f"own applier through register_lora_appliers).")
    if getattr(module, "sequence_parallel", False):
        raise ValueError(f"{global_name}: LoRA does not support sequence parallelism yet; build with "
                         f"sequence_parallel=False.")
    weight = module.weight
    out_local, in_local = weight.shape
    in_full = in_local * tp_size if parallel == "row" else in_local
    gen = torch.Generator().manual_seed((settings.init_seed * 1_000_003 + zlib.crc32(global_name.encode())) % 2**63)
    a_full = torch.empty(settings.rank, in_full, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=gen)
    if parallel == "row" and tp_size > 1:
        a_full = a_full.narrow(1, tp_rank * in_local, in_local)
    adapter = LoraAdapter(in_local=in_local, out_local=out_local, rank=settings.rank, scaling=settings.scaling,
                          dropout=settings.dropout, parallel=parallel, kind=kind, tp_size=tp_size,
                          dtype=weight.dtype, device=weight.device)
    if shared_a is not None:
        if tuple(shared_a.shape) != tuple(adapter.lora_A.shape):
            raise ValueError(f"{global_name}: shared lora_A has shape {tuple(shared_a.shape)}, the module needs "
                             f"{tuple(adapter.lora_A.shape)}.")
        adapter.lora_A = shared_a
    else:
        with torch.no_grad():
            adapter.lora_A.copy_(a_full)
    if expert:
        # as megatron marks the base expert weight (tensor_parallel/layers.py: allreduce = not (is_expert and
        # ep > 1)); always False over-reduced at ep == 1, tp > 1: the expert-data-parallel group then holds the
        # TP peers, which compute the same full gradient (ferrule.megatron.moe), so B's gradient came out tp x
        adapter.lora_B.allreduce = bool(getattr(weight, "allreduce", False))
    module.lora = adapter
    module.register_forward_hook(_forward_hook, with_kwargs=True)
    module._register_state_dict_hook(_drop_adapter_keys)
    module.register_load_state_dict_post_hook(_ignore_missing_adapter_keys)
    return adapter


def is_adapter_module(obj: Any) -> bool:
    """True for a :class:`LoraAdapter`, or a family's own adapter module (a ``torch.nn.Module`` with
    ``lora_A`` / ``lora_B`` parameters marked by :data:`LORA_PARAM_ATTR` and a ``kind``, e.g. Inkling's
    stacked shared-expert adapter) attached to its base module as ``base.lora``."""
    if isinstance(obj, LoraAdapter):
        return True
    return (isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "kind", None), str)
            and is_adapter_param(getattr(obj, "lora_A", None)) and is_adapter_param(getattr(obj, "lora_B", None)))


def adapters_of(chunk: Any) -> list[tuple[str, Any]]:
    """``(local module name, adapter)`` of every adapted module of one model chunk, in module order
    (:class:`LoraAdapter` or a family adapter module, see :func:`is_adapter_module`)."""
    return [(name, mod.lora) for name, mod in chunk.named_modules() if is_adapter_module(getattr(mod, "lora", None))]
