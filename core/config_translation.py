"""Declarative HF-config <-> Megatron-Core ``TransformerConfig`` translation tables.

A family declares one immutable :class:`ConfigTranslation` per variant (module-level data in
``plugins/<family>/<variant>.py``). It has four entry kinds:

- :class:`Field`: a value copied 1:1 between an HF key (with optional legacy aliases) and a
  ``TransformerConfig`` kwarg or a model option.
- :class:`Constant`: an mcore value the family always uses (no HF key), e.g.
  ``normalization='RMSNorm'``.
- :class:`Derived`: a value computed by a *named* function from the whole HF config, with a
  named inverse that returns the HF keys it owns (e.g. RoPE base from ``rope_parameters``).
- :class:`Require`: an HF key whose value must be one of a few supported values (e.g.
  ``hidden_act == 'silu'``); anything else raises :class:`ConfigTranslationError` naming the key,
  the value found and what is supported.

``to_mcore(hf_config)`` returns ``(transformer_config_kwargs, model_options)``: plain Python
data (no torch objects) that :func:`ferrule.megatron.gpt_builder.build_gpt_model` turns into a
``TransformerConfig`` and a ``GPTModel``. ``to_hf(...)`` inverts it.

Model options understood by the builder: ``vocab_size`` (unpadded HF vocab, tokens),
``max_sequence_length`` (tokens), ``share_embeddings_and_output_weights``, ``rotary_base``,
``position_embedding_type``, ``activation`` (name, e.g. ``'silu'``).

Importing this module imports neither torch nor megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping

__all__ = [
    "DECODER_ENTRIES",
    "ConfigTranslationError",
    "Field",
    "Constant",
    "Derived",
    "Require",
    "ConfigTranslation",
    "MISSING",
    "rope_theta_from_hf",
    "rope_theta_to_hf",
    "head_dim_from_hf",
    "head_dim_to_hf",
    "num_experts_from_hf",
    "num_experts_to_hf",
    "pre_softmax_from_norm_topk_prob",
    "pre_softmax_to_norm_topk_prob",
]

Target = Literal["config", "option"]


class ConfigTranslationError(ValueError):
    """An HF config cannot be translated (unsupported value, missing key, inconsistent values)."""


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


#: Sentinel: "no default" (the HF key is required).
MISSING: Any = _Missing()


def _lookup(hf: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    """First key of ``keys`` present in ``hf`` (and its value), or ``(None, MISSING)``."""
    for key in keys:
        if key in hf and hf[key] is not None:
            return key, hf[key]
    return None, MISSING


@dataclass(frozen=True)
class Field:
    """Copy one value between an HF key and an mcore kwarg/option.

    Attributes:
        hf: the HF key written by :meth:`ConfigTranslation.to_hf`.
        mcore: the ``TransformerConfig`` kwarg (``target='config'``) or model option
            (``target='option'``) name.
        target: where the value goes on the mcore side.
        aliases: older HF spellings also accepted on input (checked after ``hf``), e.g.
            ``num_experts`` for ``num_local_experts``.
        default: value used when the HF config lacks every spelling; ``MISSING`` makes the key
            required.
        cast: Python type the value is coerced to (``int``, ``float``, ``bool``) or None.
    """

    hf: str
    mcore: str
    target: Target = "config"
    aliases: tuple[str, ...] = ()
    default: Any = MISSING
    cast: type | None = None


@dataclass(frozen=True)
class Constant:
    """An mcore kwarg/option the family always sets; it has no HF key."""

    mcore: str
    value: Any
    target: Target = "config"


@dataclass(frozen=True)
class Derived:
    """A value computed from the whole HF config by a named function.

    Attributes:
        mcore: kwarg/option name.
        to_mcore: ``f(hf_config) -> value``; may raise :class:`ConfigTranslationError`.
        to_hf: ``g(value, transformer_config_kwargs, model_options) -> dict`` of the HF keys it
            owns (an empty dict writes nothing).
        hf_keys: the HF keys this entry reads; ``to_hf`` removes those of them that ``to_hf``
            does not write (legacy spellings such as top-level ``rope_theta``).
        target: where the value goes on the mcore side.
    """

    mcore: str
    to_mcore: Callable[[Mapping[str, Any]], Any]
    to_hf: Callable[[Any, Mapping[str, Any], Mapping[str, Any]], dict]
    hf_keys: tuple[str, ...]
    target: Target = "config"


@dataclass(frozen=True)
class Require:
    """An HF key whose value must be one of ``allowed``.

    Attributes:
        hf: the HF key.
        allowed: supported values; the first is written back by ``to_hf``.
        default: value assumed when the key is absent (``MISSING``: the key is required).
        reason: what ferrule does not support, for the error message.
        write_back: whether ``to_hf`` writes ``allowed[0]`` (False for keys transformers
            itself does not serialize for the family).
    """

    hf: str
    allowed: tuple[Any, ...]
    default: Any = MISSING
    reason: str = ""
    write_back: bool = True


Entry = Field | Constant | Derived | Require


@dataclass(frozen=True)
class ConfigTranslation:
    """An immutable HF <-> mcore config table for one model variant.

    Attributes:
        name: variant name for error messages (e.g. ``"qwen3"``).
        entries: the table, applied in order.
    """

    name: str
    entries: tuple[Entry, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.entries, tuple):
            raise TypeError(f"ConfigTranslation({self.name}).entries must be a tuple (tables are immutable).")
        seen: dict[tuple[str, str], int] = {}
        for i, e in enumerate(self.entries):
            if isinstance(e, Require):
                continue
            if not isinstance(e, (Field, Constant, Derived)):
                raise TypeError(f"ConfigTranslation({self.name}).entries[{i}]={e!r} is not a Field/Constant/Derived/Require.")
            key = (e.target, e.mcore)
            if key in seen:
                raise ValueError(
                    f"ConfigTranslation({self.name}): {e.target} {e.mcore!r} is set by entries "
                    f"{seen[key]} and {i}; each mcore value must have exactly one entry."
                )
            seen[key] = i

    # -- queries --------------------------------------------------------------------------
    def hf_keys(self) -> tuple[str, ...]:
        """Every HF key the table reads (canonical names, aliases and derived inputs)."""
        keys: list[str] = []
        for e in self.entries:
            if isinstance(e, Field):
                keys += [e.hf, *e.aliases]
            elif isinstance(e, Derived):
                keys += list(e.hf_keys)
            elif isinstance(e, Require):
                keys.append(e.hf)
        return tuple(dict.fromkeys(keys))

    # -- HF -> mcore ----------------------------------------------------------------------
    def to_mcore(self, hf_config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Translate an HF config dict (``PretrainedConfig.to_dict()`` or ``config.json``).

        Returns:
            ``(transformer_config_kwargs, model_options)``, two new dicts of plain values.

        Raises:
            ConfigTranslationError: a required key is missing, a value is unsupported, or a
                value has the wrong type; the message names the key and the fix.
        """
        if not isinstance(hf_config, Mapping):
            raise ConfigTranslationError(
                f"{self.name}: expected the HF config as a dict (config.to_dict()), got {type(hf_config).__name__}."
            )
        out: dict[str, dict[str, Any]] = {"config": {}, "option": {}}
        for e in self.entries:
            if isinstance(e, Require):
                _, value = _lookup(hf_config, (e.hf,))
                if value is MISSING:
                    if e.default is MISSING:
                        raise ConfigTranslationError(
                            f"{self.name}: HF config lacks required key {e.hf!r} (supported: {list(e.allowed)})."
                        )
                    value = e.default
                if value not in e.allowed:
                    raise ConfigTranslationError(
                        f"{self.name}: HF config has {e.hf}={value!r}, which ferrule does not support"
                        f"{' (' + e.reason + ')' if e.reason else ''}; supported: {list(e.allowed)}."
                    )
            elif isinstance(e, Field):
                key, value = _lookup(hf_config, (e.hf, *e.aliases))
                if value is MISSING:
                    if e.default is MISSING:
                        spell = " or ".join(repr(k) for k in (e.hf, *e.aliases))
                        raise ConfigTranslationError(
                            f"{self.name}: HF config lacks required key {spell} (maps to {e.target} {e.mcore!r})."
                        )
                    value = e.default
                out[e.target][e.mcore] = _cast(self.name, key or e.hf, value, e.cast)
            elif isinstance(e, Constant):
                out[e.target][e.mcore] = e.value
            else:  # Derived
                out[e.target][e.mcore] = e.to_mcore(hf_config)
        return out["config"], out["option"]

    # -- mcore -> HF ----------------------------------------------------------------------
    def to_hf(
        self,
        transformer_config_kwargs: Mapping[str, Any],
        model_options: Mapping[str, Any],
        base: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Translate back to an HF config dict.

        Args:
            transformer_config_kwargs / model_options: as returned by :meth:`to_mcore` (extra
                keys are ignored).
            base: an HF config dict whose other keys (token ids, architectures, ...) are kept;
                translated keys overwrite it. Legacy spellings replaced by a canonical key
                (e.g. top-level ``rope_theta``) are removed. ``base`` is not modified.

        Raises:
            ConfigTranslationError: a value the table needs is missing, or a constant differs
                from the family's value (the model is not of this variant).
        """
        hf: dict[str, Any] = dict(base or {})
        src = {"config": transformer_config_kwargs, "option": model_options}
        for e in self.entries:
            if isinstance(e, Require):
                if e.write_back:
                    hf[e.hf] = e.allowed[0]
                continue
            if isinstance(e, Constant):
                if e.mcore in src[e.target] and src[e.target][e.mcore] != e.value:
                    raise ConfigTranslationError(
                        f"{self.name}: {e.target} {e.mcore}={src[e.target][e.mcore]!r} but this "
                        f"variant always uses {e.value!r}; use the translation of the matching variant."
                    )
                continue
            if e.mcore not in src[e.target]:
                raise ConfigTranslationError(
                    f"{self.name}: cannot write the HF config: {e.target} {e.mcore!r} is missing."
                )
            value = src[e.target][e.mcore]
            if isinstance(e, Field):
                for alias in e.aliases:
                    hf.pop(alias, None)
                hf[e.hf] = value
            else:
                written = e.to_hf(value, transformer_config_kwargs, model_options)
                for key in e.hf_keys:  # drop legacy spellings the derivation replaced
                    if key not in written:
                        hf.pop(key, None)
                hf.update(written)
        return hf


def _cast(name: str, key: str, value: Any, cast: type | None) -> Any:
    if cast is None:
        return value
    if cast is bool:
        if not isinstance(value, bool):
            raise ConfigTranslationError(f"{name}: HF key {key!r}={value!r} must be true or false.")
        return value
    if cast is int and (isinstance(value, bool) or not isinstance(value, int)):
        if not (isinstance(value, float) and value.is_integer()):
            raise ConfigTranslationError(f"{name}: HF key {key!r}={value!r} must be an integer.")
    if cast is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigTranslationError(f"{name}: HF key {key!r}={value!r} must be a number.")
    return cast(value)


# ---------------------------------------------------------------------------------------------
# Named derivations shared by families.
# ---------------------------------------------------------------------------------------------

#: RoPE types the Megatron GPTModel local path reproduces exactly (plain RoPE, no scaling).
SUPPORTED_ROPE_TYPES = ("default",)


def rope_theta_from_hf(hf: Mapping[str, Any]) -> float:
    """RoPE base (``theta``) from ``rope_parameters`` (transformers 5) or legacy ``rope_theta``.

    transformers >= 5 writes ``rope_parameters: {"rope_type": "default", "rope_theta": 1e6}``;
    older configs write top-level ``rope_theta`` plus an optional ``rope_scaling`` dict. Only
    unscaled RoPE (``rope_type`` ``'default'``) is supported: Megatron's GPTModel has no YaRN /
    linear / dynamic scaling that matches HF.

    Raises:
        ConfigTranslationError: a scaled ``rope_type`` / ``rope_scaling`` (naming the key and the
            supported types), or no theta anywhere.
    """
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping):
            raise ConfigTranslationError(f"HF key 'rope_parameters'={params!r} must be a dict.")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigTranslationError(
                f"HF key 'rope_parameters.rope_type'={rope_type!r} is not supported; supported "
                f"rope types: {list(SUPPORTED_ROPE_TYPES)} (RoPE scaling is not implemented)."
            )
        theta = params.get("rope_theta", hf.get("rope_theta"))
    else:
        scaling = hf.get("rope_scaling")
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else scaling
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigTranslationError(
                    f"HF key 'rope_scaling' has type {rope_type!r}, which is not supported; supported "
                    f"rope types: {list(SUPPORTED_ROPE_TYPES)} (RoPE scaling is not implemented)."
                )
        theta = hf.get("rope_theta")
    if theta is None:
        raise ConfigTranslationError("HF config has no RoPE base: expected 'rope_parameters.rope_theta' or 'rope_theta'.")
    return float(theta)


def rope_theta_to_hf(value: float, _cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`rope_theta_from_hf`: the transformers-5 ``rope_parameters`` dict."""
    return {"rope_parameters": {"rope_theta": float(value), "rope_type": "default"}}


def head_dim_from_hf(hf: Mapping[str, Any]) -> int:
    """Per-head width (``kv_channels``): ``head_dim`` if set, else ``hidden_size // num_attention_heads``.

    Qwen3 sets ``head_dim`` explicitly and it may differ from hidden/heads (Qwen3-0.6B: 1024 /
    16 heads with head_dim 128).
    """
    head_dim = hf.get("head_dim")
    if head_dim is not None:
        return int(head_dim)
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    if not hidden or not heads or hidden % heads:
        raise ConfigTranslationError(
            f"HF config has no 'head_dim' and hidden_size={hidden!r} is not divisible by "
            f"num_attention_heads={heads!r}; set 'head_dim'."
        )
    return hidden // heads


def head_dim_to_hf(value: int, cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`head_dim_from_hf`: always writes ``head_dim`` (transformers reads it)."""
    return {"head_dim": int(value)}


def head_dim_to_hf_implicit(value: int, cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """For families whose HF config has no ``head_dim`` (Qwen2): require hidden/heads."""
    implied = cfg["hidden_size"] // cfg["num_attention_heads"]
    if value != implied:
        raise ConfigTranslationError(
            f"kv_channels={value} differs from hidden_size/num_attention_heads={implied}; this "
            f"family's HF config cannot express that (it has no 'head_dim' key)."
        )
    return {}


def num_experts_from_hf(hf: Mapping[str, Any]) -> int:
    """Routed expert count: ``num_local_experts`` (transformers 5) or legacy ``num_experts``.

    Raises:
        ConfigTranslationError: neither key is present, or both are present and differ.
    """
    a, b = hf.get("num_local_experts"), hf.get("num_experts")
    if a is not None and b is not None and a != b:
        raise ConfigTranslationError(
            f"HF config has num_local_experts={a} and num_experts={b}; they must agree (remove one)."
        )
    value = a if a is not None else b
    if value is None or int(value) < 1:
        raise ConfigTranslationError("HF config needs 'num_local_experts' (or legacy 'num_experts') >= 1 for an MoE model.")
    return int(value)


def num_experts_to_hf(value: int, _cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`num_experts_from_hf` (writes the transformers-5 key)."""
    return {"num_local_experts": int(value)}


def pre_softmax_from_norm_topk_prob(hf: Mapping[str, Any]) -> bool:
    """``moe_router_pre_softmax`` from HF ``norm_topk_prob``.

    HF Qwen3-MoE: ``softmax`` over all experts, take top-k, and if ``norm_topk_prob`` divide by
    the top-k sum. Megatron (``moe_utils.topk_routing_with_score_function``): with
    ``pre_softmax`` it softmaxes all logits then takes top-k (= HF without renormalisation);
    without it, it takes top-k logits and softmaxes those (= HF with renormalisation, since
    softmax over a subset equals the renormalised full softmax). So ``pre_softmax = not
    norm_topk_prob``.
    """
    value = hf.get("norm_topk_prob", False)
    if not isinstance(value, bool):
        raise ConfigTranslationError(f"HF key 'norm_topk_prob'={value!r} must be true or false.")
    return not value


def pre_softmax_to_norm_topk_prob(value: bool, _cfg: Mapping[str, Any], _opts: Mapping[str, Any]) -> dict:
    """Inverse of :func:`pre_softmax_from_norm_topk_prob`."""
    return {"norm_topk_prob": not bool(value)}


# Read-only view used by families composing tables (documentation aid).
ENTRY_KINDS = MappingProxyType({"Field": Field, "Constant": Constant, "Derived": Derived, "Require": Require})


#: Entries every Llama-style decoder shares (HF ``LlamaConfig`` field names; RMSNorm pre-norm,
#: SwiGLU MLP without biases, RoPE, GQA): layer/width/head counts, norm epsilon, init std,
#: dropout, and the model options vocab size, max sequence length, tied embeddings, rope and
#: silu. A family adds its ``model_type`` requirement, head width (``kv_channels``), RoPE base,
#: QKV bias / q-k norm, MoE fields and anything it must refuse. ``num_key_value_heads`` is
#: required (Llama-1 style configs without it are refused rather than guessed).
DECODER_ENTRIES: tuple = (
    Field("num_hidden_layers", "num_layers", cast=int),
    Field("hidden_size", "hidden_size", cast=int),
    Field("intermediate_size", "ffn_hidden_size", cast=int),
    Field("num_attention_heads", "num_attention_heads", cast=int),
    Field("num_key_value_heads", "num_query_groups", cast=int),
    Field("rms_norm_eps", "layernorm_epsilon", cast=float),
    Field("initializer_range", "init_method_std", default=0.02, cast=float),
    Field("attention_dropout", "attention_dropout", default=0.0, cast=float),
    Constant("hidden_dropout", 0.0),
    Constant("normalization", "RMSNorm"),
    Constant("gated_linear_unit", True),
    Constant("add_bias_linear", False),
    Field("vocab_size", "vocab_size", target="option", cast=int),
    Field("max_position_embeddings", "max_sequence_length", target="option", cast=int),
    Field("tie_word_embeddings", "share_embeddings_and_output_weights", target="option", default=False, cast=bool),
    Constant("position_embedding_type", "rope", target="option"),
    Constant("activation", "silu", target="option"),
)
