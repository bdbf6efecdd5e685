"""Rollout engines: ``generate`` tokens + logprobs, ``update_weights`` from HF-named tensors.

``get_rollout_engine("embedded", ...)`` (default; a transformers model in-process) or
``get_rollout_engine("sglang", ...)`` (an SGLang server over HTTP). The protocol and the
logprob convention are in :mod:`ferrule.rollout.base`. Importing this package imports no torch.
"""

from ferrule.rollout.base import (
    ENGINE_KINDS,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    as_requests,
)
from ferrule.rollout.factory import get_rollout_engine

__all__ = [
    "ENGINE_KINDS",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "RolloutEngine",
    "RolloutError",
    "SamplingParams",
    "as_requests",
    "get_rollout_engine",
]
