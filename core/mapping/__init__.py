"""Declarative parameter mapping between Megatron-Core (``mcore_``) and Hugging Face (``hf_``).

Modules, imported in one direction only (no cycle):

- :mod:`ferrule.mapping.vocabulary`: the row types. :class:`ParamMapping` is the base of every
  row (:class:`Rename`, :class:`FuseQKV`, :class:`FuseGateUp`, :class:`OutputLayer`);
  :class:`Ignore` drops an HF key with a reason; :class:`TPSplit` says how TP splits a full tensor;
  :class:`MappingContext` carries the few config numbers a row needs; :class:`MappingError`.
- :mod:`ferrule.mapping.experts`: the routed-expert rows (:class:`ExpertRename`,
  :class:`ExpertFuseGateUp`, :class:`StackExperts`, :class:`StackExpertsInterleaved`); imports :mod:`~ferrule.mapping.vocabulary`.
- :mod:`ferrule.mapping.table`: :class:`MappingTable` (a family's complete, immutable table)
  and :class:`HFAssembler` (full mcore tensors -> HF tensors, shared by export, weight sync
  and :meth:`MappingTable.mcore_to_hf`); imports the two above.
- :mod:`ferrule.mapping.decoder`: shared rows and update groups for Llama-shaped decoders.

``Mapping`` is the old name of :class:`ParamMapping` (it clashed with
``collections.abc.Mapping``) and ``ferrule.mapping_table`` the old path of
:mod:`ferrule.mapping.table`; both still work for this release and warn (``DeprecationWarning``;
listed in :mod:`ferrule.compat`). Importing this package imports no torch.
"""

from __future__ import annotations

from typing import Any

from ferrule.compat import renamed_name
from ferrule.mapping.experts import ExpertFuseGateUp, ExpertRename, StackExperts, StackExpertsInterleaved
from ferrule.mapping.table import HFAssembler, MappingTable
from ferrule.mapping.vocabulary import (
    FuseGateUp,
    FuseQKV,
    Ignore,
    MappingContext,
    MappingError,
    OutputLayer,
    ParamMapping,
    Passthrough,
    Rename,
    TPSplit,
)

__all__ = [
    "Passthrough",
    "ExpertFuseGateUp",
    "ExpertRename",
    "FuseGateUp",
    "FuseQKV",
    "HFAssembler",
    "Ignore",
    "MappingContext",
    "MappingError",
    "MappingTable",
    "OutputLayer",
    "ParamMapping",
    "Rename",
    "StackExperts",
    "StackExpertsInterleaved",
    "TPSplit",
]


def __getattr__(name: str) -> Any:
    # PEP 562: the old names of ferrule.compat.RENAMED_NAMES (not an import-cycle workaround)
    return renamed_name(__name__, name)
