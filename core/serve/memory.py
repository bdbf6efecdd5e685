"""The memory budget of ``ferrule serve`` (``--max-memory``): what the service holds, what a request
would need, and the refusal of a request that would not fit.

**Held** (:meth:`MemoryBudget.refresh`, on the worker after every operation): the bytes of the tensors
the service keeps between requests, each storage counted once: every base's sampler weights (its
rollout engine's parameters and buffers) and the base copy it swaps back to, every unnamed sampler
snapshot (a merged copy, or an adapter), and every training client's engine: its parameters (the
frozen base shared by LoRA clients counts once) and, per trained parameter, an fp32 gradient and
Adam's two fp32 moments (12 bytes; 4 more for an fp32 master copy of a 16-bit parameter). Not
counted: the interpreter, libraries and allocator caches (about 0.5 GB of a CPU process), so give a
budget below the machine's memory by that much.

**Need** of one request, estimated from the base's ``config.json`` before it is queued:

- ``sample`` (and the OpenAI routes): the KV cache of ``num_samples x (prompt + max_tokens)`` tokens
  (:func:`kv_bytes_per_token`: ``2 x layers x kv_heads x head_dim x`` the sampler dtype's bytes, what
  transformers' ``DynamicCache`` holds), one layer's prefill activations of the prompts, fp32 logits and
  their log-softmax for each row, and the prompt's full logits when prompt logprobs are asked for.
- ``forward_backward``: the activations autograd keeps for the longest datum (the train engine runs one
  datum per micro-batch; :func:`activation_bytes`: per token and layer the block inputs, q/k/v, the
  attention output, the attention probabilities of the sequence and the gated MLP's three intermediate
  tensors, after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", section 4.1) plus fp32 logits, log-softmax and their gradient; ``forward`` one layer's.
- ``create_model``: a second base copy (a new engine is built before its frozen tensors are shared)
  and, for a full-parameter client, its gradients and Adam moments; an unnamed merged snapshot
  (``save_weights_and_get_sampling_client``): a full copy of the model.

A request whose need is more than the budget minus what is held minus what queued requests will add
is refused on arrival with a 400 naming ``--max-memory``, the need and what is left; nothing is
queued or changed. Sampling requests are batched only while their summed need fits
(:meth:`MemoryBudget.room`).
"""

from __future__ import annotations

import re
import threading
from typing import Any, Iterable, Mapping

__all__ = ["MemoryBudget", "parse_bytes", "fmt_bytes", "kv_bytes_per_token", "activation_bytes",
           "sample_need", "forward_need", "tensor_bytes", "load_need", "model_copy_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str | int, option: str = "--max-memory") -> int:
    """``"24GiB"``, ``"512MiB"``, ``"8GB"``, ``"1.5G"`` or an int -> bytes (``K/M/G/T`` and ``kB/MB/GB/TB``
    are powers of 1000, ``KiB/MiB/GiB/TiB`` of 1024).

    Raises:
        ValueError: another form, or a value < 1 byte.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m and m.group(2).lower()
        if not m or unit not in _UNITS:
            raise ValueError(f"{option} {text!r}: expected a size such as 24GiB, 512MiB, 8GB or a number of "
                             "bytes.")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{option} {text!r}: expected at least 1 byte.")
    return value


def fmt_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'`` (binary units)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _text(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    return cfg if "num_hidden_layers" in cfg else cfg.get("text_config") or cfg


def _dims(cfg: Mapping[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    """``(layers, hidden, heads, kv_heads, head_dim, intermediate, vocab)`` of an HF config."""
    t = _text(cfg)
    hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    kv = int(t.get("num_key_value_heads") or heads)
    head_dim = int(t.get("head_dim") or hidden // heads)
    inter = int(t.get("intermediate_size") or 4 * hidden)
    if t.get("moe_intermediate_size") and t.get("num_experts_per_tok"):   # routed experts: the active ones
        inter = max(inter, int(t["moe_intermediate_size"]) * int(t["num_experts_per_tok"]))
    vocab = int(t.get("unpadded_vocab_size") or t["vocab_size"])
    return int(t["num_hidden_layers"]), hidden, heads, kv, head_dim, inter, vocab


def kv_bytes_per_token(cfg: Mapping[str, Any], dtype_bytes: int) -> int:
    """Bytes of KV cache per token: ``2 (K and V) x layers x kv_heads x head_dim x dtype_bytes``."""
    layers, _, _, kv, head_dim, _, _ = _dims(cfg)
    return 2 * layers * kv * head_dim * dtype_bytes


def activation_bytes(cfg: Mapping[str, Any], tokens: int, dtype_bytes: int = 4, layers: int | None = None) -> int:
    """Activations autograd keeps for one sequence of ``tokens`` over ``layers`` (default: all) layers:
    per token and layer ``5 x hidden`` (block and sub-layer inputs, attention output) ``+ 2 x kv_dim``
    (k, v; q counted in the hidden terms) ``+ 4 x intermediate`` (gate, up, activation, product)
    ``+ 2 x heads x tokens`` (attention scores and probabilities), times ``dtype_bytes``."""
    n_layers, hidden, heads, kv, head_dim, inter, _ = _dims(cfg)
    per_token = 5 * hidden + 2 * kv * head_dim + 4 * inter + 2 * heads * tokens
    return (n_layers if layers is None else layers) * tokens * per_token * dtype_bytes


def sample_need(cfg: Mapping[str, Any], dtype_bytes: int, num_samples: int, prompt: int, max_tokens: int,
                prompt_logprobs: bool = False) -> int:
    """Bytes one sampling request needs while it runs (module docstring)."""
    _, hidden, heads, _, _, inter, vocab = _dims(cfg)
    kv = num_samples * (prompt + max_tokens) * kv_bytes_per_token(cfg, dtype_bytes)
    prefill = num_samples * prompt * (4 * hidden + 3 * inter + heads * prompt) * dtype_bytes
    logits = num_samples * vocab * 4 * 2
    full = prompt * vocab * 4 * 2 if prompt_logprobs else 0
    return kv + prefill + logits + full


def forward_need(cfg: Mapping[str, Any], longest: int, backward: bool, dtype_bytes: int = 4) -> int:
    """Bytes one ``forward`` / ``forward_backward`` request needs while it runs: the longest datum's
    activations (all layers with ``backward``, one without) and its fp32 logits, log-softmax and (with
    ``backward``) their gradient."""
    vocab = _dims(cfg)[6]
    acts = activation_bytes(cfg, longest, dtype_bytes, layers=None if backward else 1)
    return acts + longest * vocab * 4 * (3 if backward else 2)


def tensor_bytes(tensors: Iterable[Any], seen: set) -> int:
    """Bytes of ``tensors`` whose storage is not in ``seen`` (which is updated); meta tensors count 0."""
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def backend_bytes(backend: Any, seen: set) -> int:
    """What :class:`~ferrule.serve.backend.EngineBackend` ``backend`` holds (module docstring)."""
    import torch

    total = 0
    engine = backend._rollout
    if engine is not None:
        model = getattr(engine, "model", None)
        if model is not None:
            total += tensor_bytes(list(model.parameters()) + list(model.buffers()), seen)
    total += tensor_bytes((backend._base_state or {}).values(), seen)
    for snap in list(backend._snapshots.values()):
        total += tensor_bytes((getattr(snap, "tensors", snap) or {}).values(), seen)
    for train in list(backend.engines.values()):
        for chunk in getattr(train, "model", []):
            for p in chunk.parameters():
                total += tensor_bytes([p], seen)
                if p.requires_grad:
                    total += p.numel() * (12 + (4 if p.dtype != torch.float32 else 0))
    return total


def load_need(backend: Any) -> int:
    """Bytes loading ``backend``'s sampler would add (0 when it is loaded): its weights in the sampler dtype
    and the base copy it swaps back to; 0 when the base's size is unknown."""
    if backend._rollout is not None:
        return 0
    return 2 * (backend.param_count() or 0) * backend.sampler_dtype_bytes


def model_copy_bytes(backend: Any) -> int:
    """Bytes of one copy of ``backend``'s base in the training dtype (a new engine, a merged snapshot)."""
    return (backend.param_count() or 0) * (4 if backend.placement.device == "cpu" else 2)


class MemoryBudget:
    """The service's ``--max-memory`` (None: no budget; held bytes are still tracked for
    ``/api/v1/healthz``), what it holds, and the persistent growth queued requests will add.

    :meth:`refresh` runs on the worker thread; :meth:`check` on the event loop reads the numbers the
    last refresh left (ints, read atomically) and reserves a request's persistent growth until the
    request has run (:meth:`release`)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()
        self._reserved: dict[str, int] = {}

    def refresh(self, backends: Iterable[Any]) -> int:
        seen: set = set()
        self.held = sum(backend_bytes(b, seen) for b in backends)
        return self.held

    @property
    def reserved(self) -> int:
        with self._lock:
            return sum(self._reserved.values())

    def left(self) -> int | None:
        """Bytes of the budget not held or reserved now (None: no budget)."""
        return None if self.limit is None else self.limit - self.held - self.reserved

    def room(self) -> int | None:
        """What one batch of queued sampling requests may need together (None: unbounded)."""
        return None if self.limit is None else max(0, self.limit - self.held)

    def check(self, what: str, need: int, detail: str) -> str | None:
        """The refusal message when ``need`` bytes do not fit in what is left, else None."""
        left = self.left()
        if left is None or need <= left:
            return None
        return (f"{what} needs about {fmt_bytes(need)} ({detail}), more than the {fmt_bytes(max(left, 0))} left of the "
                f"server's --max-memory = {fmt_bytes(self.limit)} ({fmt_bytes(self.held)} held by loaded weights, "
                f"training clients and snapshots, {fmt_bytes(self.reserved)} reserved by queued requests); send less "
                "per request, free memory (unload_model or finish idle training clients), or start the server with a "
                "larger --max-memory.")

    def reserve(self, key: str, grow: int) -> None:
        if grow > 0:
            with self._lock:
                self._reserved[key] = grow

    def release(self, key: str) -> None:
        with self._lock:
            self._reserved.pop(key, None)

    def as_json(self) -> dict:
        return {"max_memory": self.limit, "held": self.held, "reserved": self.reserved, "left": self.left()}
