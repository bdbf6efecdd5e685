"""Media beside tokens: the format every layer shares, its checks, and placeholder expansion.

A prompt with media is token ids plus ``media = {modality: [item, ...]}`` (modalities of
:data:`ferrule.contract.specs.TOWER_MODALITIES`), items in order of appearance. An item is one media part
already preprocessed for the family's tower (e.g. Inkling: an image as ``pixel_values``
``[n_patches, 2, P, P, 3]``, an audio clip as dMel ids ``[n_frames, 80]``); its dim 0 is the number
of placeholder tokens it fills, or, for a tower with ``TowerSpec.item_token_dims = k > 1``, the
product of its first ``k`` dims (Inkling-2: an image as a grid of tokens ``[rows, cols, S, S, 3]``).
Chat templates write **one** placeholder per part;
:func:`expand_placeholders` repeats it to the item's row count, after which the tokens hold
exactly as many placeholders as the media have rows (:func:`check_media`). The train engine
(``Datum.media``), the embedded rollout engine (``GenerateRequest.media``) and the RL loop use
this format. Importing this module imports torch only.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from ferrule.contract import registry
from ferrule.contract.specs import resolve_ref

__all__ = ["MediaError", "check_media", "check_requests", "expand_placeholders", "hf_media_inputs",
           "item_tokens", "media_token_counts", "message_media", "towers_for_config", "MEDIA_PART_TYPES"]


class MediaError(ValueError):
    """A datum's / request's media do not fit the model (no tower for it, counts or shapes wrong)."""


def item_tokens(specs: Mapping[str, Any] | None, modality: str, item: Any) -> int:
    """Placeholder tokens one media item fills: ``TowerSpec.item_tokens`` of the modality's tower in
    ``specs`` (``{modality: TowerSpec}``), else its dim 0 (0 for a non-tensor or a 0-d tensor)."""
    spec = (specs or {}).get(modality)
    if spec is not None:
        return spec.item_tokens(item)
    shape = tuple(getattr(item, "shape", ()))
    return int(shape[0]) if shape else 0


def media_token_counts(media: Mapping[str, Sequence[torch.Tensor]] | None,
                       specs: Mapping[str, Any] | None = None) -> dict[str, int]:
    """``{modality: total placeholder tokens}`` of one prompt's media (:func:`item_tokens` summed over items;
    ``specs`` = ``{modality: TowerSpec}``, without it dim 0 counts)."""
    return {m: sum(item_tokens(specs, m, t) for t in items) for m, items in (media or {}).items()}


def expand_placeholders(tokens: Sequence[int], media: Mapping[str, Sequence[torch.Tensor]] | None,
                        placeholder_ids: Mapping[str, int], where: str = "prompt",
                        specs: Mapping[str, Any] | None = None) -> list[int]:
    """Repeat the k-th placeholder of each modality to the k-th item's token count (:func:`item_tokens`).

    Args:
        tokens: rendered token ids holding one placeholder per media part.
        media: ``{modality: [item, ...]}`` (see module docstring).
        placeholder_ids: ``{modality: token id}`` (``TowerSpec.placeholder_id``).
        where: names the prompt in errors (e.g. ``"datum 3"``).
        specs: ``{modality: TowerSpec}``, for towers whose items count tokens over several dims
            (``item_token_dims``); without it an item's dim 0 counts.

    Returns:
        The expanded token list.

    Raises:
        MediaError: a modality without a placeholder id, or a count of single placeholders that
            differs from the number of media parts (e.g. more media parts than placeholders).
    """
    media = media or {}
    unknown = sorted(set(media) - set(placeholder_ids))
    if unknown:
        raise MediaError(f"{where}: media of modality {unknown} but this model has towers for "
                         f"{sorted(placeholder_ids) or 'no modality'}.")
    by_id = {pid: m for m, pid in placeholder_ids.items()}
    found = {m: sum(1 for t in tokens if t == pid) for m, pid in placeholder_ids.items()}
    for m, pid in placeholder_ids.items():
        parts = len(media.get(m, ()))
        if found[m] != parts:
            raise MediaError(f"{where}: {parts} {m} part(s) but {found[m]} {m} placeholder(s) (id {pid}) in the "
                             f"rendered prompt; every {m} part needs exactly one placeholder in the chat messages.")
    out: list[int] = []
    seen = dict.fromkeys(placeholder_ids, 0)
    for t in tokens:
        m = by_id.get(t)
        if m is None:
            out.append(t)
            continue
        out.extend([t] * item_tokens(specs, m, media[m][seen[m]]))
        seen[m] += 1
    return out


def check_media(tokens: torch.Tensor, media: Mapping[str, Sequence[torch.Tensor]] | None,
                towers: Mapping[str, tuple[Any, Any, int]], where: str, family: str) -> dict[str, list[torch.Tensor]]:
    """Validate one prompt's media against its (expanded) tokens; return ``{modality: [CPU tensors]}``.

    Args:
        tokens: ``[N]`` token ids.
        towers: ``{modality: (TowerSpec, module or None, placeholder id)}`` of the model.
        where / family: name the prompt and the family in errors.

    Raises:
        MediaError (naming ``where``): a modality without a tower in ``family``; an item that is
            not a tensor with at least one row; a placeholder count in ``tokens`` that differs
            from the media rows (including placeholders without media).
    """
    out: dict[str, list[torch.Tensor]] = {}
    for modality, items in (media or {}).items():
        if modality not in towers:
            have = sorted(towers) or "none"
            raise MediaError(f"{where}: has {modality} media but family {family!r} has no {modality} tower "
                             f"(towers: {have}); remove the {modality} parts or use a family with that tower.")
        if isinstance(items, torch.Tensor) or not isinstance(items, Sequence):
            raise MediaError(f"{where}: media[{modality!r}] must be a list of tensors (one per media part), "
                             f"got {type(items).__name__}.")
        spec = towers[modality][0]
        dims = getattr(spec, "item_token_dims", 1)
        for k, t in enumerate(items):
            if not isinstance(t, torch.Tensor) or item_tokens({modality: spec}, modality, t) == 0:
                lead = "dim 0 counts" if dims == 1 else f"first {dims} dims count"
                raise MediaError(f"{where}: media[{modality!r}][{k}] must be a tensor whose {lead} its "
                                 f"placeholder tokens (>= 1), got {getattr(t, 'shape', type(t).__name__)}.")
        out[modality] = [t.detach().cpu() for t in items]
    tokens = torch.as_tensor(tokens)
    for modality, (spec, _, pid) in towers.items():
        n_tokens = int((tokens == pid).sum())
        n_rows = sum(item_tokens({modality: spec}, modality, t) for t in out.get(modality, []))
        if n_tokens != n_rows:
            raise MediaError(f"{where}: {n_tokens} {modality} placeholder tokens (id {pid}) but {n_rows} {modality} "
                             f"rows in {len(out.get(modality, []))} media part(s); each part must be expanded to as "
                             f"many placeholders as it has rows (ferrule.media.expand_placeholders).")
    return out


#: chat content-part types that carry media, by modality (the TMLv0 template renders the same types)
MEDIA_PART_TYPES = {"vision": ("image", "image_url"), "audio": ("audio", "input_audio")}


def _part_source(part: Mapping[str, Any], base_dir: Any) -> Any:
    """The media payload of a content part: a path (relative to ``base_dir``), bytes, or an object.

    ``{"type": "image", "image": PATH}``; OpenAI style ``{"type": "image_url", "image_url": {"url":
    "data:image/png;base64,..." or PATH}}`` and ``{"type": "input_audio", "input_audio": {"data":
    BASE64, "format": "wav"}}`` (base64 payloads are decoded to bytes).
    """
    import base64
    import binascii
    import os

    value = part.get(part["type"])
    if isinstance(value, Mapping):
        if "data" in value:  # OpenAI input_audio: base64 without a data: prefix
            value = "data:;base64," + str(value["data"])
        else:
            value = value.get("url", value.get("path"))
    if isinstance(value, str) and value.startswith("data:"):
        try:
            return base64.b64decode(value.partition(",")[2], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"the base64 payload does not decode: {exc}") from exc
    if isinstance(value, str) and base_dir is not None and not os.path.isabs(value):
        value = os.path.join(str(base_dir), value)
    return value


def message_media(messages: Sequence[Mapping[str, Any]], towers: Sequence[Any], hf_config: Mapping[str, Any],
                  where: str, *, base_dir: Any = None) -> dict[str, list[torch.Tensor]]:
    """Preprocess the media parts of chat ``messages`` in order: ``{modality: [item, ...]}``.

    A part ``{"type": "image", "image": SOURCE}`` (or ``audio``) goes through the tower's
    ``TowerSpec.preprocess``; string sources are paths, relative to ``base_dir`` if given.

    Raises:
        MediaError (naming ``where`` and the part): a media part for a modality the family has no
            tower (or no ``preprocess``) for, or a part its ``preprocess`` rejects (corrupt file,
            wrong sampling rate, ...).
    """
    by_type = {t: m for m, types in MEDIA_PART_TYPES.items() for t in types}
    specs = {s.modality: s for s in towers}
    out: dict[str, list[torch.Tensor]] = {}
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, str) or content is None:
            continue
        for j, part in enumerate(content):
            modality = by_type.get(part.get("type")) if isinstance(part, Mapping) else None
            if modality is None:
                continue
            at = f"{where}: messages[{i}].content[{j}] ({part['type']})"
            spec = specs.get(modality)
            if spec is None or not spec.preprocess:
                raise MediaError(f"{at}: this model has no {modality} tower"
                                 f"{'' if spec is None else ' preprocessing'} (towers: {sorted(specs) or 'none'}); "
                                 f"remove the part or use a family with a {modality} tower.")
            try:
                item = resolve_ref(spec.preprocess)(_part_source(part, base_dir), dict(hf_config))
            except (ValueError, OSError) as exc:
                raise MediaError(f"{at}: {exc}") from exc
            out.setdefault(modality, []).append(item)
    return out


# ---------------------------------------------------------------------------------------
# Embedded rollout (a transformers model fed the media at prefill)
# ---------------------------------------------------------------------------------------


def towers_for_config(hf_config: Mapping[str, Any]) -> dict[str, tuple[Any, None, int]]:
    """``{modality: (TowerSpec, None, placeholder id)}`` of the family claiming ``hf_config`` (empty if
    none claims it or it has no towers)."""
    try:
        specs = registry.get_towers(registry.family_for_hf_config(dict(hf_config)).name)
    except registry.UnknownModelError:
        specs = []
    return {s.modality: (s, None, s.placeholder_id(hf_config)) for s in specs}


def check_requests(reqs: Sequence[Any], towers: Mapping[str, tuple[Any, Any, int]],
                   family: str) -> dict[int, dict[str, list[torch.Tensor]]]:
    """``{request index: media}`` of the ``GenerateRequest``s that carry media, each checked with
    :func:`check_media` (a request without media is checked too: it must hold no placeholder).

    Raises:
        MediaError: naming the request (index and ``request_id``).
    """
    out = {}
    for i, r in enumerate(reqs):
        if r.media or towers:
            checked = check_media(torch.tensor(r.prompt_token_ids), r.media, towers,
                                  f"request {i} (id {r.request_id!r})", family)
            if checked:
                out[i] = checked
    return out


def hf_media_inputs(towers: Mapping[str, tuple[Any, Any, int]], media: Mapping[str, Sequence[torch.Tensor]],
                    copies: int, device: Any, hf_config: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The transformers model's forward keywords for ``copies`` rows sharing ``media``, items in row order
    (as its ``masked_scatter`` consumes them): ``TowerSpec.hf_inputs(items, hf_config)`` where the tower
    declares it, else the items concatenated on dim 0 under ``TowerSpec.hf_input``.

    Raises:
        ValueError: a tower declares neither.
    """
    out = {}
    for modality, items in media.items():
        spec = towers[modality][0]
        if getattr(spec, "hf_inputs", ""):
            extra = resolve_ref(spec.hf_inputs)(list(items) * copies, dict(hf_config or {}))
            out.update({k: v.to(device) for k, v in extra.items()})
            continue
        if not spec.hf_input:
            raise ValueError(f"tower {spec.family}/{spec.name} declares no hf_input; the embedded engine cannot "
                             f"pass {modality} media to the transformers model.")
        out[spec.hf_input] = torch.cat(list(items) * copies, 0).to(device)
    return out
