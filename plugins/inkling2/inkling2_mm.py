"""Inkling-2 multimodal checkpoints (HF ``model_type='inkling2'``): the text model + the vision tower.

Layout: the *released* one (what ``Inkling2ForConditionalGeneration.save_pretrained`` writes;
transformers' ``conversion_mapping`` entry ``inkling2`` renames it on load). Its text tensors
``model.llm.*`` are byte-for-byte the keys ``Inkling2ForCausalLM.save_pretrained`` writes (checked
in tests/test_inkling2_vision.py), so the text rows are the ``inkling2_text`` variant's; the
vision tower's ``model.visual.*`` keys are the tower's own parameter names
(:mod:`ferrule.plugins.inkling2.vision`) under ``towers.vision.``: :data:`TOWER_ROWS` renames.

**Towers** (attached by the core as ``towers.vision`` on the first pipeline stage, replicated
over TP) travel on every weight sync in the ``vision_tower*`` update groups
(:data:`TOWER_UPDATE_GROUPS`). Module-level data only (no torch import).
"""

from __future__ import annotations

from ferrule.mapping import Rename
from ferrule.specs import UpdateGroup

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
