"""Request-size limits of ``ferrule serve``: checked when a request arrives, before anything is queued.

One request must not be able to take the machine (``sample(num_samples=10**6)`` on a tiny model
grew a server to 8.4 GB in four minutes while it blocked the single worker for every tenant), and
one tenant must not be able to fill the queue for the others. A request over a limit gets a 4xx
whose message names the limit, its value and the ``ferrule serve`` option that raises it:

- 400 for a request that can never run as sent (too many samples, too many tokens, too large a
  LoRA rank); a training-client request refused so consumes its ``seq_id``.
- 429 when the tenant already has :attr:`ServeLimits.max_queued_per_tenant` requests queued or
  running. The SDK retries a 429 with back-off (``tinker`` 0.38: up to five minutes), resending
  the same ``seq_id``, so the ``seq_id`` is *not* consumed: the retry fills it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrule.lora.settings import MAX_LORA_RANK

__all__ = ["ServeLimits"]


@dataclass(frozen=True)
class ServeLimits:
    """Per-request and per-tenant bounds (defaults sized for one machine; every field > 0).

    Attributes:
        max_samples_per_request: ``num_samples`` of one ``sample`` request.
        max_tokens_per_request: tokens one request may process: for ``sample``,
            ``num_samples * (prompt tokens + max_tokens)``; for ``forward`` / ``forward_backward``,
            the sum of the data's ``model_input`` lengths (the SDK splits larger batches into
            chunks of ``fwdbwd_max_chunk_len`` data, each one request).
        max_lora_rank: ``lora_config.rank`` of a training client (default
            :data:`ferrule.lora.settings.MAX_LORA_RANK`, the limit ``ferrule train`` applies to ``lora.rank``).
        max_queued_per_tenant: requests of one tenant queued or running at once (all its clients).
        max_image_bytes: encoded bytes of one ``ImageChunk`` (checked before decoding).
        max_image_pixels: width x height of one image, read from its header before its pixels
            are decoded (Inkling: 24 bytes of ``pixel_values`` per pixel, one token per 40 x 40
            patch; the default, 2048 x 2048, is ~100 MB and 2,704 tokens).
        max_audio_frames: dMel frames of one ``DmelChunk`` (20 per second: 36,000 = 30 minutes).
        max_memory: bytes the whole service may hold plus what a request needs while it runs
            (``--max-memory``; :mod:`ferrule.serve.memory`), or None: no budget.
    """

    max_samples_per_request: int = 256
    max_tokens_per_request: int = 1 << 20
    max_lora_rank: int = MAX_LORA_RANK
    max_queued_per_tenant: int = 512
    max_image_bytes: int = 32 << 20
    max_image_pixels: int = 2048 * 2048
    max_audio_frames: int = 36_000
    max_memory: int | None = None

    def __post_init__(self) -> None:
        bad = [f"{k}={v!r}" for k, v in vars(self).items() if not (v is None and k == "max_memory")
               and (not isinstance(v, int) or isinstance(v, bool) or v < 1)]
        if bad:
            raise ValueError(f"ServeLimits: {', '.join(bad)}; every limit is an int >= 1.")

    @staticmethod
    def option(field: str) -> str:
        """The ``ferrule serve`` option of a limit (``max_lora_rank`` -> ``--max-lora-rank``)."""
        return "--" + field.replace("_", "-")

    def over(self, field: str, value: int, what: str) -> str | None:
        """A refusal message when ``value`` exceeds limit ``field``, else None."""
        limit = getattr(self, field)
        if value <= limit:
            return None
        fix = f"use a rank <= {limit}" if field == "max_lora_rank" else "send less per request"
        return (f"{what} = {value} exceeds the server's limit {field} = {limit}; {fix} "
                f"(or start the server with a larger {self.option(field)}).")
