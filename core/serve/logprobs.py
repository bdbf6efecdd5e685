"""Prompt and sample logprobs beyond the sampled tokens' own: ``topk_prompt_logprobs``,
``topk_sample_logprobs``, ``target_prompt_logprobs`` and ``prompt_alt_tokens_k`` of a Tinker
``SampleRequest``, as the ``tinker`` 0.38 SDK defines them (``tinker/types/sample_request.py``,
``sample_response.py``, ``topk_logprobs.py``, ``prompt_alt_tokens.py``; protobuf
``SampleResponse`` fields 3, 5, 6 and ``SampledSequence`` field 4).

For a prompt of ``P`` tokens, prompt position ``i`` (``1 <= i < P``) is scored by the model's
next-token distribution after ``prompt[:i]``: ``log_softmax(logits[i - 1])`` in float32 over the
whole vocabulary, untempered, exactly as ``prompt_logprobs``.

- ``topk_prompt_logprobs = k``: ``TopkLogprobs`` ``[P, k]`` (int32 ids, float32 logprobs), the k
  most likely ids per position, most likely first; row 0 (no context) and rows before
  ``prompt_logprobs_last_n`` hold the SDK's sentinel (id 0, logprob ``-99999.0``: ``None``).
- ``target_prompt_logprobs``: int64 ``[P - 1, K]`` token ids (dense, or sparse CSR listing only
  some cells); cell ``[i, j]`` is scored at position ``i + 1``; ``-1`` asks nothing and gets 0.0.
  The answer is float32 in the request's shape and layout (sparse in, sparse out).
- ``prompt_alt_tokens_k = k``: ``k`` independent draws (with replacement) per position ``1..P-1``
  from the distribution at the request's temperature (``softmax(logits / T)``; the argmax when
  ``T == 0``), seeded by the request's ``seed``; their logprobs under that same distribution.
- ``topk_sample_logprobs = k``: per sampled token, the k most likely ids of the distribution its
  own logprob is reported under (``log_softmax(logits / T)``, untempered for ``T == 0``: the
  rollout engine's convention, ``ferrule.rollout.base``), from one teacher-forced forward over
  prompt + sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

__all__ = ["Extras", "parse_extras", "compute_extras", "fill_response", "MASK_LOGPROB"]

#: the SDK's filler of an empty top-k slot (``tinker.types.topk_logprobs.MASK_LOGPROB``)
MASK_LOGPROB = -99999.0
#: largest k of any top-k / alternative-token request
MAX_K = 64


@dataclass(frozen=True)
class Extras:
    """The validated extras of one request (all zero / None: none asked)."""

    topk_prompt: int = 0
    topk_sample: int = 0
    alt_k: int = 0
    targets: np.ndarray | None = None          # int64 [P - 1, K], -1 = nothing asked
    target_csr: tuple | None = None             # (crow, col) of a sparse request, else None
    last_n: int | None = None

    @property
    def needs_prompt_forward(self) -> bool:
        return bool(self.topk_prompt or self.alt_k or self.targets is not None)

    @property
    def any(self) -> bool:
        return self.needs_prompt_forward or bool(self.topk_sample)


def _k(body: Mapping[str, Any], key: str) -> int:
    v = body.get(key) or 0
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_K:
        raise ValueError(f"{key} = {v!r}; expected an int in 0..{MAX_K}.")
    return v


def parse_extras(body: Mapping[str, Any], prompt_len: int, vocab_size: int, last_n: int | None) -> Extras:
    """Validate the request's extras (JSON ``SampleRequest`` fields).

    Raises:
        ValueError: a k out of ``0..MAX_K``, a ``target_prompt_logprobs`` of another shape than
            ``[len(prompt) - 1, K]``, not int64, with ids outside ``[-1, vocab)``, or a bad CSR layout.
    """
    targets, csr = None, None
    raw = body.get("target_prompt_logprobs")
    if raw is not None:
        targets, csr = _parse_targets(raw, prompt_len, vocab_size)
    return Extras(_k(body, "topk_prompt_logprobs"), _k(body, "topk_sample_logprobs"), _k(body, "prompt_alt_tokens_k"),
                  targets, csr, last_n)


def _parse_targets(raw: Any, prompt_len: int, vocab_size: int) -> tuple[np.ndarray, tuple | None]:
    where = "target_prompt_logprobs"
    if not isinstance(raw, Mapping) or raw.get("dtype") != "int64":
        raise ValueError(f"{where} must be a TensorData of dtype int64 (token ids, -1 = none).")
    shape = list(raw.get("shape") or [])
    if len(shape) != 2 or shape[0] != prompt_len - 1 or shape[1] < 1:
        raise ValueError(f"{where} has shape {shape}; expected [len(prompt) - 1, K] = [{prompt_len - 1}, K >= 1].")
    data = np.asarray(raw.get("data") or [], dtype=np.int64)
    crow, col = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    if (crow is None) != (col is None):
        raise ValueError(f"{where}: sparse_crow_indices and sparse_col_indices come together.")
    if crow is None:
        if data.size != shape[0] * shape[1]:
            raise ValueError(f"{where}: {data.size} values for shape {shape}.")
        dense = data.reshape(shape)
    else:
        crow_a, col_a = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
        if (len(crow_a) != shape[0] + 1 or crow_a[0] != 0 or crow_a[-1] != len(col_a) or len(col_a) != data.size
                or np.any(np.diff(crow_a) < 0) or (col_a.size and (col_a.min() < 0 or col_a.max() >= shape[1]))):
            raise ValueError(f"{where}: inconsistent sparse CSR layout for shape {shape}.")
        dense = np.full(shape, -1, dtype=np.int64)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow_a))
        dense[rows, col_a] = data
    bad = dense[(dense < -1) | (dense >= vocab_size)]
    if bad.size:
        raise ValueError(f"{where} holds ids {bad[:5].tolist()} outside [-1, {vocab_size}).")
    return dense, (None if crow is None else (np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)))


def _topk(lp: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    import torch

    k_eff = min(k, lp.shape[-1])
    vals, ids = torch.topk(lp, k_eff, dim=-1)
    out_ids = np.zeros((lp.shape[0], k), dtype=np.int32)
    out_lp = np.full((lp.shape[0], k), MASK_LOGPROB, dtype=np.float32)
    out_ids[:, :k_eff] = ids.cpu().numpy()
    out_lp[:, :k_eff] = vals.float().cpu().numpy()
    return out_ids, out_lp


def compute_extras(model: Any, device: Any, prompt: list[int], sequences: list, extras: Extras,
                   temperature: float, seed: int | None, media_inputs: dict | None = None) -> dict:
    """The extras of one request. ``sequences``: ``[(tokens, logprobs, reason)]`` as sampled;
    ``media_inputs``: the model's keywords for the prompt's media (``pixel_values`` ...), if any.

    Returns:
        ``{"topk_prompt": (ids [P, k], lps [P, k]), "targets": float32 [P-1, K] (or CSR values),
        "alt": (ids [P-1, k] int64, lps [P-1, k]), "topk_sample": [(ids [T, k], lps [T, k])]}``,
        each key present only when asked.
    """
    import torch

    out: dict = {}
    with torch.inference_mode():
        if extras.needs_prompt_forward:
            ids = torch.tensor([prompt], device=device)
            logits = model(input_ids=ids, **(media_inputs or {})).logits[0, :-1].float()          # [P - 1, V]: position i + 1
            lp = torch.log_softmax(logits, -1)
            if extras.topk_prompt:
                t_ids, t_lp = _topk(lp, extras.topk_prompt)
                first = 1 if extras.last_n is None else len(prompt) - extras.last_n
                ids_full = np.zeros((len(prompt), extras.topk_prompt), dtype=np.int32)
                lp_full = np.full((len(prompt), extras.topk_prompt), MASK_LOGPROB, dtype=np.float32)
                ids_full[first:], lp_full[first:] = t_ids[first - 1:], t_lp[first - 1:]
                out["topk_prompt"] = (ids_full, lp_full)
            if extras.targets is not None:
                tgt = torch.from_numpy(extras.targets).to(device)
                got = lp.gather(-1, tgt.clamp(min=0)).masked_fill(tgt < 0, 0.0).cpu().numpy().astype(np.float32)
                if extras.target_csr is not None:
                    crow, col = extras.target_csr
                    got = got[np.repeat(np.arange(got.shape[0]), np.diff(crow)), col]
                out["targets"] = got
            if extras.alt_k:
                out["alt"] = _alternatives(logits, extras.alt_k, temperature, seed)
        if extras.topk_sample:
            per_seq = []
            for tokens, _, _ in sequences:
                if not tokens:
                    per_seq.append((np.zeros((0, extras.topk_sample), np.int32),
                                    np.zeros((0, extras.topk_sample), np.float32)))
                    continue
                full = torch.tensor([prompt + list(tokens)], device=device)
                logits = model(input_ids=full, **(media_inputs or {})).logits[0, len(prompt) - 1:-1].float()   # [T, V]
                scaled = logits / temperature if temperature > 0 else logits
                per_seq.append(_topk(torch.log_softmax(scaled, -1), extras.topk_sample))
            out["topk_sample"] = per_seq
    return out


def _alternatives(logits: Any, k: int, temperature: float, seed: int | None) -> tuple[np.ndarray, np.ndarray]:
    import torch

    if temperature <= 0:
        lp = torch.log_softmax(logits, -1)
        tok = lp.argmax(-1, keepdim=True).expand(-1, k)
    else:
        lp = torch.log_softmax(logits / temperature, -1)
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        tok = torch.multinomial(lp.exp(), k, replacement=True, generator=gen)
    return tok.cpu().numpy().astype(np.int64), lp.gather(-1, tok).cpu().numpy().astype(np.float32)


def fill_response(msg: Any, pb: Any, extras: Extras, out: Mapping[str, Any]) -> None:
    """Write ``out`` (:func:`compute_extras`) into a ``tinker_public.SampleResponse`` ``msg``."""
    def topk(field: Any, ids: np.ndarray, lps: np.ndarray) -> None:
        field.token_ids = np.ascontiguousarray(ids, dtype="<i4").tobytes()
        field.logprobs = np.ascontiguousarray(lps, dtype="<f4").tobytes()
        field.length, field.k = int(ids.shape[0]), int(ids.shape[1])

    if "topk_prompt" in out:
        topk(msg.topk_prompt_logprobs, *out["topk_prompt"])
    if "targets" in out:
        t = msg.target_prompt_logprobs
        t.dtype = pb.DTYPE_FLOAT32
        t.shape.extend(list(extras.targets.shape))
        if extras.target_csr is None:
            t.dense = np.ascontiguousarray(out["targets"], dtype="<f4").tobytes()
        else:
            crow, col = extras.target_csr
            t.sparse_csr.values = np.ascontiguousarray(out["targets"], dtype="<f4").tobytes()
            t.sparse_csr.crow_indices = crow.astype("<i8").tobytes()
            t.sparse_csr.col_indices = col.astype("<i8").tobytes()
    if "alt" in out:
        ids, lps = out["alt"]
        for field, arr, dtype, enum in ((msg.prompt_alt_tokens.tokens, ids, "<i8", pb.DTYPE_INT64),
                                        (msg.prompt_alt_tokens.logprobs, lps, "<f4", pb.DTYPE_FLOAT32)):
            field.dtype = enum
            field.shape.extend(list(arr.shape))
            field.dense = np.ascontiguousarray(arr, dtype=dtype).tobytes()
    for seq, pair in zip(msg.sequences, out.get("topk_sample", ())):
        topk(seq.topk_sampled_logprobs, *pair)
