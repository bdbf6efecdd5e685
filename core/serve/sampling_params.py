"""Tinker ``SamplingParams`` (the ``sampling_params`` JSON of ``asample``) as ferrule's
:class:`~ferrule.rollout.base.SamplingParams` (reference/tinker_protocol.md §5)."""

from __future__ import annotations

from typing import Any, Mapping
from ferrule.rollout.base import SamplingParams

__all__ = ["DEFAULT_MAX_TOKENS", "to_sampling_params"]

#: default ``max_tokens`` when a sample request leaves it unset
DEFAULT_MAX_TOKENS = 128


def to_sampling_params(body: Mapping[str, Any], prompt_len: int, n: int, max_positions: int | None) -> Any:
    """Tinker ``SamplingParams`` JSON -> ferrule :class:`~ferrule.rollout.base.SamplingParams`.

    ``stop``: None keeps EOS stopping; a list of strings / token ids adds stops and turns EOS
    off (Tinker: ``[]`` disables every stop, EOS included).

    ``max_tokens`` unset: :data:`DEFAULT_MAX_TOKENS`, capped by the context left after the prompt
    (``max_positions``: the model's ``max_position_embeddings``, None = unbounded).

    Raises:
        ValueError: a field out of range, or prompt + ``max_tokens`` beyond the context.
    """
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if max_positions is None else \
            max(1, min(DEFAULT_MAX_TOKENS, max_positions - prompt_len))
    stop = body.get("stop")
    stop_strs: tuple = ()
    stop_ids: tuple = ()
    ignore_eos = False
    if stop is not None:
        ignore_eos = True
        stop = [stop] if isinstance(stop, str) else list(stop)
        if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            stop_ids = tuple(stop)
        elif all(isinstance(s, str) for s in stop):
            stop_strs = tuple(stop)
        else:
            raise ValueError(f"sampling_params.stop = {stop!r}: expected a string, a list of strings or a list "
                             "of token ids.")
    if max_positions is not None and prompt_len + int(max_tokens) > max_positions:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                         f"context of {max_positions} tokens; shorten the prompt or max_tokens.")
    top_k = body.get("top_k", -1)
    return SamplingParams(temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                          top_k=-1 if top_k in (None, 0) else int(top_k), max_new_tokens=int(max_tokens),
                          stop=stop_strs, stop_token_ids=stop_ids, n=n, seed=body.get("seed"),
                          ignore_eos=ignore_eos)
