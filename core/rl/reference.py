"""The frozen reference policy of the KL penalty (``algorithm.kl_coef > 0``).

The reference is the *initial* checkpoint (``model.hf_dir``) run by transformers in this
process, in eval mode under ``torch.inference_mode`` (one extra copy of the weights; no optimizer
state, no gradients), with the family's ``hf_model_class`` from the plugin registry. Its
logprobs are ``log_softmax`` of fp32 logits at temperature 1, the same quantity the train engine
computes (megatron and HF forwards agree to ~1e-6 in fp32,
plugins/qwen/tests/test_qwen_parity.py), so at step 1 the KL estimate is ~0. Computing them costs one forward pass over the rollout batch per
step; a reference kept as a second Megatron engine would cost the same compute and more memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from ferrule.contract import registry


class ReferencePolicy:
    """Frozen transformers copy of a checkpoint that scores token sequences.

    Args:
        hf_dir: HF checkpoint folder; dtype: parameter dtype; device: torch device.

    Raises:
        ferrule.contract.registry.IncompleteFamilyError: the family registers no ``hf_model_class``.
    """

    def __init__(self, hf_dir: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        from transformers import AutoConfig

        from ferrule.rollout.embedded import family_attn_implementation

        config = AutoConfig.from_pretrained(os.fspath(hf_dir))
        cls = registry.hf_model_class(config)
        self.model = cls.from_pretrained(os.fspath(hf_dir), use_kernels=False, dtype=dtype,
                                         attn_implementation=family_attn_implementation(config)).to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.device = torch.device(device)

    @torch.inference_mode()
    def logprobs(self, sequences: Sequence[Sequence[int]], max_tokens: int = 4096) -> list[torch.Tensor]:
        """Per-position logprobs ``[L - 1]`` float32 (CPU) of ``seq[1:]`` given ``seq[:-1]`` for each sequence.

        Sequences are right-padded into batches of at most ``max_tokens`` padded tokens
        (causal attention: right padding does not change the real positions).
        """
        out: list[torch.Tensor | None] = [None] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        k = 0
        while k < len(order):
            longest = len(sequences[order[k]])
            take = max(1, max_tokens // max(longest, 1))
            idx = order[k:k + take]
            k += len(idx)
            ids = torch.zeros(len(idx), longest, dtype=torch.long)
            mask = torch.zeros(len(idx), longest, dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, :len(sequences[i])] = torch.tensor(list(sequences[i]))
                mask[row, :len(sequences[i])] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits.float()
            lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None].to(self.device))[..., 0]
            for row, i in enumerate(idx):
                out[i] = lp[row, :len(sequences[i]) - 1].cpu()
        return out  # type: ignore[return-value]
