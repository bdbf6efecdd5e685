"""Checkpoint-named views of a transformers model's in-memory parameters.

transformers >= 5 may keep parameters in a layout other than the checkpoint's: Qwen3-MoE (and
every model on transformers' ``"qwen2_moe"`` conversion) stacks the routed experts as
``mlp.experts.gate_up_proj`` ``[num_experts, 2 * moe_intermediate, hidden]`` (all gate rows of an
expert, then all up rows) and ``mlp.experts.down_proj`` ``[num_experts, hidden, moe_intermediate]``,
while checkpoints, ferrule's mapping tables, weight sync and SGLang use one tensor per expert
(``mlp.experts.E.gate_proj.weight`` ...). ``save_pretrained`` turns one layout into the other with
``transformers.core_model_loading.revert_weight_conversion`` (the reversed
``conversion_mapping``). This module reuses exactly that function, so the names and layouts are
transformers' own, for any model with a registered conversion:

1. names: revert a *meta* copy of the state dict (no data). A checkpoint tensor that comes back
   as the very same object is a plain (possibly renamed) parameter.
2. layout of converted parameters: revert, one owning module at a time (the memory of one
   module, transiently), int64 tensors holding each element's flat index into the module's
   parameters. Every checkpoint tensor then says, element by element, which parameter element it
   is. We require a bijection (each parameter element in exactly one checkpoint tensor) and turn
   each index tensor into a strided view of its parameter (``as_strided``: true aliases, so
   in-place writes reach the model and CUDA graphs stay valid); a layout that is not strided
   (e.g. a rope permutation) keeps its flat index for gather / scatter.
"""

from __future__ import annotations

import bisect
import collections
import difflib
from dataclasses import dataclass
import torch


@dataclass(frozen=True)
class CheckpointTensor:
    """Where one checkpoint-named tensor lives in the model.

    ``view`` is a tensor aliasing the parameter (plain parameters and strided layouts); for a
    non-strided layout ``view`` is None and ``index`` (int64, the checkpoint shape) holds flat
    indices into ``param`` (contiguous).
    """

    name: str
    param_name: str
    param: torch.Tensor
    shape: tuple[int, ...]
    view: torch.Tensor | None
    index: torch.Tensor | None = None
    #: a checkpoint tensor assembled from several parameters (e.g. Inkling's released
    #: ``shared_w13_weight`` from ``shared_experts.gate_proj`` and ``up_proj``): the parameters, and
    #: per parameter the positions in the flattened checkpoint tensor and the flat indices in it
    parts: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...] = ()
    #: (positions of ``parts`` cover the tensor except padding the conversion adds: zeros on read, dropped on write)
    #: the model parameter name of each entry of ``parts``
    part_names: tuple[str, ...] = ()

    def read(self) -> torch.Tensor:
        """The tensor (an alias when ``view`` is set, else a gathered copy)."""
        if self.view is not None:
            return self.view
        if self.parts:
            out = torch.zeros(self.shape, dtype=self.param.dtype, device=self.param.device).view(-1)
            for param, pos, local in self.parts:
                out[pos] = param.reshape(-1)[local]
            return out.view(self.shape)
        return self.param.reshape(-1)[self.index.reshape(-1)].view(self.shape)

    def write_(self, src: torch.Tensor) -> None:
        """Copy ``src`` (checkpoint shape, same device / dtype as the parameter) into the model."""
        if self.view is not None:
            self.view.copy_(src)
        elif self.parts:
            flat = src.reshape(-1)
            for param, pos, local in self.parts:
                param.view(-1).index_copy_(0, local, flat[pos])
        else:
            self.param.view(-1).index_copy_(0, self.index.reshape(-1), src.reshape(-1))

    def alias_key(self) -> tuple:
        """Equal for two entries that address the same memory (tied parameters)."""
        t = self.view if self.view is not None else self.param
        # the storage object, not its data pointer: a storage freed by EmbeddedEngine.sleep() has
        # data pointer 0, like every other freed one, but stays the same storage
        return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                None if self.index is None else self.index.data_ptr())


def _revert(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state_dict)


def _strided(local: torch.Tensor) -> tuple[tuple[int, ...], int] | None:
    """``(strides, offset)`` with ``local == offset + sum_k i_k * strides[k]``, or None."""
    if local.numel() == 0:
        return None
    offset = int(local.reshape(-1)[0])
    strides = []
    expected = torch.full(local.shape, offset, dtype=torch.int64)
    for k, size in enumerate(local.shape):
        if size == 1:
            strides.append(1)
            continue
        unit = [0] * local.dim()
        unit[k] = 1
        s = int(local[tuple(unit)]) - offset
        if s < 0:
            return None
        strides.append(s)
        shape = [1] * local.dim()
        shape[k] = size
        expected = expected + (torch.arange(size, dtype=torch.int64) * s).view(shape)
    return (tuple(strides), offset) if torch.equal(expected, local) else None


def _trace_group(model: torch.nn.Module, names: list[str], params: dict[str, torch.Tensor]
                 ) -> list[CheckpointTensor]:
    """Revert index tensors of ``names`` (one module's converted parameters); see module docstring."""
    bases, total = [], 0
    for n in names:
        if not params[n].is_contiguous():
            raise NotImplementedError(f"Parameter {n!r} is not contiguous; cannot map checkpoint names onto it.")
        bases.append(total)
        total += params[n].numel()
    # 1-based element indices: a 0 in a reverted tensor is padding the conversion adds (zero rows that are no
    # parameter's elements, e.g. Inkling-2's unembedding rows past unpadded_vocab_size): read as 0, never written
    probe = {n: torch.arange(b + 1, b + 1 + params[n].numel(), dtype=torch.int64).view(params[n].shape)
             for n, b in zip(names, bases)}
    out = _revert(model, probe)
    seen = torch.zeros(total, dtype=torch.int64)
    entries = []
    for ck_name, raw in out.items():
        if raw.dtype != torch.int64 or raw.numel() == 0 or int(raw.min()) < 0 or not bool((raw > 0).any()):
            raise NotImplementedError(
                f"transformers' reverse conversion of {names} changes values (checkpoint tensor {ck_name!r}), "
                "not only their layout; the embedded engine cannot map it onto the model in place.")
        idx = raw - 1
        real = idx.reshape(-1) >= 0
        first = int(idx.reshape(-1)[real][0])
        i = bisect.bisect_right(bases, first) - 1
        p_name, base = names[i], bases[i]
        local = idx - base
        param = params[p_name]
        seen.index_add_(0, idx.reshape(-1)[real], torch.ones(int(real.sum()), dtype=torch.int64))
        if not bool(real.all()) or int(local.min()) < 0 or int(local.max()) >= param.numel():
            # elements of several parameters (one module's), or padding: gather / scatter per parameter
            flat = idx.reshape(-1)
            owner = torch.tensor([bisect.bisect_right(bases, int(v)) - 1 if v >= 0 else -1 for v in flat.tolist()])
            parts, part_names = [], []
            for j in [j for j in owner.unique().tolist() if j >= 0]:
                pos = (owner == j).nonzero().reshape(-1)
                parts.append((params[names[j]], pos, flat[pos] - bases[j]))
                part_names.append(names[j])
            entries.append(CheckpointTensor(ck_name, p_name, param, tuple(idx.shape), None, None, tuple(parts),
                                            tuple(part_names)))
            continue
        strided = _strided(local)
        if strided is None:
            entries.append(CheckpointTensor(ck_name, p_name, param, tuple(idx.shape), None, local.clone()))
        else:
            strides, offset = strided
            view = param.as_strided(tuple(idx.shape), strides, param.storage_offset() + offset)
            entries.append(CheckpointTensor(ck_name, p_name, param, tuple(idx.shape), view))
    if not bool((seen == 1).all()):
        raise NotImplementedError(f"transformers' reverse conversion of {names} does not cover each parameter "
                                  "element exactly once; the embedded engine cannot map it in place.")
    return entries


@torch.no_grad()
def checkpoint_tensors(model: torch.nn.Module) -> dict[str, CheckpointTensor]:
    """Checkpoint name -> :class:`CheckpointTensor` for every tensor ``save_pretrained`` would write
    (tied names included: ``lm_head.weight`` and ``model.embed_tokens.weight`` both appear).

    Views are built under ``no_grad`` from ``param.detach()`` (ordinary tensors, writable inside
    or outside ``inference_mode``) and stay valid while parameters are updated in place.

    Raises:
        NotImplementedError: transformers' reverse conversion is not a pure re-layout (it changes
            values or drops / duplicates elements). A checkpoint tensor made of elements of several
            parameters of one module is gathered / scattered per parameter (``parts``).
    """
    params = {k: v.detach() for k, v in model.state_dict().items()}
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in params.items()}
    origin = {id(t): k for k, t in meta.items()}
    reverted = _revert(model, meta)
    result: dict[str, CheckpointTensor] = {}
    plain: set[str] = set()
    for ck_name, t in reverted.items():
        src = origin.get(id(t))
        if src is not None:
            plain.add(src)
            result[ck_name] = CheckpointTensor(ck_name, src, params[src], tuple(t.shape), params[src])
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for k in params:
        if k not in plain:
            groups[k.rpartition(".")[0]].append(k)
    # parameters of sibling modules may form one checkpoint tensor (Inkling's released dense
    # ``mlp.w13_dn.weight`` interleaves ``mlp.gate_proj`` and ``mlp.up_proj``): groups whose
    # (meta, data-free) reverse conversions share a checkpoint name are traced together
    merged: list[tuple[list[str], set[str]]] = []
    for names in groups.values():
        outs = set(_revert(model, {k: meta[k] for k in names}))
        for other in [m for m in merged if m[1] & outs]:
            merged.remove(other)
            names, outs = other[0] + names, other[1] | outs
        merged.append((names, outs))
    for names, _ in merged:
        for e in _trace_group(model, names, params):
            result[e.name] = e
    missing = sorted(set(reverted) - set(result))
    if missing:
        raise NotImplementedError(f"Checkpoint tensors {missing[:5]} could not be traced to model parameters.")
    return result


def check_bucket(targets: dict[str, CheckpointTensor], items: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse a weight-update bucket as a whole before anything is written: every name must be one of
    ``targets`` (:func:`checkpoint_tensors`), with its shape and a loadable dtype (floating into floating,
    else the same dtype), each tensor sent once, tied names (one storage) with equal values.

    Raises:
        KeyError: unknown names (each listed with the closest known names).
        ValueError: every shape / dtype mismatch, duplicate name and conflicting tied pair, in one message.
    """
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
