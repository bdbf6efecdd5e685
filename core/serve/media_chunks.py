"""Image and audio chunks of a Tinker ``ModelInput``, turned into what the family's towers take.

Tinker's ``ModelInput`` is a list of chunks (``tinker`` 0.38 SDK, ``tinker.types``):

- ``EncodedTextChunk`` ``tokens``: token ids, kept as they are.
- ``ImageChunk`` ``data`` (the encoded PNG / JPEG file), ``format`` (``"png"`` | ``"jpeg"``),
  ``expected_tokens`` (advisory: the server computes the count and may fail fast when it differs).
  On the wire: protobuf ``Chunk.image`` (``forward_backward``) or JSON ``{"type": "image", "data":
  BASE64, ...}`` (``asample``).
- ``DmelChunk`` ``dmel``: a serialized *TensorContainer* holding the dMel ids ``[n_frames,
  n_mel_bins]`` (protobuf ``Chunk.dmel`` / JSON ``{"type": "dmel", "dmel": BASE64}``).
- ``ImageAssetPointerChunk`` (a path or URL): refused; it would make the server read files or
  URLs a client names (send the bytes as an ``ImageChunk``).

Each media chunk becomes **its token count of placeholder tokens** (the tower's
``TowerSpec.placeholder_id``) in the prompt, plus one item of ``media[modality]``
(:mod:`ferrule.media`): an image goes through the vision tower's ``TowerSpec.preprocess`` (Inkling:
``pixel_values`` ``[n_patches, 2, P, P, 3]``, one token per patch: the count tml-renderers gives an
``ImageAssetPointerTokenSpan``), a dMel tensor is the audio tower's input as it is (one token per
frame: ``DmelChunk.length``).

TensorContainer layout (as ``tinker.types._tensor_container`` reads its header and
``tml_renderers``' ``_dmel_to_tensor_container_bytes`` writes it): one dtype byte (2 = int32,
3 = int64, 4 = uint8: the integer kinds that serializer writes), ``ndim`` as a varint, each dim as
a varint, then the elements, little-endian, row-major. A leading byte 254 marks a constant tensor,
whose payload layout neither package documents: refused.

Size limits (:class:`~ferrule.serve.limits.ServeLimits`) are checked before anything is decoded
(encoded bytes, then the image's pixels read from its header, dMel frames from the container
header); every refusal is a :class:`ValueError` naming the chunk.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Mapping, Sequence
from ferrule.contract import registry
from ferrule.contract.specs import resolve_ref

__all__ = ["MediaPart", "ChunkMedia", "attention_leaves", "decoder", "hf_inputs", "parts_from_json",
           "parse_tensor_container"]

#: TensorContainer dtype byte -> numpy dtype (little-endian); the kinds tml-renderers writes for dMel
_TC_DTYPES = {2: "<i4", 3: "<i8", 4: "|u1"}
_TC_CONSTANT = 254
#: ImageChunk.format -> the PIL format name of the decoded file
_PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG"}


@dataclass
class MediaPart:
    """One undecoded media chunk: ``kind`` ``"image"`` | ``"dmel"``, its bytes, and for images the
    declared ``format`` / ``expected_tokens``; ``where`` names it in errors (``datum 0 chunk 2``)."""

    kind: str
    data: bytes
    where: str
    format: str | None = None
    expected_tokens: int | None = None


def _varint(raw: bytes, pos: int, where: str) -> tuple[int, int]:
    out = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise ValueError(f"{where}: truncated TensorContainer header.")
        byte = raw[pos]
        pos += 1
        out |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return out, pos


def parse_tensor_container(raw: bytes, where: str, max_rows: int | None = None):
    """A TensorContainer (module docstring) -> int64 ``torch.Tensor`` of its shape.

    Args:
        max_rows: refuse before reading the payload when dim 0 exceeds it (the message names
            ``max_audio_frames``).

    Raises:
        ValueError: empty or truncated bytes, the constant form, an unknown dtype byte, a payload
            whose length differs from what the shape needs, dim 0 over ``max_rows``.
    """
    import numpy as np
    import torch

    if not raw:
        raise ValueError(f"{where}: dmel is empty; send the TensorContainer bytes of the dMel ids.")
    if raw[0] == _TC_CONSTANT:
        raise ValueError(f"{where}: a constant-encoded TensorContainer (leading byte 254) is not decoded here; "
                         "send the dense form (what tml_renderers.tinker writes for a DmelTokenSpan).")
    dtype = _TC_DTYPES.get(raw[0])
    if dtype is None:
        raise ValueError(f"{where}: TensorContainer dtype byte {raw[0]} is not an integer kind this server reads "
                         f"({sorted(_TC_DTYPES)}: int32, int64, uint8); dMel ids are integers.")
    ndim, pos = _varint(raw, 1, where)
    if ndim > 8:
        raise ValueError(f"{where}: TensorContainer of {ndim} dimensions; dMel ids are [n_frames, n_mel_bins].")
    shape = []
    for _ in range(ndim):
        dim, pos = _varint(raw, pos, where)
        shape.append(dim)
    if max_rows is not None and shape and shape[0] > max_rows:
        raise ValueError(f"{where}: {shape[0]} dMel frames exceeds the server's limit max_audio_frames = {max_rows}; "
                         "send shorter clips (or start the server with a larger --max-audio-frames).")
    item = np.dtype(dtype).itemsize
    need = int(np.prod(shape, dtype=np.int64)) * item if shape else item
    if len(raw) - pos != need:
        raise ValueError(f"{where}: TensorContainer of shape {shape} ({np.dtype(dtype).name}) needs {need} payload "
                         f"bytes, it holds {len(raw) - pos}.")
    arr = np.frombuffer(raw, dtype=dtype, offset=pos).astype(np.int64).reshape(shape)
    return torch.from_numpy(arr)


def parts_from_json(chunks: Sequence[Mapping[str, Any]], where: str) -> list:
    """JSON ``ModelInput.chunks`` (``asample``'s ``prompt``) -> token ids and :class:`MediaPart` s, in order.

    Raises:
        ValueError: an unknown chunk type, an ``image_asset_pointer``, base64 that does not decode.
    """
    import base64
    import binascii

    out: list = []
    for j, chunk in enumerate(chunks):
        kind, at = chunk.get("type", "encoded_text"), f"{where} chunk {j}"
        if kind == "encoded_text":
            out.extend(int(t) for t in chunk.get("tokens") or [])
            continue
        if kind == "image_asset_pointer":
            raise ValueError(f"{at}: image_asset_pointer chunks (location {str(chunk.get('location'))[:80]!r}) are "
                             "not read by this server (it would read files / URLs a client names); send the image "
                             "bytes as an ImageChunk.")
        if kind not in ("image", "dmel"):
            raise ValueError(f"{at}: chunk type {kind!r} is not one of encoded_text, image, dmel.")
        field = "data" if kind == "image" else "dmel"
        value = chunk.get(field)
        try:
            data = base64.b64decode(value, validate=True) if isinstance(value, str) else bytes(value or b"")
        except (binascii.Error, ValueError, TypeError) as exc:
            raise ValueError(f"{at}: {field} is not base64 ({exc}).") from None
        out.append(MediaPart(kind, data, at, chunk.get("format"), chunk.get("expected_tokens")))
    return out


class ChunkMedia:
    """The served model's media decoder: :class:`MediaPart` s -> placeholder tokens + tower inputs.

    Args:
        hf_config: the served HF config dict (placeholder ids, the towers' preprocessing).
        towers: the family's ``TowerSpec`` s (``ferrule.contract.registry.get_towers``); empty = text only.
        limits: :class:`~ferrule.serve.limits.ServeLimits` (``max_image_bytes``,
            ``max_image_pixels``, ``max_audio_frames``).
        family: names the family in errors.
    """

    MODALITY = {"image": "vision", "dmel": "audio"}

    def __init__(self, hf_config: Mapping[str, Any], towers: Sequence[Any], limits: Any, family: str):
        self.hf_config, self.limits, self.family = dict(hf_config), limits, family
        self.towers = {t.modality: t for t in towers}
        self.placeholder = {m: t.placeholder_id(self.hf_config) for m, t in self.towers.items()}
        self._dmel_geometry: tuple[int, int] | None = None

    def _tower(self, part: MediaPart) -> Any:
        modality = self.MODALITY[part.kind]
        spec = self.towers.get(modality)
        if spec is None:
            raise ValueError(f"{part.where}: an {part.kind} chunk, but family {self.family!r} has no {modality} tower "
                             f"(towers: {sorted(self.towers) or 'none'}); send text chunks only to this model.")
        return spec

    def image(self, part: MediaPart):
        """An ``ImageChunk`` -> the vision tower's input (its first ``TowerSpec.item_token_dims`` dims = its tokens).

        Raises:
            ValueError: over ``max_image_bytes`` / ``max_image_pixels``, a format other than
                png / jpeg or other than the file's, an undecodable file, ``expected_tokens``
                differing from the computed count.
        """
        from PIL import Image, UnidentifiedImageError

        spec = self._tower(part)
        if part.format not in _PIL_FORMAT:
            raise ValueError(f"{part.where}: image format {part.format!r}; expected 'png' or 'jpeg'.")
        if over := self.limits.over("max_image_bytes", len(part.data), f"{part.where}: image bytes"):
            raise ValueError(over)
        try:
            with Image.open(io.BytesIO(part.data)) as img:  # reads the header only
                actual, (w, h) = img.format, img.size
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            raise ValueError(f"{part.where}: the image data does not decode as PNG or JPEG ({exc}).") from None
        if actual != _PIL_FORMAT[part.format]:
            raise ValueError(f"{part.where}: format {part.format!r} but the data is a {actual} file; set format to "
                             "the file's.")
        if over := self.limits.over("max_image_pixels", w * h, f"{part.where}: image pixels ({w} x {h})"):
            raise ValueError(over)
        if not spec.preprocess:
            raise ValueError(f"{part.where}: the {spec.modality} tower of {self.family!r} declares no preprocess.")
        try:
            item = resolve_ref(spec.preprocess)(part.data, self.hf_config)
        except (ValueError, OSError, Image.DecompressionBombError) as exc:  # a limit above PIL's own
            raise ValueError(f"{part.where}: {exc}") from None
        self._check_expected(part, spec.item_tokens(item))
        return item

    @staticmethod
    def _check_expected(part: MediaPart, n: int) -> None:
        if part.expected_tokens is not None and int(part.expected_tokens) != n:
            raise ValueError(f"{part.where}: expected_tokens = {part.expected_tokens} but this {part.kind} is {n} tokens "
                             "for the served model; fix expected_tokens (or leave it unset).")

    def geometry(self) -> tuple[int, int]:
        """``(n_mel_bins, mel_vocab_size)`` of the served model's dMel input (its HF config's
        ``audio_config``, transformers' defaults filled in)."""
        if self._dmel_geometry is None:
            from transformers import AutoConfig

            cfg = AutoConfig.for_model(**self.hf_config)
            audio = getattr(cfg, "audio_config", None)
            if audio is None or not hasattr(audio, "n_mel_bins") or not hasattr(audio, "mel_vocab_size"):
                raise ValueError(f"family {self.family!r}: the config's audio_config has no n_mel_bins / mel_vocab_size, "
                                 "so dmel chunks cannot be checked.")
            self._dmel_geometry = (int(audio.n_mel_bins), int(audio.mel_vocab_size))
        return self._dmel_geometry

    def dmel(self, part: MediaPart):
        """A ``DmelChunk`` -> dMel ids ``[n_frames, n_mel_bins]`` int64 (the audio tower's input).

        Raises:
            ValueError: not a TensorContainer (:func:`parse_tensor_container`), over
                ``max_audio_frames``, a shape other than ``[n >= 1, n_mel_bins]``, ids outside
                ``[0, mel_vocab_size)``.
        """
        self._tower(part)
        ids = parse_tensor_container(part.data, part.where, self.limits.max_audio_frames)
        bins, levels = self.geometry()
        if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] != bins:
            raise ValueError(f"{part.where}: dmel of shape {list(ids.shape)}; the served model takes dMel ids "
                             f"[n_frames >= 1, {bins}].")
        if int(ids.min()) < 0 or int(ids.max()) >= levels:
            raise ValueError(f"{part.where}: dMel ids in [{int(ids.min())}, {int(ids.max())}]; the served model's "
                             f"levels are [0, {levels}).")
        return ids

    def assemble(self, pieces: Sequence[Any]) -> tuple[list[int], dict | None]:
        """Token ids and :class:`MediaPart` s in order -> ``(tokens, media)``: each part becomes as
        many placeholder tokens as its item has rows; ``media`` is None without parts.

        Raises:
            ValueError: a part :meth:`image` / :meth:`dmel` refuses, a text token equal to a
                placeholder id (the placeholders are the server's to write).
        """
        tokens: list[int] = []
        media: dict[str, list] = {}
        reserved = {pid: m for m, pid in self.placeholder.items()}
        for piece in pieces:
            if not isinstance(piece, MediaPart):
                tokens.append(piece)
                continue
            item = self.image(piece) if piece.kind == "image" else self.dmel(piece)
            modality = self.MODALITY[piece.kind]
            media.setdefault(modality, []).append(item)
            tokens.extend([self.placeholder[modality]] * self.towers[modality].item_tokens(item))
        if media:
            clash = sorted({p for p in pieces if not isinstance(p, MediaPart) and p in reserved})
            if clash:
                raise ValueError(f"text tokens {clash} are the {[reserved[t] for t in clash]} placeholder id(s); with media "
                                 "chunks they are written by the server (one per media token), not sent as text.")
        return tokens, media or None


def decoder(backend: Any, limits: Any) -> ChunkMedia:
    """The :class:`ChunkMedia` of ``backend``'s served model (built once per backend and limits;
    a family without towers gives a decoder that refuses every media chunk, naming the family)."""
    cached = getattr(backend, "_chunk_media", None)
    if cached is not None and cached.limits is limits:
        return cached
    try:
        family = registry.family_for_hf_config(dict(backend.hf_config)).name
        towers = registry.get_towers(family)
    except registry.UnknownModelError:
        family, towers = str(backend.hf_config.get("model_type")), []
    backend._chunk_media = ChunkMedia(backend.hf_config, towers, limits, family)
    return backend._chunk_media


def hf_inputs(hf_config: Mapping[str, Any], media: Mapping[str, Sequence[Any]] | None, device: Any) -> dict:
    """The transformers model's keywords for one prompt's media (``TowerSpec.hf_input``: Inkling's
    ``pixel_values`` / ``audio_input_ids``); ``{}`` for a text prompt."""
    if not media:
        return {}
    from ferrule.media import hf_media_inputs, towers_for_config

    return hf_media_inputs(towers_for_config(hf_config), media, 1, device, hf_config)


def attention_leaves(hf_config: Mapping[str, Any]) -> list[str]:
    """The Megatron attention linears of the family serving ``hf_config`` (the ``self_attention.linear_*``
    rows of its mapping table): what Tinker's ``lora_config.train_attn`` adapts. ``linear_qkv`` +
    ``linear_proj`` for most families; Inkling (whose multimodal checkpoints carry image / audio
    towers) has ``linear_q``, ``linear_k``, ``linear_v``, ``linear_r``, ``linear_proj``."""
    default = ["linear_proj", "linear_qkv"]
    try:
        table = registry.get_converter(registry.family_for_hf_config(dict(hf_config)).name).resolved_mapping()
    except registry.UnknownModelError:
        return default
    return sorted({m.mcore.split(".")[-2] for m in table.mappings
                   if "self_attention.linear_" in getattr(m, "mcore", "")}) or default
