"""Inkling-2 vision tower (``ferrule.plugins.inkling2.towers``) vs transformers' ``Inkling2VisionModel``.

Referee: transformers 5.24's ``Inkling2ForConditionalGeneration.model.vision_tower`` (its own
rotary embedding, position-grid interpolation, class tokens, merger), fed what
``Inkling2ImageProcessor`` returns (``pixel_values`` + ``image_grid_thw``, built by
``hf_vision_inputs``). The tower's weights are read from the safetensors that transformers'
``save_pretrained`` writes (the released ``model.visual.*`` layout), so the parameter names are
checked too. fp32: max abs diff <= 1e-5 on outputs of magnitude ~1.
"""

from __future__ import annotations

import math

import pytest
import torch

from inkling2_vision_fixtures import VISION, VISION_NO_MERGE, config_dict, hf_model, images

ATOL = 1e-5


def _released_tower_state(model, tmp_path) -> dict[str, torch.Tensor]:
    """The ``model.visual.*`` tensors of ``model.save_pretrained`` (prefix stripped)."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    return {k[len("model.visual."):]: v for k, v in sd.items() if k.startswith("model.visual.")}


@pytest.mark.parametrize("vision", [VISION, VISION_NO_MERGE], ids=["merge2", "merge1"])
def test_tower_matches_hf_vision_model(vision, tmp_path):
    from ferrule.plugins.inkling2.towers import build_vision_tower, hf_vision_inputs

    cfg = config_dict(vision)
    hf = hf_model(cfg)
    tower = build_vision_tower(cfg)
    tower.load_state_dict(_released_tower_state(hf, tmp_path), strict=True)  # every released name, nothing else
    items = images(vision["patch_size"] * vision["spatial_merge_size"])
    with torch.no_grad():
        ref = hf.model.vision_tower(**hf_vision_inputs(items, cfg)).pooler_output
        out = tower(items)
    assert out.shape == ref.shape == (sum(t.shape[0] * t.shape[1] for t in items), 32)
    assert ref.abs().max() > 0.1
    diff = (out - ref).abs().max().item()
    assert diff <= ATOL, f"vision tower vs Inkling2VisionModel max abs diff {diff:.3g}"


def test_tower_gradients_match_hf(tmp_path):
    """An unfrozen tower trains like the reference: every parameter's gradient within 1e-5 relative."""
    from ferrule.plugins.inkling2.towers import build_vision_tower, hf_vision_inputs

    cfg = config_dict()
    hf = hf_model(cfg)
    tower = build_vision_tower(cfg)
    tower.load_state_dict(_released_tower_state(hf, tmp_path))
    items = images(6, grids=((2, 2), (1, 3)))
    w = torch.randn(7, 32, generator=torch.Generator().manual_seed(3))
    (hf.model.vision_tower(**hf_vision_inputs(items, cfg)).pooler_output * w).sum().backward()
    (tower(items) * w).sum().backward()
    ref = {k[len("model.visual."):]: v for k, v in _hf_grads_released(hf, tmp_path).items()}
    ours = {n: p.grad for n, p in tower.named_parameters()}
    assert sorted(ours) == sorted(ref)
    for name, g in ours.items():
        scale = max(ref[name].abs().max().item(), 1e-6)
        assert (g - ref[name]).abs().max().item() <= ATOL * max(scale, 1.0), name


def _hf_grads_released(hf, tmp_path) -> dict[str, torch.Tensor]:
    """HF vision gradients under released names: save the gradients as the weights, read them back."""
    with torch.no_grad():
        for p in hf.model.vision_tower.parameters():
            p.copy_(p.grad)
    return {"model.visual." + k: v for k, v in _released_tower_state(hf, tmp_path / "grads").items()}


def test_bad_items_are_refused():
    from ferrule.plugins.inkling2.towers import build_vision_tower

    tower = build_vision_tower(config_dict())
    with pytest.raises(ValueError, match=r"image 1 has shape \(2, 8, 8, 3\).*\[rows, cols, 6, 6, 3\]"):
        tower([torch.zeros(1, 1, 6, 6, 3), torch.zeros(2, 8, 8, 3)])
    with pytest.raises(ValueError, match="hidden_act='swish'"):
        build_vision_tower(config_dict(dict(VISION, hidden_act="swish")))


def test_preprocess_grid_and_values():
    """Token grid = ceil(H / S) x ceil(W / S) (Inkling2ImageProcessor), padding = -1 on the 0-255 scale."""
    import numpy as np
    from PIL import Image

    from ferrule.plugins.inkling2.towers import preprocess_image

    rgb = np.random.default_rng(0).integers(0, 256, (7, 13, 3), dtype=np.uint8)  # H=7, W=13, S=6
    item = preprocess_image(Image.fromarray(rgb), config_dict())
    assert item.shape == (math.ceil(7 / 6), math.ceil(13 / 6), 6, 6, 3) == (2, 3, 6, 6, 3)
    canvas = item.permute(0, 2, 1, 3, 4).reshape(12, 18, 3)  # tokens back into the padded picture
    assert torch.equal(canvas[:7, :13], torch.from_numpy(rgb).float() / 127.5 - 1.0)
    assert torch.allclose(canvas[7:], torch.full_like(canvas[7:], (-1 / 255 - 0.5) / 0.5))
    with pytest.raises(ValueError, match="cannot decode the image"):
        preprocess_image(b"not an image", config_dict())


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchvision") is None,
                    reason="transformers' Inkling2ImageProcessor needs torchvision (no CPU wheel for torch 2.13 here)")
def test_preprocess_equals_transformers_processor():
    import numpy as np
    from PIL import Image
    from transformers import Inkling2ImageProcessor

    from ferrule.plugins.inkling2.towers import hf_vision_inputs, image_to_pixel_values

    pics = [Image.fromarray(np.random.default_rng(1).integers(0, 256, (37, 50, 3), dtype=np.uint8)),
            Image.fromarray(np.random.default_rng(2).integers(0, 256, (9, 9, 4), dtype=np.uint8), "RGBA")]
    ref = Inkling2ImageProcessor(size={"height": 16, "width": 16})(pics, return_tensors="pt")
    ours = hf_vision_inputs([image_to_pixel_values(p, 16) for p in pics], {})
    assert torch.equal(ours["image_grid_thw"], ref["image_grid_thw"])
    assert (ours["pixel_values"] - ref["pixel_values"]).abs().max() <= 1e-6


def test_grid_items_through_the_core_media_helpers():
    """``item_token_dims=2``: an image [R, C, ...] fills R*C placeholders in expand / check / count."""
    from ferrule.media import MediaError, check_media, expand_placeholders, media_token_counts
    from ferrule.contract.specs import SpecError, TowerSpec

    spec = TowerSpec(family="f", modality="vision", build="a:b", placeholder_token_id=9, item_token_dims=2,
                     hf_inputs="a:c")
    media = {"vision": [torch.zeros(2, 3, 6, 6, 3), torch.zeros(1, 1, 6, 6, 3)]}
    ids = expand_placeholders([1, 9, 2, 9], media, {"vision": 9}, specs={"vision": spec})
    assert ids == [1] + [9] * 6 + [2, 9]
    assert media_token_counts(media, {"vision": spec}) == {"vision": 7}
    check_media(torch.tensor(ids), media, {"vision": (spec, None, 9)}, "datum 0", "f")
    with pytest.raises(MediaError, match=r"datum 0: 6 vision placeholder tokens .* but 7 vision rows"):
        check_media(torch.tensor(ids[2:]), media, {"vision": (spec, None, 9)}, "datum 0", "f")
    with pytest.raises(MediaError, match="first 2 dims count"):
        check_media(torch.tensor([9]), {"vision": [torch.zeros(3)]}, {"vision": (spec, None, 9)}, "datum 1", "f")
    with pytest.raises(SpecError, match="needs hf_inputs"):
        TowerSpec(family="f", modality="vision", build="a:b", placeholder_token_id=9, item_token_dims=2)
    with pytest.raises(SpecError, match="item_token_dims=0"):
        TowerSpec(family="f", modality="vision", build="a:b", placeholder_token_id=9, item_token_dims=0)


@pytest.mark.parametrize("vision", [VISION, VISION_NO_MERGE], ids=["bias", "no_bias"])
def test_tower_mapping_rows_and_update_groups(vision, tmp_path):
    """The released ``model.visual.*`` keys (transformers' save_pretrained) <-> ``towers.vision.*``: complete both
    ways, bit-exact round trip; the update groups put every tower parameter in exactly one unit."""
    from ferrule.mapping import MappingContext, MappingTable
    from ferrule.plugins.inkling2.inkling2 import TOWER_ROWS, TOWER_UPDATE_GROUPS
    from ferrule.plugins.inkling2.towers import build_vision_tower
    from ferrule.sync.groups import build_update_units

    cfg = config_dict(vision)
    released = {"model.visual." + k: v for k, v in _released_tower_state(hf_model(cfg), tmp_path).items()}
    names = ["towers.vision." + n for n, _ in build_vision_tower(cfg).named_parameters()]
    table, ctx = MappingTable(family="inkling2", mappings=TOWER_ROWS), MappingContext.from_hf_config(cfg)
    mcore = table.hf_to_mcore(released, names, ctx)  # raises on a missing or an unmapped key
    back = table.mcore_to_hf(mcore, ctx)
    assert sorted(back) == sorted(released)
    assert all(torch.equal(back[k], released[k]) for k in released)
    units = build_update_units(names, TOWER_UPDATE_GROUPS)
    assert sorted(n for u in units for n in u.names) == sorted(names)
    assert len(units) == 1 + vision["num_hidden_layers"] + int(vision["projector_bias"])


def test_text_keys_are_the_text_families(tmp_path):
    """The multimodal checkpoint's non-vision keys are exactly ``Inkling2ForCausalLM``'s (so the inkling2 family
    maps its text model with the inkling2_text rows)."""
    from safetensors import safe_open
    from transformers import Inkling2ForCausalLM, Inkling2TextConfig

    from inkling2_vision_fixtures import TEXT

    hf_model(config_dict()).save_pretrained(tmp_path / "mm")
    Inkling2ForCausalLM(Inkling2TextConfig(**TEXT)).save_pretrained(tmp_path / "text")

    def shapes(d):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if not k.startswith("model.visual.")}

    assert shapes(tmp_path / "mm") == shapes(tmp_path / "text")


def test_core_passes_grid_items_as_a_list():
    """``embed_with_media`` hands a grid tower the list of items and scatters its rows in order; the embedded
    engine's keywords come from ``TowerSpec.hf_inputs`` (here ``hf_vision_inputs``), repeated per copy."""
    from ferrule.media import hf_media_inputs
    from ferrule.megatron.towers import embed_with_media
    from ferrule.plugins.inkling2.towers import build_vision_tower, hf_vision_inputs
    from ferrule.contract.specs import TowerSpec

    spec = TowerSpec(family="f", modality="vision", build="a:b", placeholder_token_id=9, item_token_dims=2,
                     hf_inputs="ferrule.plugins.inkling2.towers:hf_vision_inputs")
    tower = build_vision_tower(config_dict()).eval()
    items = images(6, grids=((1, 2), (2, 1)))

    class _Embedding(torch.nn.Module):
        def forward(self, input_ids, position_ids):
            return torch.zeros(input_ids.shape[1], input_ids.shape[0], 32)

    class _GPT:
        embedding = _Embedding()
        _ferrule_towers = {"vision": (spec, tower, 9)}

    tokens = torch.tensor([[1, 9, 9, 2, 9, 9]])
    out = embed_with_media(_GPT(), tokens, torch.arange(6)[None], [{"vision": items}])[:, 0]  # [s, hidden]
    with torch.no_grad():
        assert torch.equal(out[[1, 2, 4, 5]], tower(items)) and not out[[0, 3]].any()
    kw = hf_media_inputs({"vision": (spec, None, 9)}, {"vision": items}, 2, "cpu", {})
    ref = hf_vision_inputs(items * 2, {})
    assert kw.keys() == ref.keys() and all(torch.equal(kw[k], ref[k]) for k in ref)
