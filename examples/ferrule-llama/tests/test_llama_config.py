"""The llama config translation on configs built by transformers' own ``LlamaConfig``.

Expected Megatron values are the architecture facts of SmolLM2-135M-Instruct (30 layers, hidden
576, intermediate 1536, 9 heads / 3 KV heads, head_dim 64, tied embeddings, rope_theta 1e5)
and of Llama-3.1 (``rope_type='llama3'``), written here by hand.
"""

from __future__ import annotations

import copy

import pytest

from ferrule.config_translation import ConfigTranslationError
from ferrule_llama.llama import CONFIG_TRANSLATION

SMOLLM2_KW = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _hf(**kw) -> dict:
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(**{**SMOLLM2_KW, **kw}).to_dict()


def test_smollm2_config_to_mcore():
    cfg, opts = CONFIG_TRANSLATION.to_mcore(_hf())
    assert {k: cfg[k] for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                "num_query_groups", "kv_channels")} == {
        "num_layers": 30, "hidden_size": 576, "ffn_hidden_size": 1536, "num_attention_heads": 9,
        "num_query_groups": 3, "kv_channels": 64}
    assert cfg["normalization"] == "RMSNorm" and cfg["gated_linear_unit"] is True
    assert cfg["add_bias_linear"] is False and cfg["add_qkv_bias"] is False and cfg["qk_layernorm"] is False
    assert cfg["layernorm_epsilon"] == pytest.approx(1e-5)
    assert opts == {"vocab_size": 49152, "max_sequence_length": 8192, "share_embeddings_and_output_weights": True,
                    "rotary_base": 100000.0, "position_embedding_type": "rope", "activation": "silu",
                    "rotary_percent": 1.0, "rope_scaling": None}
    assert cfg["window_size"] is None and cfg["window_attn_skip_freq"] is None


def test_to_hf_inverts_to_mcore():
    hf = _hf()
    cfg, opts = CONFIG_TRANSLATION.to_mcore(hf)
    assert CONFIG_TRANSLATION.to_hf(cfg, opts, base=hf) == hf


def test_legacy_rope_theta_key():
    hf = _hf()
    del hf["rope_parameters"]
    hf["rope_theta"] = 250000.0
    assert CONFIG_TRANSLATION.to_mcore(hf)[1]["rotary_base"] == 250000.0


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_llama3_rope_scaling_is_refused(key):
    hf = _hf()
    if key == "rope_parameters":
        hf["rope_parameters"] = dict(LLAMA31_ROPE)
    else:  # transformers-4 style config.json
        del hf["rope_parameters"]
        hf.update(rope_theta=500000.0, rope_scaling=dict(LLAMA31_ROPE))
    with pytest.raises(ConfigTranslationError, match=r"rope_type='llama3'.*unscaled RoPE"):
        CONFIG_TRANSLATION.to_mcore(hf)


@pytest.mark.parametrize("key, value", [("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu")])
def test_unsupported_features_are_refused(key, value):
    with pytest.raises(ConfigTranslationError, match=key):
        CONFIG_TRANSLATION.to_mcore(_hf(**{key: value}))


def test_other_model_type_is_refused():
    hf = _hf()
    hf["model_type"] = "mistral"
    with pytest.raises(ConfigTranslationError, match="model_type"):
        CONFIG_TRANSLATION.to_mcore(hf)


@pytest.mark.parametrize("where", ["top level", "rope_parameters"])
def test_partial_rotary_factor_is_refused_because_hf_llama_ignores_it(where):
    """Issue 45.6: before, 0.5 became megatron's rotary_percent=0.5, 5.1e-2 off HF's logits. The reference is
    HF itself: LlamaForCausalLM's logits are the same with and without the key (it rotates the whole head)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ferrule_llama.llama import TINY_HF_CONFIG

    def kw():  # a fresh copy each time: LlamaConfig writes partial_rotary_factor into the rope_parameters it is given
        return copy.deepcopy({k: v for k, v in TINY_HF_CONFIG.items() if k != "model_type"})

    plain = transformers.LlamaConfig(**kw())
    if where == "top level":
        partial = transformers.LlamaConfig(**kw(), partial_rotary_factor=0.5)
    else:
        args = kw()
        args["rope_parameters"]["partial_rotary_factor"] = 0.5
        partial = transformers.LlamaConfig(**args)
    assert partial.to_dict()["rope_parameters"].get("partial_rotary_factor", partial.to_dict().get(
        "partial_rotary_factor")) == 0.5
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(plain).eval()
    other = transformers.LlamaForCausalLM(partial).eval()
    other.load_state_dict(model.state_dict())
    ids = torch.arange(1, 33)[None] % TINY_HF_CONFIG["vocab_size"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, other(ids).logits)
    with pytest.raises(ConfigTranslationError, match=r"partial_rotary_factor=0.5; transformers' LlamaForCausalLM "
                                                      r"ignores it"):
        CONFIG_TRANSLATION.to_mcore(partial.to_dict())
    assert CONFIG_TRANSLATION.to_mcore(plain.to_dict())[1]["rotary_percent"] == 1.0  # without the key: accepted
