"""Tinker wire formats: the protobuf ``forward_backward`` request, the protobuf results.

Schema: ``tinker_public.proto`` as shipped in the ``tinker`` 0.38.0 SDK
(``tinker.proto.tinker_public_pb2``; dump in ``shared/reference/tinker_public_proto_schema.txt``).
The SDK sends ``ForwardBackwardRequest`` as protobuf (optionally zstd-compressed) and accepts
``ForwardBackwardOutput`` / ``SampleResponse`` results only as protobuf; everything else is
JSON (reference/tinker_protocol.md §1, §6).

Layouts (little-endian bytes):

- ``EncodedTextChunk.tokens``: int32 token ids; a datum's ``model_input`` is its chunks
  concatenated. ``ImageChunk`` / ``DmelChunk`` are kept undecoded (:class:`FBRequest.pieces`)
  until the served model's towers turn them into placeholders + media
  (:func:`resolve_media`, :mod:`ferrule.serve.media_chunks`).
- ``Tensor``: ``dense`` bytes of ``dtype`` (FLOAT32 or INT64), or ``sparse_csr`` (values,
  int64 ``crow_indices`` / ``col_indices``); ``shape`` gives the dense shape.
- ``BatchedTensor``: per-datum bytes concatenated in ``data``; ``offsets`` = ``num_datums + 1``
  int64 **byte** offsets; ``trailing_shape`` empty for ``[N]`` per-token outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from .media_chunks import MediaPart

__all__ = ["WireError", "FBRequest", "decode_forward_backward", "encode_forward_backward_output",
           "encode_sample_response", "pb", "resolve_media"]


class WireError(ValueError):
    """A request body that does not decode (message names the field and what was expected).

    ``model_id`` / ``seq_id``: the request's training client and sequence number where the body
    holds them (so the refusal can consume that ``seq_id``), else None."""

    model_id: str | None = None
    seq_id: int | None = None


def peek_ids(body: bytes) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` of a ``ForwardBackwardRequest`` whose fields 1 (string) and 2 (int32)
    are readable even when the rest of the body is not (a tolerant scan of the top-level protobuf
    wire format: varint tags, skipping fields 3+ by their length). None when either is absent."""
    pos, model_id, seq_id = 0, None, None

    def varint() -> int:
        nonlocal pos
        out = shift = 0
        while True:
            if pos >= len(body) or shift > 63:
                raise IndexError
            byte = body[pos]
            pos += 1
            out |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return out
    try:
        while pos < len(body) and (model_id is None or seq_id is None):
            tag = varint()
            field, kind = tag >> 3, tag & 7
            if kind == 0:
                value = varint()
                if field == 2:
                    seq_id = value
            elif kind == 2:
                n = varint()
                chunk, pos = body[pos:pos + n], pos + n
                if field == 1:
                    model_id = chunk.decode()
            elif kind in (1, 5):
                pos += 8 if kind == 1 else 4
            else:
                break
    except (IndexError, UnicodeDecodeError):
        pass
    return (model_id, seq_id if seq_id < 2**31 else seq_id - 2**64) if model_id and seq_id is not None else None


def pb():
    """The SDK's generated protobuf module (``tinker.proto.tinker_public_pb2``)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class FBRequest:
    """A decoded ``ForwardBackwardRequest``: ``data`` are :class:`ferrule.megatron.batching.Datum`."""

    model_id: str
    seq_id: int
    data: list
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    #: datum index -> its model_input as token ids and undecoded media chunks, in order (only the
    #: data holding image / dmel chunks; :func:`resolve_media` fills their ``model_input`` / ``media``)
    pieces: dict[int, list] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(d.model_input) for d in self.data)


_NP = {1: np.dtype("<f4"), 2: np.dtype("<i8")}


def _tensor(msg: Any, where: str) -> np.ndarray:
    dtype = _NP.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype enum {msg.dtype} is not FLOAT32 (1) or INT64 (2).")
    shape = [int(s) for s in msg.shape]
    which = msg.WhichOneof("encoding")
    if which == "sparse_csr":
        csr = msg.sparse_csr
        values = _frombuffer(csr.values, dtype, f"{where}.sparse_csr.values")
        crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), f"{where}.sparse_csr.crow_indices")
        col = _frombuffer(csr.col_indices, np.dtype("<i8"), f"{where}.sparse_csr.col_indices")
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or (len(crow) and crow[-1] != len(values)):
            raise WireError(f"{where}: inconsistent sparse CSR tensor (shape {shape}, {len(crow)} crow indices, "
                            f"{len(col)} col indices, {len(values)} values).")
        dense = np.zeros(shape, dtype=dtype)
        for r in range(shape[0]):
            cols = col[crow[r]:crow[r + 1]]
            if len(cols) and (cols.min() < 0 or cols.max() >= shape[1]):
                raise WireError(f"{where}: sparse column index outside [0, {shape[1]}).")
            dense[r, cols] = values[crow[r]:crow[r + 1]]
        return dense
    arr = _frombuffer(msg.dense, dtype, f"{where}.dense")
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise WireError(f"{where}: shape {shape} needs {int(np.prod(shape))} elements, the bytes hold {arr.size}.")
        arr = arr.reshape(shape)
    return arr


def _frombuffer(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise WireError(f"{where}: {len(raw)} bytes is not a multiple of {dtype.itemsize} ({dtype}).")
    return np.frombuffer(raw, dtype=dtype).copy()


def decode_forward_backward(body: bytes, content_encoding: str | None = None) -> FBRequest:
    """Decode a (possibly zstd-compressed) protobuf ``ForwardBackwardRequest``.

    Returns:
        :class:`FBRequest` whose data hold ``model_input`` as a list of int and
        ``loss_fn_inputs`` as torch tensors (int64 ``target_tokens``, float32 others).

    Raises:
        WireError: undecodable bytes, a non-text chunk, a bad tensor encoding; it carries the
            request's ``model_id`` / ``seq_id`` when the body holds them.
    """
    if content_encoding and content_encoding.strip().lower() == "zstd":
        try:
            import zstandard

            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
        except Exception as exc:  # zstandard raises its own ZstdError
            raise WireError(f"forward_backward body is not valid zstd ({exc}).") from exc
    elif content_encoding and content_encoding.strip().lower() not in ("identity", ""):
        raise WireError(f"Content-Encoding {content_encoding!r} is not supported; send zstd or none.")
    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # google.protobuf.message.DecodeError
        err = WireError(f"forward_backward body is not a tinker_public.ForwardBackwardRequest protobuf ({exc}).")
        err.model_id, err.seq_id = peek_ids(body) or (None, None)
        raise err from exc
    try:
        return _decode_message(msg)
    except WireError as exc:
        exc.model_id, exc.seq_id = msg.model_id or None, int(msg.seq_id)
        raise


def _decode_message(msg: Any) -> FBRequest:
    import torch

    from ferrule.megatron.batching import Datum

    data = []
    pieces: dict[int, list] = {}
    for i, d in enumerate(msg.data):
        tokens: list = []
        for j, chunk in enumerate(d.model_input):
            kind, at = chunk.WhichOneof("chunk"), f"datum {i} chunk {j}"
            if kind == "encoded_text":
                tokens += _frombuffer(chunk.encoded_text.tokens, np.dtype("<i4"), at).tolist()
            elif kind == "image":
                if chunk.image.HasField("override_dimensions"):
                    raise WireError(f"{at}: image override_dimensions is not supported; resize the image itself.")
                tokens.append(MediaPart("image", chunk.image.data, at, chunk.image.format,
                                        chunk.image.expected_tokens if chunk.image.HasField("expected_tokens") else None))
            elif kind == "dmel":
                tokens.append(MediaPart("dmel", chunk.dmel.dmel, at))
            else:
                raise WireError(f"{at}: model_input chunk of kind {kind!r}; expected encoded_text, image or dmel.")
        if any(isinstance(t, MediaPart) for t in tokens):
            pieces[i], tokens = tokens, []
        inputs = {}
        for key, t in d.loss_fn_inputs.items():
            arr = _tensor(t, f"datum {i}: loss_fn_inputs[{key!r}]")
            inputs[key] = torch.from_numpy(np.ascontiguousarray(arr))
        data.append(Datum(tokens, inputs))
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # v2 wins (SDK writes floats to both maps)
        which = v.WhichOneof("value")
        config[k] = v.text if which == "text" else float(v.number)
    return FBRequest(msg.model_id, int(msg.seq_id), data, msg.loss_fn, config, bool(msg.forward_only), pieces or None)


def resolve_media(req: FBRequest, decoder: Any) -> None:
    """Turn the undecoded media chunks of ``req`` into placeholder tokens + ``Datum.media`` in place
    (:meth:`ferrule.serve.media_chunks.ChunkMedia.assemble`).

    Raises:
        ValueError: a media chunk the decoder refuses (the message names datum and chunk).
    """
    for i, pieces in (req.pieces or {}).items():
        req.data[i].model_input, req.data[i].media = decoder.assemble(pieces)
    req.pieces = None


def _batched(arrays: Sequence[np.ndarray], dtype_enum: int, np_dtype: str) -> Any:
    bt = pb().BatchedTensor()
    parts = [np.ascontiguousarray(a, dtype=np_dtype).tobytes() for a in arrays]
    offsets = np.cumsum([0] + [len(p) for p in parts]).astype("<i8")
    bt.data = b"".join(parts)
    bt.offsets = offsets.tobytes()
    bt.dtype = dtype_enum
    return bt


def encode_forward_backward_output(outputs: Sequence[Mapping[str, Any]], metrics: Mapping[str, float],
                                   loss_fn_output_type: str = "ArrayRecord") -> bytes:
    """``ArrayRecord`` s holding each output field (``[N]``, or ``[N, K]`` for rank-2
    cross_entropy, float32 per datum) for every datum, in the request's datum order (one record
    per run of data with equal trailing shape), and the metrics (``name:reduction`` keys)."""
    msg = pb().ForwardBackwardOutput()
    msg.loss_fn_output_type = loss_fn_output_type
    arrays = [{name: np.asarray(v.detach().cpu().float().numpy() if hasattr(v, "detach") else v)
               for name, v in o.items()} for o in outputs]
    # one ArrayRecord per run of data with the same trailing shape ([N] outputs: (); rank-2
    # cross_entropy: (K,)), in datum order: the SDK concatenates the records' data
    runs: list[list[dict]] = []
    for a in arrays:
        shape = tuple(next(iter(a.values())).shape[1:]) if a else ()
        if runs and runs[-1][0] == shape:
            runs[-1][1].append(a)
        else:
            runs.append([shape, [a]])
    for shape, group in runs or [((), [])]:
        record = msg.loss_fn_outputs.add()
        record.type_tag = loss_fn_output_type
        record.num_datums = len(group)
        for name in (group[0].keys() if group else ()):
            bt = _batched([g[name] for g in group], pb().DTYPE_FLOAT32, "<f4")
            bt.trailing_shape.extend(list(shape))
            record.fields[name].CopyFrom(bt)
    for k, v in metrics.items():
        if k.count(":") != 1:
            raise ValueError(f"metric key {k!r} is not 'name:reduction' (the SDK's combine step needs one colon).")
        msg.metrics[k] = float(v)
    return msg.SerializeToString()


def encode_sample_response(sequences: Sequence[tuple[Sequence[int], Sequence[float], str]],
                           prompt_logprobs: Sequence[float] | None = None, extras: Any = None,
                           extras_out: Mapping[str, Any] | None = None) -> bytes:
    """``SampleResponse``: each sequence is ``(tokens, logprobs, "stop"|"length")``;
    ``prompt_logprobs`` (float32, NaN at position 0, which the SDK turns into None) if asked;
    top-k / target / alternative-token fields from ``extras_out``
    (:func:`ferrule.serve.logprobs.fill_response`)."""
    msg = pb().SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb().STOP_REASON_STOP if reason == "stop" else pb().STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([math.nan if x is None else x for x in prompt_logprobs], dtype="<f4").tobytes()
    if extras_out:
        from .logprobs import fill_response

        fill_response(msg, pb(), extras, extras_out)
    return msg.SerializeToString()
