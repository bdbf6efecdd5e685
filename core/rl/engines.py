"""What the RL loop needs of its engines, as small Protocols (structural types: the real engines
satisfy them without inheriting, and a test's fake engine needs only these members).

- :class:`PolicyTrainer`: the train engine (:class:`ferrule.megatron.engine.TrainEngine`).
- :class:`ReferenceScorer`: the frozen reference policy (:class:`ferrule.rl.reference.ReferencePolicy`).
- The rollout engine: :class:`ferrule.rollout.RolloutEngine` (already a Protocol).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    from ferrule.lora import LoraSettings
    import torch

    from ferrule.megatron.batching import Datum, FBOutput

__all__ = ["PolicyTrainer", "ReferenceScorer"]


class PolicyTrainer(Protocol):
    """The train engine as the loop drives it.

    Attributes:
        step: optimizer steps applied (the weight version the sync sends).
        lora: the engine's LoRA settings, None for full-parameter training (the sync then sends
            every update group, else only the adapter).
        hf_config: the HF ``config.json`` of the model (dict).
    """

    step: int
    lora: LoraSettings | None
    hf_config: dict[str, Any]

    def forward_backward(self, batch: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> FBOutput:
        """Gradients accumulate; per-datum ``logprobs`` ``[N]`` and ``:sum`` metrics come back."""
        ...

    def forward_logprobs(self, batch: Sequence[Datum]) -> list[torch.Tensor]:
        """Per datum the ``[N]`` float32 logprobs of its target tokens (no gradient)."""
        ...

    def optim_step(self, learning_rate: float | None = None) -> dict[str, Any]:
        """One optimizer step: ``{"success", "grad_norm", "learning_rate"}``."""
        ...


class ReferenceScorer(Protocol):
    """The frozen reference policy of the KL term (``algorithm.kl_coef > 0``)."""

    def logprobs(self, sequences: Sequence[Sequence[int]], max_tokens: int = 4096) -> list[torch.Tensor]:
        """Per sequence the ``[len - 1]`` logprobs of its tokens 1.. (micro-batches of ``max_tokens``)."""
        ...
