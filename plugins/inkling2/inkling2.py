"""Inkling-2 multimodal checkpoints (HF ``model_type='inkling2'``): the text model + the vision tower.

Layout: the *released* one (what ``Inkling2ForConditionalGeneration.save_pretrained`` writes;
transformers' ``conversion_mapping`` entry ``inkling2`` renames it on load). Its text tensors
``model.llm.*`` are byte-for-byte the keys ``Inkling2ForCausalLM.save_pretrained`` writes (checked
in plugins/inkling2/tests/test_inkling2_vision.py), so the text rows are the ``inkling2_text`` variant's; the
vision tower's ``model.visual.*`` keys are the tower's own parameter names
(:mod:`ferrule.plugins.inkling2.towers`) under ``towers.vision.``: :data:`TOWER_ROWS` renames.

**Towers** (attached by the core as ``towers.vision`` on the first pipeline stage, replicated
over TP) travel on every weight sync in the ``vision_tower*`` update groups
(:data:`TOWER_UPDATE_GROUPS`). Module-level data (no torch import), plus the kit's ``tiny_media``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ferrule.config_translation import ConfigTranslationError
from ferrule.mapping import MappingTable, Rename
from ferrule.plugins.inkling2.config import TEXT_ENTRIES, Inkling2ConfigTranslation
from ferrule.plugins.inkling2.inkling2_text import TINY_HF_CONFIG as TINY_TEXT_CONFIG
from ferrule.plugins.inkling2.inkling2_text import TINY_TP2_OVERRIDES as TINY_TEXT_TP2_OVERRIDES
from ferrule.plugins.inkling2.inkling2_text import UPDATE_GROUPS as TEXT_UPDATE_GROUPS
from ferrule.plugins.inkling2.inkling2_text import peft_text_mappings, text_model_mappings
from ferrule.contract.specs import UpdateGroup

#: Top-level keys of an ``inkling2`` config besides ``text_config`` and why none changes the text model's
#: numbers (the keys every ``PretrainedConfig`` has are checked by the text translation's own rules).
TOP_LEVEL_KEYS = {
    "model_type": "must be 'inkling2' (checked)",
    "text_config": "translated (the inkling2_text entries)",
    "vision_config": "read by the vision tower's build (ferrule.plugins.inkling2.towers.build_vision_tower)",
    "image_token_id": "the vision tower's placeholder id (TowerSpec.placeholder_config_key)",
    "architectures": "names the transformers class; ferrule picks the family by model_type",
    "dtype": "storage dtype of the checkpoint; conversions keep each tensor's own dtype",
    "torch_dtype": "legacy spelling of dtype",
    "transformers_version": "provenance only", "_name_or_path": "provenance only",
    "tie_word_embeddings": "Inkling2ForConditionalGeneration never ties embed and unembed (_tied_weights_keys is {})",
    "output_hidden_states": "HF output plumbing", "output_attentions": "HF output plumbing",
    "return_dict": "HF output plumbing", "use_cache": "HF generation caching", "chunk_size_feed_forward": "0 = off",
    "is_encoder_decoder": "False for this model", "id2label": "classification heads only",
    "label2id": "classification heads only", "problem_type": "classification heads only",
    "pad_token_id": "generation only", "bos_token_id": "generation only", "eos_token_id": "generation only",
}


@dataclass(frozen=True)
class Inkling2MMConfigTranslation(Inkling2ConfigTranslation):
    """The ``inkling2_text`` translation of an ``inkling2`` config's ``text_config``, with the top-level keys checked.

    ``to_mcore`` refuses a config whose ``model_type`` is not ``inkling2`` or which holds a top-level
    key outside :data:`TOP_LEVEL_KEYS`; ``to_hf`` writes the text keys under ``text_config`` of ``base``.
    """

    def to_mcore(self, hf_config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        if not isinstance(hf_config, Mapping) or hf_config.get("model_type") != "inkling2":
            got = hf_config.get("model_type") if isinstance(hf_config, Mapping) else type(hf_config).__name__
            raise ConfigTranslationError(f"{self.name}: HF config has model_type={got!r}; this translation reads "
                                         f"['inkling2'] (Inkling2Config).")
        unknown = sorted(set(hf_config) - set(TOP_LEVEL_KEYS))
        if unknown:
            raise ConfigTranslationError(
                f"{self.name}: top-level HF config key(s) {unknown} are neither translated nor listed as harmless "
                f"(inkling2.TOP_LEVEL_KEYS); translate them or list them with a reason.")
        if not isinstance(hf_config.get("text_config"), Mapping):
            raise ConfigTranslationError(f"{self.name}: HF config lacks its text_config (a dict).")
        return super().to_mcore(hf_config)

    def to_hf(self, transformer_config_kwargs, model_options, base=None) -> dict[str, Any]:
        """The HF config dict: ``base`` (an ``inkling2`` config) with its ``text_config`` rewritten."""
        out = dict(base or {"model_type": "inkling2"})
        out["text_config"] = super().to_hf(transformer_config_kwargs, model_options,
                                           dict(out.get("text_config") or {"model_type": "inkling2_text"}))
        return out


#: HF ``inkling2`` config (its ``text_config``) <-> megatron.
CONFIG_TRANSLATION = Inkling2MMConfigTranslation(name="inkling2", entries=TEXT_ENTRIES)


def build_provider(hf_config: Mapping[str, Any], layout, **options) -> list:
    """This rank's megatron Inkling-2 text-model chunks for an ``inkling2`` HF config (``ProviderSpec.build``; the
    core attaches the vision tower, ``ferrule.megatron.provider.provider_build``)."""
    from ferrule.plugins.inkling2.model import build_from_hf_config

    return build_from_hf_config(hf_config, layout, CONFIG_TRANSLATION, **options)

_T, _V = "towers.vision.", "model.visual."

#: Per-encoder-layer parameters (suffix under ``backbone.layers.N.``), as released.
LAYER_SUFFIXES = (
    "ln_1.weight", "ln_1.bias",
    "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.out_proj.weight", "self_attn.out_proj.bias",
    "ls_1.gamma",
    "ln_2.weight", "ln_2.bias",
    "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
    "ls_2.gamma",
)

#: Once-per-tower parameters (suffix under ``towers.vision.`` / ``model.visual.``).
TOWER_SUFFIXES = (
    "backbone.embeddings.patch_embedding.weight", "backbone.embeddings.position_embedding",
    "backbone.embeddings.class_embedding", "backbone.embeddings.cls_position_embedding",
    "backbone.ln_pre.weight", "backbone.ln_pre.bias",
    "proj_in.weight", "proj_out.weight",
)

#: The merger's biases (only with ``vision_config.projector_bias``; released models have none).
PROJECTOR_BIAS_SUFFIXES = ("proj_in.bias", "proj_out.bias")

#: Tower rows of the mapping table: renames, replicated over TP (the tower is not TP-sharded).
TOWER_ROWS = tuple(
    [Rename(_T + s, _V + s) for s in TOWER_SUFFIXES + PROJECTOR_BIAS_SUFFIXES]
    + [Rename(_T + "backbone.layers.*." + s, _V + "backbone.layers.*." + s) for s in LAYER_SUFFIXES]
)

#: Tower update groups: one unit for the embeddings + merger, one per encoder layer, the optional
#: merger biases. Optional: only the first pipeline stage holds towers.
TOWER_UPDATE_GROUPS = (
    UpdateGroup(key="vision_tower", suffixes=tuple("vision." + s for s in TOWER_SUFFIXES), optional=True),
    UpdateGroup(key="vision_tower_bias", suffixes=tuple("vision." + s for s in PROJECTOR_BIAS_SUFFIXES),
                optional=True),
    UpdateGroup(key="vision_tower_layer", suffixes=LAYER_SUFFIXES, optional=True),
)


#: Released-layout mapping table: the ``inkling2_text`` rows (same ``model.llm.*`` keys) + the tower's.
#: LoRA's naming table: the text model's adaptable modules as ``Inkling2ForConditionalGeneration`` holds them
#: (``model.language_model.layers.L.self_attn.q_proj.linear``, ...; not the released ``model.llm.*``); the
#: tower is never adapted.
PEFT_MAPPING = MappingTable(family="inkling2", mappings=peft_text_mappings("model.language_model."))

MAPPING = MappingTable(family="inkling2", mappings=text_model_mappings() + TOWER_ROWS, peft_table=PEFT_MAPPING)

#: The text variant's groups plus the tower's (a missing tower group is refused when the model is built,
#: ``ferrule.megatron.provider.provider_build``). Every base weight sync sends every group.
UPDATE_GROUPS = TEXT_UPDATE_GROUPS + TOWER_UPDATE_GROUPS

#: A tiny random ``inkling2`` config for the conformance kit: the text model of
#: :data:`ferrule.plugins.inkling2.inkling2_text.TINY_HF_CONFIG` and a 2-layer vision tower with odd shapes
#: (3 heads of 8, native patch 3, merge 2: 6 x 6 pixel tokens, a 5 x 5 position grid, merger biases);
#: the image placeholder inside the 90-token head.
TINY_HF_CONFIG = {
    "model_type": "inkling2", "text_config": dict(TINY_TEXT_CONFIG), "image_token_id": 89,
    "vision_config": {"hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 3,
                      "patch_size": 3, "spatial_merge_size": 2, "posemb_grid_size": 5, "projection_hidden_dim": 20,
                      "projector_bias": True, "text_hidden_size": TINY_TEXT_CONFIG["hidden_size"],
                      "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}},
}
#: TP=2 splits the KV heads: the text variant's override, nested under ``text_config``.
TINY_TP2_OVERRIDES = {"text_config": dict(TINY_TEXT_CONFIG, **TINY_TEXT_TP2_OVERRIDES)}
#: As for the text variant.
KIT_FEATURE_KEYS: dict = {}


def tiny_media(hf_config: Mapping[str, Any]) -> dict:
    """Media for the kit's media case (:mod:`ferrule.conformance.media`): one random 10 x 14 RGB image (fixed
    seed) through the tower's own ``preprocess_image``: ``{"vision": [[2, 3, 6, 6, 3]]}`` (6 tokens)."""
    import numpy as np
    from PIL import Image

    from ferrule.plugins.inkling2.towers import preprocess_image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (10, 14, 3), dtype=np.uint8))
    return {"vision": [preprocess_image(image, dict(hf_config))]}
