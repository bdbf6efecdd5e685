"""Weight sync: train engine -> rollout engine through update-group tables (``ferrule.sync``).

- :mod:`ferrule.sync.groups`: update units from mcore names and a family's update-group table;
  :func:`is_routed_expert_param`, the one routed-expert classifier.
- :mod:`ferrule.sync.buckets`: planning update units and packing their HF tensors into
  byte-bounded buckets; the collective gathering (TP / EP / PP) is
  :mod:`ferrule.megatron.weights`'s and the HF assembly :class:`ferrule.mapping.HFAssembler`'s.
- :mod:`ferrule.sync.weight_sync`: :func:`sync_weights` and the verification mode
  :func:`check_weight_update_equal`.
- :mod:`ferrule.sync.direct`: the direct path of :func:`sync_weights` (one process, one device,
  an embedded rollout engine): strided copies from the mcore parameters into the served weights,
  planned once, no buckets.
- :mod:`ferrule.sync.lora_sync`: adapter-only sync of a LoRA train engine,
  :func:`sync_lora_adapter` (HF PEFT tensors -> ``update_lora_adapter``) and
  :func:`check_lora_adapter_equal`.

Importing this package imports no torch (the functions import it when called).
"""

from ferrule.sync.buckets import DEFAULT_BUCKET_BYTES, WeightSyncError, pack_buckets
from ferrule.sync.groups import (
    UpdateGroupError,
    UpdateUnit,
    build_update_units,
    is_routed_expert_param,
    match_group,
)
from ferrule.sync.lora_sync import check_lora_adapter_equal, send_lora_adapter, sync_lora_adapter
from ferrule.sync.weight_sync import (
    DEFAULT_CHECK_SKIP,
    SENDER_RANK,
    SyncStats,
    WeightCheckReport,
    check_weight_update_equal,
    sync_weights,
    tensor_checksum,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHECK_SKIP",
    "SENDER_RANK",
    "SyncStats",
    "UpdateGroupError",
    "UpdateUnit",
    "WeightCheckReport",
    "WeightSyncError",
    "build_update_units",
    "check_lora_adapter_equal",
    "check_weight_update_equal",
    "is_routed_expert_param",
    "match_group",
    "pack_buckets",
    "send_lora_adapter",
    "sync_lora_adapter",
    "sync_weights",
    "tensor_checksum",
]
