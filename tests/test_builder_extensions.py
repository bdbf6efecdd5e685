"""Builder extension points (megatron/extensions.py, SDPAttention windows / soft-cap) on tiny models.

References: a float64 attention written here (windows, soft-cap), HF transformers' Qwen2 (logits)
and torch's own tanh GELU. The Gemma-2 and Mistral families using the options end to end are
checked against HF in tests/test_fixture_families.py.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ferrule.conformance import numeric as cn  # noqa: E402

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 9, 2, 4, 2, 8


@pytest.fixture(scope="module")
def mcore():
    from ferrule.megatron.parallel import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout(), seed=5)
    yield
    destroy_distributed()


def _float64_attention(q, k, v, blocked, *, softcap=None, sinks=None):
    """q [s,b,np,d], k/v [s,b,ng,d], blocked [s, s] True = masked -> [s, b, np*d] (float64); ``sinks [np]``: one
    more logit per head in each row's softmax, dropped after it (HF gpt-oss ``eager_attention_forward``)."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(blocked, float("-inf"))
    if sinks is not None:
        sink = sinks.double().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        out = torch.cat([scores, sink], -1).softmax(-1)[..., :-1] @ v
        return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)
    out = scores.softmax(-1) @ v
    return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)


def _attention(window=None, skip=None, layer=1, softcap=None, softmax_type="vanilla"):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ferrule.megatron.attention import SDPAttention

    cfg = TransformerConfig(num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                            num_query_groups=GROUPS, kv_channels=HEAD_DIM, use_cpu_initialization=True,
                            attention_dropout=0.0, window_size=window, window_attn_skip_freq=skip,
                            softmax_type=softmax_type)
    return SDPAttention(config=cfg, layer_number=layer, attn_mask_type=AttnMaskType.causal, attention_type="self",
                        softcap=softcap)


def _qkv():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=g) * 2,
            torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=g) * 2,
            torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=g))


def _blocked(window):
    i, j = torch.arange(SEQ).unsqueeze(1), torch.arange(SEQ).unsqueeze(0)
    blocked = j > i
    if window is not None:
        blocked |= j <= i - window  # HF: key j visible when i - window < j <= i
    return blocked


@pytest.mark.parametrize("hf_window", [1, 3, SEQ + 2])
def test_sdpa_sliding_window_matches_float64(mcore, hf_window):
    q, k, v = _qkv()
    out = _attention(window=(hf_window - 1, 0))(q, k, v, None)
    assert (out.double() - _float64_attention(q, k, v, _blocked(hf_window))).abs().max() < 1e-5


def test_window_only_on_the_layers_skip_freq_selects(mcore):
    q, k, v = _qkv()
    full, sliding = _attention(window=(2, 0), skip=[0, 1], layer=1), _attention(window=(2, 0), skip=[0, 1], layer=2)
    assert full.window is None and sliding.window == (2, 0)
    assert (full(q, k, v, None).double() - _float64_attention(q, k, v, _blocked(None))).abs().max() < 1e-5
    assert (sliding(q, k, v, None).double() - _float64_attention(q, k, v, _blocked(3))).abs().max() < 1e-5


def test_attention_softcap_matches_float64(mcore):
    q, k, v = _qkv()
    out = _attention(softcap=0.7)(q, k, v, None)
    ref = _float64_attention(q, k, v, _blocked(None), softcap=0.7)
    assert (out.double() - ref).abs().max() < 1e-5
    assert (_float64_attention(q, k, v, _blocked(None)) - ref).abs().max() > 1e-2  # the cap bites


def test_attention_sinks_match_float64_padded_and_packed(mcore):
    """softmax_type='learnable' (gpt-oss sinks: megatron's softmax_offset [heads]): padded with a window and
    packed (thd, CPU path) per document, vs a float64 softmax over [scores, sink] (before: NotImplementedError)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v = _qkv()
    attn = _attention(window=(2, 0), softmax_type="learnable")
    sinks = torch.tensor([1.5, -0.5, 0.3, 2.0])[:HEADS]
    with torch.no_grad():
        attn.softmax_offset.copy_(sinks)
    assert attn.softmax_offset.tensor_model_parallel and attn.softmax_offset.partition_dim == 0  # split with heads
    ref = _float64_attention(q, k, v, _blocked(3), sinks=sinks)
    assert (attn(q, k, v, None).double() - ref).abs().max() < 1e-5
    assert (_float64_attention(q, k, v, _blocked(3)) - ref).abs().max() > 1e-2  # the sinks bite
    lengths = (5, SEQ - 5)
    cu = torch.tensor([0, lengths[0], SEQ], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=SEQ, max_seqlen_kv=SEQ)
    out = attn(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=params)
    docs = []
    for start, n in ((0, lengths[0]), (lengths[0], lengths[1])):
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        doc = [x[start:start + n, :1] for x in (q, k, v)]
        docs.append(_float64_attention(*doc, (j > i) | (j <= i - 3), sinks=sinks)[:, 0])
    assert (out.double() - torch.cat(docs)).abs().max() < 1e-5


def test_gelu_tanh_and_activation_references():
    from ferrule.megatron.gpt_config import ACTIVATIONS

    x = torch.linspace(-5, 5, 101)
    ref = 0.5 * x.double() * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x.double() + 0.044715 * x.double() ** 3)))
    assert (ACTIVATIONS["gelu_pytorch_tanh"](x).double() - ref).abs().max() < 1e-6
    from transformers.activations import ACT2FN

    assert torch.allclose(ACTIVATIONS["gelu_pytorch_tanh"](x), ACT2FN["gelu_pytorch_tanh"](x))


def _qwen2_pair(tmp_path, **build_options):
    from ferrule.converters import load_hf_into_mcore
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.plugins.qwen import qwen2

    src = cn.tiny_hf_dir("qwen2", tmp_path / "hf")
    hf_config = json.loads((src / "config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    from ferrule.contract import registry
    (model,) = registry.provider_build("qwen2")(hf_config, ParallelLayout(), **build_options)
    load_hf_into_mcore([model], src, qwen2.MAPPING, hf_config=hf_config)
    ids = cn.test_token_ids(hf_config["vocab_size"], 12)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = model.eval()(ids, torch.arange(12).expand_as(ids), None)[..., :hf_config["vocab_size"]]
    return model, (got - ref).abs().max().item()


def local_layer_spec(config):
    """A layer_spec factory (``"module:attr"`` target): megatron's local spec with its own attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)


@pytest.mark.parametrize("options", [
    {"core_attention": "ferrule.megatron.attention:SDPAttention"},
    {"core_attention": "megatron.core.transformer.dot_product_attention:DotProductAttention"},
    {"config_overrides": {"perform_initialization": True}, "core_attention": "local"},
])
def test_core_attention_class_by_reference(mcore, tmp_path, options):
    model, diff = _qwen2_pair(tmp_path, **options)
    assert diff < 1e-5


def test_custom_layer_spec(mcore, tmp_path):
    """``layer_spec="module:attr"`` replaces the local spec and gets ferrule's SDPA core attention unless
    ``core_attention='local'`` (before: megatron's slow local attention, silently); same weights give HF's logits."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from ferrule.megatron.attention import SDPAttention
    from ferrule.megatron.gpt_builder import build_gpt_model

    model, diff = _qwen2_pair(tmp_path)
    assert diff < 1e-5
    local = build_gpt_model(model.config, vocab_size=96, max_sequence_length=64, rotary_base=10000.0,
                            layer_spec="test_builder_extensions:local_layer_spec", core_attention="local")
    assert type(local.decoder.layers[0].self_attention.core_attention) is DotProductAttention
    custom = build_gpt_model(model.config, vocab_size=96, max_sequence_length=64, rotary_base=10000.0,
                             layer_spec="test_builder_extensions:local_layer_spec")
    assert type(custom.decoder.layers[0].self_attention.core_attention) is SDPAttention
    custom.load_state_dict(model.state_dict(), strict=True)
    ids = cn.test_token_ids(96, 12)
    pos = torch.arange(12).expand_as(ids)
    with torch.no_grad():
        assert (custom.eval()(ids, pos, None) - model(ids, pos, None)).abs().max() < 1e-5


def test_unknown_options_are_refused(mcore):
    from ferrule.megatron.attention import core_attention_class
    from ferrule.megatron.gpt_config import make_transformer_config
    from ferrule.megatron.parallel import ParallelLayout

    with pytest.raises(ValueError, match="core_attention='flash'"):
        core_attention_class("flash")
    with pytest.raises(ValueError, match="activation='swish2'"):
        make_transformer_config({"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2}, ParallelLayout(),
                                activation="swish2")


def test_packed_thd_sequences_respect_the_window(mcore):
    """thd-packed documents (CPU path): causal within each document and within the window."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = (5, 4)
    t = sum(lengths)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(t, GROUPS, HEAD_DIM, generator=g)
    v = torch.randn(t, GROUPS, HEAD_DIM, generator=g)
    cu = torch.tensor([0, lengths[0], t], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    out = _attention(window=(1, 0))(q, k, v, None, packed_seq_params=params)
    ref = []
    for start, n in ((0, lengths[0]), (lengths[0], lengths[1])):  # each document alone, window 2 tokens
        blocked = torch.arange(n).unsqueeze(0) > torch.arange(n).unsqueeze(1)
        blocked |= torch.arange(n).unsqueeze(0) <= torch.arange(n).unsqueeze(1) - 2
        doc = [x[start:start + n].unsqueeze(1) for x in (q, k, v)]
        ref.append(_float64_attention(*doc, blocked)[:, 0])
    assert (out.double() - torch.cat(ref)).abs().max() < 1e-5
    with pytest.raises(NotImplementedError, match="soft-capping with packed"):
        _attention(softcap=1.0)(q, k, v, None, packed_seq_params=params)


def test_layer_spec_refuses_the_options_it_would_drop(mcore, tmp_path):
    """A layer_spec with zero_centered_norms / extra_norms / a soft-cap: refused naming each option
    (before: built without them, silently)."""
    from ferrule.megatron.gpt_builder import build_gpt_model

    model, _ = _qwen2_pair(tmp_path)
    with pytest.raises(ValueError, match=r"\['attn_logit_softcapping', 'extra_norms', 'zero_centered_norms'\]"):
        build_gpt_model(model.config, vocab_size=96, max_sequence_length=64,
                        layer_spec="test_builder_extensions:local_layer_spec", zero_centered_norms=True,
                        extra_norms=("post_attention",), attn_logit_softcapping=50.0)


def test_unknown_model_option_names_the_option(mcore):
    """A translation producing ``zero_centred_norms`` (a typo) fails naming it and the known spelling
    (before: dropped, a plain-norm model was built)."""
    from ferrule.config_translation import ConfigTranslation, Constant
    from ferrule.config_translation import ConfigTranslationError
    from ferrule.megatron.gpt_builder import build_from_hf_config
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.plugins.qwen.qwen2 import CONFIG_TRANSLATION

    typo = ConfigTranslation("qwen2-typo", CONFIG_TRANSLATION.entries + (Constant("zero_centred_norms", True,
                                                                                    target="option"),))
    hf_config = dict(cn.tiny_hf_config("qwen2"))
    with pytest.raises(ConfigTranslationError, match=r"\['zero_centred_norms'\].*did you mean 'zero_centered_norms'"):
        build_from_hf_config(hf_config, ParallelLayout(), typo)


def test_core_attention_from_a_translation_row(mcore):
    """``Constant("core_attention", "local", target="option")`` in a family's translation chooses megatron's
    attention (before: refused as an unknown option, forcing a custom provider); an explicit keyword still wins."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from ferrule.config_translation import ConfigTranslation, Constant
    from ferrule.megatron.attention import SDPAttention
    from ferrule.megatron.gpt_builder import build_from_hf_config
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.plugins.qwen.qwen2 import CONFIG_TRANSLATION

    local = ConfigTranslation("qwen2-local", CONFIG_TRANSLATION.entries + (Constant("core_attention", "local",
                                                                                     target="option"),))
    hf_config = dict(cn.tiny_hf_config("qwen2"))
    (model,) = build_from_hf_config(hf_config, ParallelLayout(), local)
    assert type(model.decoder.layers[0].self_attention.core_attention) is DotProductAttention
    (model,) = build_from_hf_config(hf_config, ParallelLayout(), local, core_attention="sdpa")
    assert type(model.decoder.layers[0].self_attention.core_attention) is SDPAttention


def test_an_old_option_name_still_builds_with_a_deprecation_warning(mcore):
    """Round 3's Gemma-3 package translated the sliding layers' RoPE base as ``local_rotary_base``; that option
    became unknown (refused) with ``layer_rope``. It builds again, with a FutureWarning naming the replacement,
    and each layer's rotary table equals HF Gemma-3's table for its layer type."""
    import sys

    from ferrule.config_translation import ConfigTranslation, Derived
    from ferrule.conformance.fields import rotary_tables_by_layer
    from ferrule.megatron.gpt_builder import build_from_hf_config
    from ferrule.megatron.parallel import ParallelLayout
    from fixture_plugins import FIXTURES

    sys.path.insert(0, str(FIXTURES / "ferrule-gemma3-fixture"))
    try:
        from ferrule_gemma3_fixture import gemma3
    finally:
        sys.path.remove(str(FIXTURES / "ferrule-gemma3-fixture"))

    def theta(kind):
        return lambda hf: float(hf["rope_parameters"][kind]["rope_theta"])

    old_rows = (Derived("rotary_base", theta("full_attention"), lambda v, c, o: {}, hf_keys=("rope_parameters",),
                        target="option", reads=("layer_types",)),
                Derived("local_rotary_base", theta("sliding_attention"), lambda v, c, o: {}, hf_keys=(),
                        target="option"))
    old = ConfigTranslation("gemma3_round3", tuple(e for e in gemma3.CONFIG_TRANSLATION.entries
                                                   if getattr(e, "mcore", None) != "layer_rope") + old_rows)
    hf_config = dict(gemma3.TINY_HF_CONFIG, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    with pytest.warns(FutureWarning, match=r"'gemma3_round3' produces the model option 'local_rotary_base', "
                                           r"deprecated: use the layer_rope option"):
        (model,) = build_from_hf_config(hf_config, ParallelLayout(), old)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**hf_config)).eval()
    rows = rotary_tables_by_layer(hf, model, 12)
    assert [r[0] for r in rows] == ["layer 0 (sliding_attention)", "layer 1 (full_attention)"]
    for label, (cos_m, sin_m), (cos_h, sin_h) in rows:
        assert max((cos_m - cos_h).abs().max(), (sin_m - sin_h).abs().max()) < 1e-6, label
