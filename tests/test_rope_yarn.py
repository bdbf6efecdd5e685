"""RoPE YaRN (``rope_type: yarn``) on Qwen2 / Qwen3 through megatron-core's ``YarnRotaryEmbedding``
(issue 28 item 9); ``dynamic`` stays refused (docs/plugins.md says why).

Referee: HF transformers 5.24 models built from the same ``config.json``
(``modeling_rope_utils._compute_yarn_parameters``): rotary tables (cos / sin times HF's
``attention_scaling``) within 1e-6 and logits within 1e-5 in fp32, on sequences longer than the
pre-training context ``original_max_position_embeddings`` (where YaRN differs from plain RoPE).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ferrule.conformance import numeric as cn  # noqa: E402
from ferrule.config_translation import ConfigTranslationError  # noqa: E402
from ferrule.plugins.qwen import qwen2, qwen3  # noqa: E402

SEQ = 48  # tokens; beyond ORIG so the interpolated frequencies matter
ORIG = 16
FAMILIES = {"qwen2": (qwen2, "Qwen2ForCausalLM"), "qwen3": (qwen3, "Qwen3ForCausalLM")}


@pytest.fixture(scope="module")
def mcore():
    from ferrule.megatron.parallel import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout(), seed=3)
    yield
    destroy_distributed()


def _hf_and_mcore(tmp_path, family: str, rope: dict):
    from ferrule.contract import registry
    from ferrule.converters import load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout

    module, hf_cls = FAMILIES[family]
    hf_dir = cn.tiny_hf_dir(family, tmp_path / family)
    config_json = json.loads((hf_dir / "config.json").read_text())
    config_json["rope_parameters"] = {"rope_theta": 1e4, **rope}
    config_json.pop("rope_scaling", None)
    (hf_dir / "config.json").write_text(json.dumps(config_json))
    hf = getattr(transformers, hf_cls).from_pretrained(hf_dir, dtype=torch.float32).eval()
    (model,) = registry.provider_build(family)(config_json, ParallelLayout())
    load_hf_into_mcore([model], hf_dir, module.MAPPING, hf_config=config_json)
    return hf, model.eval(), module, config_json


@pytest.mark.parametrize("family,rope", [
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}),
    ("qwen3", {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": ORIG, "beta_fast": 16.0,
               "beta_slow": 2.0, "truncate": False}),
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG,
               "attention_factor": 1.25}),
    ("qwen2", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": ORIG, "mscale": 1.0,
               "mscale_all_dim": 0.5}),
], ids=["qwen2_default", "qwen3_betas_no_truncate", "qwen3_attention_factor", "qwen2_mscales"])
def test_yarn_matches_hf(mcore, tmp_path, family, rope):
    hf, model, module, config_json = _hf_and_mcore(tmp_path, family, rope)
    assert model.position_embedding_type == "yarn"
    cos_m, sin_m = cn.rotary_tables_mcore(model, SEQ)
    cos_h, sin_h = cn.rotary_tables_hf(hf, SEQ)
    assert hf.model.rotary_emb.attention_scaling != 1.0 or rope.get("attention_factor") == 1.0
    assert (cos_m - cos_h).abs().max() < 1e-6 and (sin_m - sin_h).abs().max() < 1e-6
    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = model(ids, torch.arange(SEQ).expand(2, SEQ), None)[..., :96]
    assert (got - ref).abs().max() < 1e-5
    # the conversion back writes a config HF reads as the same YaRN
    tc, opts = module.CONFIG_TRANSLATION.to_mcore(config_json)
    back = module.CONFIG_TRANSLATION.to_hf(tc, opts)
    again = type(hf.config).from_dict(dict(config_json, rope_parameters=back["rope_parameters"]))
    cos_b, sin_b = cn.rotary_tables_hf(getattr(transformers, FAMILIES[family][1])(again).eval(), SEQ)
    assert (cos_b - cos_h).abs().max() < 1e-7 and (sin_b - sin_h).abs().max() < 1e-7


def test_dynamic_and_partial_yarn_are_refused_by_name():
    raw = dict(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with pytest.raises(ConfigTranslationError, match="'dynamic' is not supported.*docs/plugins.md"):
        qwen2.CONFIG_TRANSLATION.to_mcore(dict(raw, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                     "rope_theta": 1e4}))
    with pytest.raises(ConfigTranslationError, match="partial_rotary_factor.*yarn"):
        qwen2.CONFIG_TRANSLATION.to_mcore(dict(raw, rope_parameters={
            "rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "original_max_position_embeddings": 16,
            "partial_rotary_factor": 0.5}))
