"""Config translation reads the config as transformers parses it and refuses keys it does not translate.

References: transformers 5.24's own config classes (``save_pretrained`` output, parsed values) and
HF models built from the same ``config.json`` (rotary tables, module shapes, logits).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ferrule.conformance import numeric as cn  # noqa: E402
from ferrule.config_translation import (  # noqa: E402
    ConfigTranslation,
    ConfigTranslationError,
    Harmless,
    Require,
)
from ferrule.plugins.qwen import qwen2, qwen3, qwen3_moe  # noqa: E402

ferrule_llama = pytest.importorskip("ferrule_llama.llama")

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
TRANSLATIONS = {"qwen2": qwen2.CONFIG_TRANSLATION, "qwen3": qwen3.CONFIG_TRANSLATION,
                "qwen3_moe": qwen3_moe.CONFIG_TRANSLATION, "llama": ferrule_llama.CONFIG_TRANSLATION}


@pytest.fixture(scope="module")
def mcore():
    from ferrule.megatron.parallel import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout(), seed=3)
    yield
    destroy_distributed()


@pytest.mark.parametrize("model_type", sorted(TRANSLATIONS))
@pytest.mark.parametrize("size", ["default", "tiny"])
def test_every_key_transformers_writes_is_translated_or_harmless(model_type, size, tmp_path):
    """Every key of a ``config.json`` written by transformers 5.24 is translated or listed as harmless."""
    kw = {} if size == "default" else dict(TINY, **({"moe_intermediate_size": 16, "num_experts": 4}
                                                   if model_type == "qwen3_moe" else {}))
    transformers.AutoConfig.for_model(model_type, **kw).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    translation = TRANSLATIONS[model_type]
    assert translation.unknown_keys(written) == []
    cfg, opts = translation.to_mcore(written)
    assert cfg["num_layers"] == written["num_hidden_layers"] and opts["vocab_size"] == written["vocab_size"]


def test_unknown_key_is_refused_by_name():
    """A Gemma-2 config through a Llama-copied table: every untranslated Gemma-2 key is named."""
    entries = tuple(e for e in ferrule_llama.CONFIG_TRANSLATION.entries
                    if not (isinstance(e, Require) and e.hf in ("model_type", "hidden_act")))
    copied = ConfigTranslation("gemma2_copy", (Require("model_type", ("gemma2",)), *entries))
    hf = transformers.Gemma2Config(**TINY, head_dim=8).to_dict()
    with pytest.raises(ConfigTranslationError) as err:
        copied.to_mcore(hf)
    msg = str(err.value)
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "hidden_activation"):
        assert repr(key) in msg
    assert "Harmless(key, reason=...)" in msg
    # listing a key as harmless (with a reason) is the explicit way out
    with pytest.raises(ValueError, match="needs a reason"):
        Harmless("use_bidirectional_attention", " ")


def test_parsed_config_object_is_accepted():
    cfg = transformers.Qwen2Config(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    tc, opts = qwen2.CONFIG_TRANSLATION.to_mcore(cfg)
    assert opts["rotary_base"] == 5e5 and tc["num_query_groups"] == 2


def test_legacy_rope_scaling_beside_rope_parameters_is_what_transformers_builds():
    """Issue 9: transformers 5.24 turns ``rope_parameters`` + legacy ``rope_scaling: linear x4``
    into linear RoPE with theta 10000; ferrule must translate the same."""
    raw = dict(model_type="qwen2", **TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
               rope_scaling={"type": "linear", "factor": 4.0})
    parsed = transformers.AutoConfig.for_model("qwen2").from_dict(dict(raw))
    assert parsed.rope_parameters["rope_theta"] == 10000.0  # the reference: what HF uses
    _, opts = qwen2.CONFIG_TRANSLATION.to_mcore(raw)
    assert opts["rotary_base"] == parsed.rope_parameters["rope_theta"]
    assert opts["rope_scaling"] == {"type": "linear", "factor": parsed.rope_parameters["factor"]}


def _hf_and_mcore(tmp_path, family_module, config_json: dict, hf_cls):
    """HF model saved with ``config_json`` as its config.json, and ferrule's model loaded from it."""
    from ferrule.converters import load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout

    cn_dir = cn.tiny_hf_dir(family_module.CONFIG_TRANSLATION.name, tmp_path / "hf")
    (cn_dir / "config.json").write_text(json.dumps(config_json))
    hf = getattr(transformers, hf_cls).from_pretrained(cn_dir, dtype=torch.float32).eval()
    from ferrule.contract import registry
    (model,) = registry.provider_build(family_module.CONFIG_TRANSLATION.name)(config_json, ParallelLayout())
    load_hf_into_mcore([model], cn_dir, family_module.MAPPING, hf_config=config_json)
    return hf, model.eval()


def test_legacy_rope_scaling_logits_and_rotary_match_hf(mcore, tmp_path):
    base = json.loads((cn.tiny_hf_dir("qwen2", tmp_path / "base") / "config.json").read_text())
    config_json = dict(base, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       rope_scaling={"type": "linear", "factor": 4.0})
    hf, model = _hf_and_mcore(tmp_path, qwen2, config_json, "Qwen2ForCausalLM")
    cos_m, sin_m = cn.rotary_tables_mcore(model, 48)
    cos_h, sin_h = cn.rotary_tables_hf(hf, 48)
    assert (cos_m - cos_h).abs().max() < 1e-6 and (sin_m - sin_h).abs().max() < 1e-6
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = model(ids, torch.arange(48).expand(2, 48), None)[..., :96]
    assert (got - ref).abs().max() < 1e-5
    bad = [row for row in cn.translated_fields_vs_hf(hf, model) if row[1] != row[2]]
    assert bad == []


def _decoder_translation(model_type: str, not_in_this_check: tuple[str, ...]) -> ConfigTranslation:
    """A Llama-shaped table for ``model_type`` (rotary checks only: the listed keys are outside them)."""
    from ferrule.config_translation import DECODER_ENTRIES, Constant, Derived, head_dim_from_hf, head_dim_to_hf
    from ferrule.config_translation import rope_theta_from_hf, rope_theta_to_hf

    return ConfigTranslation(f"{model_type}_rotary_check", (
        Require("model_type", (model_type,)), *DECODER_ENTRIES,
        Derived("kv_channels", head_dim_from_hf, head_dim_to_hf, hf_keys=("head_dim",)),
        Derived("rotary_base", rope_theta_from_hf, rope_theta_to_hf,
                hf_keys=("rope_parameters", "rope_theta", "rope_scaling"), target="option"),
        Require("hidden_act", ("silu",)), Constant("add_qkv_bias", False), Constant("qk_layernorm", False),
        *(Harmless(k, "outside this rotary-table check") for k in not_in_this_check)))


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_rotary_tables_match_hf_for_partial_and_llama3(mcore, rope):
    """Phi-3's ``partial_rotary_factor`` and Llama-3.1 scaling: ferrule's cos/sin equal HF's."""
    from ferrule.megatron.parallel import ParallelLayout

    if "partial_rotary_factor" in rope:
        cfg = transformers.Phi3Config(**TINY, rope_parameters=rope, pad_token_id=0)
        hf = transformers.Phi3ForCausalLM(cfg).eval()
        extra = ("resid_pdrop", "embd_pdrop", "original_max_position_embeddings")
    else:
        cfg = transformers.LlamaConfig(**dict(TINY, max_position_embeddings=16384), rope_parameters=rope)
        hf = transformers.LlamaForCausalLM(cfg).eval()
        extra = ("attention_bias", "mlp_bias", "pretraining_tp")
    translation = _decoder_translation(cfg.model_type, extra)
    from ferrule.megatron.gpt_builder import build_from_hf_config

    (model,) = build_from_hf_config(cfg.to_dict(), ParallelLayout(), translation)
    cos_m, sin_m = cn.rotary_tables_mcore(model, 64)
    cos_h, sin_h = cn.rotary_tables_hf(hf, 64)
    assert cos_m.shape == cos_h.shape
    assert (cos_m - cos_h).abs().max() < 1e-6 and (sin_m - sin_h).abs().max() < 1e-6


def test_partial_rotary_logits_match_hf_phi3(mcore):
    """Phi-3 with ``partial_rotary_factor=0.5``: megatron (rotary_percent 0.5) logits equal HF's.

    Phi-3 fuses q/k/v and gate/up in its checkpoint; the test splits them into Llama names by
    hand (rows ``[q; k; v]`` and ``[gate; up]``, ``modeling_phi3.py``) and loads them through the
    Llama example's mapping table.
    """
    from ferrule.converters import load_hf_into_mcore
    from ferrule.megatron.gpt_builder import build_from_hf_config
    from ferrule.megatron.parallel import ParallelLayout

    cfg = transformers.Phi3Config(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                           "partial_rotary_factor": 0.5}, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    tensors = {}
    for name, t in hf.state_dict().items():
        if name.endswith("self_attn.qkv_proj.weight"):
            q, k, v = t.split([heads * hd, kv * hd, kv * hd])
            base = name.removesuffix("qkv_proj.weight")
            tensors.update({base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v})
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = t.chunk(2)
            base = name.removesuffix("gate_up_proj.weight")
            tensors.update({base + "gate_proj.weight": gate, base + "up_proj.weight": up})
        else:
            tensors[name] = t
    translation = _decoder_translation("phi3", ("resid_pdrop", "embd_pdrop", "original_max_position_embeddings"))
    hf_config = cfg.to_dict()
    _, opts = translation.to_mcore(hf_config)
    assert opts["rotary_percent"] == 0.5
    (model,) = build_from_hf_config(hf_config, ParallelLayout(), translation)
    load_hf_into_mcore([model], tensors, ferrule_llama.MAPPING, hf_config=hf_config)
    ids = cn.test_token_ids(96, 24)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = model.eval()(ids, torch.arange(24).expand_as(ids), None)[..., :96]
        full = build_from_hf_config(dict(hf_config, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                                    ParallelLayout(), translation)[0]
        load_hf_into_mcore([full], tensors, ferrule_llama.MAPPING, hf_config=hf_config)
        wrong = full.eval()(ids, torch.arange(24).expand_as(ids), None)[..., :96]
    assert (got - ref).abs().max() < 1e-5
    assert (wrong - ref).abs().max() > 1e-3  # rotating every channel (the old behaviour) is visibly wrong


def test_layer_type_rope_rows_translate_gemma3_rope_parameters_per_layer():
    """transformers' Gemma3TextConfig keeps one RoPE per layer type; the shared rows give each layer its own
    (before: the flat rope rows refused the nested rope_parameters)."""
    from ferrule.config_translation.layer_types import LAYER_TYPE_ROPE_ENTRIES
    from ferrule.config_translation import DECODER_ENTRIES, ConfigTranslation, Require

    table = ConfigTranslation("g3", (Require("model_type", ("gemma3_text",)), *DECODER_ENTRIES, *LAYER_TYPE_ROPE_ENTRIES))
    hf = {"model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}
    from ferrule.config_translation import parse_hf_config

    values, _ = parse_hf_config(hf, "g3")
    _, opts = table._translate(values)
    assert [e["layer_type"] for e in opts["layer_rope"]] == hf["layer_types"]
    assert opts["layer_rope"][1] == {"layer_type": "full_attention", "rotary_base": 1e6,
                                     "rope_scaling": {"type": "linear", "factor": 8.0}, "rotary_percent": 1.0}
    assert opts["layer_rope"][0]["rotary_base"] == 10000.0 and opts["layer_rope"][0]["rope_scaling"] is None
    assert opts["rope_scaling"] is None and opts["rotary_percent"] == 1.0
    back = table.to_hf(*table._translate(values))["rope_parameters"]
    assert back["full_attention"] == {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0}
    assert back["sliding_attention"] == {"rope_theta": 10000.0, "rope_type": "default"}


def test_rope_parameters_sub_fields_are_checked_like_top_level_keys():
    """A family that drops the shared RoPE rows and reads only ``rope_theta`` itself: a YaRN checkpoint was
    built with plain RoPE, silently (only the logits showed it, 1.7e-3); now the unread sub-fields are named.
    Declaring what the row reads (``reads=("rope_parameters.factor", ...)``) or keeping the shared rows passes."""
    from ferrule.config_translation import ROPE_SCALING_ENTRIES, ConfigTranslation, ConfigTranslationError, Derived
    from ferrule.config_translation.decoder import rope_theta_from_hf, rope_theta_to_hf

    theta_only = tuple(e for e in qwen2.CONFIG_TRANSLATION.entries
                       if getattr(e, "mcore", None) not in ("rope_scaling", "rotary_percent"))
    hf = dict(cn.tiny_hf_config("qwen2"), rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})
    with pytest.raises(ConfigTranslationError, match=r"sub-key\(s\) \['rope_parameters.factor', "
                                                     r"'rope_parameters.original_max_position_embeddings', "
                                                     r"'rope_parameters.rope_type'\] are read by no row"):
        ConfigTranslation("qwen2-theta-only", theta_only).to_mcore(hf)
    # plain RoPE needs no scaling reader; the shared rows read the YaRN fields
    ConfigTranslation("qwen2-theta-only", theta_only).to_mcore(dict(hf, rope_parameters={"rope_type": "default",
                                                                                        "rope_theta": 10000.0}))
    _, opts = qwen2.CONFIG_TRANSLATION.to_mcore(hf)
    assert opts["rope_scaling"]["type"] == "yarn"
    declared = tuple(e for e in theta_only if getattr(e, "mcore", None) != "rotary_base") + (
        Derived("rotary_base", rope_theta_from_hf, rope_theta_to_hf, hf_keys=("rope_parameters",), target="option",
                reads=("rope_parameters.rope_type", "rope_parameters.factor",
                       "rope_parameters.original_max_position_embeddings")),)
    ConfigTranslation("qwen2-declared", declared).to_mcore(hf)
    assert ROPE_SCALING_ENTRIES  # the rows the fix names
