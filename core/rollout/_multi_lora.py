"""Many LoRA adapters served at once on one base: each row of a batch applies its own adapter, unmerged.

What it computes is Punica's BGMV ("batched gather matrix-vector", Chen et al., *Punica: Multi-Tenant
LoRA Serving*, MLSys 2024, arXiv:2310.18547, section 4; S-LoRA, Sheng et al., arXiv:2311.03285,
serves the same operator as MBGMV): for row ``i`` of a batch with adapter index ``idx[i]``,

    y[i] = base(x[i]) + scale[idx[i]] * B[idx[i]] @ (A[idx[i]] @ x[i])

and ``y[i] = base(x[i])`` for a row of the plain base (``idx[i] = -1``). Punica gathers each row's
``A``/``B`` inside one CUDA kernel. Here the same function is written with dense torch ops over the
adapters stacked in a pool of ``S`` slots of rank ``r`` (a rank-``r'`` adapter, ``r' < r``, is
zero-padded, which adds exact zeros), with the scaling folded into ``B``:

    u = x @ A_cat^T              [rows, S*r]   A_cat: the slots' A stacked, [S*r, in]
    u = u * mask[idx]            mask[i, s*r:(s+1)*r] = 1 where slot s is row i's adapter, else 0
    y = base(x) + u @ B_cat^T    B_cat: [out, S*r]

The masked columns are exact zeros, so a row gets its own adapter's product only (up to the order of
a sum's terms). Every resident adapter's ``A`` and ``B`` are read once per forward (the traffic of an
ideal BGMV when every resident adapter is in the batch), instead of a per-row gather of ``A[idx]``,
``B[idx]`` (``rows x`` an adapter's bytes); the extra ``rows x S x r`` multiply-adds are small next to
a decode step's weight reads. Shapes are fixed while the pool keeps its size, so the forward is
compiled and captured as a CUDA graph like the base's (the pool's tensors and the row mask are
written in place; a pool that grows drops the engine's decode states, which are then prepared again).

The adapters are applied by forward hooks on the base model's ``nn.Linear`` modules
(``module.register_forward_hook``): no module is replaced or renamed, so the base's parameters,
their checkpoint names and weight syncs are untouched, and the base weights stay bit-identical.

Adapters arrive as PEFT's saved tensors and config (``adapter_model.safetensors`` names
``base_model.model.<module path>.lora_A.weight`` ``[r, in]`` / ``lora_B.weight`` ``[out, r]``;
``adapter_config.json``), as for :mod:`ferrule.rollout._lora`. The module each pair targets is
read from the tensor names; scaling is PEFT's ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA).

The number of resident adapters is bounded (``RolloutEngineSettings.max_lora_adapters``): adding one
more is refused before anything changes, naming the setting; memory is
``slots x rank x sum(in + out)`` elements of the model dtype over the targeted linears (the pool
doubles its slots up to the bound as adapters arrive).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from ferrule.rollout._lora import PEFT_PREFIX, lora_config_from_dict

__all__ = ["HeldAdapters", "MultiLoraPool", "adapter_pairs"]

_A, _B = ".lora_A.weight", ".lora_B.weight"
#: the projections of a decoder layer the fast decode step adds adapter terms to, in its order
_FAST_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                     ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def adapter_pairs(tensors: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any]
                  ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float, int]:
    """PEFT saved tensors -> ``({module path: (A [r, in], B [out, r])}, scaling, r)``.

    Raises:
        ValueError: not a plain LoRA config (:func:`ferrule.rollout._lora.lora_config_from_dict`),
            per-module ``rank_pattern`` / ``alpha_pattern``, names that are not PEFT LoRA factors, an
            ``A`` without its ``B`` (or the reverse), or factors whose rank is not ``peft_config['r']``.
    """
    cfg = lora_config_from_dict(peft_config)
    if cfg.rank_pattern or cfg.alpha_pattern:
        raise ValueError("peft_config has rank_pattern / alpha_pattern (per-module ranks); batched multi-adapter "
                         "serving takes one r and lora_alpha per adapter.")
    r = int(cfg.r)
    scaling = cfg.lora_alpha / (math.sqrt(r) if cfg.use_rslora else r)
    pairs: dict[str, list] = {}
    for name, t in tensors.items():
        part = _A if name.endswith(_A) else _B if name.endswith(_B) else None
        if not name.startswith(PEFT_PREFIX) or part is None:
            raise ValueError(f"adapter tensor {name!r} is not a PEFT LoRA factor (expected "
                             f"{PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight).")
        path = name[len(PEFT_PREFIX):-len(part)]
        pairs.setdefault(path, [None, None])[0 if part == _A else 1] = t
    out = {}
    for path, (a, b) in pairs.items():
        if a is None or b is None:
            raise ValueError(f"adapter module {path}: lora_{'A' if a is None else 'B'} is missing; send both factors.")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"adapter module {path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have "
                             f"rank r={r} (lora_A [r, in], lora_B [out, r]).")
        out[path] = (a, b)
    if not out:
        raise ValueError("the adapter has no tensors.")
    return out, float(scaling), r


class _Target:
    """The stacked factors of one ``nn.Linear`` (``A [S*r, in]``, ``B [out, S*r]``) and its hook."""

    def __init__(self, pool: "MultiLoraPool", module: torch.nn.Linear):
        self.pool, self.module = pool, module
        self.A = self.B = None
        self.handle = module.register_forward_hook(self._hook)

    def allocate(self, slots: int, rank: int) -> None:
        w = self.module.weight
        old_a, old_b = self.A, self.B
        with torch.inference_mode(False):  # normal tensors: written in place in and out of inference mode
            self.A = torch.zeros(slots * rank, self.module.in_features, dtype=w.dtype, device=w.device)
            self.B = torch.zeros(self.module.out_features, slots * rank, dtype=w.dtype, device=w.device)
        if old_a is not None:  # keep the resident adapters: slot s's rows/columns move to the new stride
            s0, r0 = self.pool._shape
            for s in range(s0):
                self.A[s * rank:s * rank + r0] = old_a[s * r0:(s + 1) * r0]
                self.B[:, s * rank:s * rank + r0] = old_b[:, s * r0:(s + 1) * r0]

    def _hook(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        mask = self.pool.mask[:x.shape[0]]
        mask = mask.view(mask.shape[0], *([1] * (x.dim() - 2)), mask.shape[1])
        return out + F.linear(F.linear(x, self.A) * mask, self.B)


class MultiLoraPool:
    """The adapters an :class:`~ferrule.rollout.embedded.EmbeddedEngine` holds for batched multi-adapter
    decode (see the module docstring). Slots are numbered from 0; a row's slot ``-1`` is the plain base.

    Args:
        model: the engine's transformers model (its ``nn.Linear`` modules get the hooks).
        max_adapters: the most adapters held at once (``RolloutEngineSettings.max_lora_adapters``).
        on_realloc: called after the pool's tensors were reallocated (the engine drops its decode
            states and captured graphs, which hold the old addresses).
        rows: the row mask's first capacity (the engine passes its largest batch rung, so the mask is
            not reallocated later).
    """

    def __init__(self, model: torch.nn.Module, max_adapters: int, on_realloc: Any = None, rows: int = 0):
        if not isinstance(max_adapters, int) or max_adapters < 1:
            raise ValueError(f"rollout_engine.max_lora_adapters = {max_adapters!r}; expected an int >= 1.")
        self.model = model
        self.max_adapters = max_adapters
        self.on_realloc = on_realloc or (lambda: None)
        self.slots: dict[str, int] = {}          # adapter name -> slot
        self.meta: dict[str, dict[str, Any]] = {}  # adapter name -> {"r", "scaling", "modules", "config"}
        self.targets: dict[str, _Target] = {}    # module path -> stacked factors + hook
        self._shape = (0, 0)                     # (slots, rank) allocated
        p = next(model.parameters())
        self.mask = torch.zeros(rows, 0, dtype=p.dtype, device=p.device)

    # ------------------------------------------------------------------ adapters
    def names(self) -> list[str]:
        """The resident adapters' names, in slot order."""
        return sorted(self.slots, key=self.slots.__getitem__)

    def nbytes(self) -> int:
        """Bytes of the pool's stacked factors (every slot, resident or free)."""
        return sum(t.A.numel() * t.A.element_size() + t.B.numel() * t.B.element_size() for t in self.targets.values())

    def check_room(self, name: str) -> None:
        """Raise ``ValueError`` naming ``rollout_engine.max_lora_adapters`` if ``name`` would be one adapter too many."""
        if name not in self.slots and len(self.slots) >= self.max_adapters:
            raise ValueError(f"add_lora_adapter({name!r}): the engine already holds rollout_engine.max_lora_adapters="
                             f"{self.max_adapters} adapters ({', '.join(self.names())}); remove_lora_adapter() one "
                             "first, or raise rollout_engine.max_lora_adapters (each slot holds rank x sum(in + out) "
                             "elements per targeted linear).")

    @torch.no_grad()
    def add(self, name: str, tensors: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any]) -> None:
        """Hold adapter ``name`` (replacing the values of one held under that name).

        Raises:
            ValueError: one adapter too many (:meth:`check_room`), a bad config or tensors
                (:func:`adapter_pairs`), or a targeted module that is not an ``nn.Linear`` of the
                model or whose shape differs from the factors'. A refused call changes nothing.
        """
        self.check_room(name)
        pairs, scaling, r = adapter_pairs(tensors, peft_config)
        modules = dict(self.model.named_modules())
        errors = []
        for path, (a, b) in pairs.items():
            m = modules.get(path)
            if not isinstance(m, torch.nn.Linear):
                errors.append(f"{path}: {'no such module' if m is None else type(m).__name__ + ', not nn.Linear'}")
            elif a.shape[1] != m.in_features or b.shape[0] != m.out_features:
                errors.append(f"{path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit nn.Linear"
                              f"({m.in_features}, {m.out_features})")
        if errors:
            raise ValueError(f"add_lora_adapter({name!r}) refused (nothing was changed): " + "; ".join(errors[:5])
                             + (f"; ... {len(errors) - 5} more" if len(errors) > 5 else ""))
        slots_now, rank_now = self._shape
        need_slots = len(self.slots) + (name not in self.slots)
        slots = slots_now
        while slots < need_slots:
            slots = min(self.max_adapters, max(1, 2 * slots))
        rank = max(rank_now, r)
        new_paths = [p for p in pairs if p not in self.targets]
        for path in new_paths:
            self.targets[path] = _Target(self, modules[path])
        if (slots, rank) != self._shape or new_paths:
            for path, t in self.targets.items():  # a new target starts at zero for the adapters already held
                if path in new_paths or (slots, rank) != self._shape:
                    t.allocate(slots, rank)
            self._shape = (slots, rank)
            with torch.inference_mode(False):
                self.mask = torch.zeros(self.mask.shape[0], slots * rank, dtype=self.mask.dtype,
                                        device=self.mask.device)
            self.on_realloc()
        slot = self.slots.get(name)
        if slot is None:
            slot = min(set(range(slots)) - set(self.slots.values()))
        self._clear_slot(slot)
        for path, (a, b) in pairs.items():
            t = self.targets[path]
            t.A[slot * rank:slot * rank + r] = a.to(device=t.A.device, dtype=torch.float32).to(t.A.dtype)
            t.B[:, slot * rank:slot * rank + r] = (b.to(device=t.B.device, dtype=torch.float32) * scaling).to(t.B.dtype)
        self.slots[name] = slot
        self.meta[name] = {"r": r, "scaling": scaling, "modules": len(pairs), "config": dict(peft_config)}

    @torch.no_grad()
    def _clear_slot(self, slot: int) -> None:
        rank = self._shape[1]
        for t in self.targets.values():
            t.A[slot * rank:(slot + 1) * rank] = 0
            t.B[:, slot * rank:(slot + 1) * rank] = 0

    def remove(self, name: str) -> None:
        """Stop holding adapter ``name`` (its slot is zeroed and free again); ``KeyError`` if not held."""
        if name not in self.slots:
            raise KeyError(f"remove_lora_adapter({name!r}): not held; held: {self.names()}.")
        self._clear_slot(self.slots.pop(name))
        self.meta.pop(name, None)

    def close(self) -> None:
        """Remove every hook and free the factors (the model is the plain base again)."""
        for t in self.targets.values():
            t.handle.remove()
        self.targets, self.slots, self.meta, self._shape = {}, {}, {}, (0, 0)

    def fast_factors(self, layers: int) -> list[list[tuple | None]] | None:
        """Per decoder layer, the ``(A, B)`` of ``[q, k, v, o, gate, up, down]`` (None where no adapter
        targets it) for the fast decode step (:func:`ferrule.rollout._fast_decode.decode_logits`), or None
        when an adapter targets another module (``lm_head``, ...): then the plain path runs the hooks."""
        where = {f"model.layers.{i}.{part}.{proj}": (i, k) for i in range(layers)
                 for k, (part, proj) in enumerate(_FAST_PROJECTIONS)}
        if any(path not in where for path in self.targets):
            return None
        out: list[list[tuple | None]] = [[None] * len(_FAST_PROJECTIONS) for _ in range(layers)]
        for path, t in self.targets.items():
            i, k = where[path]
            out[i][k] = (t.A, t.B)
        return out

    # ------------------------------------------------------------------ rows
    def slot_of(self, adapter: str | None) -> int:
        """The slot of adapter ``adapter`` (``-1`` for None, the base); ``ValueError`` naming the held ones."""
        if adapter is None:
            return -1
        if adapter not in self.slots:
            raise ValueError(f"LoRA adapter {adapter!r} is not held by this engine; add_lora_adapter() it first "
                             f"(held: {self.names() or 'none'}).")
        return self.slots[adapter]

    @contextlib.contextmanager
    def rows(self, slots: Sequence[int]) -> Iterator[None]:
        """While inside, row ``i`` of the model's input applies slot ``slots[i]`` (``-1``: the base); rows
        beyond ``len(slots)`` the base. The mask grows (the engine's decode states dropped) when a batch
        has more rows than any before."""
        n = len(slots)
        if n > self.mask.shape[0]:
            cap = max(n, 2 * self.mask.shape[0], 8)
            with torch.inference_mode(False):
                self.mask = torch.zeros(cap, self.mask.shape[1], dtype=self.mask.dtype, device=self.mask.device)
            self.on_realloc()
        rank = self._shape[1]
        col_slot = torch.arange(self.mask.shape[1], device=self.mask.device) // max(rank, 1)
        want = torch.tensor(list(slots), dtype=torch.long).to(self.mask.device)
        with torch.no_grad():
            self.mask.zero_()
            self.mask[:n] = (col_slot[None, :] == want[:, None]).to(self.mask.dtype)
        try:
            yield
        finally:
            with torch.no_grad():
                self.mask.zero_()


class HeldAdapters:
    """The adapters an :class:`~ferrule.rollout.embedded.EmbeddedEngine` holds by name for batched
    multi-adapter decode: a part of the engine (``engine._multi``) that owns its state, the
    :class:`MultiLoraPool` while at least one adapter is held (``pool``; None otherwise, the model is then
    the plain base without hooks).

    The engine's :meth:`~ferrule.rollout.embedded.EmbeddedEngine.add_lora_adapter` /
    :meth:`~ferrule.rollout.embedded.EmbeddedEngine.remove_lora_adapter` check what the engine owns
    (shut down, asleep, a single served adapter) and count the weights serial around :meth:`add` /
    :meth:`remove`. Exclusive with the single served adapter of :mod:`ferrule.rollout._lora`
    (``update_lora_adapter``: one adapter applied to every row), which merges it for the fast decode path.
    While adapters are held, the prefill runs the hooks; the fast decode step (CUDA) adds the same per-row
    terms to its fused projections (:meth:`fast`); an adapter on another module (``lm_head``) sends the call
    to the plain path, which runs the hooks.

    Args:
        model: the engine's transformers model (its ``nn.Linear`` modules get the hooks).
        on_realloc: called when the engine's decode states must go (their captured graphs hold the pool's
            old addresses, or ran without the hooks): the pool's tensors were reallocated, the first
            adapter came, or the last one went.
    """

    def __init__(self, model: torch.nn.Module, on_realloc: Any) -> None:
        self.model = model
        self.on_realloc = on_realloc
        self.pool: MultiLoraPool | None = None

    def names(self) -> list[str]:
        """The held adapters' names, in slot order."""
        return [] if self.pool is None else self.pool.names()

    def add(self, name: str, tensors: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any], *,
            max_adapters: int, rows: int) -> None:
        """Hold adapter ``name`` (:meth:`MultiLoraPool.add`); the first one builds the pool with room for
        ``max_adapters`` adapters and a row mask of ``rows`` rows. A refused call changes nothing.

        Raises:
            ValueError: as :meth:`MultiLoraPool.add` (and ``max_adapters`` < 1 for the first adapter).
        """
        pool = self.pool
        if pool is None:
            pool = MultiLoraPool(self.model, max_adapters, self.on_realloc, rows=rows)
        try:
            pool.add(name, tensors, peft_config)
        except Exception:
            if self.pool is None:
                pool.close()
            raise
        if self.pool is None:
            self.pool = pool
            self.on_realloc()  # decode states captured without the hooks

    def remove(self, name: str) -> None:
        """Stop holding adapter ``name``; the last one removed takes the hooks out (the plain base again).

        Raises:
            KeyError: ``name`` is not held (the message lists the held ones).
        """
        if self.pool is None:
            raise KeyError(f"remove_lora_adapter({name!r}): no adapters are held.")
        self.pool.remove(name)
        if not self.pool.slots:
            self.close()
            self.on_realloc()

    def close(self) -> None:
        """Drop every adapter and hook (engine shutdown)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def request_slots(self, adapters: Sequence[str | None]) -> list[int] | None:
        """Each request's slot (``-1``: the base), or None when every request asks for the base.

        Raises:
            ValueError: an adapter that is not held (the message names the held ones, or says none are).
        """
        if all(a is None for a in adapters):
            return None
        if self.pool is None:
            raise ValueError(f"requests name LoRA adapters {sorted(set(adapters) - {None})} but "
                             "this engine holds none; add_lora_adapter() them first.")
        return [self.pool.slot_of(a) for a in adapters]

    def rows(self, slots: Sequence[int]) -> Any:
        """Context in which row ``i`` applies slot ``slots[i]`` (:meth:`MultiLoraPool.rows`); a no-op
        context while no adapter is held."""
        return contextlib.nullcontext() if self.pool is None else self.pool.rows(slots)

    def rows_of(self, adapters: Sequence[str | None]) -> Any:
        """Context in which row ``i`` applies adapter ``adapters[i]`` (None: the base); a no-op context while
        no adapter is held and all are None.

        Raises:
            ValueError: an adapter that is not held.
        """
        if self.pool is None:
            if any(a is not None for a in adapters):
                raise ValueError(f"LoRA adapters {sorted({a for a in adapters if a})} are not held by this engine; "
                                 "add_lora_adapter() them first.")
            return contextlib.nullcontext()
        return self.pool.rows([self.pool.slot_of(a) for a in adapters])

    def fast(self, layers: int) -> tuple[torch.Tensor, list[list[tuple | None]] | None] | None:
        """``(row mask, per-layer factors)`` for the fast decode step (:meth:`MultiLoraPool.fast_factors`),
        or None while no adapter is held."""
        return None if self.pool is None else (self.pool.mask, self.pool.fast_factors(layers))
