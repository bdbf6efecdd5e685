"""Inkling-2's vision tower (a ViT with axial 2-D RoPE and a patch merger), as a plain PyTorch module.

It computes what transformers' ``Inkling2VisionModel`` computes
(``transformers/models/inkling2/modeling_inkling2.py``, transformers 5.24) and holds its parameters
under the names of the *released* checkpoint layout (``model.visual.*``, what
``Inkling2ForConditionalGeneration.save_pretrained`` writes; transformers' ``conversion_mapping``
entry ``inkling2`` renames them on load), so the family's mapping table is a prefix rename
(``towers.vision.`` <-> ``model.visual.``):

==================================================  ============================================
``backbone.embeddings.patch_embedding.weight``      ``[hidden, P*P*C]`` (``Linear``, no bias)
``backbone.embeddings.position_embedding``          ``[G*G, hidden]`` learned grid, ``G = posemb_grid_size``
``backbone.embeddings.class_embedding``             ``[hidden]``; ``cls_position_embedding`` ``[hidden]``
``backbone.ln_pre.{weight,bias}``                   ``LayerNorm`` before the layers
``backbone.layers.N.ln_1`` / ``ln_2``               ``LayerNorm`` before attention / MLP
``backbone.layers.N.self_attn.{q,k,v,out}_proj``    ``Linear`` ``[hidden, hidden]`` with bias
``backbone.layers.N.mlp.c_fc`` / ``c_proj``         ``Linear`` ``hidden -> intermediate -> hidden``, bias
``backbone.layers.N.ls_1.gamma`` / ``ls_2.gamma``   layer scales ``[hidden]``
``proj_in`` / ``proj_out``                          merger ``Linear`` ``m*m*hidden -> projection_hidden_dim -> text_hidden``
==================================================  ============================================

**Input item** (one image, :func:`image_to_pixel_values`): ``[R, C_, S, S, 3]`` float32, the image
cut into an ``R x C_`` grid of language-model tokens, each an ``S x S`` pixel square, ``S = P * m``
(``P = patch_size``, ``m = spatial_merge_size``), values in ``[-1, 1]``. The tower's item has two
token dims (``TowerSpec.item_token_dims = 2``): it fills ``R * C_`` image placeholders in raster order.

**Forward**, per image (each image is its own attention sequence, as transformers' ``cu_seqlens``):

1. each token square is cut into ``m x m`` native ``P x P`` patches (token-major, then row-major
   inside the token: "spatial-merge-block order"), flattened ``(py, px, c)`` and projected;
2. the learned ``G x G`` position grid is resampled to the image's ``Rm x C_m`` patch grid
   (``F.interpolate``, bilinear, ``align_corners=False``: what transformers'
   ``get_vision_interpolation_indices_and_weights`` reproduces) and added;
3. a class token (``class_embedding + cls_position_embedding``) is put in front; ``ln_pre``;
4. pre-norm layers: ``x += ls_1 * attn(ln_1(x))``, ``x += ls_2 * mlp(ln_2(x))``; attention is
   bidirectional, scale ``head_dim ** -0.5``, with the axial RoPE of :func:`axial_rope`;
5. the class token is dropped, each token's ``m*m`` patch states are concatenated and the merger
   (``proj_out(act(proj_in(.)))``) maps them to ``text_hidden_size``.

Frozen by default (``ferrule.plugins.inkling2.plugin``), replicated on every TP rank like every
tower (:mod:`ferrule.megatron.towers`).
"""

from __future__ import annotations

import io
import math
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

__all__ = ["Inkling2VisionTower", "axial_rope", "build_vision_tower", "image_to_pixel_values", "hf_vision_inputs",
           "preprocess_image", "vision_config"]

#: ``hidden_act`` values of the vision config this tower implements (transformers ``ACT2FN`` names).
ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu, "relu": F.relu}


def vision_config(hf_config: Mapping[str, Any]):
    """The ``vision_config`` of an ``inkling2`` HF config dict, with transformers' defaults filled in
    (``Inkling2Config``; ``intermediate_size = hidden_size * mlp_ratio``, ``rope_parameters`` standardised)."""
    from transformers import Inkling2Config

    return Inkling2Config(**{k: v for k, v in hf_config.items() if k != "model_type"}).vision_config


def axial_rope(rows: int, cols: int, head_dim: int, theta: float, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[1 + rows*cols, head_dim]`` float32 of one image's sequence (class token first).

    Axial 2-D RoPE (HF ``Inkling2VisionRotaryEmbedding``): ``head_dim / 4`` frequencies
    ``theta ** (-4 j / head_dim)``, shared by both axes; the angle vector is ``[w * f, h * f]``
    with each entry repeated for one interleaved channel pair (so the whole head rotates, pair
    ``(2i, 2i+1)``). Patches sit at 1-based ``(h, w)`` of the native patch grid (spatial-merge-
    block order, as the patch embeddings); the class token at ``(0, 0)``.

    Args:
        rows, cols: the image's native patch grid (``R * merge``, ``C_ * merge``).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)))
    h = torch.arange(rows).reshape(rows // merge, merge, 1, 1).expand(-1, -1, cols // merge, merge)
    w = torch.arange(cols).reshape(1, 1, cols // merge, merge).expand(rows // merge, merge, -1, -1)
    hw = torch.stack([h.transpose(1, 2).flatten(), w.transpose(1, 2).flatten()], -1) + 1
    hw = torch.cat([torch.zeros(1, 2, dtype=hw.dtype), hw])  # [1 + n, 2]
    freqs = hw[..., None].float() * inv_freq  # [1 + n, 2, head_dim / 4]
    angles = torch.cat([freqs[:, 1], freqs[:, 0]], -1).repeat_interleave(2, -1)
    return angles.cos(), angles.sin()


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1, x2, x3, ...)`` -> ``(-x1, x0, -x3, x2, ...)`` over the last dim."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)


class _LayerScale(torch.nn.Module):
    """Per-channel scale ``gamma`` ``[hidden]`` (released ``ls_1.gamma``; HF ``lambda_1``)."""

    def __init__(self, hidden: int, init: float):
        super().__init__()
        self.gamma = torch.nn.Parameter(torch.full((hidden,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gamma * x


class _Attention(torch.nn.Module):
    """Bidirectional multi-head attention over one image, RoPE on q/k (HF ``Inkling2VisionAttention``)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"Inkling-2 vision tower: hidden_size {hidden} is not divisible by "
                             f"num_attention_heads {heads}.")
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (torch.nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.heads, self.head_dim).transpose(0, 1) for p in (self.q_proj, self.k_proj,
                                                                                      self.v_proj))
        q = (q.float() * cos + _rotate_pairs(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_pairs(k.float()) * sin).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)  # [heads, n, head_dim]
        return self.out_proj(out.transpose(0, 1).reshape(n, -1))


class _MLP(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, act):
        super().__init__()
        self.c_fc, self.c_proj, self.act = torch.nn.Linear(hidden, intermediate), torch.nn.Linear(intermediate, hidden), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class _EncoderLayer(torch.nn.Module):
    """Pre-norm ViT layer with layer scales (HF ``Inkling2VisionEncoderLayer``)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float, scale_init: float, act):
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(hidden, eps=eps), torch.nn.LayerNorm(hidden, eps=eps)
        self.self_attn, self.mlp = _Attention(hidden, heads), _MLP(hidden, intermediate, act)
        self.ls_1, self.ls_2 = _LayerScale(hidden, scale_init), _LayerScale(hidden, scale_init)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.ls_1(self.self_attn(self.ln_1(x), cos, sin))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class _Embeddings(torch.nn.Module):
    def __init__(self, hidden: int, patch: int, channels: int, grid: int):
        super().__init__()
        self.patch_embedding = torch.nn.Linear(channels * patch * patch, hidden, bias=False)
        self.position_embedding = torch.nn.Parameter(torch.zeros(grid * grid, hidden))
        self.class_embedding = torch.nn.Parameter(torch.zeros(hidden))
        self.cls_position_embedding = torch.nn.Parameter(torch.zeros(hidden))


class _Backbone(torch.nn.Module):
    def __init__(self, embeddings: _Embeddings, ln_pre: torch.nn.LayerNorm, layers: list[_EncoderLayer]):
        super().__init__()
        self.embeddings, self.ln_pre, self.layers = embeddings, ln_pre, torch.nn.ModuleList(layers)


class Inkling2VisionTower(torch.nn.Module):
    """HF ``Inkling2VisionModel`` + its merger: images -> one embedding per image token.

    ``forward(items)``: ``items`` a list of images, each ``[R, C_, S, S, num_channels]`` (float,
    ``S = patch_size * spatial_merge_size``, values in ``[-1, 1]``); returns ``[sum R * C_,
    text_hidden_size]`` in the parameters' dtype, images in order, tokens of each in raster order
    (the order transformers' ``masked_scatter`` fills the placeholders in).

    Args:
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_channels,
        patch_size, layer_norm_eps, layer_scale_init_value, spatial_merge_size, posemb_grid_size,
        projection_hidden_dim, projector_bias, text_hidden_size, hidden_act: the
        ``Inkling2VisionConfig`` fields; rope_theta: ``rope_parameters["rope_theta"]``.

    Raises:
        ValueError: an unknown ``hidden_act``; ``forward`` got an item of the wrong shape.
    """

    def __init__(self, *, hidden_size: int, intermediate_size: int, num_hidden_layers: int, num_attention_heads: int,
                 num_channels: int, patch_size: int, layer_norm_eps: float, layer_scale_init_value: float,
                 spatial_merge_size: int, posemb_grid_size: int, projection_hidden_dim: int, projector_bias: bool,
                 text_hidden_size: int, hidden_act: str, rope_theta: float):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"Inkling-2 vision tower: hidden_act={hidden_act!r} is not implemented; expected one of "
                             f"{sorted(ACTIVATIONS)}.")
        act = ACTIVATIONS[hidden_act]
        layers = [_EncoderLayer(hidden_size, num_attention_heads, intermediate_size, layer_norm_eps,
                                layer_scale_init_value, act) for _ in range(num_hidden_layers)]
        self.backbone = _Backbone(_Embeddings(hidden_size, patch_size, num_channels, posemb_grid_size),
                                  torch.nn.LayerNorm(hidden_size, eps=layer_norm_eps), layers)
        m = spatial_merge_size
        self.proj_in = torch.nn.Linear(m * m * hidden_size, projection_hidden_dim, bias=projector_bias)
        self.proj_out = torch.nn.Linear(projection_hidden_dim, text_hidden_size, bias=projector_bias)
        self.act = act
        self.patch, self.merge, self.grid, self.channels = patch_size, m, posemb_grid_size, num_channels
        self.head_dim, self.theta = hidden_size // num_attention_heads, float(rope_theta)

    def _check(self, k: int, item: torch.Tensor) -> None:
        s = self.patch * self.merge
        if item.dim() != 5 or tuple(item.shape[2:]) != (s, s, self.channels) or not item.dtype.is_floating_point:
            raise ValueError(f"Inkling-2 vision tower: image {k} has shape {tuple(item.shape)} {item.dtype}; expected "
                             f"float [rows, cols, {s}, {s}, {self.channels}] (ferrule.plugins.inkling2.towers."
                             f"image_to_pixel_values for this model's patch_size * spatial_merge_size = {s}).")

    def _positions(self, rows: int, cols: int) -> torch.Tensor:
        """Learned grid resampled to a ``rows x cols`` patch grid, ``[rows * cols, hidden]`` in block order."""
        table = self.backbone.embeddings.position_embedding
        g = table.reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
        pos = F.interpolate(g.float(), size=(rows, cols), mode="bilinear", align_corners=False)[0]  # [hidden, r, c]
        m = self.merge
        pos = pos.reshape(-1, rows // m, m, cols // m, m).permute(1, 3, 2, 4, 0)  # [R, C_, m, m, hidden]
        return pos.reshape(rows * cols, -1).to(table.dtype)

    def _encode(self, item: torch.Tensor) -> torch.Tensor:
        emb = self.backbone.embeddings
        n_r, n_c = item.shape[:2]
        m, p = self.merge, self.patch
        x = item.to(emb.patch_embedding.weight.dtype).reshape(n_r, n_c, m, p, m, p, self.channels)
        x = x.permute(0, 1, 2, 4, 3, 5, 6).reshape(n_r * n_c * m * m, p * p * self.channels)
        x = emb.patch_embedding(x) + self._positions(n_r * m, n_c * m)
        x = torch.cat([(emb.class_embedding + emb.cls_position_embedding)[None], x])
        x = self.backbone.ln_pre(x)
        cos, sin = axial_rope(n_r * m, n_c * m, self.head_dim, self.theta, m)
        cos, sin = cos.to(x.device)[None], sin.to(x.device)[None]  # [1, 1 + n, head_dim]: broadcast over heads
        for layer in self.backbone.layers:
            x = layer(x, cos, sin)
        x = x[1:].reshape(n_r * n_c, -1)  # drop the class token; each token's m*m patch states side by side
        return self.proj_out(self.act(self.proj_in(x)))

    def forward(self, items: Sequence[torch.Tensor]) -> torch.Tensor:
        if isinstance(items, torch.Tensor):
            items = [items]
        for k, item in enumerate(items):
            self._check(k, item)
        return torch.cat([self._encode(item) for item in items])


def build_vision_tower(hf_config: Mapping[str, Any]) -> Inkling2VisionTower:
    """``TowerSpec.build`` of the vision tower, from an ``inkling2`` HF config dict."""
    v = vision_config(hf_config)
    rope = v.rope_parameters or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"Inkling-2 vision tower: rope_parameters.rope_type={rope.get('rope_type')!r}; only "
                         f"'axial' exists in transformers' Inkling2VisionRotaryEmbedding.")
    return Inkling2VisionTower(
        hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_hidden_layers=v.num_hidden_layers,
        num_attention_heads=v.num_attention_heads, num_channels=v.num_channels, patch_size=v.patch_size,
        layer_norm_eps=v.layer_norm_eps, layer_scale_init_value=v.layer_scale_init_value,
        spatial_merge_size=v.spatial_merge_size, posemb_grid_size=v.posemb_grid_size,
        projection_hidden_dim=v.projection_hidden_dim, projector_bias=v.projector_bias,
        text_hidden_size=v.text_hidden_size, hidden_act=v.hidden_act, rope_theta=rope["rope_theta"])


# ---------------------------------------------------------------------------------------
# Media preprocessing and the transformers model's inputs
# ---------------------------------------------------------------------------------------

#: ``Inkling2ImageProcessor``'s normalisation (``image_mean`` = ``image_std`` = 0.5 per channel).
IMAGE_MEAN = IMAGE_STD = 0.5


def _open_image(image: Any):
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(image, (bytes, bytearray)):
            image = Image.open(io.BytesIO(image))
        elif not isinstance(image, Image.Image):
            image = Image.open(image)
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"cannot decode the image: {exc}") from exc
    return image


def _rgb(image) -> torch.Tensor:
    """``[3, H, W]`` uint8 RGB; transparency composited on ``Inkling2ImageProcessor.convert_to_rgb``'s
    checkerboard (8-pixel squares of 204 / 153, ``(rgb * a + bg * (255 - a) + 127) // 255``)."""
    import numpy as np

    rgba = image.has_transparency_data
    x = torch.from_numpy(np.asarray(image.convert("RGBA" if rgba else "RGB"), dtype=np.uint8).copy()).permute(2, 0, 1)
    if not rgba:
        return x
    h, w = x.shape[-2:]
    bg = torch.where((torch.arange(h)[:, None] // 8 + torch.arange(w)[None, :] // 8) % 2 == 0, 204, 153)
    x = x.to(torch.int32)
    return ((x[:3] * x[3:4] + bg * (255 - x[3:4]) + 127) // 255).to(torch.uint8)


def image_to_pixel_values(image: Any, token_size: int) -> torch.Tensor:
    """One image -> the tower's item ``[R, C_, S, S, 3]`` float32, ``S = token_size``.

    The steps of transformers' ``Inkling2ImageProcessor._preprocess`` (its ``size`` is ``S x S``;
    40 = 20 * 2 for the released model): RGB (transparency on a checkerboard), padded bottom/right
    to ``R = ceil(H / S)`` x ``C_ = ceil(W / S)`` squares with ``-1.0`` on the 0-255 scale,
    rescaled by 1/255, normalised with mean = std = 0.5, cut into squares in raster order. That
    processor needs torchvision (no CPU wheel for our torch); plugins/inkling2/tests/test_inkling2_vision.py compares
    the two where torchvision is installed.

    Args:
        image: a ``PIL.Image.Image``, or a path / bytes of an image file.

    Raises:
        ValueError: the file cannot be decoded as an image (the message says why).
    """
    x = _rgb(_open_image(image)).float()
    h, w = x.shape[-2:]
    rows, cols = math.ceil(h / token_size), math.ceil(w / token_size)
    x = F.pad(x, (0, cols * token_size - w, 0, rows * token_size - h), value=-1.0)
    x = (x / 255.0 - IMAGE_MEAN) / IMAGE_STD
    return x.reshape(3, rows, token_size, cols, token_size).permute(1, 3, 2, 4, 0).contiguous()


def preprocess_image(source: Any, hf_config: Mapping[str, Any]) -> torch.Tensor:
    """``TowerSpec.preprocess`` of the vision tower: an image (path, bytes or PIL image) -> the tower's item
    for this model's ``vision_config`` (:func:`image_to_pixel_values`). Raises ``ValueError`` (undecodable)."""
    v = vision_config(hf_config)
    return image_to_pixel_values(source, v.patch_size * v.spatial_merge_size)


def hf_vision_inputs(items: Sequence[torch.Tensor], hf_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``TowerSpec.hf_inputs``: images -> ``Inkling2ForConditionalGeneration.forward`` keywords.

    ``pixel_values`` ``[sum R * C_, S, S, 3]`` (the items' token squares, in order) and
    ``image_grid_thw`` ``[n_images, 3]`` int64 ``(1, R, C_)`` (what ``Inkling2ImageProcessor`` returns).
    """
    del hf_config
    return {"pixel_values": torch.cat([t.reshape(-1, *t.shape[2:]) for t in items]),
            "image_grid_thw": torch.tensor([[1, int(t.shape[0]), int(t.shape[1])] for t in items], dtype=torch.long)}
