"""Inkling config translation (ferrule.plugins.inkling.config) against transformers' InklingTextConfig.

Referee: ``transformers.InklingTextConfig`` / ``InklingConfig`` (5.24): its dataclass fields are
the list every field must be translated / checked / refused from, and its ``__post_init__``
normalisation of legacy keys is what our pure-Python normalisation must reproduce.
"""

from __future__ import annotations

import pytest
from transformers import InklingConfig, InklingTextConfig, PreTrainedConfig

from ferrule.config_translation import ConfigTranslationError
from ferrule.megatron.parallel import ParallelLayout
from ferrule.plugins.inkling.inkling_text import CONFIG_TRANSLATION, TINY_HF_CONFIG
from ferrule.plugins.inkling.model import check_inkling_layout


def _tiny(**overrides) -> dict:
    cfg = dict(TINY_HF_CONFIG)
    cfg.pop("model_type")
    cfg.update(overrides)
    return InklingTextConfig(**cfg).to_dict()


def test_every_inkling_text_config_field_is_read_by_the_translation():
    inkling_fields = set(InklingTextConfig.__dataclass_fields__) - set(PreTrainedConfig.__dataclass_fields__)
    read = set(CONFIG_TRANSLATION.hf_keys())
    assert inkling_fields - read == set(), f"fields neither translated, checked nor refused: {inkling_fields - read}"


def test_defaults_for_absent_keys_are_transformers_defaults():
    import dataclasses

    from ferrule.plugins.inkling.config import HF_DEFAULTS

    fields = InklingTextConfig.__dataclass_fields__
    expected = {k: f.default for k, f in fields.items()
                if k not in PreTrainedConfig.__dataclass_fields__ and f.default is not dataclasses.MISSING}
    assert HF_DEFAULTS == expected


def test_translation_values_and_round_trip():
    hf = _tiny()
    cfg, opts = CONFIG_TRANSLATION.to_mcore(hf)
    assert (cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_query_groups"],
            cfg["kv_channels"], cfg["ffn_hidden_size"]) == (3, 32, 4, 2, 8, 48)
    assert (cfg["num_moe_experts"], cfg["moe_ffn_hidden_size"], cfg["moe_router_topk"]) == (4, 16, 2)
    assert opts["sliding_layers"] == (True, False, True)
    assert opts["sparse_layers"] == (False, True, True)
    assert (opts["sliding_window_size"], opts["rel_extent"], opts["d_rel"], opts["conv_kernel_size"]) == (4, 6, 4, 4)
    assert (opts["n_shared_experts"], opts["route_scale"], opts["logits_mup_width_multiplier"]) == (2, 2.0, 4.0)
    back = CONFIG_TRANSLATION.to_hf(cfg, opts, base=hf)
    assert back == hf
    # and transformers parses the written config to the same model
    assert InklingTextConfig(**{k: v for k, v in back.items() if k != "model_type"}).to_dict() == hf


def test_dense_only_model_has_no_megatron_experts():
    cfg, opts = CONFIG_TRANSLATION.to_mcore(_tiny(mlp_layer_types=["dense"] * 3))
    assert cfg["num_moe_experts"] is None and opts["sparse_layers"] == (False, False, False)


def test_legacy_keys_normalise_like_transformers():
    raw = dict(TINY_HF_CONFIG)
    raw.pop("mlp_layer_types")
    raw.pop("layer_types")
    raw.update(dense_mlp_idx=1, dense_intermediate_size=40, intermediate_size=24, sconv_kernel_size=3,
               local_layer_ids=[0, 2])
    raw.pop("moe_intermediate_size")
    ours = CONFIG_TRANSLATION.to_mcore(raw)
    parsed = InklingTextConfig(**{k: v for k, v in raw.items() if k != "model_type"}).to_dict()
    assert ours == CONFIG_TRANSLATION.to_mcore(parsed)
    assert ours[0]["ffn_hidden_size"] == 40 and ours[1]["moe_intermediate_size"] == 24
    assert ours[1]["conv_kernel_size"] == 3 and ours[1]["sparse_layers"] == (False, True, True)


def test_multimodal_config_translates_its_text_config():
    text = _tiny()
    mm = InklingConfig(text_config={k: v for k, v in text.items() if k != "model_type"},
                       vision_config={"hidden_size": 16, "num_hidden_layers": 2, "patch_size": 8}).to_dict()
    from ferrule.plugins.inkling.config import TEXT_ENTRIES, InklingConfigTranslation

    mm_translation = InklingConfigTranslation(name="inkling", entries=TEXT_ENTRIES, model_types=("inkling_mm_model",))
    assert mm_translation.to_mcore(mm) == CONFIG_TRANSLATION.to_mcore(text)
    with pytest.raises(ConfigTranslationError, match="model_type='inkling_mm_model'"):
        CONFIG_TRANSLATION.to_mcore(mm)


@pytest.mark.parametrize("overrides, key", [
    ({"num_mtp_layers": 1}, "num_mtp_layers"),
    ({"shared_expert_sink": False}, "shared_expert_sink"),
    ({"unpadded_vocab_size": 90}, "unpadded_vocab_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"layer_types": ["hybrid", "full_attention", "hybrid"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"local_layer_ids": [1]}, "local_layer_ids"),
])
def test_unsupported_values_are_refused_by_name(overrides, key):
    hf = dict(TINY_HF_CONFIG, **overrides)
    with pytest.raises(ConfigTranslationError, match=key):
        CONFIG_TRANSLATION.to_mcore(hf)


@pytest.mark.parametrize("layout, overrides, message", [
    (ParallelLayout(tp=2), {"num_key_value_heads": 1}, "num_query_groups"),
    (ParallelLayout(tp=2), {"swa_num_key_value_heads": 1}, "swa_num_key_value_heads"),
    (ParallelLayout(ep=3), {}, "ep=3"),
    (ParallelLayout(ep=2), {"mlp_layer_types": ["dense"] * 3}, "no routed experts"),
])
def test_layouts_the_model_cannot_use_are_refused(layout, overrides, message):
    cfg, opts = CONFIG_TRANSLATION.to_mcore(_tiny(**overrides))
    with pytest.raises(ValueError, match=message):
        check_inkling_layout(cfg, opts, layout)
    check_inkling_layout(cfg, opts, ParallelLayout())  # TP=1 always fits
