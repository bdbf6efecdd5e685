"""Inkling multimodal checkpoints (HF ``model_type='inkling_mm_model'``), text model in the *released* layout.

The released checkpoint layout (what ``InklingForConditionalGeneration.save_pretrained`` writes;
transformers' ``conversion_mapping.py`` entry ``inkling_mm_model`` renames it on load):
``model.llm.embed.weight``, ``model.llm.embed_norm.weight``, ``model.llm.layers.L.attn_norm``,
``attn.{wq_du,wk_dv,wv_dv,wr_du,wo_ud}.weight``, ``attn.{q,k}_norm.weight``,
``attn.{k,v}_sconv.weight``, ``attn.rel_logits_proj.proj``, ``attn_sconv.weight``, ``mlp_norm``,
``mlp_sconv.weight``, dense ``mlp.w13_dn.weight`` / ``mlp.w2_md.weight`` / ``mlp.global_scale``,
MoE ``mlp.gate.{weight,bias,global_scale}``, ``mlp.experts.{w13,w2}_weight``,
``mlp.shared_experts.shared_{w13,w2}_weight``, ``model.llm.norm.weight``, ``model.llm.unembed.weight``;
plus the vision and audio towers ``model.visual.*`` / ``model.audio.*``.

**Gate/up interleaving.** Every ``w13`` tensor stores gate and up rows interleaved
(``g0, u0, g1, u1, ...`` along the ffn dim: transformers applies ``Interleave`` then ``Chunk`` on
load); megatron keeps ``[gate; up]``. The mappings below de-interleave on load and re-interleave
on export (bit-exact).

**Towers.** The vision and audio towers (:mod:`ferrule.plugins.inkling.towers`, attached by the
core as ``towers.vision`` / ``towers.audio`` on the first stage, replicated over TP) are mapped by
:data:`TOWER_ROWS` (renames; ``layers.<i>.linear`` <-> ``layers.linear_<i>``) and travel on every
weight sync in the ``*_tower*`` update groups.

Same Megatron model, provider and update groups as :mod:`ferrule.plugins.inkling.inkling_text`
(the config translation reads ``text_config``). Module-level data, plus the kit's ``tiny_media``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ferrule.mapping import ParamMapping
from ferrule.mapping import MappingTable, Rename, StackExperts, StackExpertsInterleaved, TPSplit
from ferrule.mapping.experts import deinterleave, interleave
from ferrule.plugins.inkling.config import TEXT_ENTRIES, InklingConfigTranslation
from ferrule.plugins.inkling.inkling_text import UPDATE_GROUPS as TEXT_UPDATE_GROUPS
from ferrule.plugins.inkling.inkling_text import TINY_HF_CONFIG as TINY_TEXT_CONFIG
from ferrule.plugins.inkling.inkling_text import text_model_mappings
from ferrule.contract.specs import UpdateGroup

#: HF ``inkling_mm_model`` config (its ``text_config``) <-> megatron.
CONFIG_TRANSLATION = InklingConfigTranslation(name="inkling", entries=TEXT_ENTRIES, model_types=("inkling_mm_model",))


def build_provider(hf_config: Mapping[str, Any], layout, **options) -> list:
    """This rank's megatron Inkling text-model chunks for an ``inkling_mm_model`` HF config (``ProviderSpec.build``)."""
    from ferrule.plugins.inkling.model import build_from_hf_config

    return build_from_hf_config(hf_config, layout, CONFIG_TRANSLATION, **options)


@dataclass(frozen=True)
class InterleavedGateUp(ParamMapping):
    """Dense ``mlp.w13_dn.weight`` ``[2*ffn, hidden]`` (gate/up rows interleaved) <-> megatron ``linear_fc1`` ``[gate; up]``.

    TP: ``GATE_UP`` (rank r holds ``[gate_r; up_r]``).
    """

    hf: str = ""
    tp: TPSplit = field(default=TPSplit.GATE_UP, kw_only=True)

    def hf_patterns(self, ctx):
        return (self.hf,)

    def to_mcore(self, hf, ctx, wildcards=()):
        return deinterleave(hf[0], 0)

    def to_hf(self, full, ctx, wildcards=()):
        return (interleave(full, 0),)


@dataclass(frozen=True)
class SharedInterleaved(ParamMapping):
    """``mlp.shared_experts.shared_w13_weight`` ``[S, 2*ffn, hidden]`` (interleaved on dim 1) <-> shared ``linear_fc1`` (``[gate; up]`` per expert).

    Replicated over TP and EP (shared experts are never expert-parallel).
    """

    hf: str = ""

    def hf_patterns(self, ctx):
        return (self.hf,)

    def to_mcore(self, hf, ctx, wildcards=()):
        return deinterleave(hf[0], 1)

    def to_hf(self, full, ctx, wildcards=()):
        return (interleave(full, 1),)


_L = "decoder.layers.*."
_H = "model.llm.layers.*."

#: (mcore suffix, released HF suffix, TP split) per layer: attention, norms, ShortConvs.
ATTENTION_ROWS = (
    ("input_layernorm.weight", "attn_norm.weight", TPSplit.REPLICATED),
    ("self_attention.linear_q.weight", "attn.wq_du.weight", TPSplit.COLUMN),
    ("self_attention.linear_k.weight", "attn.wk_dv.weight", TPSplit.COLUMN),
    ("self_attention.linear_v.weight", "attn.wv_dv.weight", TPSplit.COLUMN),
    ("self_attention.linear_r.weight", "attn.wr_du.weight", TPSplit.COLUMN),
    ("self_attention.linear_proj.weight", "attn.wo_ud.weight", TPSplit.ROW),
    ("self_attention.k_sconv.weight", "attn.k_sconv.weight", TPSplit.COLUMN),
    ("self_attention.v_sconv.weight", "attn.v_sconv.weight", TPSplit.COLUMN),
    ("self_attention.q_layernorm.weight", "attn.q_norm.weight", TPSplit.REPLICATED),
    ("self_attention.k_layernorm.weight", "attn.k_norm.weight", TPSplit.REPLICATED),
    ("self_attention.rel_logits_proj.weight", "attn.rel_logits_proj.proj", TPSplit.REPLICATED),
    ("self_attention.attn_sconv.weight", "attn_sconv.weight", TPSplit.REPLICATED),
    ("pre_mlp_layernorm.weight", "mlp_norm.weight", TPSplit.REPLICATED),
    ("mlp.mlp_sconv.weight", "mlp_sconv.weight", TPSplit.REPLICATED),
)

#: Tower parameters (mcore name under ``towers.``, released HF key); replicated over TP.
TOWER_ROWS = (
    ("towers.vision.layers.*.linear.weight", "model.visual.layers.linear_*.weight"),
    ("towers.vision.layers.*.norm.weight", "model.visual.layers.norm_*.weight"),
    ("towers.vision.final_norm.weight", "model.visual.final_norm.weight"),
    ("towers.audio.encoder.weight", "model.audio.encoder.weight"),
    ("towers.audio.final_norm.weight", "model.audio.final_norm.weight"),
)

#: The text model as ``InklingForConditionalGeneration`` holds it in memory after loading (transformers'
#: ``conversion_mapping`` entry ``inkling_mm_model``: ``model.llm.layers`` -> ``model.language_model.layers``,
#: ``attn.wq_du`` -> ``self_attn.q_proj``, ``w13`` de-interleaved and split into ``gate_proj`` / ``up_proj``,
#: ``model.llm.unembed`` -> ``lm_head``): the names and layouts of :mod:`ferrule.plugins.inkling.inkling_text`
#: under ``model.language_model.``. HF PEFT adapter keys use these module names, so LoRA names its adapters
#: through this table (``MappingTable.peft_table``); the towers are never adapted.
PEFT_MAPPING = MappingTable(family="inkling", mappings=text_model_mappings("model.language_model."))

#: Released-layout mapping table (text model + towers).
MAPPING = MappingTable(
    family="inkling",
    mappings=(
        Rename("embedding.word_embeddings.weight", "model.llm.embed.weight", tp=TPSplit.VOCAB),
        Rename("embedding.embed_norm.weight", "model.llm.embed_norm.weight"),
        Rename("decoder.final_layernorm.weight", "model.llm.norm.weight"),
        Rename("output_layer.weight", "model.llm.unembed.weight", tp=TPSplit.VOCAB),
        *(Rename(_L + m, _H + h, tp=tp) for m, h, tp in ATTENTION_ROWS),
        InterleavedGateUp(_L + "mlp.linear_fc1.weight", hf=_H + "mlp.w13_dn.weight"),
        Rename(_L + "mlp.linear_fc2.weight", _H + "mlp.w2_md.weight", tp=TPSplit.ROW),
        Rename(_L + "mlp.global_scale", _H + "mlp.global_scale"),
        Rename(_L + "mlp.router.weight", _H + "mlp.gate.weight"),
        Rename(_L + "mlp.router.expert_bias", _H + "mlp.gate.bias"),
        Rename(_L + "mlp.router.global_scale", _H + "mlp.gate.global_scale"),
        StackExpertsInterleaved(_L + "mlp.experts.local_experts.*.linear_fc1.weight", hf=_H + "mlp.experts.w13_weight",
                                tp=TPSplit.GATE_UP),
        StackExperts(_L + "mlp.experts.local_experts.*.linear_fc2.weight", hf=_H + "mlp.experts.w2_weight",
                     tp=TPSplit.ROW),
        SharedInterleaved(_L + "mlp.shared_experts.linear_fc1.weight", hf=_H + "mlp.shared_experts.shared_w13_weight"),
        Rename(_L + "mlp.shared_experts.linear_fc2.weight", _H + "mlp.shared_experts.shared_w2_weight"),
        *(Rename(m, h) for m, h in TOWER_ROWS),
    ),
    peft_table=PEFT_MAPPING,
)

#: The text variant's groups plus the towers' (first pipeline stage only, hence optional; a
#: missing tower group is refused when the model is built, see ``ferrule.megatron.provider.provider_build``).
#: Every base weight sync sends every group, so the towers always travel with the text model.
UPDATE_GROUPS = TEXT_UPDATE_GROUPS + (
    UpdateGroup(key="vision_tower", suffixes=("vision.final_norm.weight",), optional=True),
    UpdateGroup(key="vision_tower_linear", suffixes=("linear.weight",), optional=True),
    UpdateGroup(key="vision_tower_norm", suffixes=("norm.weight",), optional=True),
    UpdateGroup(key="audio_tower", suffixes=("audio.encoder.weight", "audio.final_norm.weight"), optional=True),
)

#: A tiny random ``inkling_mm_model`` config for the conformance kit: the text model of
#: :data:`ferrule.plugins.inkling.inkling_text.TINY_HF_CONFIG`, a 2-layer vision tower on 8x8 patches, the
#: 80-bin dMel audio tower, placeholder ids inside the 96-token vocabulary.
TINY_HF_CONFIG = {
    "model_type": "inkling_mm_model", "text_config": dict(TINY_TEXT_CONFIG),
    "vision_config": {"num_hidden_layers": 2, "patch_size": 8}, "audio_config": {"n_mel_bins": 80, "mel_vocab_size": 16},
    "image_token_id": 90, "audio_token_id": 91,
}
#: As for the text variant: the window sizes the relative-position projection (see inkling_text.KIT_FEATURE_KEYS).
KIT_FEATURE_KEYS: dict = {}


def tiny_media(hf_config: Mapping[str, Any]) -> dict:
    """Media for the kit's media case (:mod:`ferrule.conformance.media`): one random 12x20 RGB image and one
    0.3 s 16 kHz clip (fixed seed), preprocessed by the towers' own ``TowerSpec.preprocess`` functions:
    ``{"vision": [pixel_values [6, 2, 8, 8, 3]], "audio": [dmel ids [6, 80]]}``."""
    import numpy as np
    from PIL import Image

    from ferrule.plugins.inkling.towers import preprocess_audio, preprocess_image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (12, 20, 3), dtype=np.uint8))
    wave = rng.standard_normal(4800).astype(np.float32) * 0.1
    return {"vision": [preprocess_image(image, dict(hf_config))], "audio": [preprocess_audio((wave, 16000), dict(hf_config))]}
