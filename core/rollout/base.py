"""The rollout-engine protocol: sampling parameters, requests, results, the engine interface.

Every rollout engine (``embedded``: a transformers model in-process; ``sglang``: an SGLang server
driven over HTTP) takes token ids in and gives token ids plus per-token logprobs out. Text and
chat templates live above this layer.

Which distribution a logprob is taken from (the same convention as SGLang's default, see
``python/sglang/srt/layers/sampler.py``: logprobs are computed after temperature scaling and
before top-k/top-p truncation unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set):

- ``temperature > 0``: ``logprobs[t] = log_softmax(logits_t / temperature)[token_t]``, the
  tempered full-vocabulary distribution. top-k / top-p only decide which tokens *may* be
  sampled (the sample is drawn from the tempered distribution renormalised over the kept
  tokens); they do not change the reported logprob.
- ``temperature == 0`` (greedy): ``logprobs[t] = log_softmax(logits_t)[token_t]``, i.e. the
  temperature-1 distribution (SGLang likewise turns temperature 0 into ``top_k=1`` at
  temperature 1).
- ``return_raw_logprobs=True`` additionally returns ``log_softmax(logits_t)[token_t]`` (the
  untempered model distribution) in :attr:`GenerateResult.raw_logprobs`.

All logprobs are natural-log values of float32 softmaxes of the model's logits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # torch is imported lazily by the engines
    import torch

FinishReason = Literal["stop", "length"]

#: Engine kinds known to :func:`get_rollout_engine`.
ENGINE_KINDS = ("embedded", "sglang")


class RolloutError(RuntimeError):
    """A rollout engine failed (bad server answer, dead subprocess, inconsistent output)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample continuations. Shared by every prompt of one ``generate`` call.

    Attributes:
        temperature: softmax temperature, ``>= 0``; ``0`` means greedy (argmax).
        top_p: nucleus mass in ``(0, 1]``; ``1`` disables it. Applied after top-k.
        top_k: keep the ``top_k`` most likely tokens; ``-1`` (or 0) disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely token's
            (HF ``MinPLogitsWarper``, SGLang ``min_p``), in ``[0, 1]``; ``0`` disables it.
            Applied after top-p.
        max_new_tokens: most tokens to generate per sample, ``>= 1``.
        stop_token_ids: generation of a sample ends after it samples one of these ids; the
            stop token is included in the output (it is part of what the policy produced).
        stop: stop strings; a sample ends at the first token whose decoded text completes one
            of them (that token is included). Needs a tokenizer on the engine.
        n: samples per prompt, ``>= 1``. Results are ordered prompt-major (all samples of
            prompt 0, then prompt 1, ...).
        seed: seed for this call (``None``: nondeterministic). Same requests + params + seed
            on the same device and engine build give the same tokens.
        ignore_eos: if False (default) the model's EOS id(s) (``generation_config`` /
            ``config.eos_token_id``) also stop a sample, as in SGLang and HF ``generate``.
        return_raw_logprobs: also return untempered logprobs (see module docstring).
        return_routed_experts: also return, per fed token and MoE layer, the experts the model's
            routers picked (``GenerateResult.routed_experts``; MoE routing replay, R3). The embedded
            engine records them on its eager decode path; an engine that cannot raises ValueError.

    Raises:
        ValueError: on any out-of-range value; the message names the field and the range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    return_raw_logprobs: bool = False
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        # Normalise list inputs to tuples so the dataclass stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature={t!r}; expected a finite number >= 0 (0 = greedy).")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"SamplingParams.top_p={p!r}; expected 0 < top_p <= 1 (1 disables nucleus sampling).")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k not in (-1, 0)):
            raise ValueError(f"SamplingParams.top_k={k!r}; expected an int >= 1, or -1 / 0 to disable top-k.")
        mp = self.min_p
        if isinstance(mp, bool) or not isinstance(mp, (int, float)) or not (0.0 <= mp <= 1.0):
            raise ValueError(f"SamplingParams.min_p={mp!r}; expected 0 <= min_p <= 1 (0 disables min-p).")
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={m!r}; expected an int >= 1.")
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"SamplingParams.n={n!r}; expected an int >= 1 (samples per prompt).")
        bad_ids = [i for i in self.stop_token_ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad_ids:
            raise ValueError(f"SamplingParams.stop_token_ids has invalid ids {bad_ids}; expected ints >= 0.")
        bad_stops = [s for s in self.stop if not isinstance(s, str) or not s]
        if bad_stops:
            raise ValueError(f"SamplingParams.stop has invalid entries {bad_stops!r}; expected non-empty strings.")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise ValueError(f"SamplingParams.seed={s!r}; expected None or an int >= 0.")

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0`` (argmax decoding)."""
        return self.temperature == 0

    @property
    def effective_top_k(self) -> int | None:
        """``top_k`` or None when disabled."""
        return self.top_k if self.top_k >= 1 else None


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One prompt.

    Attributes:
        prompt_token_ids: the prompt, token ids (non-empty; already chat-templated, media
            placeholders expanded: :func:`ferrule.media.expand_placeholders`).
        request_id: optional caller id, copied to each result.
        media: ``{modality: [item, ...]}`` for a family with towers (:mod:`ferrule.media`), or None.
        lora_adapter: the name of a LoRA adapter the engine holds for batched multi-adapter decode
            (``EmbeddedEngine.add_lora_adapter``; each row applies its own request's adapter), or None
            for the engine's weights as they are.
    """

    prompt_token_ids: tuple[int, ...]
    request_id: str | None = None
    media: Any = dataclasses.field(default=None, compare=False, hash=False)
    lora_adapter: str | None = None

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.prompt_token_ids)
        if not ids:
            raise ValueError(f"GenerateRequest(request_id={self.request_id!r}) has an empty prompt; "
                             "pass at least one token id (e.g. a BOS token).")
        if any(i < 0 for i in ids):
            raise ValueError(f"GenerateRequest(request_id={self.request_id!r}) has negative token ids.")
        object.__setattr__(self, "prompt_token_ids", ids)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """One sampled continuation.

    Attributes:
        token_ids: generated ids, ``len == num tokens`` (includes a matched stop token).
        logprobs: per-token logprob of each sampled token, same length (see module docstring
            for the distribution).
        finish_reason: ``"stop"`` (stop token id, EOS or stop string) or ``"length"``
            (``max_new_tokens`` reached).
        prompt_index: index of the prompt in the request list.
        sample_index: index among the ``n`` samples of that prompt.
        request_id: the request's ``request_id``.
        raw_logprobs: untempered logprobs when ``return_raw_logprobs`` was set, else None.
        weights_version: the engine's ``weights_version`` when the sample was produced.
        routed_experts: with ``SamplingParams.return_routed_experts``, the expert ids each MoE layer's
            router picked for every token the model was fed: ``[P + R - 1, num_moe_layers, top_k]``
            int16 CPU (the prompt's ``P`` tokens, then the first ``R - 1`` generated ones; the last
            generated token is never fed), layers in model order, ids in the router's (unsorted)
            order; None otherwise. Not compared by ``==``.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    prompt_index: int
    sample_index: int
    request_id: str | None = None
    raw_logprobs: tuple[float, ...] | None = None
    weights_version: int | None = None
    routed_experts: torch.Tensor | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"GenerateResult: {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs.")
        if self.raw_logprobs is not None and len(self.raw_logprobs) != len(self.token_ids):
            raise ValueError("GenerateResult: raw_logprobs length differs from token_ids.")
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"GenerateResult.finish_reason={self.finish_reason!r}; expected 'stop' or 'length'.")


def as_requests(requests: Sequence[GenerateRequest | Sequence[int]]) -> list[GenerateRequest]:
    """Accept ``GenerateRequest`` objects or bare token-id lists; return ``GenerateRequest``s.

    Raises:
        ValueError: empty request list or an empty prompt.
    """
    out = [r if isinstance(r, GenerateRequest) else GenerateRequest(tuple(r)) for r in requests]
    if not out:
        raise ValueError("generate() got no requests; pass at least one prompt.")
    return out


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop and the Tinker service need from a rollout engine.

    ``generate`` returns ``len(requests) * sampling_params.n`` results, prompt-major: result
    ``i * n + j`` is sample ``j`` of prompt ``i``. ``update_weights`` takes HF-named tensors (the
    names of ``AutoModelForCausalLM.state_dict()``) and may be called several times with the
    same ``version`` (one call per bucket); ``weights_version`` is the last version loaded
    (``0`` for the boot weights).

    ``update_lora_adapter(tensors, peft_config, version)`` serves the base weights plus one HF
    PEFT LoRA adapter (full, TP-gathered tensors under PEFT's saved names,
    ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` / ``lora_B.weight`` ``[out, r]``, and the
    ``LoraConfig.to_dict()`` dict); every call sends the whole adapter and sets
    ``weights_version``. The adapter is applied unmerged (never merged into the base *and* applied).
    """

    weights_version: int

    def generate(self, requests: Sequence[GenerateRequest | Sequence[int]],
                 sampling_params: SamplingParams) -> list[GenerateResult]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], version: int) -> None: ...

    def load_lora_adapter(self, name: str, path: str, **kwargs: Any) -> None: ...

    def update_lora_adapter(self, tensors: Mapping[str, "torch.Tensor"], peft_config: Mapping[str, Any],
                            version: int) -> None: ...

    def health(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...
