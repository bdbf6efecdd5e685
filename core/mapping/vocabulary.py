"""The mapping vocabulary: one row type per way an mcore parameter relates to HF tensors.

A family's *mapping table* (:class:`~ferrule.mapping.MappingTable`, in
:mod:`ferrule.mapping.table`) is module-level, immutable data keyed by the mcore parameter name, with ``*`` standing for a layer index (and, for routed experts, a
**global** expert index). Each entry is a :class:`ParamMapping` that knows

- which HF keys hold the parameter (``*`` in HF patterns is filled with the mcore wildcards in
  order),
- how to turn the full (unsharded) HF tensors into the full mcore tensor and back
  (:meth:`ParamMapping.to_mcore`, :meth:`ParamMapping.to_hf`),
- how tensor parallelism splits the full mcore tensor (:class:`TPSplit`), so one table loads
  and exports at any TP / EP size (:meth:`ParamMapping.shard`, :meth:`ParamMapping.gather`).

Vocabulary: :class:`Rename`, :class:`FuseQKV`, :class:`FuseGateUp`, :class:`OutputLayer` (a named
custom mapping, see "Writing a custom mapping" below), :class:`Ignore` (an HF key deliberately not
loaded, with a required reason) and :class:`Passthrough`; the routed-expert rows
(:class:`~ferrule.mapping.experts.StackExperts`, ``ExpertRename``, ``ExpertFuseGateUp``) build on
them in :mod:`ferrule.mapping.experts`.

Completeness is enforced, never warned about: a live mcore parameter with no mapping, or an
HF key that is neither produced by a mapping nor ignored, raises :class:`MappingError`
listing *every* offender (:meth:`MappingTable.check_mcore_names`,
:meth:`MappingTable.check_hf_keys`).

This module is the bottom of the mapping package: it imports nothing of ferrule.

Writing a custom mapping: subclass :class:`ParamMapping` as a frozen dataclass, give it a
docstring stating both layouts and the TP split, implement ``hf_patterns``, ``to_mcore`` and
``to_hf`` (inverse of each other, bit-exact), and add a round-trip test against a
hand-computed layout (tests/test_mapping.py has one per class). :class:`OutputLayer` is the
worked example.

Importing this module imports no torch; torch is imported inside the methods that need it.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "MappingError",
    "MappingContext",
    "TPSplit",
    "ParamMapping",
    "Rename",
    "FuseQKV",
    "FuseGateUp",
    "OutputLayer",
    "Ignore",
    "Passthrough",
    "parameter_site",
]


class MappingError(ValueError):
    """A mapping table does not fit a model or a checkpoint (the message lists every offender)."""


#: ``(pattern, op)`` per block of a decoder layer, megatron names first, then HF's (Llama-style names); the ops are
#: ``ferrule check``'s capture points (:mod:`ferrule.converters.check_points`). A fused TE norm weight
#: (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) belongs to the norm before its linear.
_SITES = (
    (re.compile(r"(?:decoder|model)\.layers\.(\d+)\.(?:input_layernorm|self_attention\.linear_qkv\.layer_norm_)"),
     "input_norm"),
    (re.compile(r"(?:decoder|model)\.layers\.(\d+)\.(?:pre_mlp_layernorm|pre_feedforward_layernorm|"
                r"mlp\.linear_fc1\.layer_norm_)"), "pre_mlp_norm"),
    (re.compile(r"(?:decoder|model)\.layers\.(\d+)\.(?:self_attention|self_attn|post_self_attn_layernorm)\."),
     "attention"),
    (re.compile(r"(?:decoder|model)\.layers\.(\d+)\.(?:mlp|block_sparse_moe|post_feedforward_layernorm)\."), "mlp"),
)


def parameter_site(name: str) -> tuple[int | None, str] | None:
    """Where a megatron parameter or an HF key sits, as ``ferrule check``'s capture points name it.

    ``(layer, op)`` with ``op`` one of ``input_norm``, ``attention``, ``pre_mlp_norm``, ``mlp`` for a decoder
    layer's tensor (``decoder.layers.3.mlp.router.bias`` and ``model.layers.3.mlp.router.bias`` -> ``(3, "mlp")``),
    ``(None, "embedding" | "final_norm" | "output_layer")`` outside the layers, None when the name says nothing
    certain (e.g. HF's ``post_attention_layernorm``: the pre-MLP norm of a pre-norm layer, the attention's
    post-norm of OLMo-2 / Gemma). Used to name the layer and op of a structural mistake (an unmapped parameter,
    a parameter in no update group) as the divergence report names a numeric one.
    """
    for pattern, op in _SITES:
        m = pattern.match(name)
        if m:
            return int(m.group(1)), op
    if name.startswith(("embedding.", "model.embed_tokens.")):
        return None, "embedding"
    if name.startswith(("decoder.final_layernorm.", "model.norm.")):
        return None, "final_norm"
    if name.startswith(("output_layer.", "lm_head.")):
        return None, "output_layer"
    return None


def sited(name: str) -> str:
    """``name`` followed by its :func:`parameter_site` in parentheses (``... (layer 0 mlp)``), for messages."""
    site = parameter_site(name.split()[0]) if name else None
    if site is None:
        return name
    return f"{name} (layer {site[0]} {site[1]})" if site[0] is not None else f"{name} ({site[1]})"


# ---------------------------------------------------------------------------------------
# Context: the few config numbers a mapping needs
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MappingContext:
    """Config numbers that mappings need at conversion time (tables themselves hold none).

    Attributes:
        num_attention_heads: query heads (HF ``num_attention_heads``).
        num_query_groups: KV heads (HF ``num_key_value_heads``; Megatron ``num_query_groups``).
        head_dim: per-head size (HF ``head_dim``, default ``hidden_size // num_attention_heads``).
        vocab_size: HF vocabulary size (rows of ``embed_tokens`` / ``lm_head``), unpadded.
        padded_vocab_size: rows of the full mcore embedding / output layer (Megatron pads the
            vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``); None = no padding.
        tie_word_embeddings: HF ``tie_word_embeddings``; when True the checkpoint has no
            ``lm_head.weight``.
        num_experts: routed experts per MoE layer (None for dense models).
    """

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int | None = None
    tie_word_embeddings: bool = False
    num_experts: int | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise MappingError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_query_groups}; GQA needs whole query groups."
            )
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise MappingError(
                f"padded_vocab_size={self.padded_vocab_size} < vocab_size={self.vocab_size}."
            )

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any], *,
                       padded_vocab_size: int | None = None) -> "MappingContext":
        """Build the context from a parsed HF ``config.json`` (``text_config`` is honoured)."""
        cfg = hf_config.get("text_config") or hf_config
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
        return cls(
            num_attention_heads=heads,
            num_query_groups=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            padded_vocab_size=padded_vocab_size,
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings",
                                                   cfg.get("tie_word_embeddings", False))),
            num_experts=int(experts) if experts else None,
        )


class TPSplit(str, enum.Enum):
    """How tensor parallelism splits a full mcore tensor (Megatron tensor_parallel/layers.py).

    - ``COLUMN``: ``ColumnParallelLinear`` output dim 0, contiguous chunks (also its bias).
    - ``ROW``: ``RowParallelLinear`` input dim 1, contiguous chunks (its bias is replicated).
    - ``REPLICATED``: every rank holds the full tensor (norms, router, ``q_layernorm``).
    - ``VOCAB``: ``VocabParallelEmbedding`` / output layer: dim 0 of the *padded* vocabulary.
    - ``GATE_UP``: SwiGLU ``linear_fc1`` ``[gate; up]``: gate and up are each chunked on dim 0
      and rank r holds ``[gate_r; up_r]`` (Megatron's ``partition_stride=2`` layout).
    """

    COLUMN = "column"
    ROW = "row"
    REPLICATED = "replicated"
    VOCAB = "vocab"
    GATE_UP = "gate_up"

    @property
    def dim(self) -> int | None:
        return {"column": 0, "row": 1, "replicated": None, "vocab": 0, "gate_up": 0}[self.value]


# ---------------------------------------------------------------------------------------
# Wildcard patterns
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


def _fill(pattern: str, wildcards: Sequence[str]) -> str:
    """Fill each ``*`` of ``pattern`` with the next wildcard value, in order."""
    parts = pattern.split("*")
    if len(parts) - 1 > len(wildcards):
        raise MappingError(f"pattern {pattern!r} has more '*' than the mcore name supplies {tuple(wildcards)}.")
    out = parts[0]
    for value, part in zip(wildcards, parts[1:]):
        out += value + part
    return out


def _check_pattern(cls: str, pattern: Any) -> None:
    if not isinstance(pattern, str) or not pattern or " " in pattern:
        raise MappingError(f"{cls}: {pattern!r} is not a parameter-name pattern (dotted name, '*' for indices).")


# ---------------------------------------------------------------------------------------
# Mappings
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamMapping:
    """Base class: one mcore parameter pattern <-> one or more HF key patterns.

    Subclasses set ``mcore`` (the mcore pattern) and ``tp`` and implement
    :meth:`hf_patterns`, :meth:`to_mcore` and :meth:`to_hf`. ``expert`` marks routed-expert
    parameters: they are split on the expert-tensor-parallel group and their second ``*``
    is the global expert index.
    """

    mcore: str
    tp: TPSplit = field(default=TPSplit.REPLICATED, kw_only=True)

    expert = False

    def __post_init__(self) -> None:
        _check_pattern(type(self).__name__, self.mcore)
        if not isinstance(self.tp, TPSplit):
            raise MappingError(f"{type(self).__name__}({self.mcore}).tp={self.tp!r}; use a TPSplit member.")
        for p in self.hf_patterns(None):
            _check_pattern(type(self).__name__, p)

    # -- names --------------------------------------------------------------------------
    def hf_patterns(self, ctx: MappingContext | None) -> tuple[str, ...]:
        """HF key patterns this mapping reads/writes (``ctx`` may select among them)."""
        raise NotImplementedError

    def match(self, mcore_name: str) -> tuple[str, ...] | None:
        """The wildcard values if ``mcore_name`` matches :attr:`mcore`, else None."""
        m = _pattern_regex(self.mcore).match(mcore_name)
        return m.groups() if m else None

    def hf_keys(self, mcore_name: str, ctx: MappingContext | None = None) -> tuple[str, ...]:
        """Concrete HF keys for a concrete (global) mcore name."""
        wild = self.match(mcore_name)
        if wild is None:
            raise MappingError(f"{mcore_name!r} does not match {type(self).__name__} pattern {self.mcore!r}.")
        return tuple(_fill(p, wild) for p in self.hf_patterns(ctx))

    def exports(self, ctx: MappingContext | None) -> bool:
        """False if this parameter's HF tensors are written by another mapping (tied weights)."""
        return True

    # -- values -------------------------------------------------------------------------
    def to_mcore(self, hf: Sequence["torch.Tensor"], ctx: MappingContext, wildcards: tuple[str, ...] = ()) -> "torch.Tensor":
        """Full HF tensors (in :meth:`hf_keys` order) -> the full mcore tensor."""
        raise NotImplementedError

    def to_hf(self, full: "torch.Tensor", ctx: MappingContext, wildcards: tuple[str, ...] = ()) -> tuple["torch.Tensor", ...]:
        """The full mcore tensor -> full HF tensors (in :meth:`hf_keys` order)."""
        raise NotImplementedError

    # -- tensor parallelism -------------------------------------------------------------
    def shard(self, full: "torch.Tensor", rank: int, size: int) -> "torch.Tensor":
        """The contiguous local slice of ``full`` that TP rank ``rank`` of ``size`` holds.

        Raises:
            MappingError: the split dimension is not divisible by ``size``.
        """
        if size == 1 or self.tp is TPSplit.REPLICATED:
            return full
        if self.tp is TPSplit.GATE_UP:
            gate, up = self._halves(full)
            return _torch().cat([self._chunk(gate, 0, rank, size), self._chunk(up, 0, rank, size)], 0).contiguous()
        return self._chunk(full, self.tp.dim, rank, size).contiguous()

    def gather(self, shards: Sequence["torch.Tensor"]) -> "torch.Tensor":
        """Inverse of :meth:`shard`: the full tensor from all TP ranks' slices (rank order)."""
        if len(shards) == 1 or self.tp is TPSplit.REPLICATED:
            return shards[0]
        torch = _torch()
        if self.tp is TPSplit.GATE_UP:
            halves = [self._halves(s) for s in shards]
            return torch.cat([torch.cat([g for g, _ in halves], 0), torch.cat([u for _, u in halves], 0)], 0)
        return torch.cat(list(shards), self.tp.dim)

    def _halves(self, t: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        if t.shape[0] % 2:
            raise MappingError(f"{self.mcore}: SwiGLU linear_fc1 has an odd row count {t.shape[0]}; expected [gate; up].")
        return t[: t.shape[0] // 2], t[t.shape[0] // 2:]

    def _chunk(self, t: "torch.Tensor", dim: int, rank: int, size: int) -> "torch.Tensor":
        if t.shape[dim] % size:
            raise MappingError(
                f"{self.mcore}: dim {dim} of shape {tuple(t.shape)} is not divisible by the TP size {size}; "
                f"choose a TP size that divides it."
            )
        n = t.shape[dim] // size
        return t.narrow(dim, rank * n, n)


def _torch():
    import torch

    return torch


def _expect_shape(where: str, t: "torch.Tensor", shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise MappingError(f"{where}: shape {tuple(t.shape)} does not match the expected {tuple(shape)}.")


@dataclass(frozen=True)
class Rename(ParamMapping):
    """One HF tensor is the mcore tensor, unchanged (same layout, same shape).

    ``tp`` says how TP splits it. With ``tp=TPSplit.VOCAB`` the mcore tensor is the HF
    ``[vocab, hidden]`` tensor padded with zero rows to ``ctx.padded_vocab_size`` (Megatron's
    padded vocabulary); :meth:`to_hf` drops the padding rows.
    """

    hf: str = ""

    def hf_patterns(self, ctx: MappingContext | None) -> tuple[str, ...]:
        return (self.hf,)

    def to_mcore(self, hf, ctx, wildcards=()):
        (t,) = hf
        if self.tp is TPSplit.VOCAB:
            return _pad_vocab(t, ctx, self.mcore)
        return t

    def to_hf(self, full, ctx, wildcards=()):
        if self.tp is TPSplit.VOCAB:
            return (full[: ctx.vocab_size],)
        return (full,)


def _pad_vocab(t: "torch.Tensor", ctx: MappingContext, where: str) -> "torch.Tensor":
    if t.shape[0] != ctx.vocab_size:
        raise MappingError(f"{where}: HF tensor has {t.shape[0]} rows; config vocab_size is {ctx.vocab_size}.")
    padded = ctx.padded_vocab_size or ctx.vocab_size
    if padded == t.shape[0]:
        return t
    torch = _torch()
    pad = torch.zeros((padded - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], 0)


@dataclass(frozen=True)
class FuseQKV(ParamMapping):
    """HF ``q_proj``/``k_proj``/``v_proj`` <-> Megatron ``linear_qkv`` (weights or biases).

    Megatron's layout (``megatron/core/transformer/attention.py``, ``SelfAttention.
    get_query_key_value_tensors``): along dim 0, for each of the ``G = num_query_groups``
    KV heads in order, the ``H/G`` query heads of that group, then the group's key head,
    then its value head::

        linear_qkv = [q_0 .. q_{H/G-1}, k_0, v_0,  q_{H/G} .. , k_1, v_1,  ...]   (rows)

    with each head ``head_dim`` rows; shape ``[G * (H/G + 2) * head_dim, hidden]`` for the
    weight and ``[G * (H/G + 2) * head_dim]`` for the bias. HF stores ``q_proj``
    ``[H * head_dim, hidden]``, ``k_proj``/``v_proj`` ``[G * head_dim, hidden]``, where query
    head ``h`` belongs to group ``h // (H/G)`` (transformers ``repeat_kv``). ``head_dim`` may
    differ from ``hidden / H``; ``G = 1`` (MQA) works. TP splits dim 0 contiguously
    (column-parallel): rank r holds ``G/tp`` whole groups, so ``tp`` must divide ``G``.
    """

    q: str = ""
    k: str = ""
    v: str = ""
    tp: TPSplit = field(default=TPSplit.COLUMN, kw_only=True)

    def hf_patterns(self, ctx):
        return (self.q, self.k, self.v)

    def to_mcore(self, hf, ctx, wildcards=()):
        q, k, v = hf
        G, d = ctx.num_query_groups, ctx.head_dim
        qpg = ctx.num_attention_heads // G
        rest = tuple(q.shape[1:])
        _expect_shape(f"{self.mcore} q_proj", q, (ctx.num_attention_heads * d, *rest))
        _expect_shape(f"{self.mcore} k_proj", k, (G * d, *rest))
        _expect_shape(f"{self.mcore} v_proj", v, (G * d, *rest))
        torch = _torch()
        fused = torch.cat([q.reshape(G, qpg * d, *rest), k.reshape(G, d, *rest), v.reshape(G, d, *rest)], 1)
        return fused.reshape(G * (qpg + 2) * d, *rest)

    def to_hf(self, full, ctx, wildcards=()):
        G, d = ctx.num_query_groups, ctx.head_dim
        qpg = ctx.num_attention_heads // G
        rest = tuple(full.shape[1:])
        _expect_shape(self.mcore, full, (G * (qpg + 2) * d, *rest))
        grouped = full.reshape(G, (qpg + 2) * d, *rest)
        q, k, v = grouped.split([qpg * d, d, d], dim=1)
        return (q.reshape(G * qpg * d, *rest).contiguous(), k.reshape(G * d, *rest).contiguous(),
                v.reshape(G * d, *rest).contiguous())


@dataclass(frozen=True)
class FuseGateUp(ParamMapping):
    """HF ``gate_proj``/``up_proj`` <-> Megatron SwiGLU ``linear_fc1`` = ``[gate; up]`` on dim 0.

    Layout: ``megatron/core/transformer/mlp.py`` (``glu`` splits ``linear_fc1`` output in two
    halves along the last dim: first half is the gate passed through SiLU). Shapes: HF
    ``[ffn, hidden]`` each, mcore ``[2 * ffn, hidden]``. TP (``TPSplit.GATE_UP``): rank r
    holds ``[gate_r; up_r]``, each a contiguous ``ffn/tp`` slice.
    """

    gate: str = ""
    up: str = ""
    tp: TPSplit = field(default=TPSplit.GATE_UP, kw_only=True)

    def hf_patterns(self, ctx):
        return (self.gate, self.up)

    def to_mcore(self, hf, ctx, wildcards=()):
        gate, up = hf
        _expect_shape(f"{self.mcore} up_proj", up, tuple(gate.shape))
        return _torch().cat([gate, up], 0)

    def to_hf(self, full, ctx, wildcards=()):
        gate, up = self._halves(full)
        return gate.contiguous(), up.contiguous()


@dataclass(frozen=True)
class OutputLayer(ParamMapping):
    """Named custom mapping: the output layer, tied or untied.

    Untied (``ctx.tie_word_embeddings`` False): mcore ``output_layer.weight``
    ``[padded_vocab, hidden]`` <-> HF ``lm_head.weight`` ``[vocab, hidden]``.
    Tied: HF checkpoints carry no ``lm_head.weight``; the output layer *is*
    ``model.embed_tokens.weight``. At PP=1 Megatron then allocates no ``output_layer.weight``
    at all; at PP>1 the last stage holds a copy, which is loaded from the embedding and never
    exported (:meth:`exports` is False), so the embedding is written once. Split: vocab-parallel
    on dim 0 with zero padding rows (as :class:`Rename` with ``TPSplit.VOCAB``).
    """

    hf: str = "lm_head.weight"
    tied_hf: str = "model.embed_tokens.weight"
    tp: TPSplit = field(default=TPSplit.VOCAB, kw_only=True)

    def hf_patterns(self, ctx):
        if ctx is not None and ctx.tie_word_embeddings:
            return (self.tied_hf,)
        return (self.hf,)

    def exports(self, ctx):
        return not (ctx is not None and ctx.tie_word_embeddings)

    def to_mcore(self, hf, ctx, wildcards=()):
        return _pad_vocab(hf[0], ctx, self.mcore)

    def to_hf(self, full, ctx, wildcards=()):
        return (full[: ctx.vocab_size],)


@dataclass(frozen=True)
class Ignore:
    """An HF key pattern that is deliberately not loaded (e.g. rotary ``inv_freq`` buffers).

    ``reason`` is required: it says why dropping the tensor loses nothing. ``unused_by_hf``
    says that transformers does not load the tensor either (a buffer it recomputes, such as
    ``rotary_emb.inv_freq``), so an HF export without it is complete; otherwise exporting a
    checkpoint whose source had such a tensor is an error naming it (the export would lack it).
    """

    hf: str
    reason: str
    unused_by_hf: bool = False

    def __post_init__(self) -> None:
        _check_pattern("Ignore", self.hf)
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise MappingError(f"Ignore({self.hf!r}) needs a reason saying why the tensor is not needed.")

    def match(self, hf_key: str) -> bool:
        return _pattern_regex(self.hf).match(hf_key) is not None


@dataclass(frozen=True)
class Passthrough:
    """HF tensors under ``prefix`` that Megatron does not hold but a conversion must keep.

    ``hf_to_torch_dist`` copies them verbatim into ``OUT_DIR/hf/passthrough.safetensors`` and
    ``torch_dist_to_hf`` writes them back, so the round trip stays bit-exact (e.g. Inkling's frozen
    vision / audio towers, ``model.visual.`` and ``model.audio.``, until a tower issue trains them).
    Loading into Megatron skips them like :class:`Ignore`. ``reason`` is required.
    """

    prefix: str
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix.endswith(".") or " " in self.prefix:
            raise MappingError(f"Passthrough({self.prefix!r}): the prefix must be a dotted name ending with '.'.")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise MappingError(f"Passthrough({self.prefix!r}) needs a reason saying why the tensors are kept aside.")

    def match(self, hf_key: str) -> bool:
        return hf_key.startswith(self.prefix)

