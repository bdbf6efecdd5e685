"""Inkling's vision and audio towers (plain PyTorch modules, replicated on every TP rank).

Both compute exactly what transformers' ``InklingForConditionalGeneration`` computes
(``transformers/models/inkling/modeling_inkling.py``), with the parameter names of its
*released* checkpoint layout under ``model.visual.`` / ``model.audio.`` (``layers.linear_<i>`` is
``layers.<i>.linear`` here, so that update groups can match it) and the mapping table is a rename:

- :class:`InklingVisionTower` = ``InklingVisionModel`` (the "HMLP" patch encoder, no ViT):
  ``pixel_values`` ``[n_patches, T, P, P, C]`` (what ``InklingImageProcessor`` returns, T = 2
  copies of each patch) -> ``[n_patches, text_hidden]``, one embedding per patch. Layer ``i``
  folds time/space into channels by the factors of transformers' ``plan_out_scales`` (the layer
  plan is taken from transformers itself, not re-derived), projects (``Linear``, no bias), then
  RMSNorm + GELU except on the last layer; a final RMSNorm follows.
- :class:`InklingAudioTower` = ``InklingAudioModel`` (dMel): ``audio_input_ids`` ``[n_frames,
  n_mel_bins]`` int (each mel bin quantised to ``[0, mel_vocab_size)`` by ``InklingProcessor``)
  -> ``[n_frames, text_hidden]``: one embedding table of ``n_mel_bins * mel_vocab_size`` rows,
  row ``bin * mel_vocab_size + level``, summed over the bins, then RMSNorm.

The towers are frozen by default (:data:`TOWERS` in :mod:`ferrule.plugins.inkling.plugin`): miles
trains Inkling with frozen towers (reference/miles_study.md §1.6). Their parameters travel on
every weight sync in their own update groups (``inkling.UPDATE_GROUPS``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ferrule.megatron.shared_layers import InklingRMSNorm

__all__ = ["InklingVisionTower", "InklingAudioTower", "build_vision_tower", "build_audio_tower"]

#: eps of every tower RMSNorm (transformers builds them with the default ``eps=1e-6``; the tower
#: configs' ``rms_norm_eps`` is not read by the reference).
TOWER_NORM_EPS = 1e-6


def _sub_config(hf_config: Mapping[str, Any], key: str):
    """The ``vision_config`` / ``audio_config`` of an ``inkling_mm_model`` config dict, as transformers fills it."""
    from transformers import InklingConfig

    return getattr(InklingConfig(**{k: v for k, v in hf_config.items() if k != "model_type"}), key)


class InklingVisionEncoderLayer(torch.nn.Module):
    """One HMLP stage (HF ``InklingVisionEncoderLayer``): fold ``[B, T, H, W, C]`` -> ``[B, T/t, H/hw, W/hw, C*t*hw*hw]``
    (order ``t, hw, hw, C`` inside the new channel), ``linear`` (no bias), then RMSNorm ``norm`` + GELU when
    ``add_norm``. Released names: ``model.visual.layers.linear_<i>.weight`` / ``norm_<i>.weight``."""

    def __init__(self, input_dim: int, output_dim: int, t_fold: int, hw_fold: int, add_norm: bool):
        super().__init__()
        self.linear = torch.nn.Linear(input_dim, output_dim, bias=False)
        if add_norm:
            self.norm = InklingRMSNorm(hidden_size=output_dim, eps=TOWER_NORM_EPS)
        self.t_fold, self.hw_fold, self.add_norm = t_fold, hw_fold, add_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hw_fold > 1 or self.t_fold > 1:
            b, t, h, w, c = x.shape
            t2, h2, w2 = t // self.t_fold, h // self.hw_fold, w // self.hw_fold
            x = x.reshape(b, t2, self.t_fold, h2, self.hw_fold, w2, self.hw_fold, c)
            x = x.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(b, t2, h2, w2, self.t_fold * self.hw_fold ** 2 * c)
        x = self.linear(x)
        if self.add_norm:
            x = torch.nn.functional.gelu(self.norm(x))
        return x


class InklingVisionTower(torch.nn.Module):
    """HF ``InklingVisionModel``: ``pixel_values`` ``[n, T, P, P, C]`` -> patch embeddings ``[n, text_hidden]``.

    Parameters: ``layers.<i>.linear.weight`` ``[out_i, in_i]``, ``layers.<i>.norm.weight``
    (every layer but the last), ``final_norm.weight`` ``[text_hidden]``.

    Args:
        patch_size, temporal_patch_size, num_layers, num_channels, text_hidden_size: the
            ``InklingVisionConfig`` fields (``num_layers`` = ``num_hidden_layers``).

    Raises:
        ValueError: ``forward`` got a tensor that is not ``[n, T, P, P, C]`` for this tower.
    """

    def __init__(self, *, patch_size: int, temporal_patch_size: int, num_layers: int, num_channels: int,
                 text_hidden_size: int):
        super().__init__()
        from transformers.models.inkling.modeling_inkling import plan_out_scales

        scales = plan_out_scales(temporal_patch_size, patch_size, num_layers, num_channels).tolist()
        self.input_shape = (temporal_patch_size, patch_size, patch_size, num_channels)
        layers = []
        for i, (a, b) in enumerate(zip(scales[:-1], scales[1:])):
            t_fold, hw_fold, w_fold = b[0] // a[0], b[1] // a[1], b[2] // a[2]
            last = i == num_layers - 1
            layers.append(InklingVisionEncoderLayer(a[3] * t_fold * hw_fold * w_fold, text_hidden_size if last else b[3],
                                                    t_fold, hw_fold, add_norm=not last))
        self.layers = torch.nn.ModuleList(layers)
        self.final_norm = InklingRMSNorm(hidden_size=text_hidden_size, eps=TOWER_NORM_EPS)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 5 or tuple(pixel_values.shape[1:]) != self.input_shape:
            raise ValueError(f"Inkling vision tower: pixel_values of shape {tuple(pixel_values.shape)}; expected "
                             f"[n_patches, {', '.join(map(str, self.input_shape))}] (InklingImageProcessor output "
                             f"for this model's patch_size).")
        x = pixel_values.to(self.final_norm.weight.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x).reshape(pixel_values.shape[0], -1)


class InklingAudioTower(torch.nn.Module):
    """HF ``InklingAudioModel``: dMel ids ``[n_frames, n_mel_bins]`` -> ``[n_frames, text_hidden]``.

    ``encoder.weight`` ``[n_mel_bins * mel_vocab_size, hidden]`` (released name
    ``model.audio.encoder.weight``); frame embedding = ``sum_b weight[b * mel_vocab_size + id[b]]``,
    then RMSNorm ``final_norm``.

    Raises:
        ValueError: ids of the wrong shape, dtype or range.
    """

    def __init__(self, *, n_mel_bins: int, mel_vocab_size: int, text_hidden_size: int):
        super().__init__()
        self.encoder = torch.nn.Embedding(n_mel_bins * mel_vocab_size, text_hidden_size)
        self.register_buffer("offsets", torch.arange(n_mel_bins) * mel_vocab_size, persistent=False)
        self.n_mel_bins, self.mel_vocab_size = n_mel_bins, mel_vocab_size
        self.final_norm = InklingRMSNorm(hidden_size=text_hidden_size, eps=TOWER_NORM_EPS)

    def forward(self, audio_input_ids: torch.Tensor) -> torch.Tensor:
        ids = audio_input_ids
        if ids.dim() != 2 or ids.shape[1] != self.n_mel_bins or ids.dtype.is_floating_point:
            raise ValueError(f"Inkling audio tower: audio_input_ids {tuple(ids.shape)} {ids.dtype}; expected integer "
                             f"dMel ids [n_frames, {self.n_mel_bins}] (InklingProcessor's audio_input_ids).")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.mel_vocab_size):
            raise ValueError(f"Inkling audio tower: dMel ids outside [0, {self.mel_vocab_size}).")
        emb = self.encoder(ids.long() + self.offsets.to(ids.device)).sum(dim=-2)
        return self.final_norm(emb)


def build_vision_tower(hf_config: Mapping[str, Any]) -> InklingVisionTower:
    """``TowerSpec.build`` of the vision tower, from an ``inkling_mm_model`` HF config dict."""
    v = _sub_config(hf_config, "vision_config")
    return InklingVisionTower(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                              num_layers=v.num_hidden_layers, num_channels=v.num_channels,
                              text_hidden_size=v.text_hidden_size)


def build_audio_tower(hf_config: Mapping[str, Any]) -> InklingAudioTower:
    """``TowerSpec.build`` of the audio tower, from an ``inkling_mm_model`` HF config dict."""
    a = _sub_config(hf_config, "audio_config")
    return InklingAudioTower(n_mel_bins=a.n_mel_bins, mel_vocab_size=a.mel_vocab_size,
                             text_hidden_size=a.text_hidden_size)


# ---------------------------------------------------------------------------------------
# Media preprocessing (what the towers take)
# ---------------------------------------------------------------------------------------

#: OpenAI CLIP mean / std (``transformers.utils.constants.OPENAI_CLIP_MEAN`` / ``_STD``), used by
#: ``InklingImageProcessor``.
def _clip_stats():
    from transformers.utils.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    return OPENAI_CLIP_MEAN, OPENAI_CLIP_STD


def image_to_pixel_values(image: Any, patch_size: int, temporal_patch_size: int = 2) -> torch.Tensor:
    """One image -> ``pixel_values`` ``[n_patches, temporal_patch_size, P, P, 3]`` float32.

    The steps of ``transformers``' ``InklingImageProcessor._preprocess`` with its defaults
    (``rescale_image_frac=None``: no resize): RGB, patches in row-major order over
    ``ceil(H/P)`` rows and ``floor(W/P) + 1`` columns (its ``divide_to_patches``), each padded
    bottom/right to ``P x P`` with the value ``-1.0`` on the 0-255 scale, rescaled by 1/255 and
    normalised with the CLIP mean/std, repeated ``temporal_patch_size`` times. That processor
    needs torchvision, which has no CPU wheel for our torch; plugins/inkling/tests/test_inkling_towers.py
    compares this function with it where torchvision is installed.

    Args:
        image: a ``PIL.Image.Image``, or a path / bytes of an image file.

    Raises:
        ValueError: the file cannot be decoded as an image (the message says why).
    """
    import io

    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(image, (bytes, bytearray)):
            image = Image.open(io.BytesIO(image))
        elif not isinstance(image, Image.Image):
            image = Image.open(image)
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"cannot decode the image: {exc}") from exc
    x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1).float()
    h, w = x.shape[-2:]
    p = patch_size
    patches = []
    for i in range((h + p - 1) // p):
        for j in range(w // p + 1):
            tile = x[:, i * p:(i + 1) * p, j * p:(j + 1) * p]
            patches.append(torch.nn.functional.pad(tile, (0, p - tile.shape[2], 0, p - tile.shape[1]), value=-1.0))
    mean, std = _clip_stats()
    out = (torch.stack(patches) / 255.0 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    return out[..., None].repeat(1, 1, 1, 1, temporal_patch_size).permute(0, 4, 2, 3, 1).contiguous()


def audio_to_dmel_ids(waveform: Any, sampling_rate: int, *, feature_extractor: Any = None,
                      dmel_min: float = -7.0, dmel_max: float = 2.0, levels: int = 16) -> torch.Tensor:
    """A mono clip -> dMel ids ``[n_frames, n_mel_bins]`` int32, through transformers' own code.

    ``InklingFeatureExtractor`` (log10 mel, 16 kHz, one frame per 50 ms) and ``InklingProcessor``'s
    dMel quantisation (``_extract_dmel_bins``: clamp to ``[dmel_min, dmel_max]``, nearest of
    ``levels`` bin centres). ``n_frames = ceil(samples / 800)``.

    Raises:
        ValueError: ``sampling_rate`` differs from the extractor's (16 kHz); the clip is empty or
            not 1-D / 2-D.
    """
    from transformers import InklingFeatureExtractor, InklingProcessor

    fe = feature_extractor or InklingFeatureExtractor()
    feats = fe(waveform, sampling_rate=sampling_rate, return_tensors="pt")
    proc = _DmelQuantizer(dmel_min, dmel_max, levels)
    ids = InklingProcessor._extract_dmel_bins(proc, feats["input_features"])
    return ids[0][feats["input_features_mask"][0].bool()]


class _DmelQuantizer:
    """The attributes ``InklingProcessor._extract_dmel_bins`` reads, set as its ``__init__`` sets them
    (the processor itself also needs a tokenizer, which the quantisation does not use)."""

    def __init__(self, dmel_min: float, dmel_max: float, levels: int):
        self.dmel_min_value, self.dmel_max_value = dmel_min, dmel_max
        self.bin_centers = torch.linspace(dmel_min, dmel_max, levels, dtype=torch.float64).to(torch.float32)


def preprocess_image(source: Any, hf_config: Mapping[str, Any]) -> torch.Tensor:
    """``TowerSpec.preprocess`` of the vision tower: an image (path, bytes or PIL image) -> ``pixel_values``
    for this model's ``vision_config`` (:func:`image_to_pixel_values`). Raises ``ValueError`` (undecodable)."""
    v = _sub_config(hf_config, "vision_config")
    return image_to_pixel_values(source, v.patch_size, v.temporal_patch_size)


def preprocess_audio(source: Any, hf_config: Mapping[str, Any]) -> torch.Tensor:
    """``TowerSpec.preprocess`` of the audio tower: a WAV file (path or bytes) or ``(waveform, sampling_rate)`` ->
    dMel ids (:func:`audio_to_dmel_ids`; 16 kHz mono expected, stereo is averaged by transformers).

    Raises:
        ValueError: unreadable WAV file, wrong sampling rate, ids beyond ``audio_config.mel_vocab_size``.
    """
    import numpy as np

    if isinstance(source, tuple):
        wave, rate = source
    else:
        import io

        from scipy.io import wavfile

        try:
            rate, wave = wavfile.read(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the WAV file {source}: {exc}") from exc
        if np.issubdtype(wave.dtype, np.integer):
            wave = wave.astype(np.float32) / float(np.iinfo(wave.dtype).max)
    ids = audio_to_dmel_ids(np.asarray(wave, dtype=np.float32), int(rate))
    levels = _sub_config(hf_config, "audio_config").mel_vocab_size
    if ids.numel() and int(ids.max()) >= levels:
        raise ValueError(f"dMel ids reach {int(ids.max())} but audio_config.mel_vocab_size is {levels}.")
    return ids
